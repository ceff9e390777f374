"""The first-party features, each a plugin on the stage hooks, registered through the ``gyremedia`` entry
points as a third party's would be (pyproject.toml):

- ``candidates``: Sol-RL's two-stage rollouts (``rollout.candidates``);
- ``pareto``: ParetoSlider's preference weights and front (``pareto``);
- ``prompt_history``: DDPO's per-prompt reward statistics (``advantage.history``);
- ``forward_reuse``: training the first minibatch on the rollout's own forwards (``train.reuse_rollout_forward``);
- ``monitor``: held-out gold rewards, drift and the reward-hacking warning (``monitor``);
- ``offline``: training on saved, scored rollouts instead of sampling (``data.offline``, ``gyremedia rollout``).

Each module checks its keys in ``gyremedia_check_config`` and, when the config turns it on, registers a
per-run object in ``gyremedia_setup`` (``PluginManager.register_for_run``). Leave one out of
``GYREMEDIA_PLUGINS`` and a config that sets its keys is refused; a run that does not use it is unchanged.
"""

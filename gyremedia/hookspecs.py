"""Every gyremedia hook, documented in one place (like pytest's ``hookspec.py``).

Two kinds of hooks exist:

* **Registration hooks** (``gyremedia_register_*``) are called once at start-up. Each receives a
  ``register(name, factory, *, options=None, description="", **capabilities)`` callable. ``factory``
  builds the component from its validated options (an instance of the ``options`` dataclass, whose
  types, ranges and choices are checked before any model loads: :mod:`gyremedia.options`). Capabilities
  are read from the factory's class attributes (:data:`gyremedia.plugins.CAPABILITIES`); a factory
  that is a plain function passes them here. Registering never makes a run use it: the yaml selects by name.
* **Run hooks** are called during a run, keyword-only, on every registered plugin, on the component
  objects the run's config selected (a reward or regularizer instance may implement any of them) and on
  the per-run objects features register: the stages of a step (each a ``firstresult`` hook with its
  default in ``gyremedia/stages/``), the features' hooks, and events. Hooks that change what is trained on
  (:data:`gyremedia.registry.DATA_CHANGING_HOOKS`) may only be implemented by selected components and
  per-run objects: a module loaded from an entry point that implements them is refused at load time,
  because installing a package must never silently change a training objective.

Plugins implement hooks with the ``gyremedia.hookimpl`` marker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

from gyremedia.registry import COMPONENT_KINDS, DATA_CHANGING_HOOKS  # noqa: F401 - part of this module's API

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from accelerate import Accelerator

    from gyremedia.config import ResolvedConfig, TrainConfig
    from gyremedia.evaluation import EvalResult
    from gyremedia.interfaces import BuildContext, RolloutRequest
    from gyremedia.rollout import Media, Rollout
    from gyremedia.state import TrainState

hookspec = pluggy.HookspecMarker("gyremedia")

Register = Callable[..., None]

# --------------------------------------------------------------------------- registration


@hookspec
def gyremedia_register_backbones(register: Register) -> None:
    """Register generator backbones (flow matching, diffusion, LLM, ...).

    A backbone factory receives its options and the accelerator's device and returns an object
    satisfying :class:`gyremedia.interfaces.Backbone`.
    """


@hookspec
def gyremedia_register_samplers(register: Register) -> None:
    """Register transition kernels (``flow_sde``, ``cps``, ``ode``, ...).

    A sampler turns a model prediction into the next state and, if it is stochastic, the
    log-probability of that transition (:class:`gyremedia.interfaces.Sampler`).
    """


@hookspec
def gyremedia_register_objectives(register: Register) -> None:
    """Register training objectives (``grpo``, ELBO family, tree rollouts, ...).

    An objective turns a scored rollout into losses (:class:`gyremedia.interfaces.Objective`).
    """


@hookspec
def gyremedia_register_rewards(register: Register) -> None:
    """Register reward models.

    A reward is a callable ``reward(media, prompts) -> dict[str, Tensor[B]] | Tensor[B]`` with a
    ``kinds`` attribute naming the media kinds it scores (:class:`gyremedia.interfaces.Reward`).
    A dict must hold a ``"score"`` entry; the other entries are logged as components. It may set
    ``batch_size`` (called on chunks of at most that many samples) and may be ``async``. What a
    failure (exception, timeout, NaN score) does is the run's choice (``on_failure: fail | drop``),
    see :mod:`gyremedia.scoring`.
    """


@hookspec
def gyremedia_register_regularizers(register: Register) -> None:
    """Register loss terms added to any objective (velocity-norm hinge, KL variants, ...).

    A regularizer is called with ``(state=, rollout=, outputs=)`` for each micro-step and returns
    ``dict[str, Tensor]`` of scalar losses, or a ``LossOutput`` (one loss plus metrics), added to
    the objective's loss times its weight (:class:`gyremedia.interfaces.Regularizer`). A regularizer
    with ``needs_reference = True`` makes the backbone keep the frozen reference policy.
    """


@hookspec
def gyremedia_register_weightings(register: Register) -> None:
    """Register timestep weightings of the ELBO surrogate (``uniform``, ``t``, ``budgeted``, ...).

    A weighting is a callable ``weighting(error [B], t [B]) -> log p [B]``: the log-likelihood
    surrogate ``-w(t) l`` of a per-sample flow-matching error ``l`` at noise level ``t``
    (:class:`gyremedia.interfaces.TimestepWeighting`). Objectives that use one register with
    ``default_weighting=<name>``; the yaml's ``weighting:`` section overrides it. An adaptive one
    implements lifecycle hooks (``gyremedia_on_step_end``) and ``state_dict``/``load_state_dict``.
    """


@hookspec
def gyremedia_register_loggers(register: Register) -> None:
    """Register metric sinks (jsonl, tensorboard, ...).

    A logger has ``log(metrics: dict, step: int)`` and ``close()``; it runs on the main process only.
    """


# --------------------------------------------------------------------------- lifecycle


@hookspec
def gyremedia_configure(config: ResolvedConfig, accelerator: Accelerator) -> None:
    """Called once after the config is validated and the accelerator exists, before models load: the place for
    checks that need the environment (a key, a server), which ``gyremedia config`` and ``export`` do not."""


# --------------------------------------------------------------------------- the stages of a run
#
# Each is a ``firstresult`` hook whose default lives in ``gyremedia/stages/`` (always loaded, like pytest's
# ``pytest_runtestloop`` in main.py): a plugin takes a stage over with ``@hookimpl(tryfirst=True)`` and
# returns a result, or returns ``None`` to let the next implementation (in the end the default) run.


@hookspec(firstresult=True)
def gyremedia_collect_rollout(state: TrainState, request: RolloutRequest) -> Rollout | None:
    """The rollout stage: sample this rank's share of a step.

    :param request: the prompts, their sample and group ids (each sample's noise depends on its id
        alone), the chunks training replays, and the ``rollout`` settings, as the features edited it
        (:func:`gyremedia_prepare_request`).

    The default is the policy's own: ``state.backbone.collect_rollout`` (denoising trajectories or trees;
    token generation). A plugin overrides it with ``@hookimpl(tryfirst=True)`` (an external inference engine).
    """


@hookspec(firstresult=True)
def gyremedia_score_rollout(
    state: TrainState, rollout: Rollout, futures: dict[str, Any], step: int
) -> dict[str, float] | None:
    """The scoring stage: wait for the rewards started on ``rollout.media`` (``futures``), apply their failure
    policies and set ``rollout.rewards`` and ``rollout.reward``; returns the step's reward metrics (global)."""


@hookspec(firstresult=True)
def gyremedia_compute_advantages(state: TrainState, rollout: Rollout, step: int) -> dict[str, float] | None:
    """The advantage stage: set ``rollout.advantages`` from the rewards of every rank's groups; returns the
    reward statistics it measured (``reward``, ``reward_std``, ``reward_group_std``)."""


@hookspec(firstresult=True)
def gyremedia_update(state: TrainState, rollout: Rollout, step: int) -> dict[str, float] | None:
    """The update stage: the objective's losses, backward and optimizer steps over the rollout's minibatches;
    returns the loss metrics, averaged over the processes."""


@hookspec(firstresult=True)
def gyremedia_evaluate(state: TrainState, step: int) -> dict[str, float] | None:
    """The evaluation stage at ``step`` (0: before training): score the fixed-seed eval samples, save their
    grid; returns the ``eval/*`` metrics (on the main process)."""


@hookspec(firstresult=True)
def gyremedia_save_checkpoint(state: TrainState) -> Path | None:
    """The checkpoint stage: write ``checkpoints/step-N`` of the current step (every rank); returns its folder."""


@hookspec(firstresult=True)
def gyremedia_finish(state: TrainState) -> bool | None:
    """The end of a run, after its last checkpoint: plot the metrics, write the held-out changes, export the
    trained generator. Returns ``True`` once done."""


# --------------------------------------------------------------------------- features
#
# A feature (candidate pools, Pareto preferences, the per-prompt reward history, forward reuse, the hacking
# monitor: ``plugins/gyremedia_features``) is a plugin: its module checks its config keys in
# ``gyremedia_check_config`` and, when the config turns it on, registers a per-run object in ``gyremedia_setup``
# that implements the hooks below.


@hookspec
def gyremedia_check_config(core: TrainConfig, selected: dict[str, Any]) -> list[str] | None:
    """Errors of the keys this plugin reads (one line each, naming the key and the fix), checked with the rest
    of the config before any model loads. ``selected`` maps each component section to its selection."""


@hookspec
def gyremedia_setup(state: TrainState, context: BuildContext) -> None:
    """Called once the backbone, samplers, objective, weighting and rewards are built (the regularizers and loggers
    are built next), before weights load and the optimizer exists: build what a feature needs (held-out rewards;
    ``state.reference_needed = True`` for the frozen reference) and register its per-run object."""


@hookspec
def gyremedia_prepare_request(state: TrainState, request: RolloutRequest) -> None:
    """Edit a step's rollout request before it is sampled (preference weights, kept forwards, the candidates'
    initial noises). Changes training data, so only a per-run object the config turned on implements it."""


@hookspec(firstresult=True)
def gyremedia_group_statistics(state: TrainState, step: int) -> Any:
    """What normalises a step's rewards instead of its groups' own mean and std: a callable ``(totals [N],
    groups [N]) -> advantages [N]`` (DDPO's per-prompt history), or ``None``. Changes training data."""


@hookspec
def gyremedia_after_eval(state: TrainState, step: int, result: EvalResult, metrics: dict[str, float]) -> None:
    """After an evaluation pass, on every process that computed it (the main one; all of them when the model
    is sharded): add to ``metrics`` and ``result.scores`` (held-out rewards, drift, a Pareto front)."""


@hookspec(firstresult=True)
def gyremedia_eval_preference(config: ResolvedConfig) -> torch.Tensor | None:
    """The reward-preference weights ``[R]`` a preference-conditioned model is evaluated at (a Pareto run's
    equal weights), or ``None``: every evaluation, in a run and in ``gyremedia eval``."""


@hookspec
def gyremedia_eval_report(
    config: ResolvedConfig, backbone: Any, sampler: Any, rewards: dict[str, Any], report: dict[str, Any]
) -> list[str] | None:
    """``gyremedia eval`` of a trained run (its weights loaded): add entries to the json ``report`` and return
    lines to print after its table (a Pareto front)."""


# --------------------------------------------------------------------------- events


@hookspec
def gyremedia_after_rollout(state: TrainState, rollout: Rollout) -> None:
    """Inspect or edit a fresh rollout (filtering, candidate selection) before it is scored.

    Changes training data, so only config-selected components may implement it.
    """


@hookspec
def gyremedia_process_rewards(state: TrainState, rollout: Rollout, rewards: dict[str, torch.Tensor]) -> None:
    """Shape rewards in place (``rewards`` maps each reward name to its per-sample score).

    Called on this rank's samples before group advantages are computed over all ranks. Changes
    training data, so only config-selected components may implement it.
    """


@hookspec
def gyremedia_on_step_end(state: TrainState, metrics: dict[str, float]) -> None:
    """Called on every rank after each step (its update and, when one is due, its evaluation) with that step's
    (global) metrics.

    Plugins may add entries to ``metrics`` before they reach the loggers.
    """


@hookspec
def gyremedia_on_eval(state: TrainState, media: Media, metrics: dict[str, float]) -> None:
    """Called after an evaluation pass with the generated eval media and their metrics.

    Plugins may add entries to ``metrics`` (e.g. a held-out "gold" score).
    """


@hookspec
def gyremedia_on_save_checkpoint(state: TrainState, path: Path) -> dict[str, Any] | None:
    """Return this plugin's state to store in the checkpoint (JSON-serialisable).

    :param path: the checkpoint folder being written, on every rank. Files a plugin writes there are
        published with the checkpoint (the folder is renamed to ``checkpoints/step-N`` once complete).

    Results are keyed by plugin name; the main rank's dict is handed back on load.
    """


@hookspec
def gyremedia_on_load_checkpoint(state: TrainState, path: Path, plugin_state: dict[str, Any]) -> None:
    """Restore state on resume. ``plugin_state`` maps plugin names to what they saved."""


@hookspec
def gyremedia_on_exception(state: TrainState, exc: BaseException) -> None:
    """Called when training raises, before the exception propagates (flush, alert, clean up)."""


@hookspec
def gyremedia_on_train_end(state: TrainState) -> None:
    """Called once after the last step, its checkpoint and the end of the run (``gyremedia_finish``)."""

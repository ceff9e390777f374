"""Every gyremedia hook, documented in one place (like pytest's ``hookspec.py``).

Two kinds of hooks exist:

* **Registration hooks** (``gyremedia_register_*``) are called once at start-up. Each receives a
  ``register(name, factory, *, options=None, description="", **capabilities)`` callable. ``factory``
  builds the component from its validated options (an instance of the ``options`` dataclass, whose
  types, ranges and choices are checked before any model loads: :mod:`gyremedia.options`). Capabilities
  are read from the factory's class attributes (:data:`gyremedia.plugins.CAPABILITIES`); a factory
  that is a plain function passes them here. Registering never makes a run use it: the yaml selects by name.
* **Lifecycle hooks** are called during a run, keyword-only, on every registered plugin *and* on
  the component objects the run's config selected (a reward or regularizer instance may implement
  any of them). Hooks that change what is trained on (``gyremedia_after_rollout``,
  ``gyremedia_process_rewards``) may only be implemented by such selected components: a module
  loaded from an entry point that implements them is refused at load time, because installing a
  package must never silently change a training objective.

Plugins implement hooks with the ``gyremedia.hookimpl`` marker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from accelerate import Accelerator

    from gyremedia.config import ResolvedConfig
    from gyremedia.interfaces import RolloutRequest
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


@hookspec(firstresult=True)
def gyremedia_collect_rollout(state: TrainState, request: RolloutRequest) -> Rollout | None:
    """The rollout stage: sample this rank's share of a step. The first implementation that returns a
    rollout wins, like pytest's ``pytest_runtestloop``.

    :param request: the prompts, their sample and group ids (each sample's noise depends on its id
        alone), the chunks training replays, and the ``rollout`` settings.

    The default (``gyremedia.stages``, always loaded) is the policy's own: ``state.backbone.collect_rollout``
    (denoising trajectories or trees; token generation). A plugin overrides it with
    ``@hookimpl(tryfirst=True)`` (an external inference engine, candidate pools); returning ``None`` defers.
    """


@hookspec
def gyremedia_after_rollout(state: TrainState, rollout: Rollout) -> None:
    """Inspect or edit a fresh rollout (filtering, candidate selection) before it is scored.

    Changes training data, so only config-selected components may implement it.
    """


@hookspec
def gyremedia_process_rewards(
    state: TrainState, rollout: Rollout, rewards: dict[str, torch.Tensor]
) -> None:
    """Shape rewards in place (``rewards`` maps each reward name to its per-sample score).

    Called on this rank's samples before group advantages are computed over all ranks. Changes
    training data, so only config-selected components may implement it.
    """


@hookspec
def gyremedia_on_step_end(state: TrainState, metrics: dict[str, float]) -> None:
    """Called on every rank after each optimizer step with that step's (global) metrics.

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
    """Called once after the last step and the final checkpoint."""


#: Hooks that change the data a run trains on; only config-selected components implement them.
DATA_CHANGING_HOOKS = frozenset({"gyremedia_after_rollout", "gyremedia_process_rewards"})

#: The component kinds and the registration hook of each.
COMPONENT_KINDS = {
    "backbone": "gyremedia_register_backbones",
    "sampler": "gyremedia_register_samplers",
    "objective": "gyremedia_register_objectives",
    "reward": "gyremedia_register_rewards",
    "regularizer": "gyremedia_register_regularizers",
    "weighting": "gyremedia_register_weightings",
    "logger": "gyremedia_register_loggers",
}

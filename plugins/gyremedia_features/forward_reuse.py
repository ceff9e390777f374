"""``train.reuse_rollout_forward``: the first minibatch trains on the weights that sampled it, so the rollout's
forwards of the transitions it will replay are computed with gradients and kept, and training takes them instead
of running the model again (one forward fewer per trained transition of that minibatch; the same updates up to
float rounding). The policy keeps them (``RolloutRequest.keep_forwards``, :class:`gyremedia.sampling.KeptForwards`)
and the update stage uses them where the rollout holds them."""

from __future__ import annotations

import logging
from typing import Any

from gyremedia import hookimpl
from gyremedia.interfaces import RolloutRequest
from gyremedia.sampling import stochastic_steps
from gyremedia.state import TrainState

logger = logging.getLogger("gyremedia")


@hookimpl
def gyremedia_check_config(core: Any, selected: dict[str, Any]) -> list[str]:
    """Flat rollouts trained by the weights that sampled them, and an objective that names the transitions it
    replays before they are sampled."""
    if not core.train.reuse_rollout_forward:
        return []
    errors, objective, off = [], selected.get("objective"), "or train.reuse_rollout_forward=false"
    if objective is not None and not objective.meta.get("plans_transitions"):
        errors.append(
            f"train.reuse_rollout_forward: objective {objective.name!r} does not name the transitions it "
            f"replays before sampling: use objective grpo, {off}"
        )
    if core.rollout.async_scoring:
        errors.append(
            f"train.reuse_rollout_forward trains a rollout on the weights that sampled it: set "
            f"rollout.async_scoring=false, {off}"
        )
    if core.rollout.branch_steps:
        errors.append(f"train.reuse_rollout_forward keeps flat rollouts' forwards: set rollout.branch_steps=[], {off}")
    return errors


@hookimpl
def gyremedia_setup(state: TrainState, context: Any) -> None:
    if not state.config.core.train.reuse_rollout_forward:
        return
    if state.sharded:
        logger.warning(
            "train.reuse_rollout_forward is off: a sharded model gathers its weights per forward and "
            "frees them after; training replays every transition"
        )
        return
    state.plugins.register_for_run(ForwardReuse(), name="forward_reuse:run")


def planned_forwards(state: TrainState, step: int) -> list[int]:
    """The transitions whose forwards step ``step``'s rollout keeps: those the objective will train, chosen among
    the ones the sampler will sample stochastically."""
    stochastic = stochastic_steps(state.sampler, state.backbone.sigmas(state.config.core.rollout.num_steps))
    return state.objective.planned_transitions(stochastic, step)


class ForwardReuse:
    @hookimpl
    def gyremedia_prepare_request(self, state: TrainState, request: RolloutRequest) -> None:
        request.keep_forwards = tuple(planned_forwards(state, request.step))

"""The built-in implementations of the stage hooks, always loaded (pytest's ``essential_plugins``).

A stage is a ``firstresult`` hook with a default here: a plugin takes a stage over by implementing the
hook with ``tryfirst=True``, without a branch in the trainer.
"""

from __future__ import annotations

from gyremedia import hookimpl
from gyremedia.interfaces import RolloutRequest
from gyremedia.rollout import Rollout
from gyremedia.state import TrainState


@hookimpl(trylast=True)
def gyremedia_collect_rollout(state: TrainState, request: RolloutRequest) -> Rollout:
    """The policy collects its own rollout: denoising trajectories with the run's sampler, or tokens."""
    return state.backbone.collect_rollout(request, state.sampler)

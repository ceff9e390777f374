"""``advantage.per_frame``: per-frame credit for video policies.

A clip-level advantage credits every frame with the whole clip's score, so each frame's credit carries the
other frames' noise. Rewards that report per-frame scores (the component ``frames``, ``[B, T]``: an inverse
dynamics model reads each transition, a fidelity reward each frame) give each frame ``t`` its own advantage,
normalised within its group (every rank's samples) as the clip's would be:

    A[b, t] = advantage of the scores s_r[b, t] of each reward r, combined as `advantage.combine` says

and an objective with a per-frame loss (capability ``per_frame``) weights frame ``t``'s part of its loss by
``A[b, t]``: the forward-process ones their re-noised errors, the ratio ones a ratio per frame (the old policy's
per-frame log-probs recorded while sampling, ``FrameLogProbs``). When every frame has the clip's scores the
advantages are the clip's and the loss is the usual one (``tests/objectives``). The step's reward statistics stay
the clip's.
"""

from __future__ import annotations

from typing import Any

import torch

from gyremedia import hookimpl
from gyremedia.interfaces import RolloutRequest
from gyremedia.rollout import Rollout
from gyremedia.sampling import FrameLogProbs
from gyremedia.stages import advantages as advantage_stage
from gyremedia.state import TrainState


@hookimpl
def gyremedia_check_config(core: Any, selected: dict[str, Any]) -> list[str]:
    if not core.advantage.per_frame:
        return []
    errors, off = [], "or set advantage.per_frame=false"
    backbone, objective = selected.get("backbone"), selected.get("objective")
    if backbone is not None and backbone.meta.get("frame_dim") is None:
        errors.append(
            f"advantage.per_frame=true: backbone {backbone.name!r} makes no video frames: set advantage.per_frame=false"
        )
    if objective is not None and not objective.meta.get("per_frame"):
        errors.append(
            f"advantage.per_frame=true: objective {objective.name!r} has no per-frame loss: use nft, awm, grpo or "
            f"gipo, {off}"
        )
    for reward in selected.get("rewards") or []:
        if reward is not None and not reward.meta.get("frame_scores"):
            errors.append(
                f"advantage.per_frame=true: reward {reward.name!r} reports no per-frame scores: leave it out, {off}"
            )
    if core.data.offline:
        errors.append(
            "advantage.per_frame=true: saved rollouts (data.offline) keep no per-frame scores: sample fresh "
            f"ones, {off}"
        )
    if core.advantage.history:
        errors.append("advantage.per_frame=true keeps no reward history per prompt: set advantage.history=0")
    return errors


@hookimpl
def gyremedia_setup(state: TrainState, context: Any) -> None:
    if state.config.core.advantage.per_frame:
        state.plugins.register_for_run(FrameCredit(), name="frame_credit:run")


class FrameCredit:
    """Takes the advantage stage over (each frame's advantage ``[B, T]``); for a ratio objective, records the old
    policy's per-frame log-probs while sampling."""

    @hookimpl
    def gyremedia_prepare_request(self, state: TrainState, request: RolloutRequest) -> None:
        if getattr(state.objective, "requires_log_prob", False):
            request.recorders.append(FrameLogProbs(state.backbone.frame_dim))

    @hookimpl(tryfirst=True)
    def gyremedia_compute_advantages(self, state: TrainState, rollout: Rollout, step: int) -> dict[str, float]:
        """Each frame's advantage; the clip's reward statistics, as the default stage reports them."""
        metrics = advantage_stage.gyremedia_compute_advantages(state=state, rollout=rollout, step=step)
        _, weights = advantage_stage.weighted_rewards(state.config, rollout)
        scores = torch.stack([rollout.frame_rewards[s.name].float() for s in state.config.rewards], dim=1)  # [B, R, T]
        per_frame = [
            advantage_stage.group_relative(state, rollout, scores[:, :, t], weights)[0] for t in range(scores.shape[2])
        ]
        rollout.advantages = torch.stack(per_frame, dim=1)
        return metrics

"""The advantage stage: the rewards' weighted totals normalised over every rank's groups."""

from __future__ import annotations

from typing import Any

import torch

from gyremedia import hookimpl
from gyremedia.advantages import distributed_group_advantages
from gyremedia.config import ResolvedConfig
from gyremedia.rollout import Rollout
from gyremedia.state import TrainState


def weighted_rewards(config: ResolvedConfig, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """The scores ``[B, R]`` (one column per reward) and their weights: ``[R]``, or ``[B, R]`` when the rollout
    carries per-sample preferences (each group's preference times the rewards' weights)."""
    matrix = torch.stack([rollout.rewards[s.name].float() for s in config.rewards], dim=1)
    weights = torch.tensor([s.weight for s in config.rewards])
    if rollout.preference is not None:
        weights = rollout.preference.float().cpu() * weights
    return matrix, weights


def group_relative(
    state: TrainState, rollout: Rollout, matrix: torch.Tensor, weights: torch.Tensor, normalize: Any = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The advantages of scores ``matrix [B, R]`` over every rank's groups as the ``advantage`` section says, with
    the gathered weighted totals and group ids (:func:`gyremedia.advantages.distributed_group_advantages`)."""
    adv = state.config.core.advantage
    return distributed_group_advantages(
        state.accelerator,
        matrix,
        weights,
        rollout.group_ids,
        rollout.sample_ids,
        adv.combine,
        adv.std,
        adv.eps,
        normalize=normalize,
    )


@hookimpl(trylast=True)
def gyremedia_compute_advantages(state: TrainState, rollout: Rollout, step: int) -> dict[str, float]:
    """Group-relative advantages over all ranks (a feature may normalise by other statistics:
    ``gyremedia_group_statistics``); returns the batch's reward statistics."""
    matrix, weights = weighted_rewards(state.config, rollout)
    normalize = state.plugins.hook.gyremedia_group_statistics(state=state, step=step)
    rollout.advantages, totals, groups = group_relative(state, rollout, matrix, weights, normalize)
    kept = torch.isfinite(totals)
    group_std = [totals[(groups == g) & kept].std(unbiased=False) for g in groups[kept].unique()]
    return {
        "reward": totals[kept].mean().item(),
        "reward_std": totals[kept].std(unbiased=False).item(),
        "reward_group_std": torch.stack(group_std).mean().item() if group_std else float("nan"),
    }

"""Group-relative advantages, computed over the samples of every rank.

A prompt's group may be split across ranks, so rewards are gathered first: each rank then
normalises with the statistics of whole groups and keeps its own samples' advantages.
"""

from __future__ import annotations

import torch

from gyremedia.distributed import gather_by_sample


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, std: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """``(r - mean_group) / (std + eps)`` for every sample (Flow-GRPO / GRPO normalisation).

    ``std`` is ``"group"`` (per-prompt population std), ``"global"`` (std of the whole batch) or
    ``"none"`` (only centre, as Dr. GRPO recommends to avoid the difficulty bias).
    """
    rewards = rewards.double()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1
    counts = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, inverse, torch.ones_like(rewards))
    means = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, inverse, rewards) / counts
    centred = rewards - means[inverse]
    if std == "group":
        var = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, inverse, centred**2) / counts
        scale = var.sqrt()[inverse]
    elif std == "global":
        scale = rewards.std(unbiased=False).expand_as(rewards)
    elif std == "none":
        return centred.float()
    else:
        raise ValueError(f"advantage std {std!r}: expected group, global or none")
    return (centred / (scale + eps)).float()


def distributed_group_advantages(accelerator, rewards: torch.Tensor, group_ids: torch.Tensor, sample_ids: torch.Tensor,
                                 std: str = "group", eps: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's advantages, with group statistics taken over all ranks' samples.

    Also returns the gathered rewards and group ids (every rank's, ordered by sample id), so callers
    can report batch statistics without gathering again.
    """
    all_rewards, all_groups, order = gather_by_sample(accelerator, sample_ids, rewards, group_ids)
    advantages = group_advantages(all_rewards, all_groups, std, eps)
    local = advantages[torch.searchsorted(order, sample_ids.to(order.device))].to(rewards.device)
    return local, all_rewards, all_groups

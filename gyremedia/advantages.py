"""Group-relative advantages, computed over the samples of every rank.

A prompt's group may be split across ranks, so rewards are gathered first: each rank then
normalises with the statistics of whole groups and keeps its own samples' advantages. A NaN reward
marks a sample dropped by its reward's failure policy: it gets advantage 0 and is left out of its
group's mean and standard deviation.
"""

from __future__ import annotations

from typing import Callable

import torch

from gyremedia.runtime.distributed import gather_by_sample


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, std: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """``(r - mean_group) / (std + eps)`` for every sample (Flow-GRPO / GRPO normalisation).

    ``std`` is ``"group"`` (per-prompt population std), ``"global"`` (std of the whole batch) or
    ``"none"`` (only centre, as Dr. GRPO recommends to avoid the difficulty bias). NaN rewards
    (dropped samples) get advantage 0 and do not count in any statistic.
    """
    if std not in ("group", "global", "none"):
        raise ValueError(f"advantage std {std!r}: expected group, global or none")
    valid = torch.isfinite(rewards)
    weight = valid.double()
    rewards = torch.where(valid, rewards.double(), 0.0)
    _, inverse = torch.unique(group_ids.to(rewards.device), return_inverse=True)
    num_groups = int(inverse.max()) + 1

    def per_group(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, inverse, values)

    counts = per_group(weight).clamp(min=1)
    means = per_group(rewards) / counts
    centred = (rewards - means[inverse]) * weight
    if std == "group":
        var = per_group(centred**2) / counts
        centred = centred / (var.sqrt()[inverse] + eps)
    elif std == "global":
        kept = rewards[valid]
        centred = centred / ((kept.std(unbiased=False) if len(kept) else 0.0) + eps)
    return centred.float()


def combined_advantages(
    rewards: torch.Tensor,
    weights: torch.Tensor,
    group_ids: torch.Tensor,
    combine: str = "sum",
    std: str = "group",
    eps: float = 1e-4,
) -> torch.Tensor:
    """Advantages from several rewards ``[B, R]`` with weights ``[R]``, or ``[B, R]`` (one weight
    vector per sample: a Pareto run's preference, the same within a group).

    ``"sum"``: normalise the weighted sum of the rewards. ``"normalize_each"``: normalise each
    reward within its groups, then take the weighted sum of those advantages (so a reward's scale
    does not decide its influence). A sample with any NaN reward is dropped from every reward.
    """
    dropped = ~torch.isfinite(rewards).all(dim=1)
    rewards = rewards.double().masked_fill(dropped[:, None], float("nan"))
    weights = weights.to(rewards)
    if combine == "sum":
        return group_advantages((rewards * weights).sum(dim=1), group_ids, std, eps)
    if combine == "normalize_each":
        per_reward = [group_advantages(rewards[:, r], group_ids, std, eps) for r in range(rewards.shape[1])]
        return (torch.stack(per_reward, dim=1).double() * weights).sum(dim=1).float()
    raise ValueError(f"advantage combine {combine!r}: expected sum or normalize_each")


def distributed_group_advantages(
    accelerator,
    rewards: torch.Tensor,
    weights: torch.Tensor,
    group_ids: torch.Tensor,
    sample_ids: torch.Tensor,
    combine: str = "sum",
    std: str = "group",
    eps: float = 1e-4,
    normalize: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's advantages, with group statistics taken over all ranks' samples.

    ``rewards`` is ``[B, R]`` (one column per reward), ``weights`` ``[R]`` or per sample ``[B, R]``.
    ``normalize(totals, group_ids)``, given, turns the gathered weighted totals into advantages instead of
    ``combined_advantages`` (a per-prompt history: ``gyremedia_group_statistics``). Also returns the gathered
    weighted total reward (NaN where dropped) and group ids, every rank's, ordered by sample id, so callers
    can report batch statistics without gathering again.
    """
    per_sample = weights.dim() == 2
    extra = (weights.to(rewards),) if per_sample else ()
    all_rewards, all_groups, *all_weights, order = gather_by_sample(accelerator, sample_ids, rewards, group_ids, *extra)
    weights = all_weights[0] if per_sample else weights.to(all_rewards.device)
    totals = (all_rewards.double() * weights.double()).sum(dim=1)
    if normalize is not None:
        advantages = normalize(totals, all_groups)
    else:
        advantages = combined_advantages(all_rewards, weights, all_groups, combine, std, eps)
    local = advantages[torch.searchsorted(order, sample_ids.to(order.device))].to(rewards.device)
    return local, totals.float(), all_groups

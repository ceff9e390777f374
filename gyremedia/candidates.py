"""Sol-RL's two-stage rollouts: which candidates of a cheap pool are sampled again at full quality.

A group's training samples are the candidates that teach the most: the best and the worst of the pool by
the cheap samples' rewards (the contrastive subset), so the group's reward spread, and its advantages'
signal, is as large as the pool allows. The trainer's ``choose_candidates`` draws and scores the pool.
"""

from __future__ import annotations

import torch


def contrastive_subset(rewards: torch.Tensor, keep: int) -> torch.Tensor:
    """Per row of ``rewards [G, P]``, the indices of the ``ceil(keep / 2)`` highest and ``floor(keep / 2)``
    lowest rewards (``[G, keep]``, best first). A NaN reward (a failed score) ranks lowest; ties keep pool order."""
    if not 0 < keep <= rewards.shape[1]:
        raise ValueError(f"keep={keep} of {rewards.shape[1]} candidates per group")
    order = rewards.nan_to_num(nan=-torch.inf).argsort(dim=1, descending=True, stable=True)
    best, worst = (keep + 1) // 2, keep // 2
    return torch.cat([order[:, :best], order[:, order.shape[1] - worst:]], dim=1)

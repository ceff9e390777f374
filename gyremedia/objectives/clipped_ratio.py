"""The clipped importance-ratio surrogate of PPO / GRPO, one function for media transitions and tokens.

For an element (a denoising transition, a token) with advantage ``A`` and ratio ``r = pi_theta / pi_old``:

    l = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)

(``eps_high > eps_low`` is DAPO's clip-higher). Minimising ``l`` raises the likelihood of elements with
``A > 0`` until ``r`` leaves the trust region, and lowers it for ``A < 0``; outside the region the
gradient is zero.
"""

from __future__ import annotations

import torch


def clipped_ratio_loss(
    log_ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element clipped surrogate loss and the ratio ``exp(log_ratio)``; ``advantages`` broadcast."""
    ratio = torch.exp(log_ratio)
    loss = -torch.minimum(ratio * advantages, ratio.clamp(1 - eps_low, 1 + eps_high) * advantages)
    return loss, ratio


def clipped(ratio: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """Where ``ratio`` left the trust region ``[1 - eps_low, 1 + eps_high]`` (its gradient is zero there for the
    side the advantage pushes): the elements the clip fraction counts."""
    offset = ratio.detach() - 1
    return (offset < -eps_low) | (offset > eps_high)

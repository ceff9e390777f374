"""GIPO: GRPO with a Gaussian trust weight on the log-ratio in place of PPO's hard clip.

For a transition with advantage ``A`` and ratio ``r = pi_theta / pi_old``:

    w = exp(-(log sg(r))^2 / (2 sigma^2))          (the trust weight, no gradient through it)
    l = -w r A

Near the old policy ``w ~ 1`` and this is the plain policy gradient; as ``r`` leaves it, the weight damps the
sample smoothly instead of zeroing its gradient at the clip edge, so stale or extreme ratios still pull a little
(never exactly 0) and never dominate. As ``sigma -> inf``, ``w -> 1``: the unclipped ratio loss ``-r A``.

The paper's code (AcceRL's GIPO trainer) weights per-token LLM ratios with sigma 0.5. Here the ratio is of a
denoising transition's log-prob averaged over the latent (Flow-GRPO's), whose log-ratios are of order 1e-4, so
the default sigma is on Flow-GRPO's clip scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyremedia import hookimpl
from gyremedia.objectives.grpo import GRPOObjective, GRPOOptions
from gyremedia.options import option


@dataclass
class GIPOOptions(GRPOOptions):
    clip_range: float = option(
        2e-4, gt=0, help="sigma of the Gaussian trust weight on the log-ratio (GIPO's soft trust region; no hard clip)"
    )


def gaussian_trust_loss(
    log_ratio: torch.Tensor, advantages: torch.Tensor, sigma: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-element ``-w r A`` (see the module docstring), the ratio and the trust weight ``w``."""
    ratio = torch.exp(log_ratio)
    weight = torch.exp(-(log_ratio.detach() ** 2) / (2 * sigma**2))
    return -weight * ratio * advantages, ratio, weight


class GIPOObjective(GRPOObjective):
    """GRPO over recorded transitions with GIPO's Gaussian trust weight instead of the clip."""

    name = "gipo"

    def surrogate(
        self, log_ratio: torch.Tensor, advantages: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, ratio, weight = gaussian_trust_loss(log_ratio, advantages, self.options.clip_range)
        return loss, {"ratio": ratio.detach().mean(), "trust_weight": weight.mean()}


@hookimpl
def gyremedia_register_objectives(register):
    register(
        "gipo",
        GIPOObjective,
        options=GIPOOptions,
        description="GRPO with GIPO's Gaussian trust weight on the log-ratio instead of the hard clip",
    )

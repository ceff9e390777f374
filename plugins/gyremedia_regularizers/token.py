"""The KL of a token policy to its reference (the base model: adapters off under LoRA, else a frozen copy).

Per completion token, with ``d = log pi_ref - log pi_theta``, the k3 estimator of ``KL(pi_theta || pi_ref)``

    k3 = exp(d) - d - 1            (>= 0, unbiased under pi_theta's samples, low variance; Schulman 2020)

with ``d`` clamped to [-20, 20] and ``k3`` to at most 10, as verl does: one token far from the reference
cannot overflow the term or dominate the batch's gradient.

aggregated over tokens exactly as the objective aggregates its own (``outputs["aggregate"]``), so
``loss + beta * kl`` is TRL's ``per_token_loss + beta * per_token_kl`` for every loss type.
"""

from __future__ import annotations

from typing import Any

import torch

from gyremedia.interfaces import LossOutput
from gyremedia.objectives.token_grpo import bounded_log_ratio

#: verl's bound on the estimate (``d`` is bounded by :func:`gyremedia.objectives.token_grpo.bounded_log_ratio`).
K3_BOUND = 10.0


def k3(log_probs: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per-token ``exp(d) - d - 1`` with ``d = reference - log_probs``, both bounded (see the module docstring)."""
    delta = bounded_log_ratio(reference, log_probs)
    return (torch.exp(delta) - delta - 1).clamp(max=K3_BOUND)


class TokenKL:
    """k3 KL to the reference, per token, aggregated like the objective's loss."""

    needs_reference = True
    transitions = "tokens"

    def __init__(self, context: Any = None) -> None:
        pass

    def __call__(self, *, state, rollout, outputs) -> LossOutput:
        with torch.no_grad():
            reference = state.backbone.token_log_probs(rollout, reference=True)
        kl = outputs["aggregate"](k3(outputs["log_probs"], reference))
        return LossOutput(loss=kl, metrics={"kl": kl.detach()})

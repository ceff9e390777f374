"""Regularizers on the trained velocity against the frozen reference policy's, at the same state.

They read ``outputs["model_output"]`` (the policy's velocity), ``outputs["state"]`` and
``outputs["sigma"]`` of any objective's micro-step, so they compose with GRPO and with the
forward-process objectives alike. The reference is the base model (adapters disabled under LoRA).

- ``velocity_norm_hinge``: RL inflates the velocity's norm relative to the reference; the hinge
  ``max(0, |v| - |v_ref|)`` (RMS norms, per sample and step) is zero unless the policy's velocity
  is the larger, so it never pulls a well-behaved model. Logs the inflation ``|v| / |v_ref|``.
- ``velocity_kl``: ``||v - v_ref||^2`` (the velocity-space KL up to a step-size factor); with
  ``guidance_scale > 1`` the reference is CFG-guided, CRD's KL anchored to the guided model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gyremedia.interfaces import BuildContext, LossOutput


def reference_velocity(state: Any, rollout: Any, outputs: dict[str, Any], guidance_scale: float) -> torch.Tensor:
    """The reference policy's velocity at the micro-step's states (no gradient)."""
    with torch.no_grad():
        return state.backbone.predict(outputs["state"], outputs["sigma"], rollout.conditions, guidance_scale,
                                      reference=True).float()


def rms(v: torch.Tensor) -> torch.Tensor:
    """Per-sample RMS norm (the norm divided by sqrt(dimensions): independent of resolution)."""
    return v.float().pow(2).mean(dim=tuple(range(1, v.dim()))).sqrt()


def norm_hinge(v: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    """Per-sample ``max(0, |v| - |v_ref|)``: exactly zero when the policy's norm is not the larger."""
    return torch.relu(rms(v) - rms(v_ref.detach()))


@dataclass
class NormHingeOptions:
    guidance_scale: float = 1.0  # guidance of the reference velocity


class VelocityNormHinge:
    """Penalty on velocity-norm inflation over the reference."""

    needs_reference = True

    def __init__(self, options: NormHingeOptions, context: BuildContext | None = None) -> None:
        self.guidance_scale = options.guidance_scale

    def __call__(self, *, state, rollout, outputs) -> LossOutput:
        v = outputs["model_output"]
        v_ref = reference_velocity(state, rollout, outputs, self.guidance_scale)
        return LossOutput(loss=norm_hinge(v, v_ref).mean(),
                          metrics={"inflation": (rms(v.detach()) / rms(v_ref).clamp(min=1e-12)).mean()})


@dataclass
class VelocityKLOptions:
    guidance_scale: float = 1.0  # > 1: KL to the CFG-guided reference (CRD)


class VelocityKL:
    """``||v - v_ref||^2``, averaged over dimensions and samples."""

    needs_reference = True

    def __init__(self, options: VelocityKLOptions, context: BuildContext | None = None) -> None:
        self.guidance_scale = options.guidance_scale

    def __call__(self, *, state, rollout, outputs) -> LossOutput:
        v = outputs["model_output"].float()
        return LossOutput(loss=(v - reference_velocity(state, rollout, outputs, self.guidance_scale)).pow(2).mean())

"""Regularizers against the frozen reference policy (the base model; adapters disabled under LoRA).

The velocity ones read ``outputs["model_output"]`` (the policy's velocity), ``outputs["state"]``,
``outputs["sigma"]`` and ``outputs["conditions"]`` of any objective's micro-step, so they compose
with GRPO and with the forward-process objectives alike.

- ``velocity_norm_hinge``: RL inflates the velocity's norm relative to the reference; the hinge
  ``max(0, |v| - |v_ref|)`` (RMS norms, per sample and step) is zero unless the policy's velocity
  is the larger, so it never pulls a well-behaved model. Logs the inflation ``|v| / |v_ref|``,
  overall and per noise-level bucket.
- ``velocity_kl``: ``||v - v_ref||^2`` (the velocity-space KL up to a step-size factor); with
  ``guidance_scale > 1`` the reference is CFG-guided, CRD's KL anchored to the guided model.
- ``gaussian_kl``: the exact KL between the policy's and the reference's Gaussian SDE transitions,
  ``||mean - mean_ref||^2 / (2 std^2)`` (Flow-GRPO's form), for objectives that replay transitions.

Both KL terms take a reward-adaptive strength (``adapt: relax | tighten``, see ``adaptive.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gyremedia import hookimpl
from gyremedia.distributed import global_nanmeans
from gyremedia.interfaces import BuildContext, LossOutput
from gyremedia.sampling import transition_kl
from gyremedia_regularizers.adaptive import AdaptiveOptions, RewardAdaptiveStrength


def reference_prediction(state: Any, outputs: dict[str, Any], guidance_scale: float) -> torch.Tensor:
    """The reference policy's output at the micro-step's states (no gradient)."""
    with torch.no_grad():
        return state.backbone.predict(outputs["state"], outputs["sigma"], outputs["conditions"], guidance_scale,
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
    buckets: int = 4  # noise-level buckets of [0, 1] the inflation is also logged per (0: none)


class VelocityNormHinge:
    """Penalty on velocity-norm inflation over the reference."""

    needs_reference = True
    name = "velocity_norm_hinge"

    def __init__(self, options: NormHingeOptions, context: BuildContext | None = None) -> None:
        if options.buckets < 0:
            raise ValueError("buckets must be >= 0")
        self.guidance_scale = options.guidance_scale
        self.buckets = options.buckets
        self._by_bucket: dict[str, list[torch.Tensor]] = {}  # this step's per-sample inflations

    def __call__(self, *, state, rollout, outputs) -> LossOutput:
        v = outputs["model_output"]
        v_ref = reference_prediction(state, outputs, self.guidance_scale)
        inflation = rms(v.detach()) / rms(v_ref).clamp(min=1e-12)
        if self.buckets:
            self._record(inflation, outputs["sigma"])
        return LossOutput(loss=norm_hinge(v, v_ref).mean(), metrics={"inflation": inflation.mean()})

    def _record(self, inflation: torch.Tensor, sigma: torch.Tensor) -> None:
        sigma = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1).expand(len(inflation)).cpu()
        bucket = (sigma * self.buckets).long().clamp(0, self.buckets - 1)
        for b in bucket.unique().tolist():
            key = f"{self.name}/inflation_t{b / self.buckets:.2f}-{(b + 1) / self.buckets:.2f}"
            self._by_bucket.setdefault(key, []).append(inflation.cpu()[bucket == b])

    @hookimpl
    def gyremedia_on_step_end(self, state, metrics: dict[str, float]) -> None:
        """Log this step's mean inflation per noise-level bucket, over every rank's samples."""
        if self.buckets:
            values = {key: torch.cat(parts) for key, parts in self._by_bucket.items()}
            metrics.update(global_nanmeans(state.accelerator, values))
            self._by_bucket = {}


@dataclass
class VelocityKLOptions(AdaptiveOptions):
    guidance_scale: float = 1.0  # > 1: KL to the CFG-guided reference (CRD)


class VelocityKL(RewardAdaptiveStrength):
    """``||v - v_ref||^2``, averaged over dimensions and samples (times the adaptive scale)."""

    needs_reference = True

    def __init__(self, options: VelocityKLOptions, context: BuildContext | None = None) -> None:
        super().__init__(options, context)
        self.guidance_scale = options.guidance_scale

    def __call__(self, *, state, rollout, outputs) -> LossOutput:
        v = outputs["model_output"].float()
        kl = (v - reference_prediction(state, outputs, self.guidance_scale)).pow(2).mean()
        return LossOutput(loss=self.scale * kl, metrics={"kl": kl.detach(), "strength": torch.tensor(self.scale)})


class GaussianKL(RewardAdaptiveStrength):
    """Exact KL between the policy's replayed SDE transition and the reference's from the same state."""

    needs_reference = True

    def __call__(self, *, state, rollout, outputs) -> LossOutput:
        transition = outputs.get("transition")
        if transition is None:
            raise ValueError("gaussian_kl needs an objective that replays sampler transitions (grpo, tree_grpo); "
                             "use velocity_kl with the forward-process objectives")
        guidance = state.config.core.rollout.guidance_scale  # the transitions were sampled with it
        v_ref = reference_prediction(state, outputs, guidance)
        reference = state.sampler.step(outputs["state"], v_ref, outputs["sigmas"], outputs["index"],
                                       next_state=transition.next_state)
        kl = transition_kl(transition, reference).mean()
        return LossOutput(loss=self.scale * kl, metrics={"kl": kl.detach(), "strength": torch.tensor(self.scale)})

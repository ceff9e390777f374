"""Regularizers against the frozen reference policy (the base model; adapters disabled under LoRA).

The velocity ones read ``outputs["model_output"]`` (the policy's velocity), ``outputs["state"]``,
``outputs["sigma"]`` and ``outputs["conditions"]`` of any objective's micro-step, so they compose
with GRPO and with the forward-process objectives alike.

- ``velocity_norm_hinge``: RL inflates the velocity's norm relative to the reference; the hinge
  ``max(0, |v| - |v_ref|)`` (RMS norms, per sample and step) is zero unless the policy's velocity
  is the larger, so it never pulls a well-behaved model. Logs the inflation ``|v| / |v_ref|``,
  overall and per noise-level bucket.
- ``velocity_kl``: ``||v - v_ref||^2`` (the velocity-space KL up to a step-size factor); with
  ``guidance_scale > 1`` the reference is CFG-guided, CRD's KL anchored to the guided model. The
  forward-process objectives' ``kl_beta`` selects it.
- ``gaussian_kl``: the KL between the policy's and the reference's Gaussian SDE transitions from the
  same state, for objectives that replay transitions (GRPO's ``kl_beta`` selects it). Two Gaussians
  with the step's std ``s = a sqrt(sigma / (1 - sigma)) sqrt(|dt|)`` differ only in their means, so

      exact:      KL = ||mean - mean_ref||^2 / (2 s^2)                  (the default)
      flow_grpo:  KL_fg = ||mean - mean_ref||^2 / (2 (s^2 / |dt|)) = |dt| KL

  ``flow_grpo`` is what Flow-GRPO's code computes (it divides by the std without its sqrt(|dt|)
  factor), so its published ``beta`` (0.04) carries over with ``scale: flow_grpo``. On a 10-step SD3
  schedule ``|dt|`` runs from about 0.27 down to 0.009: the same beta is 3.7x to 112x stronger per
  step under ``exact``. Both average over the state's dimensions, like the log-probs.

Both KL terms take a reward-adaptive strength (``adapt: relax | tighten``, see ``adaptive.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from gyremedia import hookimpl
from gyremedia.interfaces import BuildContext, LossOutput, Transition
from gyremedia.options import option
from gyremedia.runtime.distributed import global_nanmeans
from gyremedia_regularizers.adaptive import AdaptiveOptions, RewardAdaptiveStrength


def reference_prediction(state: Any, outputs: dict[str, Any], guidance_scale: float | None) -> torch.Tensor:
    """The reference policy's output at the micro-step's states (no gradient); guidance ``None`` is the
    run's own (``rollout.guidance_scale``, what the policy's output was made with). A forward-process
    objective's outputs (``flow_path``) hold flow velocities, compared with the reference's ``flow_velocity``;
    a replaying objective's hold the backbone's own prediction."""
    if guidance_scale is None:
        guidance_scale = state.config.core.rollout.guidance_scale
    predict = state.backbone.flow_velocity if outputs.get("flow_path") else state.backbone.predict
    with torch.no_grad():
        return predict(
            outputs["state"], outputs["sigma"], outputs["conditions"], guidance_scale, reference=True
        ).float()


def transition_kl(policy: Transition, reference: Transition) -> torch.Tensor:
    """Per-sample ``KL(pi_theta || pi_ref)`` of two Gaussian steps with the same std:
    ``||mean_theta - mean_ref||^2 / (2 std^2)``, averaged over the state's dimensions (``std`` a scalar)."""
    if policy.std is None or reference.mean is None:
        raise ValueError("a transition KL needs Gaussian transitions (mean and std) from a stochastic sampler")
    dims = tuple(range(1, policy.mean.dim()))
    std = torch.as_tensor(policy.std, dtype=torch.float32, device=policy.mean.device)
    gap = ((policy.mean.float() - reference.mean.float()) ** 2).mean(dim=dims)
    # A deterministic step (std 0, e.g. CPS's last) has no density to compare: no KL.
    return torch.where(std > 0, gap / (2 * std.clamp(min=1e-12) ** 2), torch.zeros_like(gap))


def rms(v: torch.Tensor) -> torch.Tensor:
    """Per-sample RMS norm (the norm divided by sqrt(dimensions): independent of resolution)."""
    return v.float().pow(2).mean(dim=tuple(range(1, v.dim()))).sqrt()


def norm_hinge(v: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    """Per-sample ``max(0, |v| - |v_ref|)``: exactly zero when the policy's norm is not the larger."""
    return torch.relu(rms(v) - rms(v_ref.detach()))


@dataclass
class NormHingeOptions:
    guidance_scale: float | None = option(None, ge=1, help="guidance of the reference velocity (default: the run's)")
    buckets: int = option(4, ge=0, help="noise-level buckets of [0, 1] the inflation is also logged per (0: none)")


class VelocityNormHinge:
    """Penalty on velocity-norm inflation over the reference."""

    needs_reference = True
    transitions = "denoising"
    name = "velocity_norm_hinge"

    def __init__(self, options: NormHingeOptions, context: BuildContext | None = None) -> None:
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
    guidance_scale: float | None = option(
        None, ge=1, help="guidance of the reference (> 1: CRD's CFG-guided reference); default: the run's"
    )


@dataclass
class GaussianKLOptions(AdaptiveOptions):
    scale: Literal["exact", "flow_grpo"] = option(
        "exact", help="exact KL, or Flow-GRPO's code's |dt| times it (its published betas carry over)"
    )


class VelocityKL(RewardAdaptiveStrength):
    """``||v - v_ref||^2``, averaged over dimensions and samples (times the adaptive scale)."""

    needs_reference = True
    transitions = "denoising"

    def __init__(self, options: VelocityKLOptions, context: BuildContext | None = None) -> None:
        super().__init__(options, context)
        self.guidance_scale = options.guidance_scale

    def __call__(self, *, state, rollout, outputs) -> LossOutput:
        v = outputs["model_output"].float()
        kl = (v - reference_prediction(state, outputs, self.guidance_scale)).pow(2).mean()
        return LossOutput(loss=self.scale * kl, metrics={"kl": kl.detach(), "strength": torch.tensor(self.scale)})


class GaussianKL(RewardAdaptiveStrength):
    """KL between the policy's replayed SDE transition and the reference's from the same state."""

    needs_reference = True
    requires_log_prob = True
    transitions = "denoising"

    def __init__(self, options: GaussianKLOptions, context: BuildContext | None = None) -> None:
        super().__init__(options, context)
        self.flow_grpo_scale = options.scale == "flow_grpo"

    def __call__(self, *, state, rollout, outputs) -> LossOutput:
        transition = outputs.get("transition")
        if transition is None:
            raise ValueError(
                "gaussian_kl needs an objective that replays sampler transitions (grpo, tree_grpo); "
                "use velocity_kl with the forward-process objectives"
            )
        v_ref = reference_prediction(state, outputs, None)  # with the guidance the transitions were sampled with
        sigmas, index = outputs["sigmas"], outputs["index"]
        reference = state.sampler.step(outputs["state"], v_ref, sigmas, index, next_state=transition.next_state)
        kl = transition_kl(transition, reference)
        if self.flow_grpo_scale:
            kl = kl * (sigmas[index] - sigmas[index + 1]).abs()
        kl = kl.mean()
        return LossOutput(loss=self.scale * kl, metrics={"kl": kl.detach(), "strength": torch.tensor(self.scale)})

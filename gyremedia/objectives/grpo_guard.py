"""GRPO-Guard: Flow-GRPO with the ratio normalised per step and the steps' gradients equalised.

Flow-GRPO's log-ratio of a Gaussian SDE step ``N(mu, s^2)`` (``s = sigma_t sqrt(dt)``, the step's std), averaged
over the latent's ``D`` elements, is, with ``x' = mu_old + s eps`` the recorded next state and ``d = mu_theta -
mu_old``:

    log r = <eps, d> / (s D) - ||d||^2 / (2 s^2 D)

The second term is never positive, so ratios sit below 1 and the clip stops fewer over-optimising updates on one
side than the other; and ``1/s`` makes the steps' ratios and gradients differ by orders of magnitude. GRPO-Guard
(RatioNorm) adds the bias back and rescales by ``s``, and divides each step's loss by ``dt``:

    b      = ||mu_theta - mu_old||^2 / (2 s^2 D)          (per sample; gradient through mu_theta)
    log r~ = s (log r + b)  = <eps, d> / D                 (centred, the same scale at every step)
    L      = mean_b max(-A r~, -A clip(r~, 1 - eps, 1 + eps)) / dt

``mu_old`` of the trained transitions is recorded while sampling (:class:`gyremedia.sampling.StepMeans`), so no
forward recomputes it. On the first update (``mu_theta = mu_old``) ``b = 0`` and ``r~ = 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gyremedia import hookimpl
from gyremedia.interfaces import RolloutRequest, Transition
from gyremedia.objectives.grpo import GRPOObjective, GRPOOptions
from gyremedia.options import option
from gyremedia.rollout import Rollout
from gyremedia.sampling import StepMeans, stochastic_steps


@dataclass
class GRPOGuardOptions(GRPOOptions):
    clip_range: float = option(
        2e-6, gt=0, help="PPO clip of the normalised ratio (the authors' 2e-6: their log-ratio is scaled by s)"
    )


def guarded_log_ratio(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor, std: torch.Tensor
) -> torch.Tensor:
    """``[B]`` RatioNorm's ``s (log r + b)``: the per-sample bias ``b = mean (mu - mu_old)^2 / (2 s^2)`` added back
    and the step's std ``s`` (a scalar) multiplied in (see the module docstring)."""
    dims = tuple(range(1, mean.dim()))
    bias = (mean.float() - old_mean.float()).pow(2).mean(dim=dims) / (2 * std**2)
    return (log_prob - old_log_prob + bias) * std


class GRPOGuardObjective(GRPOObjective):
    """Flow-GRPO with GRPO-Guard's ratio normalisation and per-step gradient reweighting."""

    name = "grpo_guard"
    per_frame = False  # its terms are per token or per transition

    @hookimpl
    def gyremedia_prepare_request(self, state: Any, request: RolloutRequest) -> None:
        """Record the step means of the transitions this step will train (the old policy's)."""
        sigmas = state.backbone.sigmas(request.settings.num_steps)
        trained = self.planned_transitions(stochastic_steps(state.sampler, sigmas), request.step)
        request.recorders.append(StepMeans(trained))

    def policy_terms(
        self, transition: Transition, samples: Rollout, micro_step: int, advantages: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if "old_means" not in samples.extras or transition.mean is None or transition.std is None:
            raise ValueError("grpo_guard needs the recorded step means (a flat rollout with a Gaussian sampler)")
        old_mean = samples.extras["old_means"][micro_step]
        std = torch.as_tensor(transition.std, dtype=torch.float32).mean()
        old_log_prob = samples.log_probs[:, micro_step]
        log_ratio = guarded_log_ratio(transition.log_prob, old_log_prob, transition.mean, old_mean, std)
        loss, metrics = self.surrogate(log_ratio, advantages)  # PPO's clip, on the normalised ratio
        metrics["approx_kl"] = 0.5 * ((transition.log_prob - old_log_prob).detach() ** 2).mean()  # the raw ratio's
        dt = (samples.sigmas[micro_step] - samples.sigmas[micro_step + 1]).float()
        return loss / dt, metrics


@hookimpl
def gyremedia_register_objectives(register):
    register(
        "grpo_guard",
        GRPOGuardObjective,
        options=GRPOGuardOptions,
        description="GRPO-Guard: Flow-GRPO with the ratio re-centred and scaled per step, losses divided by dt",
    )

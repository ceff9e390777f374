"""Spatial credit for Flow-GRPO: a ratio per patch token, each token's advantage weighted by a credit map.

Flow-GRPO gives a transition one log-prob, the Gaussian log-density averaged over the whole latent, and so one
ratio and one advantage for every place in the image. Here the transition's log-density is split into the
tokens a DiT patchifies (``p x p`` squares of the latent grid, channels averaged): token ``k`` of sample ``b`` at
transition ``i`` has its own ratio, and its own share of the sample's advantage:

    log pi_k   = mean over token k's elements of log N(x_{i+1}; mu_theta(x_i), sigma_i^2)
    r_k        = exp(log pi_k - log pi_old,k)              (pi_old,k recorded while sampling)
    g_k        = sum over token k's pixels and channels of |dR_hat / d image|   (a differentiable reward R_hat)
    z_k        = clip((g_k - median_k g) / (1.4826 MAD_k g + 1e-8), -3, 3)     (robust z-score, outliers capped)
    c_k        = T softmax_k(z / tau)                                           (T tokens: mean c = 1)
    L          = mean_{b,k} max(-A_b c_k r_k, -A_b c_k clip(r_k, 1 - eps, 1 + eps))

With a uniform map (``c = 1``: ``tau -> inf``, or a flat gradient) and one token covering the latent this is
exactly Flow-GRPO's loss; with a uniform map and any tokens its gradient on the first update (``r = 1``) is
Flow-GRPO's (the mean of the tokens' log-probs is the transition's). The advantage ``A_b`` still comes from the
run's rewards (the verifier); ``R_hat`` (``credit_reward``, a reward in ``rewards:``, usually with weight 0) only
says where in the image the credit goes. Its gradient is taken once per rollout on the decoded samples and pooled
from pixels to the token grid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gyremedia import hookimpl
from gyremedia.interfaces import BuildContext, RolloutRequest, Transition
from gyremedia.objectives.clipped_ratio import clipped, clipped_ratio_loss
from gyremedia.objectives.grpo import GRPOObjective, GRPOOptions
from gyremedia.options import option
from gyremedia.rollout import Rollout
from gyremedia.sampling import PatchLogProbs, patch_log_probs


@dataclass
class SpatialGRPOOptions(GRPOOptions):
    credit_reward: str = option(
        "",
        help="a differentiable reward in `rewards:` (weight 0 keeps it out of the advantage) whose input "
        "gradient makes the credit map; empty: a uniform map (Flow-GRPO with per-token ratios)",
    )
    temperature: float = option(1.0, gt=0, help="tau of the credit map's softmax over tokens (large: uniform)")
    patch_size: int = option(2, ge=1, help="tokens are patch x patch squares of the latent (SD3 and Flux: 2)")


def credit_map(gradient_magnitude: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[B, T]`` credit per token from the reward's gradient magnitude per token ``[B, T]``: a robust z-score (the
    median and the median absolute deviation, so a few extreme gradients neither set the scale nor, capped at 3,
    take all the credit), then a softmax over tokens at ``temperature``, scaled so every sample's credits average 1."""
    median = gradient_magnitude.median(dim=1, keepdim=True).values
    mad = (gradient_magnitude - median).abs().median(dim=1, keepdim=True).values
    z = ((gradient_magnitude - median) / (1.4826 * mad + 1e-8)).clamp(-3, 3)
    return gradient_magnitude.shape[1] * torch.softmax(z / temperature, dim=1)


def spatial_grpo_loss(
    log_ratio: torch.Tensor, advantages: torch.Tensor, credit: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample loss (the mean over tokens of each token's clipped surrogate with advantage ``A_b c_k``) and the
    ratios; ``log_ratio`` and ``credit`` are ``[B, T]``, ``advantages`` ``[B]``."""
    per_token, ratio = clipped_ratio_loss(log_ratio, advantages[:, None] * credit, eps, eps)
    return per_token.mean(dim=1), ratio


def token_gradient_magnitude(gradient: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """``[B, T]``: ``|gradient|`` of images ``[B, C, H, W]`` summed over channels and pooled onto the token
    ``grid`` (rows, columns), row-major as tokens are."""
    magnitude = gradient.abs().float().sum(dim=1, keepdim=True)
    return torch.nn.functional.adaptive_avg_pool2d(magnitude, grid).flatten(1)


class SpatialGRPOObjective(GRPOObjective):
    """Flow-GRPO with token-wise ratios and a reward-gradient credit map."""

    name = "spatial_grpo"
    per_frame = False  # its terms are per token or per transition
    prepares = True  # prepare: the credit maps, once per rollout

    def __init__(self, options: SpatialGRPOOptions, context: BuildContext) -> None:
        super().__init__(options, context)
        self.credit_scorer: Any = None  # the credit reward, found at setup

    @hookimpl
    def gyremedia_setup(self, state: Any, context: BuildContext) -> None:
        name = self.options.credit_reward
        if name:
            self.credit_scorer = state.rewards[name]  # the config check made sure it is there and differentiable

    @hookimpl
    def gyremedia_prepare_request(self, state: Any, request: RolloutRequest) -> None:
        request.recorders.append(PatchLogProbs(self.options.patch_size))  # the old policy's per-token log-probs

    def prepare(self, ctx: Any, rollout: Rollout) -> None:
        """Before the rollout's first update: every sample's credit map, from the credit reward's gradient."""
        tokens = rollout.extras["token_log_probs"].shape[-1]
        if self.credit_scorer is None:
            rollout.extras["credit"] = torch.ones(len(rollout), tokens, device=rollout.states.device)
            return
        p = self.options.patch_size
        grid = (rollout.states.shape[-2] // p, rollout.states.shape[-1] // p)
        gradient = self.credit_scorer.input_gradient(rollout.media, rollout.prompts)
        credit = credit_map(token_gradient_magnitude(gradient, grid), self.options.temperature)
        rollout.extras["credit"] = credit.to(rollout.states.device)

    def policy_terms(
        self, transition: Transition, samples: Rollout, micro_step: int, advantages: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token ratios against the recorded per-token log-probs, weighted by the credit map."""
        if "credit" not in samples.extras or "token_log_probs" not in samples.extras:
            raise ValueError("spatial_grpo: the rollout has no per-token log-probs or credit map (prepare it first)")
        new = patch_log_probs(transition.next_state, transition.mean, transition.std, self.options.patch_size)
        log_ratio = new - samples.extras["token_log_probs"][:, micro_step]
        credit = samples.extras["credit"]
        per_sample, ratio = spatial_grpo_loss(log_ratio, advantages, credit, self.options.clip_range)
        eps = self.options.clip_range
        return per_sample, {
            "ratio": ratio.detach().mean(),
            "clip_fraction": clipped(ratio, eps, eps).float().mean(),
            "approx_kl": 0.5 * (log_ratio.detach() ** 2).mean(),
            "credit_max": credit.max(dim=1).values.mean(),
        }


@hookimpl
def gyremedia_check_config(core: Any, selected: dict[str, Any]) -> list[str]:
    objective = selected.get("objective")
    if objective is None or objective.name != "spatial_grpo" or not objective.options.credit_reward:
        return []
    name = objective.options.credit_reward
    rewards = {s.name: s for s in selected.get("rewards") or [] if s is not None}
    if name not in rewards:
        return [
            f"objective.credit_reward: {name!r} is not in rewards: add it there (weight 0 keeps it out of the "
            f"advantage), or choose one of {', '.join(sorted(rewards)) or 'none'}"
        ]
    if not rewards[name].meta.get("differentiable"):
        return [
            f"objective.credit_reward: reward {name!r} is not differentiable (its class declares no "
            "differentiable = True with an input_gradient): choose a differentiable reward for the credit map"
        ]
    return []


@hookimpl
def gyremedia_register_objectives(register):
    register(
        "spatial_grpo",
        SpatialGRPOObjective,
        options=SpatialGRPOOptions,
        description="Flow-GRPO with a ratio per patch token and a reward-gradient credit map (DiT spatial credit)",
    )

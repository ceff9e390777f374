"""AWM: advantage-weighted matching on the forward process.

Each clean rollout sample is re-noised (``x_t = (1 - t) x0 + t eps``) and scored by an ELBO-style
log-likelihood surrogate of the flow-matching error ``l = mean ||v(x_t, t) - (eps - x0)||^2``:

    log p = -w(t) l          (w: the run's timestep weighting, section `weighting:`; default t)
    L     = -A * exp(log p - sg(log p_old))        (per sample, averaged)

On-policy the ratio is 1 and the gradient is ``A * grad log p``: pretraining's loss, weighted by
the advantage (so with A = 1 and uniform weighting it is exactly the flow-matching gradient). With
per-frame advantages (``advantage.per_frame``) each frame has its own ``log p`` (the error over its own
elements; their mean is the sample's), ratio and advantage. The
old policy is an EMA of the trained weights; an optional PPO clip bounds the ratio. Any sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyremedia import hookimpl
from gyremedia.interfaces import LossOutput, ObjectiveContext
from gyremedia.objectives.clipped_ratio import clipped, clipped_ratio_loss
from gyremedia.objectives.forward_process import ForwardProcessObjective, ForwardProcessOptions, normalised_error
from gyremedia.options import option
from gyremedia.rollout import Rollout


@dataclass
class AWMOptions(ForwardProcessOptions):
    clip_range: float = option(0.0, ge=0, help="PPO clip of the ratio; 0 = no clip")


def awm_loss(log_p: torch.Tensor, log_p_old: torch.Tensor, advantages: torch.Tensor, clip_range: float) -> torch.Tensor:
    """Per-sample ``-A r`` with ``r = exp(log p - sg(log p_old))``, PPO-clipped when ``clip_range > 0``."""
    log_ratio = log_p - log_p_old.detach()
    if clip_range > 0:
        return clipped_ratio_loss(log_ratio, advantages, clip_range, clip_range)[0]
    return -advantages * torch.exp(log_ratio)


class AWMObjective(ForwardProcessObjective):
    """Advantage-weighted matching over re-noised rollout samples."""

    default_weighting = "t"
    per_frame = True

    name = "awm"

    def loss(self, ctx: ObjectiveContext, rollout: Rollout, micro_step: int) -> LossOutput:
        o = self.options
        batch, v, v_old = self.predictions(ctx, rollout, micro_step)
        frame_dim = self.frame_dim(ctx, rollout)
        log_p, log_p_old = self.elbo_log_p(ctx, v, batch, frame_dim), self.elbo_log_p(ctx, v_old, batch, frame_dim)
        policy_loss = awm_loss(log_p, log_p_old, self.clipped_advantages(rollout), o.clip_range).mean()
        ratio = torch.exp(log_p - log_p_old).detach()
        metrics = {"ratio": ratio.mean()}
        if o.clip_range > 0:
            metrics["clip_fraction"] = clipped(ratio, o.clip_range, o.clip_range).float().mean()
        return self.output(ctx, rollout, batch, v, policy_loss, metrics)


@dataclass
class VGRPOOptions(AWMOptions):
    clip_range: float = option(
        0.01, ge=0, help="PPO clip of the ELBO ratio; inactive with one update per rollout (V-GRPO's default)"
    )
    shared_in_group: bool = option(True, help="same noise levels and noise for a group's members")
    timesteps: int = option(4, ge=1, help="(t, noise) pairs per sample per step, stratified (the paper's N_MC = 4)")
    adaptive_weighting: bool = option(
        True, help="each clean-sample error divided by its own detached mean magnitude (the paper's Eq. 14)"
    )
    soft_clip: float = option(3.0, ge=0, help="eta of the advantages' soft clip eta tanh(A / eta); 0 = none")


def soft_clip(advantages: torch.Tensor, eta: float) -> torch.Tensor:
    """``eta tanh(A / eta)``: V-GRPO's bound on the step a single sample drives (about ``A`` for ``|A| << eta``)."""
    return eta * torch.tanh(advantages / eta) if eta > 0 else advantages


class VGRPOObjective(AWMObjective):
    """V-GRPO: the GRPO ratio of ELBO surrogates with its variance reductions (the noise levels and noise shared
    within each group, stratified levels, errors normalised by their own magnitude) and its step control (the
    advantages soft-clipped, the ratio clipped when several updates share a rollout).

    Per sample, (t, eps) pair and clean-sample error ``e = x_hat - x0 = -t (v - (eps - x0))``:

        log p = w(t) * mean(e^2) / sg(mean |e|)        (w: the run's timestep weighting, uniform by default)
        A~    = eta tanh(clip(A, -5, 5) / eta)
        L     = mean max(-A~ r, -A~ clip(r, 1 - eps, 1 + eps)),   r = exp(log p - sg(log p_old))
    """

    name = "vgrpo"
    default_weighting = "uniform"
    per_frame = False  # its errors are normalised per sample

    def elbo_log_p(self, ctx, v: torch.Tensor, batch, frame_dim: int | None = None) -> torch.Tensor:
        if not self.options.adaptive_weighting:
            return super().elbo_log_p(ctx, v, batch, frame_dim)
        if ctx.weighting is None:
            raise ValueError("vgrpo needs a timestep weighting (the run's `weighting:` section)")
        clean_error = batch.broadcast(batch.t) * (v - (batch.noise - batch.x0))
        return ctx.weighting(normalised_error(clean_error), batch.t)

    def clipped_advantages(self, rollout: Rollout) -> torch.Tensor:
        return soft_clip(super().clipped_advantages(rollout), self.options.soft_clip)


@hookimpl
def gyremedia_register_objectives(register):
    register(
        "awm",
        AWMObjective,
        options=AWMOptions,
        description="advantage-weighted matching: the flow-matching loss weighted by the advantage; any sampler",
    )
    register(
        "vgrpo",
        VGRPOObjective,
        options=VGRPOOptions,
        description="V-GRPO: GRPO ratio of normalised ELBO surrogates, noise shared in groups, soft-clipped "
        "advantages; any sampler",
    )

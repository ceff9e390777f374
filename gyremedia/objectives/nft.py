"""DiffusionNFT: negative-aware fine-tuning on the forward process.

Each scored sample's clean result ``x0`` is re-noised, ``x_t = (1 - t) x0 + t eps``, and the
velocity there is pulled toward an implicit *positive* policy and away from an implicit
*negative* one, both defined around the old policy ``v_old`` (stop-gradient):

    v+ = b v + (1 - b) v_old                 v- = (1 + b) v_old - b v
    x0± = x_t - t v±                          w± = sg(mean |x0± - x0|)      (adaptive weights)
    r  = clip(A / (2 A_max) + 0.5, 0, 1)      (the advantage as an "optimality" probability)
    L  = (A_max / b) mean[ r ||x0+ - x0||^2 / w+  +  (1 - r) ||x0- - x0||^2 / w- ]  (+ kl_beta: velocity_kl)

A sample better than its group (r > 1/2) moves v toward its own clean result, a worse one away. With
per-frame advantages (``advantage.per_frame``) each frame's squared errors take that frame's ``r``.
No log-probs, no replay: any sampler (ODE included) can collect the data. With r = 1 and b = 1
it is the plain flow-matching loss ``t^2 ||v - (eps - x0)||^2`` (adaptively weighted) on x0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyremedia import hookimpl
from gyremedia.interfaces import LossOutput, ObjectiveContext
from gyremedia.objectives.forward_process import ForwardProcessObjective, ForwardProcessOptions
from gyremedia.options import option
from gyremedia.rollout import Rollout
from gyremedia.sampling import per_sample


@dataclass
class NFTOptions(ForwardProcessOptions):
    beta: float = option(1.0, gt=0, help="how far the implicit policies sit from the old one (paper: 1, 0.1 for OCR)")


def nft_loss(
    v: torch.Tensor,
    v_old: torch.Tensor,
    xt: torch.Tensor,
    x0: torch.Tensor,
    t: torch.Tensor,
    r: torch.Tensor,
    beta: float,
    adv_max: float,
) -> torch.Tensor:
    """Per-sample DiffusionNFT loss (see the module docstring); ``t`` broadcasts to the states, ``r`` is ``[B]`` or
    shaped to multiply the states (each frame weighted by its own optimality, ``advantage.per_frame``)."""
    dims = tuple(range(1, v.dim()))
    r = per_sample(r, v) if r.dim() == 1 else r
    v_old = v_old.detach()
    positive = xt - t * (beta * v + (1 - beta) * v_old)
    negative = xt - t * ((1 + beta) * v_old - beta * v)
    with torch.no_grad():
        w_pos = (positive - x0).abs().mean(dim=dims, keepdim=True).clamp(min=1e-5)
        w_neg = (negative - x0).abs().mean(dim=dims, keepdim=True).clamp(min=1e-5)
    pos_loss = (positive - x0) ** 2 / w_pos
    neg_loss = (negative - x0) ** 2 / w_neg
    return adv_max / beta * (r * pos_loss + (1 - r) * neg_loss).mean(dim=dims)


class NFTObjective(ForwardProcessObjective):
    """DiffusionNFT over re-noised rollout samples, against an EMA old policy."""

    name = "nft"
    per_frame = True

    def loss(self, ctx: ObjectiveContext, rollout: Rollout, micro_step: int) -> LossOutput:
        o = self.options
        batch, v, v_old = self.predictions(ctx, rollout, micro_step)
        r = (self.clipped_advantages(rollout) / (2 * o.adv_clip_max) + 0.5).clamp(0, 1)
        r = batch.broadcast(r, self.frame_dim(ctx, rollout))
        policy_loss = nft_loss(v, v_old, batch.xt, batch.x0, batch.broadcast(batch.t), r, o.beta, o.adv_clip_max).mean()
        return self.output(ctx, rollout, batch, v, policy_loss, {"old_policy_gap": (v.detach() - v_old).pow(2).mean()})


@hookimpl
def gyremedia_register_objectives(register):
    register(
        "nft",
        NFTObjective,
        options=NFTOptions,
        description="DiffusionNFT: negative-aware fine-tuning on the forward process; any sampler",
    )

"""GDRO: group-level direct reward optimisation, a listwise ranking loss on implicit rewards (works offline).

Rectified flows are deterministic given their noise, so GDRO needs no stochastic sampler and no log-probs: the
policy's implicit reward of a clean sample is its flow-matching error against the frozen reference's (as in
Diffusion-DPO), on the sample re-noised with the noise its group shares:

    s_i = -beta [ mean(u_i - v_theta(x_t^i))^2 - mean(u_i - v_ref(x_t^i))^2 ]          (u_i = eps - x0_i)

Each group (one prompt's ``k`` samples, sorted by reward ``R_1 >= ... >= R_k``) is ranked Plackett-Luce style:
at each position ``i`` the rest of the list is a softmax over ``s``, matched to the rewards' softmax at
temperature ``tau`` over the same items:

    L_rank = sum_{i=1}^{k-1} [ logsumexp_{m >= i} s_m - sum_{j >= i} q_i(j) s_j ],   q_i = softmax_{j >= i}(R_j / tau)
    L      = L_rank + gamma mean(u_best - v_theta(x_t^best))^2                          (best: the top reward)

``log Z(c)`` cancels inside each softmax, so the loss is well-posed without it. The flow-matching term on each
group's best sample keeps the policy on its data (the paper: without it, training collapses). Since only the
clean samples and their rewards enter, GDRO trains from a fixed folder of samples (``data.offline``, written
once by ``gyremedia rollout``) for as many epochs as wanted, or online from any sampler (the ODE included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyremedia import hookimpl
from gyremedia.interfaces import LossOutput, ObjectiveContext
from gyremedia.objectives.forward_process import ForwardProcessObjective, ForwardProcessOptions, whole_groups
from gyremedia.options import option
from gyremedia.rollout import Rollout


@dataclass
class GDROOptions(ForwardProcessOptions):
    beta: float = option(6.0, gt=0, help="scale of the implicit reward (the paper: 6 for GenEval, 12 for OCR)")
    temperature: float = option(0.05, gt=0, help="tau of the reward softmax the ranking is matched to")
    gamma: float = option(1.0, ge=0, help="weight of the flow-matching term on each group's best sample")
    shared_in_group: bool = option(True, help="a group's members share noise levels and noise")


def plackett_luce_loss(scores: torch.Tensor, rewards: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[G]``: each group's listwise loss (the module docstring's ``L_rank``); ``scores`` and ``rewards`` are
    ``[G, k]``. Positions are ranked by reward (ties keep their order)."""
    order = rewards.argsort(dim=1, descending=True, stable=True)
    s, r = scores.gather(1, order), rewards.gather(1, order)
    loss = scores.new_zeros(len(scores))
    for i in range(scores.shape[1] - 1):
        targets = torch.softmax(r[:, i:] / temperature, dim=1)
        loss = loss + torch.logsumexp(s[:, i:], dim=1) - (targets * s[:, i:]).sum(dim=1)
    return loss


class GDROObjective(ForwardProcessObjective):
    """Listwise ranking of each group's implicit rewards against the frozen reference, plus flow matching on the
    best sample."""

    name = "gdro"
    needs_reference = True  # the backbone keeps the frozen reference the implicit rewards compare with

    def loss(self, ctx: ObjectiveContext, rollout: Rollout, micro_step: int) -> LossOutput:
        if rollout.reward is None:
            raise ValueError("gdro needs the rollout's rewards")
        o = self.options
        size = whole_groups(rollout.group_ids, self.name)
        batch, v, _ = self.predictions(ctx, rollout, micro_step)
        with torch.no_grad():
            v_ref = ctx.backbone.flow_velocity(
                batch.xt, batch.t, rollout.conditions, ctx.guidance_scale, reference=True
            ).float()
        target = batch.noise - batch.x0
        dims = tuple(range(1, v.dim()))
        error = (v - target).pow(2).mean(dim=dims)
        scores = -o.beta * (error - (v_ref - target).pow(2).mean(dim=dims))
        order = rollout.group_ids.to(v.device).argsort(stable=True)  # rows by group, then [G, k]
        grouped_scores, grouped_rewards = scores[order].view(-1, size), rollout.reward[order].float().view(-1, size)
        ranking = plackett_luce_loss(grouped_scores, grouped_rewards, o.temperature)
        best = grouped_rewards.argmax(dim=1, keepdim=True)
        anchor = error[order].view(-1, size).gather(1, best).squeeze(1)
        policy_loss = (ranking + o.gamma * anchor).mean()
        return self.output(ctx, rollout, batch, v, policy_loss, {"implicit_reward": scores.detach().mean()})

    def old_is_current(self, ctx) -> bool:
        return True  # it compares with the frozen reference: no old policy's forward is needed


@hookimpl
def gyremedia_register_objectives(register):
    register(
        "gdro",
        GDROObjective,
        options=GDROOptions,
        description="GDRO: listwise ranking of implicit rewards per group, sampler-free; trains offline too",
    )

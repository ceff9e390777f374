"""DOHF: online h-transform fine-tuning, the reward-tilted velocity estimated from the rollout and distilled.

Tilting the policy's distribution of clean samples by ``h(x0) = exp(R(x0) / tau)`` (Doob's h-transform) changes
its velocity field at every noise level by a local correction: for ``x_t = (1 - t) x0 + t eps`` and ``u = eps -
x0``,

    v*(x_t) - v(x_t) = E[(h / E[h | x_t] - 1) (u - v(x_t)) | x_t]

(the normalised correction: ``h / E[h | x_t]`` averages 1 over the posterior, so only how a sample's ``h`` differs
from its neighbours' moves the field). The rollout's own samples estimate it with no extra network evaluation:
each clean sample ``x0_i``, re-noised, is a draw from the posterior of its ``x_t``, and its optimality weight
``w_i``, self-normalised within its prompt's group, stands in for ``h / E[h | x_t]``. The policy is regressed
onto the estimated tilted velocity:

    w_i   = G softmax_g(A_i / tau)                              (mean 1 in every group of G samples)
    v*_i  = v_old(x_t^i) + (w_i - 1) (u_i - v_old(x_t^i))        (the old velocity plus the local correction)
    L     = mean_i mean(v_theta(x_t^i) - sg(v*_i))^2

A group whose samples are all equally good (every ``w = 1``) asks for no change; a sample better than its group
pulls the velocity toward its own target, a worse one away. Rewards are black boxes (only their advantages ``A``
enter). No public code exists for the paper; this is our reading of its abstract (docs/objectives.md), and the
``- 1`` is ours: without it every sample also pulls the model toward its own samples with weight 1, the
self-training drift that collapsed the quickstart in 60 steps (docs/benchmarks.md).
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
class DOHFOptions(ForwardProcessOptions):
    temperature: float = option(1.0, gt=0, help="tau of the optimality weights softmax(A / tau) within each group")


def optimality_weights(advantages: torch.Tensor, group_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[B]``: ``G softmax(A / tau)`` within each group (``G`` its size): the self-normalised ``h`` of each sample."""
    _, inverse = group_ids.to(advantages.device).unique(return_inverse=True)
    logits = advantages / temperature
    peak = logits.new_full((int(inverse.max()) + 1,), float("-inf")).scatter_reduce(0, inverse, logits, "amax")
    weights = torch.exp(logits - peak[inverse])
    sums = weights.new_zeros(len(peak)).index_add(0, inverse, weights)
    counts = weights.new_zeros(len(peak)).index_add(0, inverse, torch.ones_like(weights))
    return weights / sums[inverse] * counts[inverse]


def dohf_loss(v: torch.Tensor, v_old: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per-sample ``mean(v - sg(v_old + (w - 1) (u - v_old)))^2``: ``target`` is ``u = eps - x0``, ``weights``
    ``[B]``."""
    v_old = v_old.detach()
    tilted = v_old + (weights - 1).view(-1, *[1] * (v.dim() - 1)) * (target - v_old)
    return (v - tilted).pow(2).mean(dim=tuple(range(1, v.dim())))


class DOHFObjective(ForwardProcessObjective):
    """The h-transformed velocity, estimated with the rollout's optimality weights, distilled into the policy."""

    name = "dohf"

    def loss(self, ctx: ObjectiveContext, rollout: Rollout, micro_step: int) -> LossOutput:
        whole_groups(rollout.group_ids, self.name)
        batch, v, v_old = self.predictions(ctx, rollout, micro_step)
        weights = optimality_weights(self.clipped_advantages(rollout), rollout.group_ids, self.options.temperature)
        policy_loss = dohf_loss(v, v_old, batch.noise - batch.x0, weights).mean()
        return self.output(ctx, rollout, batch, v, policy_loss, {"max_weight": weights.max()})


@hookimpl
def gyremedia_register_objectives(register):
    register(
        "dohf",
        DOHFObjective,
        options=DOHFOptions,
        description="DOHF: optimality-weighted local correction of the velocity (h-transform), distilled",
    )

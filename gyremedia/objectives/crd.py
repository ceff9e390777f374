"""CRD: centered reward distillation on the forward process.

KL-regularised reward maximisation has the optimum ``p*(x) = p_ref(x) exp(R(x) / beta) / Z(c)``, so the policy's
implicit reward ``beta log(p_theta / p_ref)`` should equal ``R - beta log Z(c)``. ``Z(c)`` is intractable, but it
is the same for every sample of a prompt: centring both sides within the prompt's group cancels it, and what is
left is a regression of the centred implicit reward onto the centred reward. Per sample ``i`` of group ``g``,
re-noised at ``x_t = (1 - t) x0 + t eps`` with target ``u = eps - x0``:

    r_i   = -[ mean(v_theta - u)^2 / sg(mean |v_theta - u|) - mean(v_ref - u)^2 / sg(mean |v_ref - u|) ]
    a_i   = clip(A_i / (2 A_max) + 1/2, 0, 1)                       (the advantage as an optimality probability)
    L     = (A_max / beta) mean_i [ beta (r_i - sg(mean_g r)) - (a_i - mean_g a) ]^2

``v_ref`` is the moving reference: an EMA of the trained weights whose decay grows from ``old_policy_decay`` by
``decay_growth`` per step up to ``decay_max`` (it follows the policy early and freezes late), while rollouts are
sampled by the policy itself (the sampler decoupled from the reference). Shifting every reward of a prompt by a
constant leaves ``L`` unchanged. The paper's other two parts are regularizers composed beside it: the KL anchor
to the CFG-guided base (``velocity_kl`` with ``guidance_scale``) and the reward-adaptive KL strength (its
``adapt``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyremedia import hookimpl
from gyremedia.interfaces import LossOutput, ObjectiveContext
from gyremedia.objectives.forward_process import (
    ForwardProcessObjective,
    ForwardProcessOptions,
    group_means,
    normalised_error,
    whole_groups,
)
from gyremedia.options import option
from gyremedia.rollout import Rollout


@dataclass
class CRDOptions(ForwardProcessOptions):
    beta: float = option(1.0, gt=0, help="scale of the implicit reward (the KL regularisation's inverse)")
    old_policy_decay: float = option(0.25, ge=0, lt=1, help="the moving reference's EMA decay at step 0")
    decay_growth: float = option(0.005, ge=0, help="added to the reference's decay per step (0: constant)")
    decay_max: float = option(0.999, ge=0, lt=1, help="the reference's decay stops growing here")
    shared_in_group: bool = option(True, help="a group's members share noise levels and noise")


def crd_loss(
    implicit: torch.Tensor, signal: torch.Tensor, group_ids: torch.Tensor, beta: float, scale: float
) -> torch.Tensor:
    """Per-sample ``scale / beta * (beta (r - sg(mean_g r)) - (a - mean_g a))^2`` (see the module docstring):
    ``implicit`` the implicit rewards ``r``, ``signal`` the optimality probabilities ``a``, both ``[B]``."""
    centred_implicit = implicit - group_means(implicit.detach(), group_ids)
    centred_signal = signal - group_means(signal, group_ids)
    return scale / beta * (beta * centred_implicit - centred_signal).pow(2)


class CRDObjective(ForwardProcessObjective):
    """Centered reward distillation against a moving EMA reference."""

    name = "crd"

    def loss(self, ctx: ObjectiveContext, rollout: Rollout, micro_step: int) -> LossOutput:
        o = self.options
        whole_groups(rollout.group_ids, self.name)
        batch, v, v_ref = self.predictions(ctx, rollout, micro_step)
        target = batch.noise - batch.x0
        implicit = -(normalised_error(v - target) - normalised_error(v_ref - target))
        signal = (self.clipped_advantages(rollout) / (2 * o.adv_clip_max) + 0.5).clamp(0, 1)
        policy_loss = crd_loss(implicit, signal, rollout.group_ids, o.beta, o.adv_clip_max).mean()
        return self.output(ctx, rollout, batch, v, policy_loss, {"implicit_reward": implicit.detach().mean()})

    def micro_steps(self, rollout: Rollout, step: int) -> list[int]:
        """The forward process's micro-steps; the reference's decay for this step's update (a function of the step,
        so a resumed run follows the same schedule)."""
        o = self.options
        self.old.decay = min(o.decay_max, o.old_policy_decay + o.decay_growth * step)
        return super().micro_steps(rollout, step)

    def old_is_current(self, ctx) -> bool:
        return self.old.decay == 0 and super().old_is_current(ctx)


@hookimpl
def gyremedia_register_objectives(register):
    register(
        "crd",
        CRDObjective,
        options=CRDOptions,
        description="CRD: centred implicit reward regressed onto the centred reward, moving EMA reference",
    )

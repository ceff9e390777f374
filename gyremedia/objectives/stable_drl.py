"""StableDRL: GRPO reformulated for estimated sequence ratios (diffusion LLMs).

A diffusion LM's sequence likelihood is a proxy (mean-field, ELBO), so its ratio ``r_b`` is an estimate with
noise of its own. GRPO's conditional clip ``min(r A, clip(r) A)`` lets a ratio that noise pushed far out through
on one side (``A < 0``, ``r >> 1``: the unclipped branch is the minimum), a gradient spike, and its fixed ``1 / G``
lets the sum of a group's ratios, hence the step's size, swing with that noise. StableDRL, per group g:

    r_b      = exp(mean_t m_bt log(pi_theta / pi_old)_bt)           (the sequence ratio, GSPO's length mean)
    r~_b     = clip(r_b, 1 - eps_low, 1 + eps_high)                  (unconditional: no gradient outside, any A)
    l_g      = -sum_{b in g} r~_b A_b / sg(sum_{b in g} r~_b)        (self-normalised)

so the update ``sum_b w_b A_b grad log pi_b`` has weights ``w_b = r_b / sum r~ >= 0`` that sum to at most one: it
lies in the convex hull of the per-sample gradients ``A_b grad log pi_b`` (and 0). The loss is the mean of the
groups' ``l_g``. With no ratio clipped and every group's ratios summing to its size (``sum r~ = G``), it equals
GRPO's sequence-level loss ``-mean_b min(r_b A_b, clip(r_b) A_b)`` (``tests/objectives/test_dllm_objectives.py``).
A group is normalised over its samples in the minibatch (keep ``train.num_minibatches`` at 1 or a multiple of
the group's rows). The ratios are of the backbone's likelihood (``backbone.likelihood``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from gyremedia import hookimpl
from gyremedia.interfaces import BuildContext, LossOutput, ObjectiveContext
from gyremedia.objectives.token_grpo import aggregate_tokens, log_ratios, old_log_probs
from gyremedia.options import OptionError, option
from gyremedia.rollout import Rollout


@dataclass
class StableDRLOptions:
    epsilon: float = option(0.2, gt=0, help="clip eps_low of the sequence ratio")
    epsilon_high: float | None = option(None, gt=0, help="clip eps_high (default: epsilon)")
    kl_beta: float = option(0.0, ge=0, help="weight of the k3 KL to the reference (selects the token_kl regularizer)")

    def validate(self) -> None:
        if self.epsilon >= 1:
            raise OptionError("epsilon", "must be below 1: the ratio's lower bound is 1 - epsilon")


def stable_drl_loss(
    log_ratio: torch.Tensor, advantages: torch.Tensor, groups: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """StableDRL's loss from sequence log-ratios ``[B]``, advantages ``[B]`` and group ids ``[B]`` (module
    docstring), and the clipped ratios ``r~``."""
    clipped = torch.exp(log_ratio).clamp(1 - eps_low, 1 + eps_high)
    _, index = torch.unique(groups, return_inverse=True)
    totals = torch.zeros(int(index.max()) + 1, device=clipped.device, dtype=clipped.dtype)
    totals = totals.index_add(0, index, clipped.detach())
    per_group = torch.zeros_like(totals).index_add(0, index, -clipped * advantages / totals[index])
    return per_group.mean(), clipped


class StableDRLObjective:
    """Self-normalised, unconditionally clipped sequence-ratio policy gradient over a token rollout."""

    requires_log_prob = True
    transitions = "tokens"
    kl_regularizer = "token_kl"
    prepares = True

    def __init__(self, options: StableDRLOptions, context: BuildContext) -> None:
        self.options = options
        self.eps_low = options.epsilon
        self.eps_high = options.epsilon_high if options.epsilon_high is not None else options.epsilon

    def prepare(self, ctx: ObjectiveContext, rollout: Rollout) -> None:
        """The loss mask and, when several updates share the rollout, the old policy's log-probs."""
        rollout.extras["loss_mask"] = rollout.mask.bool()
        if ctx.minibatches * ctx.passes > 1:
            rollout.extras["old_log_probs"] = old_log_probs(ctx, rollout, ctx.backbone.token_log_probs)

    def micro_steps(self, rollout: Rollout, step: int) -> list[int]:
        return [0]

    def loss(self, ctx: ObjectiveContext, rollout: Rollout, micro_step: int) -> LossOutput:
        if rollout.advantages is None or "loss_mask" not in rollout.extras:
            raise ValueError("stable_drl needs a prepared rollout with advantages")
        log_probs = ctx.backbone.token_log_probs(rollout)
        mask = rollout.extras["loss_mask"]
        old = rollout.extras.get("old_log_probs", log_probs.detach())
        log_ratio = log_ratios(log_probs, old, mask, "sequence")[:, 0]
        advantages = rollout.advantages.to(log_probs)
        loss, clipped = stable_drl_loss(log_ratio, advantages, rollout.group_ids, self.eps_low, self.eps_high)
        ratio = torch.exp(log_ratio.detach())
        metrics = {
            "policy_loss": loss.detach(),
            "ratio": ratio.mean(),
            "ratio_std": ratio.std(unbiased=False),
            "clip_fraction": (ratio != clipped.detach()).float().mean(),
            "approx_kl": (0.5 * log_ratio.detach() ** 2).mean(),
        }
        aggregate = partial(aggregate_tokens, mask=mask, loss_type="grpo", max_length=mask.shape[1])
        return LossOutput(
            loss=loss, metrics=metrics, outputs={"log_probs": log_probs, "mask": mask, "aggregate": aggregate}
        )


@hookimpl
def gyremedia_register_objectives(register):
    register(
        "stable_drl",
        StableDRLObjective,
        options=StableDRLOptions,
        description="StableDRL (diffusion LLMs): unconditionally clipped, self-normalised sequence ratios",
    )

"""LightningRL: GRPO for the speed-quality front of parallel decoding (diffusion LLMs).

A diffusion LM that commits every token it is sure enough of (``backbone.confidence_threshold``) decodes in fewer
forwards when it is more confident: its tokens per forward (TPF) can rise. LightningRL trains both axes:

- **decoupled rewards**: the correctness reward and the ``tokens_per_forward`` reward are each normalised within
  their group before they are summed (``advantage.combine: normalize_each``, which this objective requires), so
  the speed reward's scale neither drowns nor is drowned by correctness;
- **the token GRPO loss** of ``token_grpo`` (its options: aggregation, clip-higher, KL);
- **a token-level NLL on correct trajectories**: ``+ nll_weight x mean_b c_b [ -sum_t m log pi / sum_t m ]`` with
  ``c_b`` 1 for a sample whose ``correct_reward`` score reaches ``correct_threshold`` (0 else), which anchors
  accuracy while speed is pushed;
- **TPF-aware dynamic sampling**: a group whose samples are all wrong is left out of the policy loss (its only
  signal would be speed, and fast wrong answers are not worth reinforcing), as is a group in which no reward
  varies (no signal at all); groups with mixed correctness, and all-correct groups whose speed varies, train.
  Filtered groups are dropped from this step's loss, not replaced by resampling (DAPO refills the batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gyremedia import hookimpl
from gyremedia.interfaces import LossOutput, ObjectiveContext
from gyremedia.objectives.token_grpo import TokenGRPOObjective, TokenGRPOOptions, aggregate_tokens
from gyremedia.options import option
from gyremedia.rollout import Rollout


@dataclass
class LightningRLOptions(TokenGRPOOptions):
    nll_weight: float = option(0.1, ge=0, help="weight of the token NLL on correct trajectories")
    correct_reward: str = option("", help="the reward whose score marks a correct trajectory (default: the first)")
    correct_threshold: float = option(1.0, help="a score at least this is correct")
    dynamic_sampling: bool = option(True, help="leave all-wrong and signal-free groups out of the policy loss")


def kept_groups(correct: torch.Tensor, rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """``[B]`` booleans: samples whose group trains under TPF-aware filtering (module docstring). ``correct``
    ``[B]`` booleans, ``rewards`` ``[B, R]`` every reward's scores, ``groups`` ``[B]`` group ids."""
    keep = torch.zeros_like(correct)
    for group in groups.unique():
        members = groups == group
        varies = (rewards[members] != rewards[members][:1]).any()
        keep[members] = bool(correct[members].any()) and bool(varies)
    return keep


class LightningRLObjective(TokenGRPOObjective):
    """Token GRPO with decoupled reward normalisation, NLL on correct trajectories and TPF-aware filtering."""

    options: LightningRLOptions

    def prepare(self, ctx: ObjectiveContext, rollout: Rollout) -> None:
        super().prepare(ctx, rollout)
        o = self.options
        name = o.correct_reward or next(iter(rollout.rewards))
        correct = rollout.rewards[name] >= o.correct_threshold
        rollout.extras["correct"] = correct
        if o.dynamic_sampling:
            scores = torch.stack(list(rollout.rewards.values()), dim=1)
            keep = kept_groups(correct.cpu(), scores.cpu(), rollout.group_ids.cpu()).to(correct.device)
            rollout.extras["loss_mask"] = rollout.extras["loss_mask"] & keep[:, None]
            rollout.extras["kept_groups"] = keep

    def loss(self, ctx: ObjectiveContext, rollout: Rollout, micro_step: int) -> LossOutput:
        out = super().loss(ctx, rollout, micro_step)
        correct = rollout.extras["correct"].to(out.loss.device)
        mask = rollout.mask.bool() & correct[:, None]
        nll = aggregate_tokens(-out.outputs["log_probs"], mask, "grpo", max_length=mask.shape[1])
        out.metrics.update(
            nll=nll.detach(),
            correct_fraction=correct.float().mean(),
            kept_fraction=rollout.extras.get("kept_groups", torch.ones_like(correct)).float().mean(),
        )
        out.loss = out.loss + self.options.nll_weight * nll
        return out


@hookimpl
def gyremedia_check_config(core: Any, selected: dict[str, Any]) -> list[str]:
    objective = selected.get("objective")
    if objective is None or objective.name != "lightning_rl" or core.advantage.combine == "normalize_each":
        return []
    return ["objective 'lightning_rl' normalises each reward on its own: set advantage.combine=normalize_each"]


@hookimpl
def gyremedia_register_objectives(register):
    register(
        "lightning_rl",
        LightningRLObjective,
        options=LightningRLOptions,
        description="LightningRL (diffusion LLMs): decoupled rewards, NLL on correct samples, TPF-aware filtering",
    )

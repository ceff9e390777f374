"""Pairwise: the best and the worst sample of each group, the whole sampling process as one action.

No per-step log-probs: each sample's log-likelihood is the ELBO surrogate of its clean result
(``log p ~ -w(t) ||v(x_t, t) - (eps - x0)||^2`` on re-noised ``x_t``), with the noise shared by the
pair so the difference reflects the samples alone. A DPO-style logistic loss on the pair, against
the old policy (an EMA of the trained weights):

    L = -log sigmoid( beta * [ (log p(x+) - log p_old(x+)) - (log p(x-) - log p_old(x-)) ] )

pulls the velocity toward the better sample and away from the worse. Groups whose samples all
scored the same carry no preference and are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyremedia import hookimpl
from gyremedia.interfaces import LossOutput, ObjectiveContext
from gyremedia.objectives.forward_process import ForwardProcessObjective, ForwardProcessOptions
from gyremedia.options import option
from gyremedia.rollout import Rollout


@dataclass
class PairwiseOptions(ForwardProcessOptions):
    beta: float = option(100.0, gt=0, help="inverse temperature of the preference (surrogate log-ratios are small)")
    shared_in_group: bool = option(True, help="the pair sees the same noise levels and noise")


def preference_pairs(advantages: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the best and the worst sample of every group with a preference (ties skipped)."""
    winners, losers = [], []
    for group in group_ids.unique():
        members = (group_ids == group).nonzero().flatten()
        scores = advantages[members]
        if scores.max() > scores.min():
            winners.append(members[scores.argmax()])
            losers.append(members[scores.argmin()])
    empty = torch.zeros(0, dtype=torch.long)
    return (torch.stack(winners) if winners else empty), (torch.stack(losers) if losers else empty)


def pairwise_loss(log_p: torch.Tensor, log_p_old: torch.Tensor, winners: torch.Tensor, losers: torch.Tensor,
                  beta: float) -> torch.Tensor:
    """Per-pair ``-log sigmoid(beta (delta(winner) - delta(loser)))`` with ``delta = log p - sg(log p_old)``."""
    delta = log_p - log_p_old.detach()
    return -torch.nn.functional.logsigmoid(beta * (delta[winners] - delta[losers]))


class PairwiseObjective(ForwardProcessObjective):
    """Best-versus-worst preference per group on ELBO surrogates of the clean samples."""

    name = "pairwise"
    default_weighting = "uniform"

    def loss(self, ctx: ObjectiveContext, rollout: Rollout, micro_step: int) -> LossOutput:
        batch, v, v_old = self.predictions(ctx, rollout, micro_step)
        log_p, log_p_old = self.elbo_log_p(ctx, v, batch), self.elbo_log_p(ctx, v_old, batch)
        winners, losers = preference_pairs(rollout.advantages, rollout.group_ids.to(rollout.advantages.device))
        if len(winners):
            policy_loss = pairwise_loss(log_p, log_p_old, winners, losers, self.options.beta).mean()
        else:
            policy_loss = (v * 0).sum()  # no preference in this batch: a zero loss that keeps the graph
        return self.output(ctx, rollout, batch, v, policy_loss, {"pairs": torch.tensor(float(len(winners)))})


@hookimpl
def gyremedia_register_objectives(register):
    register("pairwise", PairwiseObjective, options=PairwiseOptions,
             description="best vs worst sample per group, DPO-style on ELBO surrogates of the whole trajectory")

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
    """Indices of the best and the worst sample of every group with a preference, in group order (ties and groups
    with a NaN skipped; of equally best or worst samples, the first). ``group_ids`` on ``advantages``' device.
    Whole-batch tensor ops: two waits for the device in all (``unique`` and ``nonzero``)."""
    groups, inverse = group_ids.unique(return_inverse=True)
    size = len(advantages)
    positions = torch.arange(size, device=advantages.device)

    def first_extreme(reduce: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Each group's extreme advantage and its first sample having it."""
        extreme = advantages.new_zeros(len(groups)).scatter_reduce(0, inverse, advantages, reduce, include_self=False)
        candidates = torch.where(advantages == extreme[inverse], positions, size)
        return extreme, positions.new_full((len(groups),), size).scatter_reduce(0, inverse, candidates, "amin")

    (best, winners), (worst, losers) = first_extreme("amax"), first_extreme("amin")
    preferred = (best > worst).nonzero().flatten()
    return winners[preferred], losers[preferred]


def pairwise_loss(
    log_p: torch.Tensor, log_p_old: torch.Tensor, winners: torch.Tensor, losers: torch.Tensor, beta: float
) -> torch.Tensor:
    """Per-pair ``-log sigmoid(beta (delta(winner) - delta(loser)))`` with ``delta = log p - sg(log p_old)``."""
    delta = log_p - log_p_old.detach()
    return -torch.nn.functional.logsigmoid(beta * (delta[winners] - delta[losers]))


class PairwiseObjective(ForwardProcessObjective):
    """Best-versus-worst preference per group on ELBO surrogates of the clean samples."""

    name = "pairwise"
    default_weighting = "uniform"
    pairs: tuple[torch.Tensor, torch.Tensor]  # the minibatch's winners and losers, set by micro_steps

    def micro_steps(self, rollout: Rollout, step: int) -> list[int]:
        """The forward process's micro-steps; the minibatch's pairs are found once for all of them."""
        if rollout.advantages is None:
            raise ValueError(f"{self.name} needs a rollout with advantages")
        self.pairs = preference_pairs(rollout.advantages, rollout.group_ids.to(rollout.advantages.device))
        return super().micro_steps(rollout, step)

    def loss(self, ctx: ObjectiveContext, rollout: Rollout, micro_step: int) -> LossOutput:
        batch, v, v_old = self.predictions(ctx, rollout, micro_step)
        log_p, log_p_old = self.elbo_log_p(ctx, v, batch), self.elbo_log_p(ctx, v_old, batch)
        winners, losers = self.pairs  # of the rollout micro_steps was given, which predictions checked
        if len(winners):
            policy_loss = pairwise_loss(log_p, log_p_old, winners, losers, self.options.beta).mean()
        else:
            policy_loss = (v * 0).sum()  # no preference in this batch: a zero loss that keeps the graph
        return self.output(ctx, rollout, batch, v, policy_loss, {"pairs": torch.tensor(float(len(winners)))})


@hookimpl
def gyremedia_register_objectives(register):
    register(
        "pairwise",
        PairwiseObjective,
        options=PairwiseOptions,
        description="best vs worst sample per group, DPO-style on ELBO surrogates of the whole trajectory",
    )

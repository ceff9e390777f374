"""TreeGRPO / BranchGRPO: GRPO on tree rollouts, each transition credited with its subtree's value.

With ``rollout.branch_steps`` a group is one tree (gyremedia/tree.py). Leaf advantages are the usual
group-normalised rewards; the transition a leaf went through at step i leads to a node shared by
every leaf under it, so its advantage is backed up from those leaves:

    mean:     A(node) = mean of A(leaf) over the node's leaves
    logprob:  A(node) = sum_l w_l A(leaf_l),  w = softmax over the node's leaves of the log-prob of
              the path from the node down to the leaf (likelier continuations count more)

optionally normalised per depth (zero mean, unit std over the nodes at that depth). Then GRPO's
clipped ratio as in ``grpo``.

Training cost (BranchGRPO's pruning): by default each leaf replays its whole path, so a shared
transition is trained once per leaf below it; with ``dedup`` it is replayed once (one row per
node, the loss a mean over nodes); ``width`` keeps, per tree and
depth, only the nodes with the largest ``|A|`` (a node as good as its siblings teaches nothing);
``skip_steps`` leaves whole depths untrained.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gyremedia import hookimpl
from gyremedia.interfaces import BuildContext
from gyremedia.objectives.grpo import GRPOObjective, GRPOOptions
from gyremedia.rollout import Rollout
from gyremedia.tree import subtree_values


@dataclass
class TreeGRPOOptions(GRPOOptions):
    aggregate: str = "mean"  # mean | logprob: how leaf advantages back up to a node
    normalize_depth: bool = False  # normalise node advantages over the nodes of each depth
    dedup: bool = False  # replay a transition shared by several leaves once (one row per tree node)
    width: int = 0  # train at most this many nodes per tree and depth, the largest |A| first; 0 = all
    skip_steps: list[int] = field(default_factory=list)  # transition indices never trained (depth pruning)


class TreeGRPOObjective(GRPOObjective):
    """GRPO whose transition advantages are the values of the subtrees they lead to."""

    def __init__(self, options: TreeGRPOOptions, context: BuildContext) -> None:
        if options.aggregate not in ("mean", "logprob"):
            raise ValueError(f"objective.aggregate={options.aggregate!r}: expected mean or logprob")
        if options.width < 0:
            raise ValueError("objective.width must be >= 0 (0 trains every node)")
        super().__init__(options, context)

    def trainable_steps(self, rollout: Rollout) -> list[int]:
        kept = [i for i in super().trainable_steps(rollout) if i not in self.options.skip_steps]
        if not kept:
            raise ValueError(f"objective.skip_steps={self.options.skip_steps} leaves no transition to train")
        return kept

    def trained_rows(self, rollout: Rollout, micro_step: int) -> tuple[Rollout, torch.Tensor]:
        """One row per node the transitions lead to (``dedup``), at most ``width`` per tree by ``|A|``."""
        advantages = self.transition_advantages(rollout, micro_step)
        if not self.options.dedup and not self.options.width:
            return rollout, advantages
        nodes = rollout.extras["tree_ancestors"][:, micro_step + 1]
        rows = unique_first(nodes)[1] if self.options.dedup else torch.arange(len(rollout))
        if self.options.width:
            rows = top_per_group(rows, rollout.group_ids[rows].cpu(), advantages[rows].abs().cpu(), self.options.width)
        return rollout.select(rows), advantages[rows.to(advantages.device)]

    def transition_advantages(self, rollout: Rollout, micro_step: int) -> torch.Tensor:
        ancestors = rollout.extras.get("tree_ancestors")
        if ancestors is None:
            raise ValueError("tree_grpo needs tree rollouts: set rollout.branch_steps (e.g. [0, 3, 6])")
        nodes = ancestors[:, micro_step + 1].to(rollout.advantages.device)
        weights = None
        if self.options.aggregate == "logprob":
            below = rollout.log_probs[:, micro_step + 1:].nan_to_num(0.0).sum(dim=1).double()
            _, inverse = torch.unique(nodes, return_inverse=True)
            peak = torch.full((int(inverse.max()) + 1,), -torch.inf, dtype=below.dtype).scatter_reduce(
                0, inverse, below, reduce="amax")
            weights = torch.exp(below - peak[inverse])  # softmax numerators, stable per node
        values = subtree_values(rollout.advantages.double(), nodes, weights)
        if self.options.normalize_depth:
            _, first = unique_first(nodes)
            node_values = values[first]
            values = (values - node_values.mean()) / (node_values.std(unbiased=False) + 1e-4)
        return values.float()


def unique_first(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The unique values and the index of each one's first occurrence."""
    unique, inverse = torch.unique(values, return_inverse=True)
    first = torch.full((len(unique),), len(values), dtype=torch.long).scatter_reduce(
        0, inverse, torch.arange(len(values)), reduce="amin")
    return unique, first


def top_per_group(rows: torch.Tensor, groups: torch.Tensor, scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` entries of ``rows`` with the highest ``scores`` within each group, in their original order."""
    keep = torch.zeros(len(rows), dtype=torch.bool)
    for group in groups.unique():
        members = (groups == group).nonzero().flatten()
        keep[members[scores[members].argsort(descending=True, stable=True)[:k]]] = True
    return rows[keep]


@hookimpl
def gyremedia_register_objectives(register):
    register("tree_grpo", TreeGRPOObjective, options=TreeGRPOOptions, requires_log_prob=True,
             description="TreeGRPO: GRPO on tree rollouts (rollout.branch_steps), subtree-valued advantages")

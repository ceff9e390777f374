"""TreeGRPO / BranchGRPO: GRPO on tree rollouts, each transition credited with its subtree's value.

With ``rollout.branch_steps`` a group is one tree (gyremedia/tree.py). Leaf advantages are the usual
group-normalised rewards; the transition a leaf went through at step i leads to a node shared by
every leaf under it, so its advantage is backed up from those leaves:

    mean:     A(node) = mean of A(leaf) over the node's leaves
    logprob:  A(node) = sum_l w_l A(leaf_l),  w = softmax over the node's leaves of the log-prob of
              the path from the node down to the leaf (likelier continuations count more)

optionally normalised per depth (zero mean, unit std over the nodes at that depth). Then GRPO's
clipped ratio as in ``grpo``.
"""

from __future__ import annotations

from dataclasses import dataclass

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


class TreeGRPOObjective(GRPOObjective):
    """GRPO whose transition advantages are the values of the subtrees they lead to."""

    def __init__(self, options: TreeGRPOOptions, context: BuildContext) -> None:
        if options.aggregate not in ("mean", "logprob"):
            raise ValueError(f"objective.aggregate={options.aggregate!r}: expected mean or logprob")
        super().__init__(options, context)

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


@hookimpl
def gyremedia_register_objectives(register):
    register("tree_grpo", TreeGRPOObjective, options=TreeGRPOOptions, requires_log_prob=True,
             description="TreeGRPO: GRPO on tree rollouts (rollout.branch_steps), subtree-valued advantages")

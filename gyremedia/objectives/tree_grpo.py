"""TreeGRPO / BranchGRPO: GRPO on tree rollouts, each transition credited with its subtree's value.

With ``rollout.branch_steps`` a group is one tree (gyremedia/tree.py). Leaf advantages are the usual
group-normalised rewards; the transition a leaf went through at step i leads to a node shared by
every leaf under it, so its advantage is backed up from those leaves:

    mean:     A(node) = mean of A(leaf) over the node's leaves
    logprob:  A(node) = sum_l w_l A(leaf_l),  w = softmax over the node's leaves of the log-prob of
              the path from the node down to the leaf (likelier continuations count more)

A leaf dropped by its reward's failure policy (NaN reward) is left out of every mean; a node with
only dropped leaves gets 0. With ``normalize_depth`` the node values are then normalised within each
group (BranchGRPO's depth-wise normalisation; a group is one tree, or ``branch_roots`` trees together):
zero mean and unit std over the group's nodes at that depth, so every depth weighs the same. Then
GRPO's clipped ratio as in ``grpo``.

Training cost (BranchGRPO's pruning): by default each leaf replays its whole path, so a shared
transition is trained once per leaf below it; with ``dedup`` it is replayed once (one row per
node, the loss a mean over nodes); ``width`` keeps, per group and depth, only the nodes with the
largest ``|A|`` (a node as good as its siblings teaches nothing); ``skip_steps`` leaves whole depths
untrained.

Which rows a micro-step trains and which node each replays depend on the tree and the advantages. They are
worked out for all of a minibatch's micro-steps at once on the host (:class:`TreePlan`): one read of the
advantages, rewards and log-probs, one copy of every index back, where finding them on an accelerator would
make the host wait for it about a dozen times per micro-step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from gyremedia import hookimpl
from gyremedia.advantages import group_advantages
from gyremedia.interfaces import BuildContext, ObjectiveContext, Transition
from gyremedia.objectives.grpo import GRPOObjective, GRPOOptions
from gyremedia.options import option
from gyremedia.rollout import Rollout
from gyremedia.runtime.distributed import to_device, to_host
from gyremedia.tree import subtree_values


@dataclass
class TreeGRPOOptions(GRPOOptions):
    aggregate: Literal["mean", "logprob"] = option("mean", help="how leaf advantages back up to a node")
    normalize_depth: bool = option(False, help="normalise node advantages over each group's nodes at each depth")
    dedup: bool = option(False, help="replay a transition shared by several leaves once (one row per tree node)")
    width: int = option(
        0, ge=0, help="train at most this many nodes per group and depth, the largest |A| first; 0 = all"
    )
    skip_steps: list[int] = option(default_factory=list, ge=0, help="transition indices never trained (depth pruning)")


@dataclass
class PlannedStep:
    """What one micro-step of a minibatch trains: positions on the host, with their copies on the minibatch's device
    (selecting with both copies nothing and waits for nothing)."""

    rows_on_host: torch.Tensor | None  # the trained rows (None: every sample)
    rows: torch.Tensor | None  # the same on the device
    advantages: torch.Tensor  # the trained rows' advantages, on the advantages' device
    first_on_host: torch.Tensor  # one row per node the transition starts from, in the order the rollout ran them
    first: torch.Tensor  # the same on the device
    inverse: torch.Tensor  # for every row, its node's position among ``first`` (on the device)

    def samples(self, rollout: Rollout) -> Rollout:
        """The trained rows' samples."""
        return rollout if self.rows is None else rollout.select(self.rows_on_host, on_device=(self.rows,))

    def heads(self, rollout: Rollout) -> Rollout:
        """One sample per node the transition starts from: what the model runs on."""
        return rollout.select(self.first_on_host, on_device=(self.first,))


@dataclass
class TreePlan:
    """A minibatch's :class:`PlannedStep` per micro-step, and what it was planned from."""

    rollout: Rollout
    found_from: torch.Tensor  # its advantages when planned
    steps: dict[int, PlannedStep]


class TreeGRPOObjective(GRPOObjective):
    """GRPO whose transition advantages are the values of the subtrees they lead to."""

    name = "tree_grpo"
    per_frame = False  # its terms are per token or per transition
    needs_tree_rollouts = True
    plans_transitions = False  # it replays once per tree node, never from kept forwards

    def __init__(self, options: TreeGRPOOptions, context: BuildContext) -> None:
        super().__init__(options, context)
        self._plan: TreePlan | None = None

    def micro_steps(self, rollout: Rollout, step: int) -> list[int]:
        micro_steps = super().micro_steps(rollout, step)
        if rollout.advantages is not None:
            self._plan = self.plan(rollout, micro_steps)
        return micro_steps

    def plan(self, rollout: Rollout, micro_steps: list[int]) -> TreePlan:
        """The rows, advantages and replayed nodes of each micro-step, found on the host and copied back at once."""
        advantages, reward, log_probs = to_host(rollout.advantages, rollout.reward, rollout.log_probs)
        host = dataclasses.replace(rollout, advantages=advantages, reward=reward, log_probs=log_probs)
        chosen = {}
        for micro_step in micro_steps:
            rows, row_advantages = self.choose_rows(host, micro_step)
            _, first, inverse = unique_first(host.tree_ancestors[:, micro_step])
            chosen[micro_step] = (rows, row_advantages, first, inverse)
        indices = []  # every index in one copy, in this order per micro-step: rows (unless all), first, inverse
        for rows, _, first, inverse in chosen.values():
            indices += ([] if rows is None else [rows]) + [first, inverse]
        on_device = iter(to_device(indices, rollout.states.device))
        advantages_there = iter(to_device([chosen[m][1] for m in chosen], rollout.advantages.device))
        steps = {}
        for micro_step, (rows, _, first, _) in chosen.items():
            rows_there = None if rows is None else next(on_device)
            steps[micro_step] = PlannedStep(
                rows_on_host=rows,
                rows=rows_there,
                advantages=next(advantages_there),
                first_on_host=first,
                first=next(on_device),
                inverse=next(on_device),
            )
        return TreePlan(rollout, rollout.advantages, steps)

    def planned(self, rollout: Rollout, micro_step: int) -> PlannedStep:
        """Micro-step ``micro_step`` of the minibatch's plan (planned now, for it alone, if ``micro_steps`` was not
        given this minibatch)."""
        plan = self._plan
        if plan is None or plan.rollout is not rollout or plan.found_from is not rollout.advantages:
            plan = self._plan = self.plan(rollout, [micro_step])
        elif micro_step not in plan.steps:
            plan.steps.update(self.plan(rollout, [micro_step]).steps)
        return plan.steps[micro_step]

    def trainable_steps(self, rollout: Rollout) -> list[int]:
        kept = [i for i in super().trainable_steps(rollout) if i not in self.options.skip_steps]
        if not kept:
            raise ValueError(f"objective.skip_steps={self.options.skip_steps} leaves no transition to train")
        return kept

    def trained_rows(self, rollout: Rollout, micro_step: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One row per node the transitions lead to (``dedup``), at most ``width`` per group by ``|A|``."""
        planned = self.planned(rollout, micro_step)
        return planned.rows, planned.advantages

    def trained_samples(self, rollout: Rollout, rows: torch.Tensor | None) -> Rollout:
        """The samples at ``rows``: those the plan selected, when they are one of its micro-steps' rows."""
        if rows is not None and self._plan is not None and self._plan.rollout is rollout:
            for planned in self._plan.steps.values():
                if planned.rows is rows:
                    return planned.samples(rollout)
        return super().trained_samples(rollout, rows)

    def choose_rows(self, rollout: Rollout, micro_step: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """:meth:`trained_rows`, worked out where ``rollout`` is (the plan's host copy)."""
        advantages = self.transition_advantages(rollout, micro_step)
        if not self.options.dedup and not self.options.width:
            return self.informative_rows(None, advantages)
        nodes = rollout.tree_ancestors[:, micro_step + 1]
        rows = unique_first(nodes)[1] if self.options.dedup else torch.arange(len(rollout), device=nodes.device)
        if self.options.width:
            rows = top_per_group(
                rows,
                rollout.group_ids.to(rows.device)[rows],
                advantages.to(rows.device)[rows].abs(),
                self.options.width,
            )
        return self.informative_rows(rows, advantages[rows.to(advantages.device)])

    def replay(
        self, ctx: ObjectiveContext, rollout: Rollout, index: int, rows: torch.Tensor | None, samples: Rollout
    ) -> tuple[Transition, torch.Tensor]:
        """The model runs once per tree node at step ``index``, on the same batch the rollout ran it on (the
        minibatch is the rollout's chunk, its nodes in the same order), so the replayed log-probs equal the
        recorded ones exactly; each leaf's transition then steps from its node's output."""
        planned = self.planned(rollout, index)
        spread = planned.inverse if rows is None else planned.inverse[rows.to(planned.inverse.device)]
        heads = planned.heads(rollout)
        output = ctx.backbone.predict(
            heads.states[:, index], rollout.sigmas[index], heads.conditions, ctx.guidance_scale
        )[spread]
        transition = ctx.sampler.step(
            samples.states[:, index], output, rollout.sigmas, index, next_state=samples.states[:, index + 1]
        )
        return transition, output

    def transition_advantages(self, rollout: Rollout, micro_step: int) -> torch.Tensor:
        ancestors = rollout.tree_ancestors
        if ancestors is None:
            raise ValueError("tree_grpo needs tree rollouts: set rollout.branch_steps (e.g. [0, 3, 6])")
        nodes = ancestors[:, micro_step + 1].to(rollout.advantages.device)
        kept = (
            torch.ones(len(nodes), dtype=torch.bool, device=nodes.device)
            if rollout.reward is None
            else torch.isfinite(rollout.reward).to(nodes.device)
        )
        weights = kept.double()
        if self.options.aggregate == "logprob":
            below = rollout.log_probs[:, micro_step + 1 :].nan_to_num(0.0).sum(dim=1).double().to(nodes.device)
            below = below.masked_fill(~kept, -torch.inf)
            _, inverse = torch.unique(nodes, return_inverse=True)
            peak = torch.full(
                (int(inverse.max()) + 1,), -torch.inf, dtype=below.dtype, device=below.device
            ).scatter_reduce(0, inverse, below, reduce="amax")
            weights = torch.where(kept, torch.exp(below - peak[inverse]), 0.0)  # softmax numerators, stable per node
        values = subtree_values(rollout.advantages.double(), nodes, weights)
        if self.options.normalize_depth:
            _, first, inverse = unique_first(nodes)
            has_leaves = subtree_values(kept.double(), nodes)[first] > 0
            node_values = values[first].masked_fill(~has_leaves, float("nan"))  # empty nodes do not count
            groups = rollout.group_ids.to(nodes.device)[first]
            values = group_advantages(node_values, groups).double()[inverse]
        return values.float()


def unique_first(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unique values (ascending), the index of each one's first occurrence, and each value's unique index."""
    unique, inverse = torch.unique(values, return_inverse=True)
    first = torch.full((len(unique),), len(values), dtype=torch.long, device=values.device).scatter_reduce(
        0, inverse, torch.arange(len(values), device=values.device), reduce="amin"
    )
    return unique, first, inverse


def top_per_group(rows: torch.Tensor, groups: torch.Tensor, scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` entries of ``rows`` with the highest ``scores`` within each group, in their original order."""
    keep = torch.zeros(len(rows), dtype=torch.bool, device=rows.device)
    for group in groups.unique():
        members = (groups == group).nonzero().flatten()
        keep[members[scores[members].argsort(descending=True, stable=True)[:k]]] = True
    return rows[keep]


@hookimpl
def gyremedia_register_objectives(register):
    register(
        "tree_grpo",
        TreeGRPOObjective,
        options=TreeGRPOOptions,
        description="TreeGRPO: GRPO on tree rollouts (rollout.branch_steps), subtree-valued advantages",
    )

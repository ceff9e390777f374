"""Tree rollouts (TreeGRPO / BranchGRPO): a group's samples share their trajectory until they branch.

A group of ``roots * width ** len(branch_steps)`` samples starts as ``roots`` nodes (one initial noise
each). At each branch step every node splits into ``width`` children that draw their own noise; between
branch steps a node moves on alone, its stochastic transition shared by every sample below it. The
model runs once per node, not once per sample, so shared prefixes cost one forward pass. The leaves
are the group's samples; ``ancestors[b, i]`` is the node sample ``b`` passed through at step ``i``,
so an objective can give each transition the advantage of the subtree below it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyremedia.interfaces import DenoisingBackbone, Sampler
from gyremedia.runtime.streams import Stream, sample_generators
from gyremedia.sampling import noise_like


@dataclass
class TreeTrajectories:
    """Per-leaf trajectories of a batch of trees, laid out like a flat rollout's."""

    states: torch.Tensor  # [B, S+1, ...] each leaf's states (shared prefixes repeated)
    log_probs: torch.Tensor  # [B, S] log-prob of the transition each leaf went through at each step
    sigmas: torch.Tensor
    ancestors: torch.Tensor  # [B, S+1] node index at each level (unique within the batch per level)
    forward_rows: int  # model evaluations done (one per node per step)


@torch.no_grad()
def sample_trees(
    backbone: DenoisingBackbone,
    sampler: Sampler,
    conditions: dict[str, torch.Tensor],
    *,
    group_ids: list[int],
    seed: int,
    step: int,
    branch_steps: list[int],
    width: int,
    num_steps: int,
    guidance_scale: float,
    roots: int = 1,
) -> TreeTrajectories:
    """Grow ``roots`` trees per entry of ``group_ids`` (``conditions`` holds one row per group).

    Node noise is drawn from a generator keyed by ``(seed, step, group, depth, path)`` (the path starts
    with the root's index when there are several), so a tree is the same whatever else is in the batch
    and on any number of processes.
    """
    x, paths = _roots(backbone, group_ids, seed, step, roots)
    sigmas = backbone.sigmas(num_steps).to(x.device)
    owner = torch.arange(len(group_ids)).repeat_interleave(roots)  # which group (row of `conditions`) owns each node

    def generators() -> list[torch.Generator]:
        return [
            sample_generators(seed, step, (Stream.TREE_NODES, len(path), *path), [group])[0] for group, path in paths
        ]

    node_generators = generators()
    node_conditions = conditions if roots == 1 else {k: v[owner] for k, v in conditions.items()}
    levels, parents, forward_rows = [x], [], 0
    log_probs: list[torch.Tensor] = []
    for i in range(num_steps):
        output = backbone.predict(x, sigmas[i], node_conditions, guidance_scale)
        forward_rows += x.shape[0]
        parent = torch.arange(x.shape[0])
        if i in branch_steps:
            parent = parent.repeat_interleave(width)
            x, output, owner = x[parent], output[parent], owner[parent]
            paths = [(group, path + (c,)) for group, path in paths for c in range(width)]
            node_generators = generators()
            node_conditions = {k: v[owner] for k, v in conditions.items()}
        transition = sampler.step(x, output, sigmas, i, noise=noise_like(x, node_generators))
        x = transition.next_state
        levels.append(x)
        parents.append(parent)
        if transition.log_prob is None:
            raise ValueError(
                f"tree rollouts branch with a stochastic sampler: {type(sampler).__name__} gave no log-prob"
            )
        log_probs.append(transition.log_prob)

    states, leaf_log_probs, ancestors = _leaf_paths(levels, parents, log_probs)
    return TreeTrajectories(states, leaf_log_probs, sigmas, ancestors, forward_rows)


def _roots(
    backbone: DenoisingBackbone,
    group_ids: list[int],
    seed: int,
    step: int,
    roots: int,
) -> tuple[torch.Tensor, list[tuple[int, tuple[int, ...]]]]:
    """The trees' initial noise, and each root's path: ``(group, child indices so far)``, the root's index first
    when a group has several."""
    if roots == 1:
        return backbone.sample_noise(sample_generators(seed, step, Stream.INITIAL_NOISE, group_ids)), [
            (g, ()) for g in group_ids
        ]
    paths: list[tuple[int, tuple[int, ...]]] = [(g, (r,)) for g in group_ids for r in range(roots)]
    return backbone.sample_noise(
        [sample_generators(seed, step, (Stream.INITIAL_NOISE, path[0]), [g])[0] for g, path in paths]
    ), paths


def _leaf_paths(
    levels: list[torch.Tensor],
    parents: list[torch.Tensor],
    log_probs: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Follow each leaf up the tree: its states ``[B, S+1, ...]``, transition log-probs ``[B, S]`` and node at
    every level ``[B, S+1]``."""
    chain = [torch.arange(levels[-1].shape[0])]
    for parent in reversed(parents):
        chain.append(parent[chain[-1]])
    ancestors = torch.stack(chain[::-1], dim=1)  # [B, S+1]
    states = torch.stack([level[ancestors[:, i]] for i, level in enumerate(levels)], dim=1)
    leaf_log_probs = torch.stack([step[ancestors[:, i + 1]] for i, step in enumerate(log_probs)], dim=1)
    return states, leaf_log_probs, ancestors


def subtree_values(leaf_values: torch.Tensor, nodes: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Per leaf, the (weighted) mean of ``leaf_values`` over every leaf under the same node.

    ``nodes[b]`` is the node leaf ``b`` passed through at the level of interest; ``weights`` (>= 0)
    default to uniform. A leaf of weight 0 does not count; a node with no weight at all gets 0.
    """
    weights = torch.ones_like(leaf_values) if weights is None else weights
    _, inverse = torch.unique(nodes, return_inverse=True)
    count = int(inverse.max()) + 1
    total = torch.zeros(count, dtype=leaf_values.dtype, device=leaf_values.device).index_add_(
        0, inverse, weights * leaf_values
    )
    mass = torch.zeros(count, dtype=leaf_values.dtype, device=leaf_values.device).index_add_(0, inverse, weights)
    return (total / mass.clamp(min=1e-12))[inverse]

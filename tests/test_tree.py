"""Tree rollouts: shared prefixes computed once, leaves laid out like a flat rollout, subtree advantages."""

from __future__ import annotations

import pytest
import torch

from gyremedia.config import ConfigError
from gyremedia.interfaces import BuildContext
from gyremedia.objectives.tree_grpo import TreeGRPOObjective, TreeGRPOOptions
from gyremedia.plugins import PluginManager
from gyremedia.rollout import Rollout
from gyremedia.trainer import Trainer
from gyremedia.tree import sample_trees, subtree_values

TREE = ["rollout.branch_steps=[0, 1]", "rollout.branch_width=2", "rollout.group_size=4", "rollout.batch_size=8"]


@pytest.fixture
def components(make_config):
    config = make_config(*TREE)
    pm, context = PluginManager(), BuildContext(device=torch.device("cpu"))
    backbone = pm.component("backbone", "flow_matching").build(config.backbone.options, context)
    sampler = pm.component("sampler", "flow_sde").build(config.sampler.options, context)
    return backbone, sampler


PROMPTS = {0: "a red circle", 1: "a blue square"}


def grow(backbone, sampler, groups=(0, 1), seed=0):
    conditions = backbone.encode([PROMPTS[g] for g in groups])
    return sample_trees(
        backbone,
        sampler,
        conditions,
        group_ids=list(groups),
        seed=seed,
        step=0,
        branch_steps=[0, 1],
        width=2,
        num_steps=3,
        guidance_scale=1.0,
    )


def test_leaves_share_their_prefix_and_the_model_runs_once_per_node(components):
    tree = grow(*components)
    assert tree.states.shape[:2] == (8, 4) and tree.log_probs.shape == (8, 3)
    assert tree.forward_rows == 2 * (1 + 2 + 4)  # per tree: 1 node at step 0, 2 at step 1, 4 at step 2 (flat: 12)
    states = tree.states
    for tree_start in (0, 4):
        leaves = states[tree_start : tree_start + 4]
        assert all(torch.equal(leaves[0, 0], leaf[0]) for leaf in leaves)  # one initial noise per tree
        assert torch.equal(leaves[0, 1], leaves[1, 1]) and torch.equal(
            leaves[2, 1], leaves[3, 1]
        )  # same child after step 0
        assert not torch.equal(leaves[0, 1], leaves[2, 1])  # ... different children of the root
        assert not torch.equal(leaves[0, 2], leaves[1, 2])  # split again at step 1
        assert torch.equal(tree.log_probs[tree_start, 0], tree.log_probs[tree_start + 1, 0])
    assert (tree.ancestors[:, 0] == torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])).all()
    assert (tree.ancestors[:, 1] == torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])).all()
    # a tree depends on its own group id only, not on what else is in the batch
    alone = grow(*components, groups=(1,))
    torch.testing.assert_close(alone.states, tree.states[4:], rtol=0, atol=1e-6)


def test_subtree_advantages_by_hand_on_a_two_level_tree():
    leaf_advantages = torch.tensor([2.0, 0.0, -1.0, -1.0])
    level1 = torch.tensor([0, 0, 1, 1])  # nodes after the first branch
    torch.testing.assert_close(subtree_values(leaf_advantages, level1), torch.tensor([1.0, 1.0, -1.0, -1.0]))
    torch.testing.assert_close(subtree_values(leaf_advantages, torch.arange(4)), leaf_advantages)
    # weighted: leaf 0 three times as likely as leaf 1 below node 0 -> (3 * 2 + 1 * 0) / 4
    weighted = subtree_values(leaf_advantages, level1, torch.tensor([3.0, 1.0, 1.0, 1.0]))
    torch.testing.assert_close(weighted, torch.tensor([1.5, 1.5, -1.0, -1.0]))


def test_tree_grpo_objective_backs_up_leaf_advantages(components):
    tree = grow(*components, groups=(0,))
    rollout = Rollout(
        prompts=["a red circle"] * 4,
        sample_ids=torch.arange(4),
        group_ids=torch.zeros(4, dtype=torch.long),
        conditions={},
        states=tree.states,
        log_probs=tree.log_probs,
        sigmas=tree.sigmas,
        advantages=torch.tensor([2.0, 0.0, -1.0, -1.0]),
        tree_ancestors=tree.ancestors,
    )
    mean = TreeGRPOObjective(TreeGRPOOptions(), BuildContext(device=torch.device("cpu")))
    torch.testing.assert_close(mean.transition_advantages(rollout, 0), torch.tensor([1.0, 1.0, -1.0, -1.0]))
    torch.testing.assert_close(mean.transition_advantages(rollout, 2), rollout.advantages)  # leaves: their own
    by_prob = TreeGRPOObjective(TreeGRPOOptions(aggregate="logprob"), BuildContext(device=torch.device("cpu")))
    below = tree.log_probs[:, 1:].sum(dim=1).double()
    w01 = torch.softmax(below[:2], dim=0)
    expected = float(w01[0] * 2.0 + w01[1] * 0.0)
    assert by_prob.transition_advantages(rollout, 0)[0].item() == pytest.approx(expected, rel=1e-5)


def test_dedup_and_pruning_choose_the_trained_rows(components):
    tree = grow(*components)  # two trees, branching at steps 0 and 1, width 2
    rollout = Rollout(
        prompts=["a red circle"] * 8,
        sample_ids=torch.arange(8),
        group_ids=torch.arange(8) // 4,
        conditions={},
        states=tree.states,
        log_probs=tree.log_probs,
        sigmas=tree.sigmas,
        advantages=torch.tensor([2.0, 0.0, -1.0, -1.0, 0.5, 0.5, -3.0, 2.0]),
        tree_ancestors=tree.ancestors,
    )

    def rows(micro_step, **options):
        objective = TreeGRPOObjective(TreeGRPOOptions(**options), BuildContext(device=torch.device("cpu")))
        chosen, advantages = objective.trained_rows(rollout, micro_step)
        chosen = torch.arange(len(rollout)) if chosen is None else chosen
        return rollout.sample_ids[chosen].tolist(), advantages.tolist()

    assert rows(0) == (list(range(8)), [1.0, 1.0, -1.0, -1.0, 0.5, 0.5, -0.5, -0.5])  # every leaf replays its path
    assert rows(0, dedup=True) == ([0, 2, 4, 6], [1.0, -1.0, 0.5, -0.5])  # one row per node at level 1
    assert rows(2, dedup=True)[0] == list(range(8))  # the leaves' own transitions are all distinct
    assert rows(2, dedup=True, width=2) == ([0, 2, 6, 7], [2.0, -1.0, -3.0, 2.0])  # largest |A| per tree
    assert rows(0, dedup=True, width=1) == ([0, 4], [1.0, 0.5])  # ties: the first node
    objective = TreeGRPOObjective(TreeGRPOOptions(skip_steps=[0, 2]), BuildContext(device=torch.device("cpu")))
    assert objective.micro_steps(rollout, 0) == [1]
    with pytest.raises(ValueError, match="leaves no transition"):
        TreeGRPOObjective(TreeGRPOOptions(skip_steps=[0, 1, 2]), BuildContext(device=torch.device("cpu"))).micro_steps(
            rollout, 0
        )


def test_depth_normalisation_is_within_each_tree_and_dropped_leaves_do_not_count(components):
    tree = grow(*components)  # two trees of 4 leaves; level-1 nodes: leaves {0, 1}, {2, 3}, {4, 5}, {6, 7}
    advantages = torch.tensor([2.0, 0.0, -1.0, -1.0, 0.5, 0.5, -3.0, 0.0])
    reward = torch.tensor([1.0, 0.2, 0.1, 0.1, 0.6, 0.6, 0.0, float("nan")])  # leaf 7 dropped (advantage 0)
    rollout = Rollout(
        prompts=["a red circle"] * 8,
        sample_ids=torch.arange(8),
        group_ids=torch.arange(8) // 4,
        conditions={},
        states=tree.states,
        log_probs=tree.log_probs,
        sigmas=tree.sigmas,
        advantages=advantages,
        reward=reward,
        tree_ancestors=tree.ancestors,
    )

    def values(micro_step, **options):
        objective = TreeGRPOObjective(TreeGRPOOptions(**options), BuildContext(device=torch.device("cpu")))
        return objective.transition_advantages(rollout, micro_step)

    # node means: tree 0 (2 + 0) / 2 = 1 and -1; tree 1 (0.5 + 0.5) / 2 = 0.5, and -3 alone (leaf 7 left out)
    torch.testing.assert_close(values(0), torch.tensor([1.0, 1.0, -1.0, -1.0, 0.5, 0.5, -3.0, -3.0]))
    # per tree and depth: tree 0's nodes (1, -1) -> (1, -1); tree 1's (0.5, -3) -> mean -1.25, std 1.75 -> (1, -1)
    scale = torch.tensor([1 / (1 + 1e-4)] * 4 + [1.75 / (1.75 + 1e-4)] * 4)
    torch.testing.assert_close(values(0, normalize_depth=True), torch.tensor([1.0, 1, -1, -1, 1, 1, -1, -1]) * scale)
    assert values(2)[7] == 0.0  # a node whose only leaf was dropped
    weighted = values(0, aggregate="logprob")
    assert weighted[6] == weighted[7] == -3.0  # the dropped leaf takes no share of its node's softmax


def test_several_roots_per_group_start_from_their_own_noise(components):
    backbone, sampler = components
    conditions = backbone.encode([PROMPTS[0]])
    tree = sample_trees(
        backbone,
        sampler,
        conditions,
        group_ids=[0],
        seed=0,
        step=0,
        branch_steps=[1],
        width=2,
        num_steps=3,
        guidance_scale=1.0,
        roots=2,
    )
    assert tree.states.shape[0] == 4 and tree.forward_rows == 2 + 2 + 4  # 2 roots, split once at step 1
    assert torch.equal(tree.states[0, 0], tree.states[1, 0]) and not torch.equal(tree.states[0, 0], tree.states[2, 0])
    assert (tree.ancestors[:, 0] == torch.tensor([0, 0, 1, 1])).all()


def test_pruned_tree_grpo_trains_on_policy(make_config):
    config = make_config(
        *TREE, "objective={name: tree_grpo, clip_range: 0.01, dedup: true, width: 1, skip_steps: [2]}", "train.steps=1"
    )
    metrics = Trainer(config, PluginManager()).train().last_metrics
    assert metrics["ratio"] == 1.0 and metrics["approx_kl"] == 0.0 and metrics["grad_norm"] > 0


def test_tree_grpo_trains_on_policy_and_reports_the_saved_forward_passes(make_config):
    config = make_config(*TREE, "objective={name: tree_grpo, clip_range: 0.01}", "train.steps=2")
    state = Trainer(config, PluginManager()).train()
    metrics = state.last_metrics
    assert metrics["ratio"] == 1.0 and metrics["approx_kl"] == 0.0
    assert metrics["rollout/forward_fraction"] == pytest.approx(7 / 12)


def test_tree_grpo_trains_on_several_roots_per_group(make_config):
    config = make_config(
        "rollout.branch_steps=[1]",
        "rollout.branch_roots=2",
        "rollout.group_size=4",
        "rollout.batch_size=8",
        "train.steps=1",
        "objective={name: tree_grpo, clip_range: 0.01, normalize_depth: true, skip_zero_advantage: true}",
    )
    metrics = Trainer(config, PluginManager()).train().last_metrics
    assert metrics["ratio"] == 1.0 and metrics["grad_norm"] > 0
    assert metrics["rollout/forward_fraction"] == pytest.approx(8 / 12)  # per group: 2 + 2 + 4 node evaluations


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["rollout.branch_steps=[0, 1]", "rollout.group_size=2", "rollout.batch_size=8"], "set rollout.group_size=4"),
        (["rollout.branch_steps=[1, 0]", "rollout.group_size=4"], "increasing step indices in [0, 3)"),
        ([*TREE, "rollout.branch_roots=2"], "set rollout.group_size=8"),
        ([*TREE, "sampler={name: ode}", "objective={name: nft}"], "needs a stochastic sampler to branch"),
    ],
)
def test_bad_tree_configs_fail_at_config_time(make_config, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", "\\[").replace("(", "\\(").replace(")", "\\)")):
        make_config(*overrides)

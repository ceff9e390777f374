"""Forward-process objectives (DiffusionNFT, AWM, V-GRPO, pairwise, CRD, DOHF, GDRO): their losses reduce to flow
matching where the papers say, on-policy ratios are 1, the old policy is an EMA that survives a resume."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from gyremedia.cli import main
from gyremedia.objectives.awm import awm_loss, soft_clip
from gyremedia.objectives.forward_process import (
    ForwardProcessObjective,
    OldPolicy,
    noised_batch,
    normalised_error,
    stratified_levels,
)
from gyremedia.objectives.nft import nft_loss
from gyremedia.objectives.pairwise import pairwise_loss, preference_pairs
from gyremedia.objectives.weighting import LinearT
from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer


def toy(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x0, eps = torch.randn(4, 3, 5, generator=g), torch.randn(4, 3, 5, generator=g)
    t = torch.rand(4, generator=g).view(4, 1, 1)
    v = torch.randn(4, 3, 5, generator=g).requires_grad_(True)
    return x0, eps, t, (1 - t) * x0 + t * eps, v


def test_nft_with_r_one_and_beta_one_is_weighted_flow_matching():
    x0, eps, t, xt, v = toy()
    loss = nft_loss(v, torch.randn_like(v), xt, x0, t, torch.ones(4), beta=1.0, adv_max=5.0)
    # x_t - t v - x0 = t (eps - x0 - v): the flow-matching error, scaled by t
    error = t * ((eps - x0) - v)
    weight = error.detach().abs().mean(dim=(1, 2))
    expected = 5.0 * (error**2).mean(dim=(1, 2)) / weight
    torch.testing.assert_close(loss, expected)
    (grad,) = torch.autograd.grad(loss.sum(), v)
    (expected_grad,) = torch.autograd.grad(expected.sum(), v)
    torch.testing.assert_close(grad, expected_grad)


def test_nft_at_the_old_policy_pushes_by_the_advantage_sign():
    x0, eps, t, xt, v = toy(1)
    (fm_grad,) = torch.autograd.grad((((xt - t * v) - x0) ** 2).sum(), v)
    for r, sign in ((0.5, 0.0), (0.9, 1.0), (0.1, -1.0)):
        (grad,) = torch.autograd.grad(nft_loss(v, v.detach(), xt, x0, t, torch.full((4,), r), 1.0, 5.0).sum(), v)
        if sign == 0:
            assert grad.abs().max() < 1e-6  # a sample as good as its group: no push
        else:  # better than the group: along each sample's flow-matching gradient; worse: against it
            cosine = torch.nn.functional.cosine_similarity(grad.flatten(1), fm_grad.flatten(1), dim=1)
            torch.testing.assert_close(cosine, torch.full((4,), sign), atol=1e-4, rtol=0)


def test_awm_on_policy_gradient_is_the_advantage_weighted_flow_matching_gradient():
    x0, eps, t, xt, v = toy(2)
    advantages = torch.tensor([1.0, -0.5, 2.0, 0.0])
    error = (v - (eps - x0)).pow(2).mean(dim=(1, 2))
    log_p = -error  # the uniform weighting's surrogate
    loss = awm_loss(log_p, log_p.detach(), advantages, clip_range=0.0)
    torch.testing.assert_close(loss, -advantages)  # ratio exactly 1 on-policy
    (grad,) = torch.autograd.grad(loss.sum(), v, retain_graph=True)
    (expected,) = torch.autograd.grad((advantages * error).sum(), v, retain_graph=True)
    torch.testing.assert_close(grad, expected)
    # with A = 1 it is exactly the flow-matching gradient
    (grad,) = torch.autograd.grad(awm_loss(log_p, log_p.detach(), torch.ones(4), 0.0).sum(), v, retain_graph=True)
    torch.testing.assert_close(grad, torch.autograd.grad(error.sum(), v)[0])


def test_levels_are_stratified_and_do_not_depend_on_the_batch_split():
    levels = stratified_levels(0, 3, 4, [0, 1, 2, 3, 4, 5, 6, 7], 0.0, 1.0)
    for column in levels.T:  # one level in each quarter of [0, 1]
        assert sorted((column * 4).astype(int).tolist()) == [0, 1, 2, 3]
    assert (stratified_levels(0, 3, 4, [5, 6], 0.0, 1.0) == levels[:, 5:7]).all()


def test_old_policy_is_an_ema_that_swaps_in_without_copies():
    module = torch.nn.Linear(2, 2)
    old = OldPolicy(decay=0.5)
    old.ensure(module)
    start = module.weight.detach().clone()
    with torch.no_grad():
        module.weight.add_(2.0)
    old.update(module)
    with old.swapped_in(module):
        torch.testing.assert_close(module.weight.detach(), start + 1.0)  # halfway
    torch.testing.assert_close(module.weight.detach(), start + 2.0)  # restored
    restored = OldPolicy(decay=0.5)
    restored.load_state_dict(old.state_dict())
    with restored.swapped_in(module):
        torch.testing.assert_close(module.weight.detach(), start + 1.0)


@pytest.mark.parametrize("objective", ["nft", "awm", "crd", "dohf", "gdro"])
def test_trains_with_the_ode_sampler_and_on_policy_ratio_is_one(make_config, objective):
    config = make_config(f"objective={{name: {objective}}}", "sampler={name: ode}", "train.steps=2")
    state = Trainer(config, PluginManager()).train()
    metrics = state.last_metrics
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0
    if objective == "awm":
        assert metrics["ratio"] == 1.0  # old policy (decay 0) == the policy that sampled
    elif objective == "nft":
        assert metrics["old_policy_gap"] == 0.0


@pytest.mark.parametrize("objective", ["nft", "awm"])
def test_an_old_policy_equal_to_the_trained_one_costs_no_forward_and_changes_no_number(
    make_config, tmp_path, monkeypatch, objective
):
    """Decay 0 and one update per rollout: the old prediction is the policy's own (detached). Forcing the
    old weights' own forward gives the same run, with one more forward per micro-step."""
    from gyremedia.objectives.forward_process import ForwardProcessObjective

    runs = {}
    for shortcut in (True, False):
        if not shortcut:
            monkeypatch.setattr(ForwardProcessObjective, "old_is_current", lambda self, ctx: False)
        trainer = Trainer(
            make_config(
                f"objective={{name: {objective}}}",
                "sampler={name: ode}",
                "train.steps=2",
                f"run.output_dir={tmp_path / str(shortcut)}",
            ),
            PluginManager(),
        )
        state = trainer.setup()
        module, forwards = state.backbone.trainable_module(), []
        module.register_forward_pre_hook(lambda *_: forwards.append(1))
        metrics = []
        for step in range(2):  # the trainer's loop: the old policy follows at every step's end
            metrics.append({k: v for k, v in trainer.train_step(step).items() if not k.startswith("time/")})
            state.plugins.hook.gyremedia_on_step_end(state=state, metrics=metrics[-1])
        runs[shortcut] = metrics, [p.detach().clone() for p in module.parameters()], len(forwards)
    (fast, fast_params, fast_forwards), (slow, slow_params, slow_forwards) = runs[True], runs[False]
    assert fast == slow and all(torch.equal(a, b) for a, b in zip(fast_params, slow_params))
    micro_steps = 2 * 2  # 2 steps x 2 re-noised levels
    assert slow_forwards - fast_forwards == micro_steps
    assert not trainer.state.objective.old_is_current(type("Ctx", (), {"minibatches": 2, "passes": 1})())


def test_resume_restores_the_old_policy(tiny_yaml, tmp_path):
    common = ["objective={name: nft, old_policy_decay: 0.5}", "sampler={name: ode}", "checkpoint.every=2"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(["train", str(tiny_yaml), f"run.output_dir={straight}", "train.steps=3", *common]) == 0
    assert main(["train", str(tiny_yaml), f"run.output_dir={split}", "train.steps=2", *common]) == 0
    assert main(["train", "--resume", str(split), "train.steps=3"]) == 0

    def last(run):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return {k: v for k, v in rows[-1].items() if not k.startswith("time/")}

    assert last(split)["old_policy_gap"] > 0  # a lagging old policy, so the test can see a lost one
    assert last(split) == last(straight)


def test_vgrpo_shares_noise_within_groups_and_is_on_policy(make_config):
    config = make_config("objective={name: vgrpo}", "sampler={name: ode}", "train.steps=1")
    state = Trainer(config, PluginManager()).train()
    assert state.last_metrics["ratio"] == 1.0
    objective, rollout = state.objective, state.rollout
    objective.micro_steps(rollout, 0)
    _, x0, levels, noise = objective._draws
    batch = noised_batch(x0, levels[1], noise[1])
    for group in rollout.group_ids.unique():
        members = (rollout.group_ids == group).nonzero().flatten()
        assert len(members) == 4 and (batch.t[members] == batch.t[members[0]]).all()
        assert (batch.noise[members] == batch.noise[members[0]]).all()
    assert not torch.equal(batch.noise[0], batch.noise[4])  # different groups, different noise


def test_pairwise_pulls_toward_the_better_sample_and_skips_ties():
    advantages = torch.tensor([0.5, -1.0, 1.5, -1.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])  # group 1 is a tie: no preference
    winners, losers = preference_pairs(advantages, groups)
    assert winners.tolist() == [2] and losers.tolist() == [1]  # first of the tied worst
    log_p = torch.tensor([0.0, -1.0, -2.0, 0.0, 0.0, 0.0], requires_grad=True)
    loss = pairwise_loss(log_p, log_p.detach(), winners, losers, beta=10.0)
    torch.testing.assert_close(loss, torch.tensor([math.log(2.0)]))  # on-policy: log 2
    (grad,) = torch.autograd.grad(loss.sum(), log_p)
    assert grad[2] < 0 < grad[1] and grad[[0, 3, 4, 5]].abs().sum() == 0  # raise the winner, lower the loser


def test_pairwise_pairs_are_each_groups_first_best_and_first_worst():
    """The whole-batch ops against the definition, group by group, on random batches with ties and NaN."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(100):
        size = int(torch.randint(1, 30, (1,), generator=generator))
        advantages = torch.randint(-2, 3, (size,), generator=generator).float()
        advantages[torch.rand(size, generator=generator) < 0.1] = float("nan")
        groups = torch.randint(0, 5, (size,), generator=generator)
        expected_winners, expected_losers = [], []
        for group in sorted(set(groups.tolist())):
            members = [i for i in range(size) if groups[i] == group]
            scores = advantages[members].tolist()
            if not any(math.isnan(x) for x in scores) and max(scores) > min(scores):
                expected_winners.append(members[scores.index(max(scores))])
                expected_losers.append(members[scores.index(min(scores))])
        winners, losers = preference_pairs(advantages, groups)
        assert (winners.tolist(), losers.tolist()) == (expected_winners, expected_losers)


def test_pairwise_trains(make_config):
    config = make_config("objective={name: pairwise}", "sampler={name: ode}", "train.steps=2")
    metrics = Trainer(config, PluginManager()).train().last_metrics
    assert metrics["pairs"] == 2.0 and metrics["grad_norm"] > 0


def test_vgrpo_soft_clip_keeps_small_advantages_and_bounds_large_ones():
    advantages = torch.tensor([-50.0, -0.01, 0.0, 0.02, 4.0])
    clipped = soft_clip(advantages, 3.0)
    torch.testing.assert_close(clipped[1:4], advantages[1:4], atol=1e-6, rtol=1e-4)
    assert clipped.abs().max() <= 3.0 and clipped[-1] < 4.0
    torch.testing.assert_close(soft_clip(advantages, 0.0), advantages)


def test_vgrpo_adaptive_weighting_is_the_clean_sample_error_over_its_own_magnitude():
    x0, eps, t, xt, v = toy(3)

    def error():
        return t * (v - (eps - x0))  # x_hat - x0 with x_hat = x_t - t v, up to the sign

    expected = error().pow(2).mean(dim=(1, 2)) / error().detach().abs().mean(dim=(1, 2))
    torch.testing.assert_close(normalised_error(error()), expected)
    # linear in the error's scale (the square over the detached magnitude): large errors do not dominate
    (grad,) = torch.autograd.grad(normalised_error(5 * error()).sum(), v)
    (unscaled,) = torch.autograd.grad(normalised_error(error()).sum(), v)
    torch.testing.assert_close(grad, 5 * unscaled)


def video_toy(seed: int = 0):
    """Clips ``[B, C, T, H, W]`` re-noised at one level per sample, and a velocity to train."""
    g = torch.Generator().manual_seed(seed)
    x0, eps = torch.randn(4, 3, 4, 2, 2, generator=g), torch.randn(4, 3, 4, 2, 2, generator=g)
    batch = noised_batch(x0, torch.rand(4, generator=g), eps)
    return batch, torch.randn(4, 3, 4, 2, 2, generator=g).requires_grad_(True)


FRAME_DIM = 2


def per_frame_losses(batch, v, advantages):
    """NFT's and AWM's losses (on-policy, ``t`` weighting) with ``[B]`` or per-frame ``[B, T]`` advantages."""
    frame_dim = FRAME_DIM if advantages.dim() == 2 else None
    r = batch.broadcast((advantages / 10 + 0.5).clamp(0, 1), frame_dim)
    nft = nft_loss(v, v.detach(), batch.xt, batch.x0, batch.broadcast(batch.t), r, 1.0, 5.0)
    log_p = ForwardProcessObjective.elbo_log_p(SimpleNamespace(weighting=LinearT()), v, batch, frame_dim)
    awm = awm_loss(log_p, log_p.detach(), advantages, 0.0)
    return nft, awm.mean(1) if frame_dim is not None else awm


def test_per_frame_advantages_that_equal_the_clips_give_the_clip_level_losses_and_gradients():
    batch, v = video_toy()
    advantages = torch.tensor([1.5, -0.5, 2.0, -3.0])
    for clip, frames in zip(
        per_frame_losses(batch, v, advantages), per_frame_losses(batch, v, advantages[:, None].expand(4, 4))
    ):
        torch.testing.assert_close(frames, clip)
        (clip_grad,) = torch.autograd.grad(clip.sum(), v)
        (frame_grad,) = torch.autograd.grad(frames.sum(), v)
        torch.testing.assert_close(frame_grad, clip_grad)


def test_a_frames_own_advantage_moves_that_frame_alone():
    batch, v = video_toy(1)
    advantages = torch.zeros(4, 4)
    advantages[:, 1] = torch.tensor([1.0, -1.0, 2.0, 0.5])
    for loss in per_frame_losses(batch, v, advantages):
        (grad,) = torch.autograd.grad(loss.sum(), v)
        moved = grad.abs().amax(dim=(0, 1, 3, 4))
        assert moved[1] > 1e-3 and moved[[0, 2, 3]].max() < 1e-7, moved

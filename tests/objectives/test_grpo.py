"""GRPO's clipped-ratio loss and KL term on a backbone whose policy is one scalar weight."""

import dataclasses

import pytest
import torch

from gyremedia.config import ConfigError
from gyremedia.interfaces import BuildContext, ObjectiveContext
from gyremedia.objectives.grpo import GRPOObjective, GRPOOptions
from gyremedia.options import validate
from gyremedia.rollout import Rollout
from gyremedia.sampling import FrameLogProbs, frame_log_probs
from gyremedia_samplers.flow_sde import FlowSDEOptions, FlowSDESampler
from gyremedia_samplers.gaussian import gaussian_log_prob


class ScalarBackbone:
    """velocity = w * x; the reference policy has w = 1."""

    media_kind = "image"

    def __init__(self, w: float) -> None:
        self.w = torch.nn.Parameter(torch.tensor(w))

    def predict(self, x, sigma, conditions, guidance_scale=1.0, *, reference=False):
        return x * (1.0 if reference else self.w)


def make_rollout(backbone, sampler, advantages):
    torch.manual_seed(0)
    sigmas = torch.tensor([1.0, 0.6, 0.3, 0.0])
    x = torch.randn(len(advantages), 2, 3)
    states, log_probs = [x], []
    with torch.no_grad():
        for i in range(3):
            out = sampler.step(x, backbone.predict(x, sigmas[i], {}), sigmas, i, noise=torch.randn_like(x))
            x = out.next_state
            states.append(x)
            log_probs.append(out.log_prob)
    n = len(advantages)
    return Rollout(
        prompts=["p"] * n,
        sample_ids=torch.arange(n),
        group_ids=torch.zeros(n, dtype=torch.long),
        conditions={},
        states=torch.stack(states, 1),
        log_probs=torch.stack(log_probs, 1),
        sigmas=sigmas,
        advantages=torch.tensor(advantages),
    )


def objective(**options):
    return GRPOObjective(GRPOOptions(**options), BuildContext(device=torch.device("cpu")))


def test_on_policy_ratio_is_one_and_loss_is_minus_mean_advantage():
    backbone, sampler = ScalarBackbone(0.5), FlowSDESampler(FlowSDEOptions())
    rollout = make_rollout(backbone, sampler, [1.0, -1.0, 3.0, 0.0])
    ctx = ObjectiveContext(backbone=backbone, sampler=sampler, guidance_scale=1.0, step=0)
    out = objective().loss(ctx, rollout, 1)
    assert out.metrics["ratio"].item() == 1.0 and out.metrics["approx_kl"].item() == 0.0
    torch.testing.assert_close(out.loss, torch.tensor(-0.75))
    out.loss.backward()
    assert backbone.w.grad is not None and backbone.w.grad != 0


def test_zero_advantage_samples_can_be_left_out_as_flow_grpo_does():
    backbone, sampler = ScalarBackbone(0.5), FlowSDESampler(FlowSDEOptions())
    rollout = make_rollout(backbone, sampler, [1.0, 0.0, 3.0, 0.0])
    ctx = ObjectiveContext(backbone=backbone, sampler=sampler, guidance_scale=1.0, step=0)
    torch.testing.assert_close(objective().loss(ctx, rollout, 1).loss, torch.tensor(-1.0))  # mean over all 4
    skipping = objective(skip_zero_advantage=True)
    rows, advantages = skipping.trained_rows(rollout, 1)
    assert rows.tolist() == [0, 2] and advantages.tolist() == [1.0, 3.0]
    torch.testing.assert_close(skipping.loss(ctx, rollout, 1).loss, torch.tensor(-2.0))  # mean over the 2 kept
    ties = make_rollout(backbone, sampler, [0.0, 0.0, 0.0, 0.0])  # a batch of tied groups keeps every row
    assert skipping.trained_rows(ties, 1)[0] is None and skipping.loss(ctx, ties, 1).loss.item() == 0.0


def test_advantages_are_clipped():
    backbone, sampler = ScalarBackbone(0.5), FlowSDESampler(FlowSDEOptions())
    rollout = make_rollout(backbone, sampler, [100.0, -100.0, 2.0, 0.0])
    ctx = ObjectiveContext(backbone=backbone, sampler=sampler, guidance_scale=1.0, step=0)
    out = objective(adv_clip_max=5.0).loss(ctx, rollout, 0)
    torch.testing.assert_close(out.loss, torch.tensor(-(5.0 - 5.0 + 2.0) / 4))


def test_ratio_outside_the_clip_range_gives_no_gradient():
    sampler = FlowSDESampler(FlowSDEOptions())
    rollout = make_rollout(ScalarBackbone(0.5), sampler, [1.0, 1.0])
    moved = ScalarBackbone(0.9)  # the policy moved far from the one that sampled
    ctx = ObjectiveContext(backbone=moved, sampler=sampler, guidance_scale=1.0, step=0)
    out = objective(clip_range=1e-4).loss(ctx, rollout, 2)
    assert out.metrics["clip_fraction"].item() == 1.0
    out.loss.backward()
    # max(-A r, -A clip(r)) picks the clipped, constant branch when r moved past 1 + eps with A > 0,
    # and the unclipped one (with gradient) when r fell below 1 - eps; at least one side must be flat.
    ratio = out.metrics["ratio"].item()
    if ratio > 1:
        assert moved.w.grad.item() == 0.0
    else:
        assert moved.w.grad.item() != 0.0


def test_kl_beta_selects_the_one_kl_regularizer(make_config):
    config = make_config("objective.kl_beta=0.1")
    implied = [r for r in config.regularizers if r.implied_by == "objective.kl_beta"]
    assert [(r.name, r.weight) for r in implied] == [("gaussian_kl", 0.1)]
    assert "gaussian_kl" not in config.to_yaml()  # the run folder's config keeps the shortcut, not its expansion
    forward = make_config("objective={name: nft, kl_beta: 0.2}", "sampler.name=ode")
    assert [(r.name, r.weight) for r in forward.regularizers] == [("velocity_kl", 0.2)]
    with pytest.raises(ConfigError, match="regularizers lists too: keep one"):
        make_config("objective.kl_beta=0.1", "regularizers=[gaussian_kl]")


def test_timestep_fraction_picks_a_reproducible_subset():
    sampler = FlowSDESampler(FlowSDEOptions())
    rollout = make_rollout(ScalarBackbone(0.5), sampler, [1.0, -1.0])
    half = objective(timestep_fraction=0.5, transition_selection="random")
    assert objective().micro_steps(rollout, 0) == [0, 1, 2]
    picked = half.micro_steps(rollout, 7)
    assert len(picked) == 2 and picked == half.micro_steps(rollout, 7)
    # the default is Flow-GRPO's: the first floor(3 * 0.5) = 1 transition, the noisiest, at every step
    assert [objective(timestep_fraction=0.5).micro_steps(rollout, step) for step in (0, 7)] == [[0], [0]]
    assert "timestep_fraction=0.0: must be in (0, 1]" in validate(GRPOOptions(timestep_fraction=0.0))[0]


def rollout_with_log_probs(log_probs: torch.Tensor) -> Rollout:
    """A rollout of ``log_probs.shape[1]`` transitions with only the log-probs filled in (what selection reads)."""
    n, steps = log_probs.shape
    return Rollout(
        prompts=["p"] * n,
        sample_ids=torch.arange(n),
        group_ids=torch.zeros(n, dtype=torch.long),
        conditions={},
        states=torch.zeros(n, steps + 1, 1),
        log_probs=log_probs,
        sigmas=torch.linspace(1, 0, steps + 1),
        advantages=torch.zeros(n),
    )


@pytest.mark.parametrize("selection", ["random", "first", "stratified", "window"])
def test_transition_selection_never_trains_a_deterministic_step(selection):
    """10 transitions, the last deterministic (NaN log-prob, as cps's and ddim_eta's last step): none of the
    rules ever picks it, each picks the count it promises, and the same step picks the same ones."""
    log_probs = torch.zeros(2, 10)
    log_probs[:, 9] = float("nan")
    rollout = rollout_with_log_probs(log_probs)
    chooser = objective(timestep_fraction=0.3, transition_selection=selection)
    picks = [chooser.micro_steps(rollout, step) for step in range(40)]
    assert all(9 not in p and p == sorted(set(p)) for p in picks)
    assert all(len(p) == (2 if selection == "first" else 3) for p in picks)  # floor(9 * 0.3) vs round(9 * 0.3)
    assert picks[5] == chooser.micro_steps(rollout, 5)
    if selection == "first":  # Flow-GRPO: the noisiest floor(N f), every step
        assert all(p == [0, 1] for p in picks)
    if selection == "stratified":  # one from each third of the 9 stochastic steps
        assert all(p[0] < 3 <= p[1] < 6 <= p[2] < 9 for p in picks)
    if selection == "window":
        assert all(p == list(range(p[0], p[0] + 3)) for p in picks) and len({p[0] for p in picks}) > 1
    if selection == "random":
        assert len({tuple(p) for p in picks}) > 1


def test_cps_rollouts_leave_the_deterministic_last_step_out_of_training(make_config):
    from gyremedia.plugins import PluginManager
    from gyremedia.runtime.streams import sample_generators
    from gyremedia.sampling import sample_trajectories

    config = make_config("sampler={name: cps}")
    context = BuildContext(device=torch.device("cpu"))
    pm = PluginManager()
    backbone = pm.component("backbone", "flow_matching").build(config.backbone.options, context)
    sampler = pm.component("sampler", "cps").build(config.sampler.options, context)
    conditions = backbone.encode(["a red circle", "a blue square"])
    states, log_probs, sigmas = sample_trajectories(
        backbone,
        sampler,
        conditions,
        initial_generators=sample_generators(0, 0, 0, [0, 1]),
        step_generators=sample_generators(0, 0, 1, [0, 1]),
        num_steps=4,
        guidance_scale=1.0,
    )
    rollout = rollout_with_log_probs(log_probs)
    assert torch.isnan(log_probs[:, -1]).all() and objective().micro_steps(rollout, 0) == [0, 1, 2]


def test_frame_log_probs_average_to_the_transitions_log_prob():
    g = torch.Generator().manual_seed(0)
    x, mean = torch.randn(2, 3, 4, 5, 5, generator=g), torch.randn(2, 3, 4, 5, 5, generator=g)
    frames = frame_log_probs(x, mean, 0.3, frame_dim=2)
    assert frames.shape == (2, 4)
    torch.testing.assert_close(frames.mean(dim=1), gaussian_log_prob(x, mean, torch.full_like(mean, 0.3)))
    torch.testing.assert_close(
        frames[:, 1], gaussian_log_prob(x[:, :, 1], mean[:, :, 1], torch.full_like(mean[:, :, 1], 0.3))
    )


def test_per_frame_advantages_that_equal_the_samples_give_flow_grpos_loss_and_gradient():
    """States [B, 2, 3] read as 2 frames of 3 elements: with every frame given its sample's advantage, per-frame
    ratios give Flow-GRPO's loss and gradient on the first update; other per-frame advantages change them."""
    backbone, sampler = ScalarBackbone(0.5), FlowSDESampler(FlowSDEOptions())
    backbone.frame_dim = 1
    rollout = make_rollout(backbone, sampler, [1.0, -1.0, 3.0, 0.0])
    record = FrameLogProbs(frame_dim=1)
    for i in range(3):
        with torch.no_grad():
            x = rollout.states[:, i]
            record.record(
                i,
                sampler.step(
                    x,
                    backbone.predict(x, rollout.sigmas[i], {}),
                    rollout.sigmas,
                    i,
                    next_state=rollout.states[:, i + 1],
                ),
            )
    rollout.extras["frame_log_probs"] = record.result()
    ctx = ObjectiveContext(backbone=backbone, sampler=sampler, guidance_scale=1.0, step=0)
    results = []
    for advantages in (rollout.advantages, rollout.advantages[:, None].expand(-1, 2), torch.tensor([[1.0, 0.0]] * 4)):
        out = objective().loss(ctx, dataclasses.replace(rollout, advantages=advantages), 1)
        (grad,) = torch.autograd.grad(out.loss, backbone.w)
        assert out.metrics["ratio"].item() == pytest.approx(1.0)
        results.append((out.loss.detach(), grad))
    torch.testing.assert_close(results[1], results[0])
    assert not torch.allclose(results[2][1], results[0][1])

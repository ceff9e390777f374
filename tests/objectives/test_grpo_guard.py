"""GRPO-Guard's RatioNorm: the bias-corrected, step-scaled log-ratio is <eps, mu - mu_old> / D; on the first
update the ratio is 1 and each step's loss is Flow-GRPO's divided by its dt."""

import torch
from test_grpo import ScalarBackbone, make_rollout

from gyremedia.interfaces import BuildContext, ObjectiveContext
from gyremedia.objectives.grpo_guard import GRPOGuardObjective, GRPOGuardOptions, guarded_log_ratio
from gyremedia.plugins import PluginManager
from gyremedia.sampling import StepMeans
from gyremedia.trainer import Trainer
from gyremedia_samplers.flow_sde import FlowSDEOptions, FlowSDESampler
from gyremedia_samplers.gaussian import gaussian_log_prob


def test_the_normalised_log_ratio_is_the_noise_times_the_mean_shift():
    g = torch.Generator().manual_seed(0)
    old_mean, eps = torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, 5, generator=g)
    mean = old_mean + 0.01 * torch.randn(3, 4, 5, generator=g)
    std = torch.tensor(0.2)
    x = old_mean + std * eps  # what the old policy sampled
    log_prob = gaussian_log_prob(x, mean, std.expand_as(mean))
    old_log_prob = gaussian_log_prob(x, old_mean, std.expand_as(mean))
    guarded = guarded_log_ratio(log_prob, old_log_prob, mean, old_mean, std)
    torch.testing.assert_close(guarded, (eps * (mean - old_mean)).mean(dim=(1, 2)), atol=1e-6, rtol=1e-4)


def test_first_update_has_ratio_one_and_the_loss_divided_by_dt():
    backbone, sampler = ScalarBackbone(0.5), FlowSDESampler(FlowSDEOptions())
    rollout = make_rollout(backbone, sampler, [1.0, -1.0, 3.0, 0.0])
    means = StepMeans([1])
    with torch.no_grad():
        x = rollout.states[:, 1]
        means.record(
            1,
            sampler.step(
                x,
                backbone.predict(x, rollout.sigmas[1], {}),
                rollout.sigmas,
                1,
                noise=None,
                next_state=rollout.states[:, 2],
            ),
        )
    rollout.extras["old_means"] = means.result()
    ctx = ObjectiveContext(backbone=backbone, sampler=sampler, guidance_scale=1.0, step=0)
    out = GRPOGuardObjective(GRPOGuardOptions(), BuildContext(device=torch.device("cpu"))).loss(ctx, rollout, 1)
    assert out.metrics["ratio"].item() == 1.0
    dt = rollout.sigmas[1] - rollout.sigmas[2]
    torch.testing.assert_close(out.loss, torch.tensor(-0.75) / dt)


def test_trains_recording_only_the_trained_transitions_means(make_config):
    config = make_config(
        "objective={name: grpo_guard, timestep_fraction: 0.5}", "train.steps=2", "train.num_minibatches=2"
    )
    state = Trainer(config, PluginManager()).train()
    assert state.last_metrics["grad_norm"] > 0
    assert list(state.rollout.extras["old_means"]) == [0]  # floor(3 x 0.5) = the first transition only

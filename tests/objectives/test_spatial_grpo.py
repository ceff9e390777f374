"""Spatial credit: per-token ratios and a MAD-normalised credit map, equal to Flow-GRPO where the paper says."""

import pytest
import torch
from test_grpo import ScalarBackbone, make_rollout

from gyremedia.config import ConfigError
from gyremedia.interfaces import BuildContext, ObjectiveContext
from gyremedia.objectives.clipped_ratio import clipped_ratio_loss
from gyremedia.objectives.grpo import GRPOObjective, GRPOOptions
from gyremedia.objectives.spatial_grpo import (
    SpatialGRPOObjective,
    SpatialGRPOOptions,
    credit_map,
    spatial_grpo_loss,
    token_gradient_magnitude,
)
from gyremedia.plugins import PluginManager
from gyremedia.sampling import PatchLogProbs, patch_log_probs
from gyremedia.trainer import Trainer
from gyremedia_samplers.flow_sde import FlowSDEOptions, FlowSDESampler
from gyremedia_samplers.gaussian import gaussian_log_prob


def test_token_log_probs_average_to_the_transitions_log_prob():
    g = torch.Generator().manual_seed(0)
    x, mean = torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 4, 6, 8, generator=g)
    std = torch.tensor(0.3)
    tokens = patch_log_probs(x, mean, std, patch=2)
    assert tokens.shape == (2, 12)  # a 3 x 4 grid of 2 x 2 patches
    torch.testing.assert_close(tokens.mean(dim=1), gaussian_log_prob(x, mean, std.expand_as(mean)))


def test_credit_map_averages_one_is_uniform_for_a_flat_gradient_and_follows_the_gradient():
    flat = credit_map(torch.full((2, 16), 0.7), temperature=1.0)
    torch.testing.assert_close(flat, torch.ones(2, 16))
    g = torch.Generator().manual_seed(0)
    magnitude = torch.rand(3, 16, generator=g)
    magnitude[0, 5] = 1e6  # one outlier: MAD scaling keeps the rest of the map apart
    credit = credit_map(magnitude, temperature=1.0)
    torch.testing.assert_close(credit.mean(dim=1), torch.ones(3))
    assert credit[1].argmax() == magnitude[1].argmax() and credit[1].argmin() == magnitude[1].argmin()
    assert credit[0].max() < 16  # the outlier does not take all the credit
    torch.testing.assert_close(credit_map(magnitude, temperature=1e6), torch.ones(3, 16), atol=1e-4, rtol=0)


def test_pixel_gradients_pool_onto_the_token_grid():
    gradient = torch.zeros(1, 3, 16, 16)
    gradient[0, :, :8, 8:] = -1.0  # the top-right quarter decides the reward
    magnitude = token_gradient_magnitude(gradient, (2, 2))
    torch.testing.assert_close(magnitude, torch.tensor([[0.0, 3.0, 0.0, 0.0]]))


def test_a_uniform_map_with_one_token_is_flow_grpos_loss_at_any_ratio():
    log_ratio = torch.tensor([[-3e-4], [5e-5], [2e-4]])
    advantages = torch.tensor([1.0, -2.0, 0.5])
    spatial, _ = spatial_grpo_loss(log_ratio, advantages, torch.ones(3, 1), eps=1e-4)
    flow_grpo, _ = clipped_ratio_loss(log_ratio[:, 0], advantages, 1e-4, 1e-4)
    torch.testing.assert_close(spatial, flow_grpo)


def spatial_rollout(backbone, sampler, advantages):
    """A rollout of the scalar policy with every transition's per-token log-probs recorded (2 x 2 patches)."""
    rollout = make_rollout(backbone, sampler, advantages)
    record = PatchLogProbs(patch=1)
    for i in range(3):
        with torch.no_grad():
            x = rollout.states[:, i]
            out = backbone.predict(x, rollout.sigmas[i], {})
            record.record(i, sampler.step(x, out, rollout.sigmas, i, next_state=rollout.states[:, i + 1]))
    rollout.extras["token_log_probs"] = record.result()
    return rollout


def test_with_a_uniform_map_the_first_update_is_flow_grpos_gradient():
    backbone, sampler = ScalarBackbone(0.5), FlowSDESampler(FlowSDEOptions())
    rollout = spatial_rollout(backbone, sampler, [1.0, -1.0, 3.0, 0.0])
    ctx = ObjectiveContext(backbone=backbone, sampler=sampler, guidance_scale=1.0, step=0)
    context = BuildContext(device=torch.device("cpu"))
    spatial = SpatialGRPOObjective(SpatialGRPOOptions(patch_size=1), context)
    spatial.prepare(ctx, rollout)  # no credit reward: a uniform map
    grads = []
    for objective in (spatial, GRPOObjective(GRPOOptions(), context)):
        out = objective.loss(ctx, rollout, 1)
        (grad,) = torch.autograd.grad(out.loss, backbone.w)
        grads.append(grad)
        assert out.metrics["ratio"].item() == pytest.approx(1.0)
    torch.testing.assert_close(grads[0], grads[1])


def test_a_credit_reward_must_be_a_selected_differentiable_reward(make_config):
    with pytest.raises(ConfigError, match="credit_reward: 'shapes_surrogate' is not in rewards"):
        make_config("objective={name: spatial_grpo, credit_reward: shapes_surrogate}")
    with pytest.raises(ConfigError, match="is not differentiable"):
        make_config("objective={name: spatial_grpo, credit_reward: jpeg_compressibility}")


def test_trains_with_the_surrogates_credit_map(make_config):
    config = make_config(
        "objective={name: spatial_grpo, clip_range: 0.01, credit_reward: shapes_surrogate}",
        "rewards=[jpeg_compressibility, {name: shapes_surrogate, weight: 0}]",
        "train.steps=2",
        "train.num_minibatches=2",
    )
    state = Trainer(config, PluginManager()).train()
    metrics = state.last_metrics
    assert metrics["grad_norm"] > 0 and metrics["credit_max"] > 1  # a map that is not uniform
    tokens = state.rollout.extras["token_log_probs"]
    assert tokens.shape[:2] == state.rollout.log_probs.shape  # one row per transition...
    torch.testing.assert_close(tokens.mean(dim=-1), state.rollout.log_probs)  # ...averaging to its log-prob

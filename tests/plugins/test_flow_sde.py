"""Flow-GRPO's SDE step: its formula, its density and its marginals."""

import math

import pytest
import torch

from gyremedia.options import validate
from gyremedia_samplers.flow_sde import FlowSDEOptions, FlowSDESampler


def test_mean_matches_flow_grpo_form_and_density_is_gaussian():
    torch.manual_seed(0)
    sampler = FlowSDESampler(FlowSDEOptions(noise_level=0.7))
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    x, v, noise = torch.randn(3, 4, 5), torch.randn(3, 4, 5), torch.randn(3, 4, 5)
    for i in range(4):
        sigma, dt = sigmas[i], sigmas[i + 1] - sigmas[i]
        std = 0.7 * math.sqrt(sigma / (1 - (sigmas[1] if sigma == 1 else sigma)))
        # The same mean written as Flow-GRPO groups it: x (1 + s^2 dt / 2 sigma) + v (1 + s^2 (1 - sigma) / 2 sigma) dt
        mean = x * (1 + std**2 / (2 * sigma) * dt) + v * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
        out = sampler.step(x, v, sigmas, i, noise=noise)
        torch.testing.assert_close(out.mean, mean)
        torch.testing.assert_close(out.next_state, mean + std * math.sqrt(-dt) * noise)
        density = torch.distributions.Normal(mean, std * math.sqrt(-dt)).log_prob(out.next_state).mean(dim=(1, 2))
        torch.testing.assert_close(out.log_prob, density)


def test_sde_preserves_the_flow_marginals():
    """With the exact velocity of Gaussian data, SDE samples end with the data's std (a wrong drift would not)."""
    s = 0.5  # data x0 ~ N(0, s^2)

    def velocity(x, sigma):  # E[eps - x0 | x_sigma] for Gaussian data
        variance = (1 - sigma) ** 2 * s**2 + sigma**2
        return (sigma - (1 - sigma) * s**2) / variance * x

    sampler = FlowSDESampler(FlowSDEOptions(noise_level=0.7))
    sigmas = torch.linspace(1, 0, 101)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 40_000, generator=generator)
    for i in range(100):
        x = sampler.step(
            x, velocity(x, sigmas[i]), sigmas, i, noise=torch.randn(x.shape, generator=generator)
        ).next_state
    assert x.std().item() == pytest.approx(s, rel=0.03)
    assert abs(x.mean().item()) < 0.01


def test_noise_level_must_be_positive():
    assert validate(FlowSDEOptions(noise_level=0.0), "sampler.")[0].startswith("sampler.noise_level=0.0: must be > 0")

"""CPS and Dance-SDE steps: their formulas, their densities, and what each preserves."""

from __future__ import annotations

import math

import pytest
import torch

from gyremedia.options import validate
from gyremedia_samplers.cps import CPSOptions, CPSSampler
from gyremedia_samplers.dance_sde import DanceSDEOptions, DanceSDESampler

SIGMAS = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])


def test_cps_step_by_hand_and_last_step_is_deterministic():
    torch.manual_seed(0)
    sampler = CPSSampler(CPSOptions(noise_level=0.8))
    x, v, noise = torch.randn(3, 4, 5), torch.randn(3, 4, 5), torch.randn(3, 4, 5)
    for i in range(3):
        sigma, nxt = SIGMAS[i], SIGMAS[i + 1]
        std = nxt * math.sin(0.8 * math.pi / 2)
        mean = (1 - nxt) * (x - sigma * v) + math.sqrt(nxt**2 - std**2) * (x + (1 - sigma) * v)
        out = sampler.step(x, v, SIGMAS, i, noise=noise)
        torch.testing.assert_close(out.mean, mean)
        torch.testing.assert_close(out.next_state, mean + std * noise)
        torch.testing.assert_close(out.log_prob, -((out.next_state - mean) ** 2).mean(dim=(1, 2)))
    last = sampler.step(x, v, SIGMAS, 3, noise=noise)
    assert torch.equal(last.next_state, last.mean) and torch.isnan(last.log_prob).all()  # never trained


def test_cps_keeps_samples_on_the_flow_path():
    """With the exact velocity toward a point x0, x' = (1 - s') x0 + s' * (unit Gaussian), for any noise level."""
    x0 = torch.full((1, 20_000), 0.3)
    generator = torch.Generator().manual_seed(0)
    for noise_level in (0.3, 1.0):
        sampler = CPSSampler(CPSOptions(noise_level=noise_level))
        eps = torch.randn(x0.shape, generator=generator)
        x = 0.5 * x0 + 0.5 * eps  # sigma = 0.5 on SIGMAS[2]
        out = sampler.step(x, eps - x0, SIGMAS, 2, noise=torch.randn(x0.shape, generator=generator))
        residual = (out.next_state - (1 - 0.25) * x0) / 0.25
        assert residual.std().item() == pytest.approx(1.0, rel=0.02) and abs(residual.mean().item()) < 0.02


def test_dance_sde_step_by_hand_and_its_density_is_gaussian():
    torch.manual_seed(1)
    sampler = DanceSDESampler(DanceSDEOptions(eta=0.3))
    x, v, noise = torch.randn(2, 6), torch.randn(2, 6), torch.randn(2, 6)
    for i in range(4):
        sigma, dt = SIGMAS[i], SIGMAS[i + 1] - SIGMAS[i]
        score = -(x - (1 - sigma) * (x - sigma * v)) / sigma**2
        mean = x + dt * v - 0.5 * 0.09 * dt * score
        out = sampler.step(x, v, SIGMAS, i, noise=noise)
        torch.testing.assert_close(out.mean, mean)
        std = 0.3 * math.sqrt(-dt)
        torch.testing.assert_close(out.next_state, mean + std * noise)
        torch.testing.assert_close(out.log_prob, torch.distributions.Normal(mean, std).log_prob(out.next_state).mean(1))


@pytest.mark.parametrize("options", [CPSOptions(noise_level=0.0), DanceSDEOptions(eta=0.0)], ids=["cps", "dance_sde"])
def test_noiseless_settings_are_refused(options):
    assert "must be > 0" in validate(options, "sampler.")[0] or "must be in (0, 1]" in validate(options, "sampler.")[0]

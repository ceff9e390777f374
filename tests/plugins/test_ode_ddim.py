"""Deterministic ODE solvers (Euler, Heun) and DDPO's DDIM-eta step for variance-preserving (v-prediction) backbones."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import DDIMScheduler

from gyremedia.config import ConfigError
from gyremedia.sampling import sample_generators, sample_trajectories
from gyremedia_samplers.ddim import DDIMEtaOptions, DDIMEtaSampler
from gyremedia_samplers.ode import EulerODESampler, HeunODESampler


class LinearField:
    """A backbone whose velocity is ``a x``: the ODE ``dx/dsigma = a x`` has a closed-form solution."""

    media_kind = "image"

    def __init__(self, a: float = 0.7) -> None:
        self.a, self.calls = a, 0

    def sample_noise(self, generators):
        return torch.stack([torch.randn(3, generator=g, dtype=torch.float64) for g in generators])

    def predict(self, x, sigma, conditions, guidance_scale=1.0, *, reference=False):
        self.calls += 1
        return self.a * x


def solve(sampler, steps: int, backbone=None):
    backbone = backbone or LinearField()
    backbone.sigmas = lambda n: torch.linspace(1.0, 0.2, n + 1, dtype=torch.float64)
    states, log_probs, _ = sample_trajectories(
        backbone,
        sampler,
        {},
        initial_generators=sample_generators(0, 0, 0, [0, 1]),
        step_generators=sample_generators(0, 0, 1, [0, 1]),
        num_steps=steps,
        guidance_scale=1.0,
    )
    exact = states[:, 0] * math.exp(0.7 * (0.2 - 1.0))
    return (states[:, -1] - exact).abs().max().item(), log_probs


def test_heun_is_second_order_and_euler_first():
    euler = [solve(EulerODESampler(), n)[0] for n in (8, 16)]
    heun = [solve(HeunODESampler(), n)[0] for n in (8, 16)]
    assert euler[0] / euler[1] == pytest.approx(2.0, rel=0.1)  # halving the step halves Euler's error
    assert heun[0] / heun[1] == pytest.approx(4.0, rel=0.1)  # ... and quarters Heun's
    assert heun[0] < euler[1] / 10  # Heun with 8 steps (15 evaluations) beats Euler with 16


def test_heun_evaluates_twice_per_step_except_the_last_to_zero():
    backbone = LinearField()
    solve(HeunODESampler(), 5, backbone)
    assert backbone.calls == 10
    backbone.calls = 0
    backbone.sigmas = lambda n: torch.linspace(1.0, 0.0, n + 1, dtype=torch.float64)
    sample_trajectories(
        backbone,
        HeunODESampler(),
        {},
        initial_generators=sample_generators(0, 0, 0, [0]),
        step_generators=sample_generators(0, 0, 1, [0]),
        num_steps=5,
        guidance_scale=1.0,
    )
    assert backbone.calls == 9  # the step to sigma = 0 is Euler
    with pytest.raises(ValueError, match="predict"):
        HeunODESampler().step(torch.ones(1, 3), torch.ones(1, 3), torch.tensor([1.0, 0.5, 0.0]), 0)


def ddim_schedule(steps: int, zero_terminal_snr: bool = False) -> tuple[DDIMScheduler, torch.Tensor]:
    """Stable Diffusion's DDIM scheduler (v-prediction; with ``zero_terminal_snr`` rescaled to reach pure noise,
    trailing spacing) and our noise levels for its timesteps: sqrt(1 - alpha_bar)."""
    spacing = {"rescale_betas_zero_snr": True, "timestep_spacing": "trailing"} if zero_terminal_snr else {}
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        prediction_type="v_prediction",
        **spacing,
    )
    scheduler.set_timesteps(steps)
    alpha_bars = torch.stack([*scheduler.alphas_cumprod[scheduler.timesteps], scheduler.final_alpha_cumprod])
    return scheduler, (1 - alpha_bars).sqrt()


@pytest.mark.parametrize("eta,zero_terminal_snr", [(0.0, False), (0.5, False), (1.0, False), (1.0, True)])
def test_ddim_eta_matches_diffusers_and_replays_its_log_probs(eta, zero_terminal_snr):
    scheduler, sigmas = ddim_schedule(10, zero_terminal_snr)
    assert (sigmas[0] == 1) == zero_terminal_snr  # the rescaled schedule starts from pure noise
    sampler = DDIMEtaSampler(DDIMEtaOptions(eta=eta))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, 8, generator=g)
    stochastic = 0
    for i, timestep in enumerate(scheduler.timesteps):
        v = 0.5 * x + torch.randn(x.shape, generator=g)  # any v prediction
        noise = torch.randn(x.shape, generator=g)
        ours = sampler.step(x, v, sigmas, i, noise=noise)
        theirs = scheduler.step(v, timestep, x, eta=eta, variance_noise=noise).prev_sample
        if sigmas[i] == 1:  # from pure noise: x0 = -v; DDPM's posterior leaves no deterministic direction
            alpha_prev = 1 - sigmas[i + 1] ** 2
            torch.testing.assert_close(
                ours.next_state, -alpha_prev.sqrt() * v + sigmas[i + 1] * noise, rtol=0, atol=1e-6
            )
            # diffusers takes the square root of 1 - a' - std^2, zero up to a rounding error of about 1e-7 here;
            # where the CPU's kernels round it below zero its step is NaN everywhere (seen on one machine)
            if theirs.isfinite().all():
                torch.testing.assert_close(ours.next_state, theirs, rtol=0, atol=3e-3)
            else:
                assert theirs.isnan().all()
        else:  # the step after pure noise was 2.4e-5 off on one machine's kernels, every other step within 1e-6
            after_pure_noise = i > 0 and sigmas[i - 1] == 1
            torch.testing.assert_close(ours.next_state, theirs, rtol=1e-5, atol=1e-4 if after_pure_noise else 1e-5)
        replayed = sampler.step(x, v, sigmas, i, next_state=ours.next_state)
        if ours.std == 0:
            assert torch.isnan(ours.log_prob).all()  # deterministic: nothing for a ratio to train
        else:
            stochastic += 1
            assert torch.isfinite(ours.log_prob).all()
            torch.testing.assert_close(replayed.log_prob, ours.log_prob, rtol=0, atol=1e-5)
        x = ours.next_state
    # eta = 0 is deterministic DDIM; otherwise every step injects noise but diffusers' last with leading spacing
    # (timestep 0 to alpha_bar_0, the same level)
    assert stochastic == (0 if eta == 0 else 10 if zero_terminal_snr else 9)


def test_ddim_eta_log_prob_is_the_gaussian_density():
    _, sigmas = ddim_schedule(4)
    sampler = DDIMEtaSampler(DDIMEtaOptions(eta=1.0))
    x, v = torch.randn(3, 5), torch.randn(3, 5)
    step = sampler.step(x, v, sigmas, 1, noise=torch.randn(3, 5))
    density = torch.distributions.Normal(step.mean, step.std).log_prob(step.next_state).mean(dim=1)
    torch.testing.assert_close(step.log_prob, density, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="alpha_bar"):
        sampler.step(x, v, torch.tensor([1.5, 0.5]), 0, noise=torch.randn(3, 5))


def test_an_epsilon_sampler_on_a_velocity_backbone_fails_at_config_time(make_config):
    with pytest.raises(
        ConfigError,
        match="sampler 'ddim_eta' steps on v_prediction predictions, but backbone "
        "'flow_matching' predicts velocity: choose one of .*flow_sde",
    ):
        make_config("sampler={name: ddim_eta}")
    with pytest.raises(ConfigError, match="eval.sampler 'ddim_eta'"):
        make_config("eval.sampler=ddim_eta")
    assert make_config("objective={name: nft}", "sampler=heun").sampler.name == "heun"

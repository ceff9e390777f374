"""Checks the backbone tests share."""

from __future__ import annotations

import pytest
import torch

from gyremedia.backbones.transformer_policy import adapters_disabled
from gyremedia.rollout import Media
from gyremedia.sampling import sample_trajectories
from gyremedia_samplers.ode import EulerODESampler


def ode_samples(
    backbone, prompts: list[str], seeds: list[int], num_steps: int, guidance_scale: float, sampler=None
) -> Media:
    """What our Euler ODE sampler (or the deterministic ``sampler`` given) generates for ``prompts`` from the
    noise of ``seeds`` (the stock pipelines' default sampler, so the two compare)."""
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    states, _, _ = sample_trajectories(
        backbone,
        sampler or EulerODESampler(),
        backbone.encode(prompts),
        initial_generators=generators,
        step_generators=[torch.Generator().manual_seed(s) for s in seeds],  # unused: std 0
        num_steps=num_steps,
        guidance_scale=guidance_scale,
    )
    return backbone.decode(states[:, -1])


def check_adapters_switch_off(base, adapted, guidance_scale: float, prompts: list[str], seeds: list[int]) -> None:
    """With random ``lora_B`` the adapters change ``adapted``'s prediction; switched off, and as the
    reference policy, it predicts exactly what ``base`` (the same model without adapters) does."""
    with torch.no_grad():  # B starts at zero: make the adapters matter
        for name, p in adapted.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    x = base.sample_noise([torch.Generator().manual_seed(s) for s in seeds])
    conditions, sigma = base.encode(prompts), torch.tensor(0.6)
    expected = base.predict(x, sigma, conditions, guidance_scale)
    assert (adapted.predict(x, sigma, conditions, guidance_scale) - expected).abs().max() > 1e-3
    with adapters_disabled(adapted.transformer):
        torch.testing.assert_close(adapted.predict(x, sigma, conditions, guidance_scale), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(
        adapted.predict(x, sigma, conditions, guidance_scale, reference=True), expected, atol=1e-6, rtol=0
    )


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices: intra-op threads only add overhead (4-5x slower on a loaded 2-core machine). A test module
    uses it by importing it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

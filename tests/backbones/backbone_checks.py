"""Checks the backbone tests share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
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


GENERATE = """
import json, sys
import numpy as np, torch
import diffusers
folder, lora, out, prompts, seeds, steps, guidance, arguments, pipeline_class = sys.argv[1:10]
pipe = getattr(diffusers, pipeline_class).from_pretrained(folder)
if lora:
    pipe.load_lora_weights(lora)
output = pipe(prompt=json.loads(prompts), num_inference_steps=int(steps), guidance_scale=float(guidance),
              output_type="pt", generator=[torch.Generator().manual_seed(s) for s in json.loads(seeds)],
              **json.loads(arguments))
np.save(out, output.images.float().numpy())
ours = [m for m in sys.modules if m.split(".")[0].startswith("gyremedia")]
assert not ours, f"the exported pipeline must load without gyremedia, but {ours} were imported"
"""


def stock_in_fresh_process(
    backbone,
    folder: Path,
    lora: Path | None,
    out: Path,
    steps: int,
    guidance: float,
    prompts: list[str],
    seeds: list[int],
) -> np.ndarray:
    """The images of the stock pipeline class that ``backbone`` exports to, loaded from ``folder`` (with the LoRA
    adapters of ``lora``) in a fresh process that must not import gyremedia, one generator per seed."""
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            GENERATE,
            str(folder),
            str(lora or ""),
            str(out),
            json.dumps(prompts),
            json.dumps(seeds),
            str(steps),
            str(guidance),
            json.dumps(backbone.generation_arguments()),
            backbone.pipeline_class,
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return np.load(out)

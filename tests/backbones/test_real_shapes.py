"""A real shape on this CPU (benchmarks/real_shapes.py): SD3.5's replica at 1024 x 1024 (4,096 image tokens, its
real latent grid, text lengths and VAE downsampling; every width narrow) against 512 x 512. Memory must grow no
faster than the image tokens do, in the update and in the whole step: a tensor quadratic in the tokens (attention
scores kept whole, a copy per token pair) would show as an exponent near 2."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import real_shapes  # noqa: E402


@pytest.mark.slow
def test_a_step_at_sd35s_real_resolution_grows_no_faster_than_its_image_tokens():
    small, large = (
        real_shapes.run_one(run, threads=2) for run in (real_shapes.sd35(512, "image tokens"), real_shapes.sd35(1024))
    )
    assert large["run"]["sizes"]["image tokens"] == 4096
    for phase in ("rollout", "decode", "update", "step"):
        assert real_shapes.exponent(small, large, "image tokens", phase) < 1.1, phase

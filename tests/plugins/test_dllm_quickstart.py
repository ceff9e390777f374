"""`gyremedia train dllm_quickstart`, end to end: token GRPO teaches the tiny masked-diffusion addition model to add.

Slow and run in CI, with two torch threads as its figure was measured. It trains from the shipped model
(assets/addition_masked) with a fixed seed and asserts, as the run's own step-0 and last evaluations measure it (the
figures `gyremedia eval` reports) on the 256 held-out prompts (pairs never seen in pretraining or RL), at least +20
points of exact-match accuracy with the paired 95% interval above zero, the whole training command within 5 minutes
of its 2 cores (10 CPU minutes; its seed 0 gained +27.0 in 3 minutes on a 2-core AMD EPYC), and the run folder a
user looks at (before/after completions, plot, the export and the decoding loop in its README).
"""

import json

import pytest

from cli_runs import gyremedia_cpu_minutes, heldout_change

MIN_POINTS, MAX_MINUTES, THREADS = 20, 5, 2  # minutes of its THREADS cores: CPU minutes / THREADS


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_dllm_quickstart_raises_heldout_exact_match(tmp_path):
    run = tmp_path / "dllm"
    _, minutes = gyremedia_cpu_minutes(
        "train", "dllm_quickstart", f"run.output_dir={run}", "logging.progress=false", timeout=900, threads=THREADS
    )
    for made in ("samples/before.txt", "samples/after.txt", "reward_curve.png", "pipeline/model.safetensors"):
        assert (run / made).is_file(), made
    assert "mask_token_id" in (run / "pipeline" / "README.md").read_text()  # the unmasking loop
    gain, base = heldout_change(run, "addition_verifier/correct")
    print(json.dumps(gain), f"\ntraining took {minutes:.1f} CPU minutes")
    assert gain["samples"] == 512
    assert 0.2 <= base <= 0.5, "the base model must be decent but imperfect"
    assert gain["ci95_low"] > 0 and 100 * gain["mean"] >= MIN_POINTS, gain
    assert minutes <= MAX_MINUTES * THREADS, f"the run took {minutes:.1f} CPU minutes"

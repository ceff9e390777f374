"""`gyremedia train llm_quickstart`, end to end: token GRPO teaches the tiny addition model to add.

Slow and run in CI, with two torch threads as its figures were measured. It trains from the shipped model with a
fixed seed and asserts, as the run's own step-0 and last evaluations measure it on the 256 held-out prompts (pairs
never seen in pretraining or RL; the figures `gyremedia eval` reports), at least +20 points of exact-match accuracy
with the paired 95% interval above zero (seeds 0, 1, 2: +27.0, +27.0, +27.3), within 10 minutes of its 2 cores (20
CPU minutes; the training command takes about 1.5 on a 2-core AMD EPYC), and the run folder a user looks at
(before/after completions, plot, export).
"""

import json

import pytest

from cli_runs import gyremedia_cpu_minutes, heldout_change

MIN_POINTS, MAX_MINUTES, THREADS = 20, 10, 2  # minutes of its THREADS cores: CPU minutes / THREADS


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_llm_quickstart_raises_heldout_exact_match(tmp_path):
    run = tmp_path / "llm"
    train, minutes = gyremedia_cpu_minutes(
        "train", "llm_quickstart", f"run.output_dir={run}", "logging.progress=false", timeout=900, threads=THREADS
    )
    assert minutes <= MAX_MINUTES * THREADS, f"the run took {minutes:.1f} CPU minutes"
    for made in (
        "samples/before.txt",
        "samples/after.txt",
        "reward_curve.png",
        "pipeline/model.safetensors",
        "pipeline/tokenizer.json",
        "pipeline/README.md",
    ):
        assert (run / made).is_file(), made
    gain, base = heldout_change(run, "addition_verifier/correct")
    print(json.dumps(gain), f"\ntraining took {minutes:.1f} CPU minutes")
    assert gain["samples"] == 512
    assert 0.2 <= base <= 0.5, "the base model must be decent but imperfect"
    assert gain["ci95_low"] > 0 and 100 * gain["mean"] >= MIN_POINTS, gain
    assert train.stdout.strip().splitlines()[-6].startswith("held-out addition_verifier/correct: 39.8% at step 0")

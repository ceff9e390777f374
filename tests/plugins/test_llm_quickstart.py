"""`gyremedia train llm_quickstart`, end to end: token GRPO teaches the tiny addition model to add.

Slow (about 2 minutes on 2 CPU cores) and run in CI. It trains from the shipped model with a fixed
seed and asserts, as `gyremedia eval` measures it on the 256 held-out prompts (pairs never seen in
pretraining or RL), at least +20 points of exact-match accuracy with the paired 95% interval above
zero, within 10 minutes (about 2 here: the bound allows for slower CI machines), and the run folder a
user looks at (before/after completions, plot, export).
"""

import json
import time

import pytest

from cli_runs import gyremedia

MIN_POINTS, MAX_MINUTES = 20, 10


@pytest.mark.slow
def test_llm_quickstart_raises_heldout_exact_match(tmp_path):
    run = tmp_path / "llm"
    start = time.monotonic()
    train = gyremedia("train", "llm_quickstart", f"run.output_dir={run}", "logging.progress=false", timeout=900)
    minutes = (time.monotonic() - start) / 60
    assert minutes <= MAX_MINUTES, f"the run took {minutes:.1f} minutes"
    for made in (
        "samples/before.txt",
        "samples/after.txt",
        "reward_curve.png",
        "pipeline/model.safetensors",
        "pipeline/tokenizer.json",
        "pipeline/README.md",
    ):
        assert (run / made).is_file(), made
    evaluate = gyremedia("eval", str(run), "--json", timeout=600)
    report = json.loads(evaluate.stdout)
    print(json.dumps(report, indent=2), f"\ntraining took {minutes:.1f} minutes")
    assert report["metric"] == "addition_verifier/correct" and report["samples"] == 512
    assert 0.2 <= report["base"]["accuracy"] <= 0.5, "the base model must be decent but imperfect"
    gain = report["gain"]
    assert gain["ci95_low"] > 0 and gain["points"] >= MIN_POINTS, gain
    assert train.stdout.strip().splitlines()[-6].startswith("held-out addition_verifier/correct: 39.8% at step 0")

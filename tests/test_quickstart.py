"""The README's first command: `gyremedia train` on the bundled quickstart, checked end to end.

Slow (a few minutes on 2 CPU cores) and run in CI: a fixed-seed GRPO run must raise the tiny model's
held-out ShapesBench accuracy by at least 10 points, with the paired 95% interval above zero.
"""

import json
import subprocess
import sys
import time

import pytest

from gyremedia.config import asset_path


@pytest.mark.slow
def test_quickstart_improves_heldout_accuracy(tmp_path):
    run = tmp_path / "quickstart"
    start = time.monotonic()
    train = subprocess.run([sys.executable, "-m", "gyremedia.cli", "train", f"run.output_dir={run}"],
                           capture_output=True, text=True, timeout=1200)
    minutes = (time.monotonic() - start) / 60
    assert train.returncode == 0, train.stderr[-4000:]
    assert minutes <= 10, f"the quickstart took {minutes:.1f} minutes"
    for made in ("config.yaml", "metrics.jsonl", "reward_curve.png", "samples/before.png", "samples/after.png",
                 "pipeline/model_index.json", "pipeline/README.md"):
        assert (run / made).is_file(), made

    evaluate = subprocess.run([sys.executable, "-m", "gyremedia.cli", "eval", str(run), "--json"],
                              capture_output=True, text=True, timeout=600)
    assert evaluate.returncode == 0, evaluate.stderr[-4000:]
    report = json.loads(evaluate.stdout)
    print(json.dumps(report, indent=2), f"\ntraining took {minutes:.1f} minutes")
    pretrained = json.loads(open(asset_path("shapes16/pretraining.json")).read())["final"]["heldout"]["accuracy"]
    assert 0.2 <= report["base"]["accuracy"] <= 0.6, "the base model must leave room to improve"
    assert abs(report["base"]["accuracy"] - pretrained) < 0.1  # our sampler agrees with diffusers' pipeline
    assert report["samples"] >= 256
    assert report["gain"]["ci95_low"] > 0
    assert report["gain"]["points"] >= 10

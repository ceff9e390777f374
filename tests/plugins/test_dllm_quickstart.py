"""`gyremedia train dllm_quickstart`, end to end: token GRPO teaches the tiny masked-diffusion addition model to add.

Slow and run in CI. It trains from the shipped model (assets/addition_masked) with a fixed seed and asserts, as
`gyremedia eval` measures it on the 256 held-out prompts (pairs never seen in pretraining or RL), at least +20
points of exact-match accuracy with the paired 95% interval above zero, the whole training command within 5
minutes on 2 CPU cores, and the run folder a user looks at (before/after completions, plot, the export and the
decoding loop in its README).
"""

import json
import time

import pytest

from cli_runs import gyremedia

MIN_POINTS, MAX_MINUTES = 20, 5


@pytest.mark.slow
def test_dllm_quickstart_raises_heldout_exact_match(tmp_path):
    run = tmp_path / "dllm"
    start = time.monotonic()
    gyremedia("train", "dllm_quickstart", f"run.output_dir={run}", "logging.progress=false", timeout=900)
    minutes = (time.monotonic() - start) / 60
    for made in ("samples/before.txt", "samples/after.txt", "reward_curve.png", "pipeline/model.safetensors"):
        assert (run / made).is_file(), made
    assert "mask_token_id" in (run / "pipeline" / "README.md").read_text()  # the unmasking loop
    report = json.loads(gyremedia("eval", str(run), "--json", timeout=600).stdout)
    print(json.dumps(report["gain"]), f"\ntraining took {minutes:.1f} minutes")
    assert report["metric"] == "addition_verifier/correct" and report["samples"] == 512
    assert 0.2 <= report["base"]["accuracy"] <= 0.5, "the base model must be decent but imperfect"
    gain = report["gain"]
    assert gain["ci95_low"] > 0 and gain["points"] >= MIN_POINTS, gain
    assert minutes <= MAX_MINUTES, f"the run took {minutes:.1f} minutes"

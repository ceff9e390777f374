"""The README's first command, `gyremedia train` (AWM on the quickstart), end to end.

Slow and run in CI, with one torch thread. It trains from the shipped ShapesBench model with a fixed seed, checks
the run folder the README promises, and asserts the held-out gain the run's own step-0 and step-100 evaluations
measure on 256 fixed-seed samples of unseen prompt combinations (the figures `gyremedia eval` reports:
tests/test_evaluation.py): its paired 95% interval above zero and at least +20 points, within 10 CPU minutes (about
2.5 on a 2-core AMD EPYC), without collapsing in-group diversity. (Seeds 0, 1, 2 gain +36.3, +39.1, +32.8 with one
thread, +32.8 for seed 0 with two: README.) The Flow-GRPO baseline, configs/quickstart_grpo.yaml, is asserted too
(its own test below), so that every speed-up measured against it is measured against a baseline that learns.
"""

import json
import subprocess
import sys

import pytest

from cli_runs import gyremedia, gyremedia_cpu_minutes, heldout_change, with_threads
from gyremedia.config import asset_path

MIN_POINTS, MAX_MINUTES, STEPS, EVAL_STEPS = 20, 10, 100, [0, 25, 50, 75, 100]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_quickstart_raises_heldout_accuracy(tmp_path):
    run = tmp_path / "quickstart"
    train, minutes = gyremedia_cpu_minutes("train", f"run.output_dir={run}", timeout=1200, threads=1)
    assert minutes <= MAX_MINUTES, f"the run took {minutes:.1f} CPU minutes"
    for made in (
        "config.yaml",
        "metrics.jsonl",
        "reward_curve.png",
        "samples/before.png",
        "samples/after.png",
        "pipeline/model_index.json",
        "pipeline/README.md",
        f"checkpoints/step-{STEPS:06d}/trainable.safetensors",
    ):
        assert (run / made).is_file(), made
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "eval/shapes_verifier/correct" in m] == EVAL_STEPS

    # The run's own step-0 and step-100 evaluations (the same samples): the figures `gyremedia eval RUN` reports
    # (tests/test_evaluation.py).
    base, trained = metrics[0], metrics[-1]
    assert trained["step"] == STEPS and "eval/diversity" in trained
    gain, base_accuracy = heldout_change(run, "shapes_verifier/correct")
    print(json.dumps(gain), f"\ntraining took {minutes:.1f} CPU minutes")
    assert gain["samples"] == 256
    trained_accuracy = trained["eval/shapes_verifier/correct"]
    assert 0.2 <= base_accuracy <= 0.6, "the base model must be decent but imperfect"
    # Our sampler and the stock diffusers pipeline (pretraining's evaluation) measure the same model.
    pretrained = json.loads(open(asset_path("shapes16/pretraining.json")).read())["final"]["heldout"]["accuracy"]
    assert abs(base_accuracy - pretrained) < 0.1
    assert gain["ci95_low"] > 0 and 100 * gain["mean"] >= MIN_POINTS, gain
    # Answers to one prompt stay varied: no mode collapse.
    assert trained["eval/diversity"] >= 0.5 * base["eval/diversity"]
    # The run's last lines say what was learned and where everything is, the figures those of `gyremedia eval`.
    last = train.stdout.strip().splitlines()[-7:]
    assert last[0].startswith(f"trained {STEPS} steps in ") and last[0].endswith(f"run folder: {run}")
    assert last[1] == (
        f"held-out shapes_verifier/correct: {100 * base_accuracy:.1f}% at step 0 -> {100 * trained_accuracy:.1f}% at "
        f"step {STEPS}: {100 * gain['mean']:+.1f} points (paired 95% interval {100 * gain['ci95_low']:+.1f} to "
        f"{100 * gain['ci95_high']:+.1f}, 256 samples)"
    )
    # the reward's own score (partial credit) too, and the file that holds every score's paired change
    assert last[2].startswith("other held-out scores, trained - base (paired 95% interval): shapes_verifier +")
    assert last[2].endswith(f"all in {run / 'heldout_changes.json'}")
    assert last[3] == f"samples: {run / 'samples/before.png'}, {run / 'samples/after.png'}"
    assert last[4] == f"plot:    {run / 'reward_curve.png'}" and last[5].startswith(f"export:  {run / 'pipeline'}")
    assert last[6].startswith(f"next:    gyremedia eval {run}")
    # The export is a complete SD3 pipeline: stock diffusers loads it with no other argument, without gyremedia.
    load = (
        "import sys; from diffusers import StableDiffusion3Pipeline; "
        f"pipe = StableDiffusion3Pipeline.from_pretrained({str(run / 'pipeline')!r}); "
        "assert pipe.text_encoder_3 is not None; "
        "assert not [m for m in sys.modules if m.startswith('gyremedia')]"
    )
    assert subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=300).returncode == 0


GRPO_MIN_POINTS, GRPO_STEPS = 10, 100


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_flow_grpo_quickstart_raises_heldout_accuracy(tmp_path):
    """The Flow-GRPO recipe (configs/quickstart_grpo.yaml, seed 0) gains held-out accuracy in the first 100 of
    its 150 steps (the test stops there to save CI time; the curve is the same): the paired interval above
    zero and at least +10 points (the issue's target). One torch thread, as the measured runs had. Runs are
    not bit-identical across machines, so another machine's run is in effect another seed: seeds 0, 1, 2 were
    at +16.0, +16.4, +19.5 at step 100 here (+17.6, +28.9, +23.4 at 150), and the bound leaves room below the
    lowest. (At the recipe's previous learning rate, 2e-4, seed 0 gained +29.3 at 150 here and +7.4 on a CI
    machine.)"""
    run = tmp_path / "grpo"
    gyremedia(
        "train",
        "quickstart_grpo",
        f"run.output_dir={run}",
        f"train.steps={GRPO_STEPS}",
        f"eval.every={GRPO_STEPS}",  # the evaluations change no training number (tests/test_trainer.py)
        "export.on_train_end=false",
        timeout=1800,
        env=with_threads(1),
    )
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "eval/shapes_verifier/correct" in m] == [0, GRPO_STEPS]
    gain, _ = heldout_change(run, "shapes_verifier/correct")
    print(json.dumps(gain))
    assert gain["ci95_low"] > 0 and 100 * gain["mean"] >= GRPO_MIN_POINTS, gain

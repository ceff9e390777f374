"""Fixed-seed evaluation, the paired gain interval, and `gyremedia eval`."""

import json
import math

import pytest
import torch

from gyremedia.cli import main
from gyremedia.evaluation import in_group_diversity, paired_gain
from gyremedia.rollout import Media


def test_paired_gain_by_hand():
    base = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    trained = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    gain = paired_gain(base, trained)
    diff = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, -1.0])
    half = 1.96 * diff.std().item() / math.sqrt(6)
    assert gain["points"] == pytest.approx(100 / 6)
    assert gain["ci95_low"] == pytest.approx(100 * (1 / 6 - half))
    assert gain["ci95_high"] == pytest.approx(100 * (1 / 6 + half))


def test_eval_command_compares_base_and_trained_on_the_same_samples(tiny_yaml, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", str(tiny_yaml), "train.steps=2", "train.learning_rate=0.01"]) == 0
    capsys.readouterr()
    assert main(["eval", str(run), "--json", "eval.samples=12"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= {"base", "trained", "gain", "metric", "samples"}
    assert report["metric"] == "jpeg_compressibility" and report["samples"] == 12
    assert set(report["base"]) == {"accuracy", "size_kb", "diversity"}
    assert report["base"]["accuracy"] != report["trained"]["accuracy"]  # lr 0.01 moved the model
    gain = report["gain"]
    assert gain["ci95_low"] <= gain["points"] <= gain["ci95_high"]
    # The base score equals the run's own step-0 evaluation: same prompts, same seeds.
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert main(["eval", str(run), "--json", "eval.samples=6"]) == 0
    assert json.loads(capsys.readouterr().out)["base"]["accuracy"] == pytest.approx(first["eval/jpeg_compressibility"])


def test_in_group_diversity_is_zero_for_identical_answers_and_grows_with_spread():
    prompts = ["a", "a", "b", "b", "c"]  # "c" has one sample: no pair to compare
    same = torch.zeros(5, 3, 2, 2)
    assert in_group_diversity(Media("image", same), prompts) == 0.0
    spread = same.clone()
    spread[1] += 0.5  # the two "a" answers differ by 0.5 everywhere; the "b" ones are equal
    assert in_group_diversity(Media("image", spread), prompts) == pytest.approx(0.25)
    # text: the share of a prompt's answers beyond the first that are distinct
    texts = Media("text", ["x", "y", "z", "z", "z", "w"])
    assert in_group_diversity(texts, ["a", "a", "b", "b", "b", "c"]) == pytest.approx((1.0 + 0.0) / 2)
    assert math.isnan(in_group_diversity(Media("text", ["x"]), ["a"]))


def test_evaluation_applies_each_rewards_timeout_and_failure_policy_and_counts_what_it_drops():
    import time

    from gyremedia.config import RewardSettings, Selected
    from gyremedia.evaluation import EvalResult, score
    from gyremedia.scoring import RewardError

    class Half:
        def __call__(self, media, prompts):
            return torch.tensor([0.1, math.nan, 0.3, math.nan])

    class Hangs:
        def __call__(self, media, prompts):
            time.sleep(3)
            return torch.zeros(len(prompts))

    media, prompts = Media("image", torch.rand(4, 3, 8, 8)), [f"p{i}" for i in range(4)]
    drop = [
        Selected("reward", "half", None, RewardSettings(on_failure="drop")),
        Selected("reward", "slow", None, RewardSettings(on_failure="drop", timeout=0.2)),
    ]
    start = time.monotonic()
    scores = score({"half": Half(), "slow": Hangs()}, media, prompts, drop)
    assert time.monotonic() - start < 2  # the timeout applies
    assert scores["half/dropped"].tolist() == [0, 1, 0, 1] and scores["slow/dropped"].tolist() == [1, 1, 1, 1]
    means = EvalResult(prompts, media, scores).means()
    assert (means["eval/half"], means["eval/half/dropped"], means["eval/slow/dropped"]) == (
        pytest.approx(0.2),
        2.0,
        4.0,
    )
    with pytest.raises(
        RewardError, match=r"^reward 'half' failed in the step-5 evaluation on prompt 'p1': 'score' is nan"
    ):
        score({"half": Half()}, media, prompts, [], "in the step-5 evaluation")  # fail, the default


@pytest.mark.parametrize("run_yaml", ["tiny_yaml", "llm_yaml"])
def test_eval_command_measures_the_runs_own_heldout_changes(request, run_yaml, tmp_path, capsys):
    """A run's heldout_changes.json (its step-0 and last evaluations: the same samples) is the gain `gyremedia eval`
    measures, images and text alike, so the slow learning tests read the file instead of evaluating twice more."""
    assert main(["train", str(request.getfixturevalue(run_yaml)), "train.steps=2", "train.learning_rate=0.01"]) == 0
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    changes = json.loads((tmp_path / "run" / "heldout_changes.json").read_text())[report["metric"]]
    assert report["samples"] == changes["samples"]
    for key, points in (("mean", "points"), ("ci95_low", "ci95_low"), ("ci95_high", "ci95_high")):
        assert report["gain"][points] == pytest.approx(100 * changes[key], abs=1e-9), key

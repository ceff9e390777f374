"""Saved rollouts (gyremedia/offline.py and the offline plugin): written once by `gyremedia rollout`, trained on
for many epochs with no sampler and no reward running, and refused with a clear line when they do not fit."""

import json

import pytest

from gyremedia.cli import main
from gyremedia.config import ConfigError
from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer


@pytest.fixture
def saved(tiny_yaml, tmp_path):
    out = tmp_path / "saved"
    assert main(["rollout", str(tiny_yaml), "--out", str(out), "--steps", "2"]) == 0
    return out


def test_rollout_writes_the_samples_their_rewards_and_a_manifest(saved):
    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest["steps"] == 2 and manifest["batch_size"] == 8 and manifest["rewards"] == ["jpeg_compressibility"]
    assert manifest["model_evaluations"] == 2 * 8 * 3
    records = [json.loads(line) for line in (saved / "records.jsonl").read_text().splitlines()]
    assert len(records) == 16 and set(records[0]["rewards"]) == {"jpeg_compressibility"}
    assert (saved / "samples.png").is_file() and (saved / "step_00001_rank0.pt").is_file()


def test_gdro_trains_from_the_folder_with_no_sampler_or_reward_in_the_run(make_config, saved, monkeypatch):
    trainer = Trainer(
        make_config("objective={name: gdro}", "sampler={name: ode}", f"data.offline={saved}", "train.steps=5"),
        PluginManager(),
    )
    state = trainer.setup()

    def never(*args, **kwargs):
        raise AssertionError("an offline run sampled or scored")

    monkeypatch.setattr(type(state.backbone), "collect_rollout", never)
    monkeypatch.setattr(state.scorer, "submit", never)
    state = trainer.train()  # 5 steps from 2 saved ones: the folder is read epoch after epoch
    assert state.step == 5 and state.last_metrics["grad_norm"] > 0
    saved_rewards = [
        json.loads(line)["rewards"]["jpeg_compressibility"]
        for line in (saved / "records.jsonl").read_text().splitlines()
    ]
    rows = [json.loads(line) for line in (state.run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [row["reward/jpeg_compressibility"] for row in rows if "reward/jpeg_compressibility" in row]
    assert rewards[0] == pytest.approx(sum(saved_rewards[:8]) / 8) == rewards[2]  # saved step 0, twice
    assert rewards[1] == pytest.approx(sum(saved_rewards[8:]) / 8)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.batch_size=4"], "the saved steps have rollout.batch_size=8: set rollout.batch_size=8"),
        (["objective={name: grpo}"], "objective 'grpo' replays transitions"),
        (["rewards=[shapes_verifier]"], "were not scored by shapes_verifier"),
    ],
)
def test_a_folder_that_does_not_fit_the_config_is_refused(make_config, saved, overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_config("objective={name: gdro}", f"data.offline={saved}", *overrides)


def test_a_missing_folder_names_the_command_that_writes_it(make_config, tmp_path):
    with pytest.raises(ConfigError, match="gyremedia rollout CONFIG --out"):
        make_config("objective={name: gdro}", f"data.offline={tmp_path / 'none'}")

"""Checkpoints survive what clusters do to runs: a damaged latest checkpoint, a full disk."""

from __future__ import annotations

import errno
import logging

import pytest

from gyremedia import checkpoint
from gyremedia.checkpoint import CheckpointError, list_checkpoints
from gyremedia.config import ConfigError
from gyremedia.plugins import PluginManager
from gyremedia.runs import run_config
from gyremedia.trainer import Trainer


def train(make_config, *overrides):
    return Trainer(make_config("checkpoint.every=2", "checkpoint.keep_last=3", *overrides), PluginManager()).train()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "no manifest"])
def test_a_damaged_latest_checkpoint_is_skipped_and_the_previous_one_resumes(make_config, tmp_path, caplog, damage):
    run = tmp_path / "run"
    train(make_config, "train.steps=4")
    latest = list_checkpoints(run)[-1]
    weights = latest / checkpoint.WEIGHTS
    if damage == "truncated":  # a kill during a save on a filesystem without atomic renames
        weights.write_bytes(weights.read_bytes()[:100])
    elif damage == "garbage":  # the sizes still match, the contents do not (a bad disk)
        weights.write_bytes(b"\0" * weights.stat().st_size)
    else:
        (latest / checkpoint.MANIFEST).unlink()
    pm = PluginManager()
    with caplog.at_level(logging.INFO, logger="gyremedia"):
        state = Trainer(run_config(run, ["train.steps=5"], pm), pm, resume=True).train()
    assert f"skipping damaged checkpoint {latest}" in caplog.text
    assert "resumed from" in caplog.text and "step-000002 at step 2" in caplog.text
    assert state.step == 5


def test_a_full_disk_stops_the_run_naming_the_folder_and_leaves_nothing_half_written(make_config, tmp_path,
                                                                                      monkeypatch):
    real_write = checkpoint._write

    def disk_full_at_step_4(path, data):
        if path.parent.name == ".tmp-step-000004" and path.name == checkpoint.OPTIMIZER:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, data)

    monkeypatch.setattr(checkpoint, "_write", disk_full_at_step_4)
    with pytest.raises(CheckpointError) as info:
        train(make_config, "train.steps=4")
    root = tmp_path / "run" / "checkpoints"
    assert str(info.value) == (f"could not write checkpoint step-000004 in {root} (OSError: No space left on device): "
                               "free disk space or fix the folder's permissions (run.output_dir); the previous "
                               "checkpoints are intact")
    assert [p.name for p in root.iterdir()] == ["step-000002"]  # no temporary folder left for --resume to trip on
    assert checkpoint.latest_checkpoint(tmp_path / "run") == root / "step-000002"


def test_the_per_prompt_reward_history_resumes_with_the_run(make_config, tmp_path):
    trainer = Trainer(make_config("advantage.history=8", "advantage.min_count=4", "train.steps=2"), PluginManager())
    state = trainer.train()
    assert state.step == 2 and sum(len(b) for b in trainer.stat_tracker.buffers.values()) == 16  # 2 steps x 8 samples
    pm = PluginManager()
    resumed = Trainer(run_config(tmp_path / "run", ["train.steps=3"], pm), pm, resume=True)
    resumed.setup()
    assert resumed.stat_tracker.buffers == trainer.stat_tracker.buffers


@pytest.mark.parametrize("overrides,message", [
    (["advantage.history=8", "advantage.combine=normalize_each"], "use advantage.combine=sum"),
    (["advantage.history=8", "advantage.std=global"], "use advantage.std=group or none"),
    (["advantage.history=8", "advantage.min_count=16"], "set advantage.min_count to at most 8"),
])
def test_bad_reward_history_settings_fail_at_config_time(make_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_config(*overrides)

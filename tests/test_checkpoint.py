"""Checkpoints survive what clusters do to runs: a damaged latest checkpoint, a full disk."""

from __future__ import annotations

import collections
import errno
import logging

import pytest

from gyremedia.config import ConfigError
from gyremedia.plugins import PluginManager
from gyremedia.runtime import checkpoint
from gyremedia.runtime.checkpoint import CheckpointError, list_checkpoints
from gyremedia.runtime.runs import run_config
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
    assert (
        f"damaged checkpoint {latest} (" in caplog.text and f"moved aside to {latest.parent / 'damaged'}" in caplog.text
    )
    assert "resumed from" in caplog.text and "step-000002 at step 2" in caplog.text
    assert state.step == 5


def test_a_full_disk_stops_the_run_naming_the_folder_and_leaves_nothing_half_written(
    make_config, tmp_path, monkeypatch
):
    real_write = checkpoint._write

    def disk_full_at_step_4(path, data):
        if path.parent.name == ".tmp-step-000004" and path.name == checkpoint.OPTIMIZER:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, data)

    monkeypatch.setattr(checkpoint, "_write", disk_full_at_step_4)
    with pytest.raises(CheckpointError) as info:
        train(make_config, "train.steps=4")
    root = tmp_path / "run" / "checkpoints"
    assert str(info.value) == (
        f"could not write checkpoint step-000004 in {root} (OSError: No space left on device): "
        "free disk space or fix the folder's permissions (run.output_dir); the previous "
        "checkpoints are intact"
    )
    assert [p.name for p in root.iterdir()] == ["step-000002"]  # no temporary folder left for --resume to trip on
    assert checkpoint.latest_checkpoint(tmp_path / "run") == root / "step-000002"


def test_the_per_prompt_reward_history_resumes_with_the_run(make_config, tmp_path):
    trainer = Trainer(make_config("advantage.history=8", "advantage.min_count=4", "train.steps=2"), PluginManager())
    state = trainer.train()
    assert (
        state.step == 2 and sum(len(b) for b in state.stateful["advantage"].buffers.values()) == 16
    )  # 2 steps x 8 samples
    pm = PluginManager()
    resumed = Trainer(run_config(tmp_path / "run", ["train.steps=3"], pm), pm, resume=True)
    resumed.setup()
    assert resumed.state.stateful["advantage"].buffers == state.stateful["advantage"].buffers


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["advantage.history=8", "advantage.combine=normalize_each"], "use advantage.combine=sum"),
        (["advantage.history=8", "advantage.std=global"], "use advantage.std=group or none"),
        (["advantage.history=8", "advantage.min_count=16"], "set advantage.min_count to at most 8"),
    ],
)
def test_bad_reward_history_settings_fail_at_config_time(make_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_config(*overrides)


def resume(run, *overrides, override_resumed=()):
    pm = PluginManager()
    return Trainer(
        run_config(run, list(overrides), pm), pm, resume=True, override_resumed=list(override_resumed)
    ).train()


def test_pruning_keeps_the_good_checkpoints_and_sets_a_damaged_one_aside(make_config, tmp_path):
    """The issue's reproduction: a damaged step 6, a resume that saves step 5 with keep_last=1. The good checkpoint
    is kept, the damaged one moved aside (not deleted), and the next resume continues from step 5."""
    run = tmp_path / "run"
    train(make_config, "train.steps=6", "checkpoint.keep_last=2")
    weights = run / "checkpoints" / "step-000006" / checkpoint.WEIGHTS
    weights.write_bytes(weights.read_bytes()[:100])
    assert resume(run, "train.steps=5", "checkpoint.keep_last=1").step == 5
    assert [p.name for p in list_checkpoints(run)] == ["step-000005"]
    assert (run / "checkpoints" / "damaged" / "step-000006" / checkpoint.WEIGHTS).stat().st_size == 100
    assert resume(run, "train.steps=6").step == 6  # from step 5, not from scratch


def test_a_run_whose_checkpoints_are_all_damaged_stops_instead_of_starting_over(make_config, tmp_path):
    run = tmp_path / "run"
    train(make_config, "train.steps=4")
    for path in list_checkpoints(run):
        (path / checkpoint.MANIFEST).unlink()
    with pytest.raises(checkpoint.NoUsableCheckpoint, match="every checkpoint is damaged .*step-000004.*step-000002"):
        resume(run, "train.steps=5")
    assert sorted(p.name for p in (run / "checkpoints" / "damaged").iterdir()) == ["step-000002", "step-000004"]


def test_checkpoints_are_ordered_by_step_number_past_a_million(tmp_path):
    for step in (999_999, 1_000_000, 20):
        (tmp_path / "checkpoints" / checkpoint.checkpoint_name(step)).mkdir(parents=True)
    (tmp_path / "checkpoints" / ".tmp-step-000021").mkdir()
    assert [checkpoint.checkpoint_step(p) for p in list_checkpoints(tmp_path)] == [20, 999_999, 1_000_000]


class RunsCode:
    """A pickle that runs a command when it is loaded (what a tampered download could hold)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_file_that_would_run_code_is_refused_and_not_run(make_config, tmp_path):
    import json

    import torch

    run = tmp_path / "run"
    train(make_config, "train.steps=2")
    latest = list_checkpoints(run)[-1]
    marker = tmp_path / "ran"
    torch.save({"x": RunsCode(marker)}, latest / checkpoint.SCHEDULER)
    manifest = json.loads((latest / checkpoint.MANIFEST).read_text())
    manifest[checkpoint.SCHEDULER] = (latest / checkpoint.SCHEDULER).stat().st_size
    (latest / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.UnsafeCheckpoint, match="scheduler.pt holds Python objects .*posix.system"):
        resume(run, "train.steps=3")
    assert not marker.exists()
    assert latest.is_dir()  # refused, not treated as damaged


def test_a_checkpoint_written_before_plain_rng_states_still_resumes_exactly(make_config, tmp_path):
    """Older checkpoints hold numpy's RNG state as numpy's own tuple: allowed, and read back unchanged."""
    import numpy as np
    import torch

    run = tmp_path / "run"
    train(make_config, "train.steps=2")
    rng_file = list_checkpoints(run)[-1] / "rng_rank0.pt"
    state = torch.load(rng_file, weights_only=True)
    np.random.seed(7)
    state["numpy"] = np.random.get_state()
    expected = np.random.random(3)
    torch.save(state, rng_file)
    import json

    manifest = json.loads((rng_file.parent / checkpoint.MANIFEST).read_text())
    manifest[rng_file.name] = rng_file.stat().st_size
    (rng_file.parent / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    loaded = checkpoint._load_rng(rng_file)
    checkpoint.set_rng_state(loaded)
    assert (np.random.random(3) == expected).all()
    assert resume(run, "train.steps=3").step == 3


def test_a_component_state_that_is_not_plain_values_fails_the_save_naming_it(make_config, monkeypatch):
    from gyremedia_features.prompt_history import PromptStatTracker

    monkeypatch.setattr(PromptStatTracker, "state_dict", lambda self: {"buffers": {"a cat": object()}})
    with pytest.raises(CheckpointError, match=r"the state of advantage\['buffers'\]\['a cat'\] is a builtins.object"):
        train(make_config, "advantage.history=8", "advantage.min_count=4", "train.steps=2")


def test_changed_settings_are_refused_on_resume_unless_overridden_and_then_apply(make_config, tmp_path):
    run = tmp_path / "run"
    train(make_config, "train.steps=2")
    with pytest.raises(
        ConfigError,
        match=r"^train.learning_rate=1e-09 differs from the 0.001 the run was trained with "
        r".*step-000002\): .* add --override-resumed train.learning_rate$",
    ):
        resume(run, "train.steps=3", "train.learning_rate=1e-9")
    # the keys that may change: run length, evaluation, logging, checkpoint cadence
    assert resume(run, "train.steps=3", "eval.samples=4", "checkpoint.keep_last=5", "logging.progress=true").step == 3
    pm = PluginManager()
    trainer = Trainer(
        run_config(run, ["train.steps=4", "train.learning_rate=1e-9", "train.weight_decay=0.5"], pm),
        pm,
        resume=True,
        override_resumed=["train"],
    )
    state = trainer.setup()
    assert state.step == 3
    group = state.optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], state.lr_scheduler.get_last_lr()) == (1e-9, 0.5, [1e-9])
    assert "momentum" not in group and state.optimizer.state  # Adam's moments were restored


def test_a_cut_off_metrics_line_is_skipped_on_resume(make_config, tmp_path, caplog):
    run = tmp_path / "run"
    train(make_config, "train.steps=2")
    metrics = run / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 3, "rew')  # a power loss mid-write
    with caplog.at_level(logging.WARNING, logger="gyremedia"):
        assert resume(run, "train.steps=3").step == 3
    assert "line 4 is not a whole JSON record" in caplog.text
    import json

    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [0, 1, 2, 3]


def test_an_atomic_write_that_fails_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "config.yaml"
    path.write_text("old: 1\n")

    def full_disk(file, data):
        file.write_bytes(data[:3])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "_write", full_disk)
    with pytest.raises(OSError):
        checkpoint.write_atomically(path, b"new: 2\n")
    assert path.read_text() == "old: 1\n" and [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


def test_a_cut_off_config_yaml_gives_way_to_the_checkpoints_copy(make_config, tmp_path, caplog):
    run = tmp_path / "run"
    train(make_config, "train.steps=2")
    config = run / "config.yaml"
    # written by a version that did not write it whole: cut inside a quoted string, whatever the run folder's path
    config.write_text(config.read_text()[:200] + '\n"cut off')
    with caplog.at_level(logging.WARNING, logger="gyremedia"):
        assert resume(run, "train.steps=3").step == 3
    assert (
        f"{config} does not parse (ScannerError): using the copy in {run / 'checkpoints' / 'step-000002'}"
        in caplog.text
    )
    assert config.read_text() == (run / "checkpoints" / "step-000003" / "config.yaml").read_text()  # whole again


def test_a_run_written_before_an_option_existed_resumes_and_a_new_section_is_still_a_change(make_config, tmp_path):
    """An option gyremedia added since the run was written (missing from its saved config) is no change of the run's;
    a reward the run did not have is."""
    import json

    run = tmp_path / "run"
    train(make_config, "train.steps=2")
    latest = list_checkpoints(run)[-1]  # as written before checkpoints kept their config
    (latest / checkpoint.CONFIG).unlink()
    manifest = json.loads((latest / checkpoint.MANIFEST).read_text())
    del manifest[checkpoint.CONFIG]
    (latest / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    config = run / "config.yaml"
    config.write_text(
        "".join(line for line in config.read_text().splitlines(keepends=True) if "max_dropped" not in line)
    )
    with pytest.raises(ConfigError, match=r"rewards.1.name=.clip_score. differs from the .\(unset\)."):
        resume(run, "train.steps=3", "rewards=[jpeg_compressibility, clip_score]")
    assert resume(run, "train.steps=3").step == 3


def test_what_the_loader_refuses_is_refused_when_saving(tmp_path):
    import numpy as np
    import torch

    plain = {"a": [1, 2.5, "x", None, True], "b": (torch.ones(2),), "c": {"d": {}}}
    checkpoint.check_plain(plain, "state")
    torch.save(plain, tmp_path / "plain.pt")
    checkpoint.load_plain(tmp_path / "plain.pt")
    for bad in (np.float64(1.0), collections.defaultdict(list), object()):
        with pytest.raises(CheckpointError, match=r"state\['x'\] is a "):
            checkpoint.check_plain({"x": bad}, "state")
        torch.save({"x": bad}, tmp_path / "bad.pt")
        with pytest.raises(checkpoint.UnsafeCheckpoint):
            checkpoint.load_plain(tmp_path / "bad.pt")


def test_rng_files_pickled_under_numpy_1_still_load(tmp_path):
    """numpy 1 names its array rebuilder numpy.core.multiarray._reconstruct, numpy 2 numpy._core...: both allowed."""
    import random
    import zipfile

    import numpy as np
    import torch

    torch.save(
        {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        tmp_path / "new.pt",
    )
    with zipfile.ZipFile(tmp_path / "new.pt") as source, zipfile.ZipFile(tmp_path / "old.pt", "w") as target:
        for item in source.infolist():
            data = source.read(item.filename)
            if item.filename.endswith("data.pkl"):
                data = data.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
            target.writestr(item, data)
    assert (checkpoint._load_rng(tmp_path / "old.pt")["numpy"][1] == np.random.get_state()[1]).all()


def test_a_read_error_is_not_damage(make_config, tmp_path, monkeypatch):
    """The disk failing while a checkpoint is read (an OSError) stops the resume; the checkpoint is not moved aside."""
    from pathlib import Path

    run = tmp_path / "run"
    train(make_config, "train.steps=2")
    real = Path.read_bytes

    def flaky(path):
        if path.name == checkpoint.WEIGHTS:
            raise OSError(5, "Input/output error")
        return real(path)

    monkeypatch.setattr(Path, "read_bytes", flaky)
    with pytest.raises(OSError, match="Input/output error"):
        resume(run, "train.steps=3")
    assert [p.name for p in list_checkpoints(run)] == ["step-000002"] and not (run / "checkpoints" / "damaged").exists()

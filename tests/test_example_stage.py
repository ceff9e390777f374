"""A third-party stage plugin (examples/gyremedia-example-stage), pip-installed into a scratch folder.

Run in subprocesses with that folder on PYTHONPATH, so the test environment itself is not changed. The plugin
takes the update stage over on steps whose rewards have no spread, and only when GYREMEDIA_EXAMPLE_STAGE=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from cli_runs import pip_install
from gyremedia.runtime import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gyremedia-example-stage"
SKIPPED = "example_stage/skipped"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A folder holding the installed example stage plugin."""
    target = tmp_path_factory.mktemp("site")
    pip_install(target, EXAMPLE)
    return target


def gyremedia(site: Path, *args: str, enable: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("GYREMEDIA_EXAMPLE_STAGE", None)
    if enable:
        env["GYREMEDIA_EXAMPLE_STAGE"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "gyremedia.cli", *args], env=env, capture_output=True, text=True, timeout=300
    )


def train_rows(run_dir: Path) -> list[dict]:
    """The metrics.jsonl rows of the training steps (the step-0 evaluation has no loss)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def weights(run_dir: Path, step: int) -> dict:
    return load_file(run_dir / ckpt.CHECKPOINT_DIR / ckpt.checkpoint_name(step) / ckpt.WEIGHTS)


def test_installed_package_is_listed_with_its_setup_hook(site):
    listing = json.loads(gyremedia(site, "plugins", "--json").stdout)
    example = next(p for p in listing["plugins"] if p["plugin"] == "example_stage")
    assert example["package"] == "gyremedia-example-stage"
    # installed, it implements only gyremedia_setup: the update takeover is registered per run, when turned on
    assert example["hooks"] == ["gyremedia_setup"] and example["registers"] == []


def test_a_step_whose_rewards_have_no_spread_skips_its_update(site, llm_yaml, tmp_path):
    """Every completion matches '.*': each reward is 1.0, so each step is skipped and the weights stay put."""
    run = gyremedia(site, "train", str(llm_yaml), "rewards.0.pattern=.*", "rewards.0.mode=fullmatch", enable=True)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = train_rows(tmp_path / "run")
    assert len(rows) == 2 and all(r[SKIPPED] == 1.0 and r["reward"] == 1.0 and r["loss"] == 0.0 for r in rows)
    before, after = weights(tmp_path / "run", 1), weights(tmp_path / "run", 2)
    assert before.keys() == after.keys() and all(before[k].equal(after[k]) for k in before)


def test_the_default_update_runs_otherwise_and_the_key_is_always_there(site, tiny_yaml, tmp_path):
    """Image rewards (JPEG sizes) differ between samples: the default update runs and says so with 0.0."""
    run = gyremedia(site, "train", str(tiny_yaml), enable=True)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = train_rows(tmp_path / "run")
    assert len(rows) == 2 and all(r[SKIPPED] == 0.0 and "grad_norm" in r for r in rows)
    before, after = weights(tmp_path / "run", 1), weights(tmp_path / "run", 2)
    assert any(not before[k].equal(after[k]) for k in before)


def test_installed_but_not_turned_on_changes_nothing(site, llm_yaml, tmp_path):
    """The same flat-reward run without GYREMEDIA_EXAMPLE_STAGE: the default update runs (weight decay moves
    the weights even with nothing to learn) and the plugin adds no metric."""
    run = gyremedia(site, "train", str(llm_yaml), "rewards.0.pattern=.*", "rewards.0.mode=fullmatch")
    assert run.returncode == 0, run.stderr[-2000:]
    rows = train_rows(tmp_path / "run")
    assert len(rows) == 2 and all(SKIPPED not in r and "grad_norm" in r for r in rows)
    before, after = weights(tmp_path / "run", 1), weights(tmp_path / "run", 2)
    assert any(not before[k].equal(after[k]) for k in before)

"""A real third-party package (examples/gyremedia-example-reward), pip-installed into a scratch folder.

Run in subprocesses with that folder on PYTHONPATH, so the test environment itself is not changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_runs import pip_install

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gyremedia-example-reward"

BROKEN_PYPROJECT = """
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"
[project]
name = "gyremedia-broken-plugin"
version = "0.0.1"
[project.entry-points.gyremedia]
broken_plugin = "gyremedia_broken_plugin"
[tool.setuptools]
packages = ["gyremedia_broken_plugin"]
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A folder holding the installed example plugin and a plugin whose import fails."""
    broken = tmp_path_factory.mktemp("broken")
    (broken / "pyproject.toml").write_text(BROKEN_PYPROJECT)
    (broken / "gyremedia_broken_plugin").mkdir()
    (broken / "gyremedia_broken_plugin" / "__init__.py").write_text("import a_dependency_that_is_not_installed\n")
    target = tmp_path_factory.mktemp("site")
    pip_install(target, EXAMPLE, broken)
    return target


def gyremedia(site: Path | None, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site) if site else ""}
    return subprocess.run(
        [sys.executable, "-m", "gyremedia.cli", *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_installed_package_is_listed_with_its_reward(site):
    listing = json.loads(gyremedia(site, "plugins", "--json").stdout)
    example = next(p for p in listing["plugins"] if p["plugin"] == "example_reward")
    assert example["package"] == "gyremedia-example-reward" and "reward:colorfulness" in example["registers"]
    # the broken package is reported by name, with why
    failed = {f["plugin"]: f for f in listing["failed"]}
    assert failed["broken_plugin"]["package"] == "gyremedia-broken-plugin"
    assert "a_dependency_that_is_not_installed" in failed["broken_plugin"]["error"]


def test_a_yaml_selects_the_third_party_reward_and_trains(site, tiny_yaml, tmp_path):
    config = tiny_yaml
    overrides = ["rewards.0.name=colorfulness", "rewards.0.saturation_only=true", "train.steps=1"]
    run = gyremedia(site, "train", str(config), *overrides)
    assert run.returncode == 0, run.stderr[-2000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "reward/colorfulness/chroma" in metrics[-1]
    # without the package the same yaml fails before any model loads, naming the reward
    missing = gyremedia(None, "config", str(config), *overrides)
    assert missing.returncode != 0 and "'colorfulness'" in missing.stderr


def test_a_broken_package_does_not_stop_runs_that_do_not_select_it(site, tiny_yaml):
    resolved = gyremedia(site, "config", str(tiny_yaml))
    assert resolved.returncode == 0, resolved.stderr[-2000:]
    assert "jpeg_compressibility" in resolved.stdout

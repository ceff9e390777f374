"""The suite's time budget (tests/suite_budget.py): a session longer than ``suite_budget_minutes`` fails with a line
that says so, after every test has run; a shorter one passes and says how much of the budget it used."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_suite(folder: Path, budget_minutes: float) -> subprocess.CompletedProcess:
    (folder / "pytest.ini").write_text(f"[pytest]\nsuite_budget_minutes = {budget_minutes}\n")
    (folder / "test_sleeps.py").write_text("import time\n\ndef test_sleeps():\n    time.sleep(0.2)\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent))
    command = [sys.executable, "-m", "pytest", "-p", "suite_budget", "-p", "no:cacheprovider", str(folder)]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=120)


def test_a_suite_past_its_budget_fails_after_its_tests_pass(tmp_path):
    done = run_suite(tmp_path, budget_minutes=0.001)  # 0.06 s
    assert done.returncode == 1, done.stdout
    assert "1 passed" in done.stdout
    assert "FAILED: the suite took 0.0 minutes of its 0.001-minute budget (suite_budget_minutes)" in done.stdout


def test_a_suite_inside_its_budget_passes_and_says_what_it_used(tmp_path):
    done = run_suite(tmp_path, budget_minutes=50)
    assert done.returncode == 0, done.stdout
    assert "the suite took 0.0 minutes of its 50-minute budget (suite_budget_minutes)" in done.stdout
    assert "FAILED" not in done.stdout

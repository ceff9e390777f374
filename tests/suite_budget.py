"""The suite's time budget, as a pytest plugin: CI must finish well inside its 90-minute wall on the slowest CPU kind
these machines come in, so a run of the suite past ``suite_budget_minutes`` (pyproject.toml) fails, with a line that
says by how much, and every run ends with the total beside the budget. Loaded by conftest.py."""

from __future__ import annotations

import time

import pytest

BUDGET_KEY = pytest.StashKey[float]()
VERDICT_KEY = pytest.StashKey[str]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "suite_budget_minutes",
        "fail the run when the whole session takes longer than this many minutes (0: no budget)",
        default="50",
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[BUDGET_KEY] = time.monotonic()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail a run that took longer than the budget (after its tests ran: nothing is cut short)."""
    minutes = (time.monotonic() - session.config.stash[BUDGET_KEY]) / 60
    budget = float(session.config.getini("suite_budget_minutes"))
    verdict = f"the suite took {minutes:.1f} minutes of its {budget:g}-minute budget (suite_budget_minutes)"
    if budget and minutes > budget:
        verdict = (
            f"FAILED: {verdict}: make the slowest tests above shorter (or move a measurement to benchmarks/) "
            "before CI reaches its 90-minute wall"
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    session.config.stash[VERDICT_KEY] = verdict


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    verdict = config.stash.get(VERDICT_KEY, "")
    if verdict:
        terminalreporter.write_line(verdict, red=verdict.startswith("FAILED"), bold=True)

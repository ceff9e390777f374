"""docs/errors.md's table, row by row: each bad input exits 2 within seconds, loads no model, and prints
exactly the one line the table shows (the key, the bad value, the fix)."""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path

import pytest

import gyremedia.trainer
from gyremedia.cli import main
from gyremedia.plugins import PluginManager

DOC = Path(__file__).parents[1] / "docs" / "errors.md"
ROW = re.compile(r"^\| *(\d+) *\| *(?P<what>[^|]+?) *\| *`(?P<command>[^`]+)` *\| *(?P<message>.+?) *\|$")


def unquote(cell: str) -> str:
    """A table cell's code span without its backticks and with its escaped pipes restored."""
    cell = cell.strip()
    for fence in ("`` ", "`"):
        if cell.startswith(fence) and cell.endswith(fence[::-1]):
            cell = cell[len(fence):-len(fence)]
            break
    return cell.replace("\\|", "|")


def documented_rows() -> list[tuple[str, str, str]]:
    rows = []
    for line in DOC.read_text().splitlines():
        match = ROW.match(line)
        if match:
            rows.append((match["what"], match["command"], unquote(match["message"])))
    return rows


ROWS = documented_rows()


def test_the_table_has_at_least_thirty_rows():
    assert len(ROWS) >= 30


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """The folder the table's commands run in: the files some rows name, no model allowed to load."""
    import huggingface_hub.constants

    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n   \n\n")
    (tmp_path / "notarun").mkdir()
    old = tmp_path / "runs" / "old" / "checkpoints" / "step-000001"
    old.mkdir(parents=True)
    (old / "trainer_state.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def refuse(*args, **kwargs):
        raise AssertionError("a component was built: the error came too late")

    monkeypatch.setattr(gyremedia.trainer.Trainer, "setup", refuse)
    monkeypatch.setattr(PluginManager, "build", refuse)
    return tmp_path


@pytest.mark.parametrize("what,command,message", ROWS, ids=[r[0] for r in ROWS])
def test_a_bad_input_fails_in_one_line_before_any_model_loads(workdir, capsys, what, command, message):
    args = shlex.split(command)
    assert args[0] == "gyremedia"
    start = time.monotonic()
    code = main(args[1:])
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [message]
    assert elapsed < 10


def test_a_reward_that_breaks_the_contract_stops_the_run_with_the_contract(tiny_yaml, capsys, monkeypatch):
    """Found only once the reward runs (at the step-0 evaluation): exit 2, and the line says what a reward returns."""
    import gyremedia.cli
    from gyremedia import hookimpl

    class Colorfulness:
        kinds = {"image"}

        def __call__(self, media, prompts):
            return {"colorfulness": media.data.mean(dim=(1, 2, 3))}

    class Plugin:
        @hookimpl
        def gyremedia_register_rewards(self, register):
            register("colorful", lambda context: Colorfulness())

    plain = gyremedia.cli.PluginManager
    monkeypatch.setattr(gyremedia.cli, "PluginManager", lambda: plain(extra_plugins=[Plugin()]))
    assert main(["train", str(tiny_yaml), "rewards=[colorful]"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "gyremedia: error: reward 'colorful' returned keys ['colorfulness'] without a 'score': a reward returns a "
        "Tensor[B], or a dict of Tensor[B] holding a 'score' (its other entries are logged as components)")

"""docs/errors.md's table, row by row: each bad input exits 2 within seconds, loads no model, and prints
exactly the one line the table shows (the key, the bad value, the fix)."""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path

import pytest

import gyremedia.trainer
from gyremedia.cli import DEFAULT_CONFIG, bundled_config, main
from gyremedia.config import load_config, resolve_config
from gyremedia.plugins import PluginManager

DOC = Path(__file__).parents[1] / "docs" / "errors.md"
ROW = re.compile(r"^\| *(\d+) *\| *(?P<what>[^|]+?) *\| *`(?P<command>[^`]+)` *\| *(?P<message>.+?) *\|$")


def unquote(cell: str) -> str:
    """A table cell's code span without its backticks and with its escaped pipes restored."""
    cell = cell.strip()
    for fence in ("`` ", "`"):
        if cell.startswith(fence) and cell.endswith(fence[::-1]):
            cell = cell[len(fence) : -len(fence)]
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
    (tmp_path / "latin1.txt").write_bytes("a red circle\ncafé au lait\n".encode("latin-1"))
    (tmp_path / "notarun").mkdir()
    (tmp_path / "exported").mkdir()
    (tmp_path / "exported" / "model_index.json").write_text("{}")
    old = tmp_path / "runs" / "old" / "checkpoints" / "step-000001"
    old.mkdir(parents=True)
    (old / "trainer_state.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    quickstart = resolve_config(
        load_config(bundled_config(DEFAULT_CONFIG), ["run.output_dir=runs/old"]), PluginManager()
    )
    (old.parents[1] / "config.yaml").write_text(quickstart.to_yaml())
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
        "Tensor[B], or a dict of Tensor[B] holding a 'score' (its other entries are logged as components, except "
        "'frames', a video reward's per-frame scores Tensor[B, T])"
    )


@pytest.mark.slow
def test_a_failing_reward_exits_with_the_same_code_every_time(tmp_path):
    """The quickstart with a reward that scores NaN at step 1, five times: exit 1 each time. Its prompt prefetch
    thread, still encoding at exit, used to abort the interpreter's teardown (exit 134) in most runs."""
    import subprocess
    import sys

    worker = Path(__file__).with_name("reward_failure_worker.py")
    codes, lines = [], []
    for attempt in range(5):
        done = subprocess.run(
            [
                sys.executable,
                str(worker),
                "0",
                "1",
                "nan",
                "train",
                "quickstart",
                f"run.output_dir={tmp_path / str(attempt)}",
                "rewards=[fails_at_step]",
                "eval.metric=fails_at_step",
                "rollout.batch_size=16",
                "rollout.num_steps=4",
                "eval.prompts_file=null",
                "data.eval_prompts=[a red circle, a blue square]",
                "eval.samples=4",
                "train.steps=3",
                "logging.progress=false",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        codes.append(done.returncode)
        lines.append(done.stderr.strip().splitlines()[-1])
    assert codes == [1] * 5, lines
    assert all(
        line.startswith("gyremedia: error: reward 'fails_at_step' failed at step 1 on prompt ")
        and line.endswith("'score' is nan")
        for line in lines
    ), lines

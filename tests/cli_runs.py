"""Running the `gyremedia` command as a user does, in a fresh process, for the end-to-end tests."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


def gyremedia(*args: str, timeout: float, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m gyremedia.cli ARGS``; fails the test with the end of its stderr unless it exits 0."""
    done = subprocess.run(
        [sys.executable, "-m", "gyremedia.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else dict(env),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def pip_install(target: Path, *packages: Path) -> None:
    """Install ``packages`` (folders) into ``target`` alone, as a user's environment would hold them; a run with
    ``target`` on PYTHONPATH sees them and the test environment itself is not changed."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--target", str(target), *map(str, packages)],
        check=True,
    )


def with_threads(threads: int) -> dict[str, str]:
    """The environment for a run with ``threads`` torch threads beside the suite's other worker: its learning figures
    were measured with that many (another count rounds differently, in effect another seed), and its threads sleep
    instead of spinning while they wait (the same numbers; two spinning runs on two cores ran 3x slower)."""
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")


def gyremedia_cpu_minutes(*args: str, timeout: float, threads: int) -> tuple[subprocess.CompletedProcess, float]:
    """:func:`gyremedia` with ``threads`` torch threads (:func:`with_threads`), and the CPU minutes it used: what the
    run costs whatever else shares the cores (the suite's tests run side by side, so their wall time is not a run's
    own)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = gyremedia(*args, timeout=timeout, env=with_threads(threads))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return done, (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / 60


def free_port() -> int:
    """A loopback port no process listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def heldout_change(run: Path, key: str) -> tuple[dict[str, float], float]:
    """A finished run's paired change in the eval score ``key`` from step 0 to its last step (heldout_changes.json:
    what `gyremedia eval RUN` measures, tests/test_evaluation.py) and its step-0 value."""
    change = json.loads((run / "heldout_changes.json").read_text())[key]
    base = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])[f"eval/{key}"]
    return change, base

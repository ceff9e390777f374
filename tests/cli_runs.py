"""Running the `gyremedia` command as a user does, in a fresh process, for the end-to-end tests."""

from __future__ import annotations

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

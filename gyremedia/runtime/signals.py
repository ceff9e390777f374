"""SIGTERM and SIGINT during a run: the first asks the loop to stop after the current step with a checkpoint,
a second exits at once."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger("gyremedia")


class Interrupted(RuntimeError):
    """A SIGTERM or SIGINT ended the run after a checkpoint; ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int, step: int, checkpoint: Path, run_dir: Path) -> None:
        name = signal.Signals(signum).name
        super().__init__(
            f"{name} received: stopped after step {step} with checkpoint {checkpoint}; continue with "
            f"`gyremedia train --resume {run_dir}`"
        )
        self.exit_code = 128 + signum


class StopSignals:
    """Records the first SIGTERM / SIGINT while :meth:`handled` is active (the main thread only)."""

    def __init__(self) -> None:
        self.received: int | None = None  # the first signal's number
        self.finishing = False  # every step done: plotting and exporting (a signal lets that finish)

    @contextlib.contextmanager
    def handled(self, next_step: Any) -> Iterator[None]:
        """Handle the signals inside the block; ``next_step()`` names the step a signal lets finish."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: Any) -> None:
            name = signal.Signals(signum).name
            if self.received is not None:
                sys.stderr.write(f"gyremedia: second {name}: exiting now, without a checkpoint\n")
                os._exit(128 + signum)
            self.received = signum
            if self.finishing:
                logger.warning(
                    "%s received during the end-of-run export: finishing it (every step is trained and "
                    "checkpointed; send it again to exit at once)",
                    name,
                )
                return
            logger.warning(
                "%s received: finishing step %d, then writing a checkpoint and stopping "
                "(send it again to exit at once)",
                name,
                next_step(),
            )

        previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

"""First-party metric loggers, registered through the ``gyremedia`` entry point."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from gyremedia import hookimpl
from gyremedia.media_io import read_jsonl
from gyremedia.options import option
from gyremedia.runtime.checkpoint import write_atomically


@dataclass
class JsonlOptions:
    filename: str = option(
        "metrics.jsonl",
        help="inside the run folder",
        check=lambda v: None if v and "/" not in v else "give a file name, without folders",
    )


class JsonlLogger:
    """Appends one JSON object per logged step to ``RUN_DIR/metrics.jsonl``.

    Each record is one write of a whole line, flushed to the disk. On resume it drops the lines logged after
    the checkpoint, and any line cut short by a crash, and rewrites the file whole, so it reads as one clean run.
    """

    def __init__(self, options: JsonlOptions, context) -> None:
        self.path = Path(context.run_dir) / options.filename
        self._file = None

    def log(self, metrics: dict, step: int) -> None:
        if self._file is None:
            self._file = self.path.open("a")
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    @hookimpl
    def gyremedia_on_load_checkpoint(self, state, path, plugin_state) -> None:
        if not self.path.is_file():
            return
        kept = [r for r in read_jsonl(self.path) if isinstance(r, dict) and r.get("step", 0) <= state.step]
        write_atomically(self.path, "".join(json.dumps(r) + "\n" for r in kept).encode())


@hookimpl
def gyremedia_register_loggers(register):
    register("jsonl", JsonlLogger, options=JsonlOptions, description="metrics.jsonl in the run folder")

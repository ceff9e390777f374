"""Which prompts a step trains on: a deterministic function of (seed, step), the same on every rank."""

from __future__ import annotations

from pathlib import Path

from gyremedia.streams import Stream, stream_rng


class PromptFileError(ValueError):
    """A prompts file cannot be read as text: the message names the file, the line and the fix."""


def read_prompts(path: str) -> list[str]:
    """The non-blank lines of a prompts file, stripped. The file is strict UTF-8 (a byte-order mark is
    tolerated and dropped); anything else raises :class:`PromptFileError` naming the line, since a prompt
    decoded wrongly would train on text nobody wrote."""
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise PromptFileError(f"cannot be read ({exc.strerror or exc}): give a text file with one prompt per line") from exc
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        start = exc.start + (3 if data.startswith(b"\xef\xbb\xbf") else 0)
        line = data[:start].count(b"\n") + 1
        column = start - (data.rfind(b"\n", 0, start) + 1) + 1
        raise PromptFileError(f"line {line} is not UTF-8 (byte 0x{data[start]:02x} at column {column}): save the file "
                              "as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)") from exc
    return [line.strip() for line in text.splitlines() if line.strip()]


class PromptSource:
    """Draws each step's prompt groups from a fixed list of prompts."""

    def __init__(self, prompts: list[str], prompts_file: str | None = None) -> None:
        self.prompts = list(prompts)
        if prompts_file:
            self.prompts += read_prompts(prompts_file)
        if not self.prompts:
            raise ValueError("no prompts: set data.prompts or data.prompts_file")

    def groups_for_step(self, seed: int, step: int, num_groups: int) -> list[str]:
        """``num_groups`` prompts for ``step``: without repetition while the list is long enough."""
        rng = stream_rng(seed, step, Stream.PROMPTS)
        replace = num_groups > len(self.prompts)
        picks = rng.choice(len(self.prompts), size=num_groups, replace=replace)
        return [self.prompts[i] for i in picks]

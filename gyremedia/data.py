"""Which prompts a step trains on: a deterministic function of (seed, step), the same on every rank."""

from __future__ import annotations

from pathlib import Path

from gyremedia.streams import Stream, stream_rng


def read_prompts(path: str) -> list[str] | None:
    """The non-blank lines of a prompts file, stripped; ``None`` when it cannot be read."""
    try:
        lines = Path(path).expanduser().read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    return [line.strip() for line in lines if line.strip()]


class PromptSource:
    """Draws each step's prompt groups from a fixed list of prompts."""

    def __init__(self, prompts: list[str], prompts_file: str | None = None) -> None:
        self.prompts = list(prompts)
        if prompts_file:
            self.prompts += read_prompts(prompts_file) or []
        if not self.prompts:
            raise ValueError("no prompts: set data.prompts or data.prompts_file")

    def groups_for_step(self, seed: int, step: int, num_groups: int) -> list[str]:
        """``num_groups`` prompts for ``step``: without repetition while the list is long enough."""
        rng = stream_rng(seed, step, Stream.PROMPTS)
        replace = num_groups > len(self.prompts)
        picks = rng.choice(len(self.prompts), size=num_groups, replace=replace)
        return [self.prompts[i] for i in picks]

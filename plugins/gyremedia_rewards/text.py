"""Rewards for text media (token policies): a format check by regular expression, and a length penalty.

Both read only the completions, so they combine with any task's verifier (``advantage.combine``) and
fail or drop samples like every other reward.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from gyremedia.options import OptionError, option, regular_expression
from gyremedia.rollout import Media


@dataclass
class FormatOptions:
    pattern: str = option(
        r"\d+", check=regular_expression, help="the regular expression a well-formed completion matches"
    )
    mode: Literal["fullmatch", "match", "search"] = option(
        "fullmatch", help="match the whole completion (stripped), its start, or anywhere"
    )


class FormatReward:
    """1 when the completion matches ``pattern`` (as ``mode`` says), else 0."""

    kinds = {"text"}

    def __init__(self, options: FormatOptions, context=None) -> None:
        self.match = getattr(re.compile(options.pattern, re.S), options.mode)

    def __call__(self, media: Media, prompts: list[str]) -> torch.Tensor:
        return torch.tensor([float(self.match(text.strip()) is not None) for text in media.data])


@dataclass
class LengthPenaltyOptions:
    max_length: int = option(512, ge=1, help="the length limit, in characters")
    cache: int = option(128, ge=0, help="the soft zone before the limit where the penalty grows from 0 to -1")

    def validate(self) -> None:
        if self.cache > self.max_length:
            raise OptionError("cache", f"must not exceed max_length={self.max_length}")


class LengthPenalty:
    """DAPO's soft overlong punishment, in characters: 0 up to ``max_length - cache``, then falling linearly
    to -1 at ``max_length``, and -1 beyond. Components: ``length``."""

    kinds = {"text"}

    def __init__(self, options: LengthPenaltyOptions, context=None) -> None:
        self.max_length, self.cache = options.max_length, options.cache

    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        length = torch.tensor([float(len(text)) for text in media.data])
        start = self.max_length - self.cache
        if self.cache:
            penalty = -((length - start) / self.cache).clamp(0, 1)
        else:
            penalty = -(length > self.max_length).float()
        return {"score": penalty, "length": length}

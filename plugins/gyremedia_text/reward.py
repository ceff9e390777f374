"""The addition task's verifier: does the completion's answer equal the sum the prompt asks for?"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyremedia.data import prompt_fields
from gyremedia.options import option
from gyremedia.rollout import Media
from gyremedia_text.task import answer, extract_answer


@dataclass
class AdditionVerifierOptions:
    partial_credit: bool = option(
        False, help="score = the share of the sum's digits in place (right-aligned), else 1 only for the exact answer"
    )
    answer_field: str = option(
        "answer", help="the prompt record's field holding the expected answer; a prompt without it is parsed ('A+B=')"
    )


def expected_answer(prompt: str, field: str) -> str:
    """The answer ``prompt``'s record gives under ``field``, else the sum its text asks for."""
    value = prompt_fields(prompt).get(field)
    return str(value) if value is not None else answer(prompt)


def digits_in_place(expected: str, given: str | None) -> float:
    """The share of ``expected``'s digits that ``given`` has at the same place counted from the right
    (units with units), 0 for no answer; a longer answer loses the share of its extra digits."""
    if not given:
        return 0.0
    same = sum(a == b for a, b in zip(reversed(expected), reversed(given)))
    return same / max(len(expected), len(given))


class AdditionVerifier:
    """``score`` (exact match, or digit credit), ``correct`` (exact match) and ``answered`` (leading digits given)."""

    kinds = {"text"}

    def __init__(self, options: AdditionVerifierOptions, context=None) -> None:
        self.partial_credit = options.partial_credit
        self.answer_field = options.answer_field

    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        expected = [expected_answer(p, self.answer_field) for p in prompts]
        given = [extract_answer(text) for text in media.data]
        correct = torch.tensor([float(e == g) for e, g in zip(expected, given)])
        credit = torch.tensor([digits_in_place(e, g) for e, g in zip(expected, given)])
        return {
            "score": credit if self.partial_credit else correct,
            "correct": correct,
            "answered": torch.tensor([float(g is not None) for g in given]),
        }

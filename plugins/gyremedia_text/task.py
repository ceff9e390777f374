"""Multi-digit addition: a tiny verifiable text task for RL on token policies.

A prompt is a plain string such as ``"47+385="``; its answer is the decimal sum, ``"432"``. A
completion is right when its leading digits are exactly the answer, so the reward needs no model.

Each operand first draws its digit count uniformly from 1 to ``max_digits`` and then a value with
that many digits, so a batch mixes easy problems (``3+5=``) with hard ones (carries through three
digits) and a partly trained model gets some of them right: RL needs groups with both outcomes.

The split is a hash of the pair: one ordered pair ``(a, b)`` in ``HELDOUT_BUCKETS`` is held out,
decided by CRC-32 of its prompt text, so it is stable on every platform and Python version. Train and
held-out problems come from the same distribution but never share a pair, so held-out accuracy
measures addition learned, not pairs remembered (pretraining and RL draw only train pairs).
"""

from __future__ import annotations

import re
import zlib
from typing import Literal

import numpy as np

MAX_DIGITS = 3
HELDOUT_BUCKETS = 10
Split = Literal["train", "heldout"]

_PROMPT = re.compile(r"^(\d+)\+(\d+)=$")
_LEADING_DIGITS = re.compile(r"\d+")


def format_prompt(a: int, b: int) -> str:
    """The prompt text for ``a + b``."""
    return f"{a}+{b}="


def parse_prompt(prompt: str) -> tuple[int, int]:
    """The operands of a prompt ``"A+B="``; ``ValueError`` for anything else."""
    match = _PROMPT.match(prompt)
    if match is None:
        raise ValueError(f"not an addition prompt: {prompt!r} (expected decimal operands as 'A+B=', e.g. '47+385=')")
    return int(match.group(1)), int(match.group(2))


def answer(prompt: str) -> str:
    """The digits of the sum a prompt asks for."""
    a, b = parse_prompt(prompt)
    return str(a + b)


def extract_answer(completion: str) -> str | None:
    """The completion's leading digits (after any leading whitespace), or None if it starts otherwise.

    Generation stops at the first non-digit, so an end-of-sequence token, its text (``"<eos>"``),
    padding or further text all end the answer.
    """
    match = _LEADING_DIGITS.match(completion.lstrip())
    return match.group(0) if match else None


def is_correct(prompt: str, completion: str) -> bool:
    """Exact match of the completion's answer with the sum."""
    return extract_answer(completion) == answer(prompt)


def is_heldout(a: int, b: int) -> bool:
    """Whether the pair ``(a, b)`` belongs to the held-out split."""
    return zlib.crc32(format_prompt(a, b).encode()) % HELDOUT_BUCKETS == 0


def make_problems(
    count: int, seed: int, split: Split = "train", max_digits: int = MAX_DIGITS, unique: bool = False
) -> list[str]:
    """``count`` prompts of one split, deterministic for a given seed.

    ``unique=True`` skips repeated prompts (the prompt files); without it the problems are i.i.d.
    draws (the pretraining stream). Raises ``ValueError`` when the split has too few distinct pairs.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if max_digits < 1:
        raise ValueError(f"max_digits must be at least 1, got {max_digits}")
    rng = np.random.default_rng(seed)
    want_heldout = split == "heldout"
    prompts: list[str] = []
    seen: set[str] = set()
    draws, max_draws = 0, 100 * count + 100_000
    while len(prompts) < count:
        if draws > max_draws:
            raise ValueError(f"could not find {count} distinct {split} problems with up to {max_digits} digits")
        # Vectorised draws in chunks: digit counts 1..max_digits, then a value with that many digits.
        digits = rng.integers(1, max_digits + 1, size=(1024, 2))
        low = np.where(digits == 1, 0, 10 ** (digits - 1))
        values = rng.integers(low, 10**digits)
        draws += len(values)
        for a, b in values.tolist():
            prompt = format_prompt(a, b)
            if is_heldout(a, b) != want_heldout or (unique and prompt in seen):
                continue
            seen.add(prompt)
            prompts.append(prompt)
            if len(prompts) == count:
                break
    return prompts

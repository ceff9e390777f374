"""Retries with exponential backoff, shared by the rewards that call a server (``vlm_judge``, ``remote``)."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


class Retry(Exception):
    """An attempt that failed in a way another attempt may not (a dropped connection, a busy server); the
    message says how."""


def with_backoff(attempt: Callable[[], T], retries: int, backoff: float) -> T:
    """``attempt()``, tried up to ``retries + 1`` times while it raises :class:`Retry`, waiting ``backoff`` seconds
    before the first retry and twice as long before each next one; the last :class:`Retry` once they run out."""
    delay = backoff
    for number in range(retries + 1):
        if number:
            time.sleep(delay)
            delay *= 2
        try:
            return attempt()
        except Retry as exc:
            last = exc
    raise last

"""Background work in short-lived threads: one thread per call, ending with it (rewards, prompt prefetch)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, wait
from typing import Any, Callable

_running: set[threading.Thread] = set()  # threads of in_own_thread that have not ended


def in_own_thread(
    function: Callable[..., Any], *args: Any, after: Future | None = None, name: str = "gyremedia-worker"
) -> Future:
    """``function(*args)`` in a new daemon thread that ends with the call (once ``after`` is done); its future.

    Not a persistent pool: a worker thread that once ran a parallel torch op keeps an OpenMP thread team for
    as long as it lives, and with GNU OpenMP (torch's CPU wheels) the surplus of threads over cores makes every
    team stop spinning between parallel regions, the trainer's own included. One idle thread of that kind made
    the quickstart's CPU steps 1.4x slower (docs/benchmarks.md). A thread that ends frees its team.

    The new thread waits until ``start`` has returned to the caller: ``Thread.start`` waits until the thread
    runs, and a thread that went straight into Python would keep the interpreter lock for up to the switch
    interval (5 ms) before the caller got it back.
    """
    future: Future = Future()
    started = threading.Event()

    def run() -> None:
        started.wait()
        try:
            if after is not None:
                wait([after])
            try:
                future.set_result(function(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)
        finally:
            _running.discard(threading.current_thread())

    thread = threading.Thread(target=run, name=name, daemon=True)
    _running.add(thread)
    thread.start()
    started.set()
    return future


def wait_for_background(timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for every thread of :func:`in_own_thread` to end; whether they all did (a
    reward call that hung past its ``timeout`` may never end)."""
    deadline = time.monotonic() + timeout
    for thread in list(_running):
        thread.join(max(deadline - time.monotonic(), 0.0))
    return not any(thread.is_alive() for thread in _running)

import sys
import threading
import time

import pytest

from gyremedia.runtime.threads import in_own_thread


def busy_python(seconds: float) -> str:
    """Pure-Python work that holds the interpreter lock (an encoder's module calls, a reward's loops)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    return "done"


def test_starting_a_thread_does_not_wait_for_the_switch_interval():
    """``Thread.start`` waits until the new thread runs; one that went straight into Python would keep the lock
    for the switch interval (5 ms) on every reward call and prompt prefetch of a step."""
    starts = []
    for _ in range(5):
        begin = time.perf_counter()
        future = in_own_thread(busy_python, 0.03)
        starts.append(time.perf_counter() - begin)
        assert future.result() == "done"
    assert sorted(starts)[2] < sys.getswitchinterval() / 2


def test_the_thread_waits_for_the_call_before_it_and_ends_with_its_own():
    order = []
    first = in_own_thread(lambda: order.append(busy_python(0.05)))
    second = in_own_thread(lambda: order.append("second"), after=first, name="gyremedia-test")
    second.result(timeout=5)
    assert order == ["done", "second"]
    for thread in [t for t in threading.enumerate() if t.name == "gyremedia-test"]:
        thread.join(timeout=5)
    assert not [t for t in threading.enumerate() if t.name == "gyremedia-test"]


def test_an_exception_reaches_the_future():
    def failing():
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        in_own_thread(failing).result(timeout=5)

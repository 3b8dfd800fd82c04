"""tests/waiting.py's ``wait_until``: what the suite's waits are built on."""
from __future__ import annotations

import threading
import time

import pytest

from waiting import POLL, wait_until


def test_returns_the_first_truthy_value_as_soon_as_it_holds():
    looks = iter([None, 0, "", "there", "later"])
    assert wait_until(lambda: next(looks), 5, "a value") == "there"
    started = time.monotonic()
    assert wait_until(lambda: 7, 5, "at once") == 7
    assert time.monotonic() - started < POLL  # no sleep before the first look


def test_sees_what_another_thread_does():
    done = threading.Event()
    threading.Timer(0.1, done.set).start()
    assert wait_until(done.is_set, 10, "the timer") is True


def test_fails_after_the_timeout_saying_what_it_waited_for():
    log = ["started"]
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"not within 0.2 s: no 'ready' in \['started', 'still not'\]"):
        wait_until(lambda: "ready" in log, 0.2, lambda: (log.append("still not"), f"no 'ready' in {log}")[1])
    assert 0.2 <= time.monotonic() - started < 5
    with pytest.raises(AssertionError, match="not within 0 s: the thing"):
        wait_until(lambda: False, 0, "the thing")


def test_what_the_predicate_raises_ends_the_wait():
    def dead():
        raise RuntimeError("the process exited")
    with pytest.raises(RuntimeError, match="exited"):
        wait_until(dead, 30, "never")

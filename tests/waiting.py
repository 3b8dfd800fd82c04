"""One way for a test to wait for something to happen: ``wait_until``.

A test waits on an event (a record written, a log line, an answer of the control API), never
on time: a sleep long enough on an idle machine is too short on a loaded one, and too long
everywhere else. Where the event can only be seen by looking (a file, a log, a count), the
test looks every ``POLL`` seconds until it holds, and fails saying what it waited for.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL = 0.02  # seconds between looks: short next to any timeout, long next to one look


def wait_until(predicate: Callable[[], T], timeout: float, what: str | Callable[[], str]) -> T:
    """``predicate()``'s first truthy value, looked for every ``POLL`` seconds (first at once);
    after ``timeout`` seconds an ``AssertionError`` saying ``what`` was not seen (a callable
    ``what`` is asked then, so it can show the log or file as it was at the end). Whatever
    the predicate raises goes through: it can fail the wait early (a process that died)."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout} s: {what() if callable(what) else what}")
        time.sleep(POLL)

"""Where one session's hooks run: its own threads, a time limit, and a fence around what they raise.

A hook is the evaluator's code, so nothing it does may reach the proxy or another session:

- **What it raises stays its own.** A plain hook runs in one of the session's threads, an
  ``async def`` in a task of its own; either way anything it raises, ``BaseException``
  included (``SystemExit``, ``KeyboardInterrupt``, ``GeneratorExit``, its own
  ``CancelledError``), is caught where it runs and handed back as ``Raised``. Let through, a
  ``SystemExit`` or ``KeyboardInterrupt`` ends asyncio's loop (a task re-raises them), so
  every session's streams with it. Cancelling the task that waits (the proxy shutting down, a
  flow killed) is still a cancellation: it cancels the hook's task and propagates.
- **It returns in time or not at all.** After ``timeout`` seconds (counted from the call, a
  wait for the session's own busy threads included) the caller gets ``Late`` and the exchange
  goes on. An async hook is cancelled; a thread cannot be killed, so a plain hook goes on
  running, its result thrown away: it keeps its thread, counted as stuck, and when all of a
  session's threads are stuck its next plain hook is ``Stuck`` at once rather than queued.
- **One session cannot starve another.** Each session has up to ``WORKERS`` threads of its
  own (started on demand, ended after ``IDLE`` seconds unused or when the session is
  released), never asyncio's small shared executor, where blocked hooks of a few sessions
  hold every other session's hooks back. The threads are daemons: a stuck hook never keeps
  the proxy from exiting.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

WORKERS = 4  # a session's threads for plain hooks: its concurrent exchanges, not the proxy's
IDLE = 30.0  # seconds an unused thread waits for work before it ends
TIMEOUT = 300.0  # the default limit: under the SDKs' 600 s read timeouts, so the harness gets a hook_error


class Raised(Exception):
    """The hook raised ``raised`` (any ``BaseException``)."""

    def __init__(self, raised: BaseException) -> None:
        try:
            text = str(raised)
        except BaseException:  # noqa: BLE001 - its own __str__ is the hook's code too
            text = "(its str() raised)"
        super().__init__(f"raised {type(raised).__name__}: {text}")
        self.raised = raised


class Late(Exception):
    """The hook did not return within the limit."""


class Stuck(Exception):
    """Every thread of the session is still in a hook that passed its limit."""


class _Job:
    __slots__ = ("fn", "kwargs", "loop", "future", "started", "dropped")

    def __init__(self, fn: Callable[..., Any], kwargs: dict[str, Any], loop: asyncio.AbstractEventLoop) -> None:
        self.fn, self.kwargs, self.loop = fn, kwargs, loop
        self.future: asyncio.Future[tuple[bool, Any]] = loop.create_future()
        self.started = self.dropped = False

    def run(self) -> None:
        try:
            outcome = (True, self.fn(**self.kwargs))
        except BaseException as e:  # noqa: BLE001 - the module docstring: whatever it is, it is the hook's
            outcome = (False, e)
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, outcome)
        except RuntimeError:  # the loop is closed: nobody waits for it any more
            pass


def _settle(future: asyncio.Future, outcome: tuple[bool, Any]) -> None:
    if not future.done():
        future.set_result(outcome)


async def _fenced(fn: Callable[..., Coroutine[Any, Any, Any]], kwargs: dict[str, Any]) -> tuple[bool, Any]:
    try:
        return True, await fn(**kwargs)
    except BaseException as e:  # noqa: BLE001 - handed back, never re-raised into the loop
        return False, e


_NO_JOBS: deque = deque(maxlen=0)  # shared until a plain hook runs: most sessions never run one


class HookPool:
    """One session's way to run its hooks; see the module docstring. Every session has one,
    sealed ones kept in memory too: its lock and queue are made by the first plain hook."""

    __slots__ = ("timeout", "stuck", "_cond", "_jobs", "_threads", "_busy", "_closed", "_tasks")

    def __init__(self, timeout: float = TIMEOUT) -> None:
        self.timeout = timeout
        self.stuck = 0  # threads still in a hook past its limit (touched on the loop only)
        self._cond: threading.Condition | None = None
        self._jobs: deque[_Job] = _NO_JOBS
        self._threads = 0
        self._busy = 0  # jobs queued or running
        self._closed = False
        self._tasks: set[asyncio.Task] | None = None  # async hooks cancelled late, not ended yet

    async def run_sync(self, fn: Callable[..., Any], /, **kwargs: Any) -> Any:
        """``fn(**kwargs)`` in one of the session's threads; its result, or Raised, Late, Stuck."""
        if self.stuck >= WORKERS:
            raise Stuck(f"all {WORKERS} of the session's hook threads are still in hooks that passed "
                        f"the {self.timeout:g} s limit")
        job = _Job(fn, kwargs, asyncio.get_running_loop())
        self._submit(job)
        try:
            done, _ = await asyncio.wait((job.future,), timeout=self.timeout)
        except asyncio.CancelledError:
            self._give_up(job)
            raise
        if not done:
            self._give_up(job)
            raise Late(f"did not return within {self.timeout:g} s (its thread runs on, the exchange does not wait for it)")
        return _result(job.future.result())

    async def run_async(self, fn: Callable[..., Coroutine[Any, Any, Any]], /, **kwargs: Any) -> Any:
        """Await ``fn(**kwargs)`` in a task of its own; its result, or Raised, Late."""
        task = asyncio.ensure_future(_fenced(fn, kwargs))
        try:
            done, _ = await asyncio.wait((task,), timeout=self.timeout)
        except asyncio.CancelledError:
            task.cancel()  # the caller's cancellation is the hook's too
            raise
        if not done:
            task.cancel()
            if not task.done():  # one that ignores it runs on, unwaited: kept from the collector
                if self._tasks is None:
                    self._tasks = set()
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            raise Late(f"did not return within {self.timeout:g} s (cancelled)")
        return _result(task.result())

    def close(self) -> None:
        """The session is released: idle threads end now, busy ones when their hook returns.
        A later call (an exchange still in flight) starts threads again."""
        if self._cond is None:
            return
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _submit(self, job: _Job) -> None:
        if self._cond is None:  # made on the loop, before any thread of this pool exists
            self._cond, self._jobs = threading.Condition(), deque()
        with self._cond:
            self._closed = False
            self._jobs.append(job)
            self._busy += 1
            if self._busy > self._threads and self._threads < WORKERS:
                self._threads += 1
                threading.Thread(target=self._work, name="interceptor-hook", daemon=True).start()
            self._cond.notify()

    def _give_up(self, job: _Job) -> None:
        """The caller no longer waits: a queued job is dropped, a running one counted stuck
        until it returns."""
        with self._cond:
            if not job.started:
                job.dropped = True
                return
        self.stuck += 1
        job.future.add_done_callback(self._unstuck)

    def _unstuck(self, _: asyncio.Future) -> None:
        self.stuck -= 1

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    if self._closed or (not self._cond.wait(IDLE) and not self._jobs):
                        self._threads -= 1
                        return
                job = self._jobs.popleft()
                job.started = not job.dropped
            if job.started:
                job.run()
            with self._cond:
                self._busy -= 1


def _result(outcome: tuple[bool, Any]) -> Any:
    ok, value = outcome
    if ok:
        return value
    raise Raised(value)

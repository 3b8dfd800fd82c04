"""MallocTrim: after sessions are sealed, the memory their turns used goes back to the system.

Two things keep a proxy's resident set at the peak of the turns once in flight, long after
their sessions are sealed (bench/scale.py: 20-turn sessions left ~1 MiB each behind):

- Garbage in reference cycles. mitmproxy's per-connection objects (layers, contexts, flows,
  generators, h11 readers, an exception and its traceback's frames) point at each other, so
  a finished connection is freed by the cycle collector, not by reference counting; it has
  lived for seconds, so it sits in the oldest generation until Python's next full pass
  (bench/scale.py with 64 sessions: ~95,000 such objects, ~55 MiB, after a batch was sealed).
- Freed heap that glibc's malloc keeps for reuse. ``malloc_trim(0)`` returns every whole
  free page.

So after a seal: when the proxy has no client connection open (between waves of rollouts:
nobody waits for the loop), a full collection first, on the event loop's own thread (the
finalizers of dead transports and streams it runs touch the loop, which is not thread-safe),
then the trim; with connections open,
the trim alone (a full collection holds the GIL for as long as it walks, 0.3-1 s here after a
big batch, and would stall every stream; Python's own full passes collect that garbage later).

Off the hot path: a seal only arms a timer (``intercept_malloc_trim`` seconds, coalescing a
burst of seals into one trim, and at most one trim per that interval); the trim itself runs
in a thread of its own. ctypes releases the GIL for the call, so Python keeps running, but
glibc holds each arena's lock while it trims that arena, so an allocation the event loop
makes from the main arena meanwhile waits for it: measured here, 33 ms to give back 540 MiB
(after a batch of hundreds of sessions), ~1 ms with nothing to give back. Hence a trim per
interval at most, not per seal. Not glibc (musl, macOS): nothing to call, nothing done.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import ctypes.util
import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from mitmproxy import ctx, exceptions

log = logging.getLogger(__name__)

DEFAULT_INTERVAL = 10  # seconds: the wait after a seal, and the least time between two trims


def glibc(name: str, argtypes: list[Any]) -> Callable[..., int] | None:
    """glibc's function ``name`` (returning an int), or None where there is none (musl,
    macOS). ``mallocheap.py`` calls ``mallopt`` through it too."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where there is none."""
    return glibc("malloc_trim", [ctypes.c_size_t])


class MallocTrim:
    def __init__(self, registry) -> None:
        self._trim = _malloc_trim()
        self._lock = threading.Lock()
        self._armed = False
        self._last = 0.0  # monotonic end of the last trim
        self.interval: float = DEFAULT_INTERVAL
        self.trims = 0
        self._proxyserver = None  # mitmproxy's, once running: its open client connections
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop, once running
        registry.on_release = self.soon

    def load(self, loader) -> None:
        loader.add_option(
            "intercept_malloc_trim", int, DEFAULT_INTERVAL,
            "Seconds after a session is sealed before glibc's malloc_trim returns the freed heap to the "
            "system (at most one trim per interval, in a thread of its own); 0: never.")

    def configure(self, updated) -> None:
        if "intercept_malloc_trim" in updated:
            value = ctx.options.intercept_malloc_trim
            if value < 0:
                raise exceptions.OptionsError(f"intercept_malloc_trim must be 0 (off) or more seconds, got {value}")
            self.interval = value

    def soon(self) -> None:
        """A session was released: one trim ``interval`` from now (or from the last one), unless one
        is already armed. Cheap, from the event loop."""
        if self._trim is None or self.interval <= 0:
            return
        with self._lock:
            if self._armed:
                return
            self._armed = True
            wait = max(self.interval, self._last + self.interval - time.monotonic())
        timer = threading.Timer(wait, self._run)
        timer.name, timer.daemon = "interceptor-malloc-trim", True
        timer.start()

    def idle(self) -> bool:
        """No client connection open: a full collection now stalls nobody."""
        server = self._proxyserver
        return server is not None and not server.connections

    def running(self) -> None:
        self._proxyserver = ctx.master.addons.get("proxyserver")
        self._loop = asyncio.get_running_loop()

    def _collect_on_loop(self) -> int | None:
        """A full collection on the event loop's thread, if it is still idle when it gets
        there (the objects found, or None). From the trim's thread: waits for it."""
        loop, done = self._loop, concurrent.futures.Future()
        if loop is None:
            return None

        def collect() -> None:
            try:
                done.set_result(gc.collect() if self.idle() else None)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                done.set_exception(e)

        try:
            loop.call_soon_threadsafe(collect)
            return done.result(timeout=60)
        except (RuntimeError, TimeoutError):  # the loop closed, or is too busy: trim alone
            return None

    def _run(self) -> None:
        with self._lock:
            self._armed = False  # a seal from here on arms the next trim
        t0 = time.monotonic()
        collected = self._collect_on_loop() if self.idle() else None
        self._trim(0)
        self._last = time.monotonic()
        self.trims += 1
        log.debug(f"interceptor: malloc_trim{f' after a full collection ({collected} objects)' if collected is not None else ''} "
                  f"took {(self._last - t0) * 1000:.1f} ms")

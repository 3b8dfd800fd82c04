"""RuntimeTuning: the process's garbage collector and glibc's allocator set for a long-running
proxy, behind one deployment switch, ``intercept_runtime_tuning``.

Nothing in a request's way reads or needs what this sets: with the switch off, every turn,
stream, retry and record is the same (tests/test_tuning.py runs a real mitmdump so). What it
changes is the proxy's tail latency and resident set over a long run; its hooks only look (an
ended flow's body sizes, a connection opened or closed, a session released). The why of each
setting: every session shares one event loop, so a full collection stalls every stream.

- **Start-up frozen** (``gc.freeze``), once: most of what a full pass walks (modules, schemas,
  the CA) never dies. Only at start-up, since a later freeze would pin flows in flight that
  die in reference cycles.
- **Young passes every** ``THRESHOLD0`` **allocations**, not Python's 700: a request's
  short-lived objects would be promoted towards the generation whose growth triggers full passes.
- **Dead flows collected by bytes and by count** (``COLLECT_MIB``, ``FLOWS``, ``GRACE`` after
  the end): mitmproxy's per-flow objects form cycles, so a dead flow's history-sized bodies
  wait for the collector, whose count (allocations minus frees of any generation) a burst of
  seals can hold under its threshold while the cycles pile up for one long pass.
- **glibc's heap kept** below ``HEAP_MIB`` (fixed mmap and trim thresholds, ``mallopt``): else
  each turn's history-sized block, a little bigger than the last, is mapped anew and its pages
  faulted in.
- **Freed heap back after seals** (``intercept_malloc_trim``, at most once per interval: glibc
  holds an arena's lock while trimming): ``malloc_trim(0)`` in a thread of its own, preceded
  by a full collection on the loop's thread when no client connection is open (nobody waits).

Turned off while running, it undoes what can be undone (thresholds and freeze restored, no
more collections or trims, glibc's thresholds set back; glibc's own adjusting stays off:
restart for its exact defaults); turned on again, all but the freeze. Without glibc (musl,
macOS) the allocator's part does nothing. ``bench/gcpause.py`` measures the collector's part.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import ctypes.util
import gc
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mitmproxy import connection, ctx, exceptions, http

log = logging.getLogger(__name__)

#: Allocations (net of frees) between young collections; Python's default is 700.
THRESHOLD0 = 10_000
#: MiB of ended flows' bodies (requests and answers as mitmproxy holds them) between the young
#: collections this asks for.
COLLECT_MIB = 2
#: Ended flows between them, whatever their size: a dead flow leaves a few hundred objects in cycles,
#: so this is about ``THRESHOLD0``'s worth.
FLOWS = 50
#: Seconds from the hook that saw a flow end to its collection: mitmproxy still holds the flow
#: while it writes the answer.
GRACE = 0.02
#: glibc's mmap and trim thresholds while tuned: the mmap threshold's upper limit on 64-bit
#: (DEFAULT_MMAP_THRESHOLD_MAX, https://man7.org/linux/man-pages/man3/mallopt.3.html). A
#: bigger block is still mapped.
HEAP_MIB = 32
#: Their values at a process's start (malloc.h's DEFAULT_MMAP_THRESHOLD_MIN, DEFAULT_TRIM_THRESHOLD).
GLIBC_START = 128 * 1024
#: mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
DEFAULT_TRIM = 10  # seconds: intercept_malloc_trim


def glibc(name: str, argtypes: list[Any]) -> Callable[..., int] | None:
    """glibc's function ``name`` (returning an int), or None where there is none (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


def mallopt() -> Callable[[int, int], int] | None:
    return glibc("mallopt", [ctypes.c_int, ctypes.c_int])


def malloc_trim() -> Callable[[int], int] | None:
    return glibc("malloc_trim", [ctypes.c_size_t])


def heap_thresholds(size: int) -> bool:
    """glibc's mmap and trim thresholds both at ``size`` bytes; True if glibc took both (the mmap
    threshold alone is not enough: the heap's freed top is then trimmed and faulted in again)."""
    fn = mallopt()
    return fn is not None and bool(fn(M_MMAP_THRESHOLD, size)) and bool(fn(M_TRIM_THRESHOLD, size))


@dataclass
class _Process:
    """What this process has set: the collector and the allocator are the process's, and a
    reloaded script makes new addons in the same process."""
    frozen: bool = False  # start-up was frozen (once, ever)
    holding: bool = False  # and is still frozen
    threshold: tuple[int, int, int] | None = None  # Python's thresholds before, while tuned
    heap: bool = False  # glibc's thresholds set


_process = _Process()


def tune() -> str:
    """Set everything (start-up frozen only the first time); what was set, for the log."""
    said = []
    if not _process.frozen:
        _process.frozen = _process.holding = True
        gc.collect()
        gc.freeze()
        said.append(f"{gc.get_freeze_count()} objects alive after start-up frozen")
    if _process.threshold is None:
        _process.threshold = gc.get_threshold()
        t0, t1, t2 = _process.threshold
        gc.set_threshold(max(t0, THRESHOLD0), t1, t2)
    said.append(f"young generation collected every {gc.get_threshold()[0]} allocations")
    if heap_thresholds(HEAP_MIB << 20):
        _process.heap = True
        said.append(f"glibc's blocks below {HEAP_MIB} MiB from its heap, freed ones kept")
    else:
        said.append("glibc's heap thresholds not set (no glibc mallopt here, or it refused)")
    return "; ".join(said)


def untune() -> str:
    """Undo what ``tune`` set, as far as it can be; what was undone, for the log."""
    said = []
    if _process.holding:
        _process.holding = False
        gc.unfreeze()
        said.append("start-up unfrozen")
    if _process.threshold is not None:
        gc.set_threshold(*_process.threshold)
        _process.threshold = None
        said.append("Python's collector thresholds restored")
    if _process.heap:
        _process.heap = False
        heap_thresholds(GLIBC_START)
        said.append("glibc's heap thresholds at their start values")
    return "; ".join(said) or "nothing was set"


class RuntimeTuning:
    def __init__(self, registry) -> None:
        self.started = False  # ``running`` was called: a change of the switch applies at once
        self.active = False  # the switch is on and the proxy has started
        self.trim_interval: float = DEFAULT_TRIM
        # dead flows' collections
        self._ended = 0  # body bytes of the flows ended since the last collection asked for
        self._flows = 0  # flows ended since then
        self.pending: asyncio.TimerHandle | None = None  # a collection asked for
        self.collections = 0
        self.collected = asyncio.Event()  # set after each of them (for whoever waits: tests)
        # trims after seals
        self._trim = malloc_trim()
        self._lock = threading.Lock()
        self.timer: threading.Timer | None = None  # the trim armed, if any
        self.trims = 0
        self.trimmed = threading.Event()  # set after each trim
        self.connections = 0  # client connections open (client_connected minus client_disconnected)
        self._loop: asyncio.AbstractEventLoop | None = None
        registry.on_release = self.soon

    def load(self, loader) -> None:
        loader.add_option(
            "intercept_runtime_tuning", bool, True,
            "Tune this process's garbage collector and glibc's allocator for a long-running proxy (start-up "
            "frozen, fewer young collections, dead flows collected by their bodies' bytes, glibc's heap kept "
            "for reuse and trimmed after seals); false: Python's and glibc's defaults. No request depends on it.")
        loader.add_option(
            "intercept_malloc_trim", int, DEFAULT_TRIM,
            "With intercept_runtime_tuning: seconds after a session is sealed before the freed heap goes back "
            "to the system (at most one trim per interval, in a thread of its own); 0: never.")

    def configure(self, updated) -> None:
        if "intercept_malloc_trim" in updated:
            value = ctx.options.intercept_malloc_trim
            if value < 0:
                raise exceptions.OptionsError(f"intercept_malloc_trim must be 0 (never) or more seconds, got {value}")
            self.trim_interval = value
        if "intercept_runtime_tuning" in updated and self.started:  # changed while running
            self._switch(ctx.options.intercept_runtime_tuning)

    def running(self) -> None:
        self.started = True
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside an event loop (in process): no collection before a trim
            self._loop = None
        if ctx.options.intercept_runtime_tuning:
            self._switch(True)
        else:
            untune()  # a reloaded script with the switch now off
            log.info("interceptor: runtime tuning off (intercept_runtime_tuning): "
                     "Python's collector and glibc's allocator at their defaults")

    def _switch(self, on: bool) -> None:
        self.active = on
        if on:
            log.info(f"interceptor: runtime tuning: {tune()}")
        else:
            self._cancel()
            log.info(f"interceptor: runtime tuning off: {untune()}")

    def done(self) -> None:
        """Removed (a reloaded script, shutdown): nothing armed outlives the addon."""
        self._cancel()

    def _cancel(self) -> None:
        if self.pending is not None:
            self.pending.cancel()
            self.pending = None
        self._ended = self._flows = 0
        with self._lock:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None

    # -- dead flows, collected by their bodies' bytes and their count

    def response(self, flow: http.HTTPFlow) -> None:
        self._end(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._end(flow)

    def _end(self, flow: http.HTTPFlow) -> None:
        if not self.active:
            return
        self._flows += 1
        self._ended += len(flow.request.raw_content or b"")
        if flow.response is not None:
            self._ended += len(flow.response.raw_content or b"")
        if self.pending is not None or (self._ended < COLLECT_MIB << 20 and self._flows < FLOWS):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a hook called outside an event loop (in process): now, then
            self._collect()
            return
        self.pending = loop.call_later(GRACE, self._collect)

    def _collect(self) -> None:
        """The young generation, and the middle one when it is due (Python's own next pass
        would take it: it counts young collections, manual ones too)."""
        flows, ended = self._flows, self._ended
        self.pending = None
        self._ended = self._flows = 0
        generation = 1 if gc.get_count()[1] >= gc.get_threshold()[1] else 0
        found = gc.collect(generation)
        self.collections += 1
        self.collected.set()
        log.debug(f"interceptor: gc: generation {generation} collected after {flows} ended flows "
                  f"({ended >> 10} KiB of bodies): {found} objects")

    # -- the freed heap back to the system after seals

    def client_connected(self, client: connection.Client) -> None:
        self.connections += 1

    def client_disconnected(self, client: connection.Client) -> None:
        self.connections = max(0, self.connections - 1)  # a reloaded script counts from zero

    def soon(self) -> None:
        """A session was released: one trim ``trim_interval`` from now, unless one is armed
        already (a burst of seals is one trim). Cheap, from the event loop."""
        if not self.active or self._trim is None or self.trim_interval <= 0:
            return
        with self._lock:
            if self.timer is not None:
                return
            self.timer = threading.Timer(self.trim_interval, self._run)
            self.timer.name, self.timer.daemon = "interceptor-malloc-trim", True
            self.timer.start()

    def _collect_on_loop(self) -> int | None:
        """A full collection on the event loop's thread, if no connection has opened by the
        time it gets there (the objects found, or None). From the trim's thread: waits for it."""
        loop, done = self._loop, concurrent.futures.Future()
        if loop is None:
            return None

        def collect() -> None:
            try:
                done.set_result(gc.collect() if not self.connections else None)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                done.set_exception(e)

        try:
            loop.call_soon_threadsafe(collect)
            return done.result(timeout=60)
        except (RuntimeError, TimeoutError):  # the loop closed, or is too busy: the trim alone
            return None

    def _run(self) -> None:
        with self._lock:
            self.timer = None  # a seal from here on arms the next trim
        if not self.active:
            return
        collected = self._collect_on_loop() if not self.connections else None
        self._trim(0)
        self.trims += 1
        self.trimmed.set()
        log.debug("interceptor: malloc_trim: freed heap returned to the system"
                  + (f" after a full collection ({collected} objects)" if collected is not None else ""))

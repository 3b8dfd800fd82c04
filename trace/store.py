"""Append trace records to msgpack files, never leaving a hole and never waiting for a disk.

The event loop must never wait for a disk: a slow fsync would stall every stream of every
session. A record is packed on its producer's thread (one that cannot be packed fails the
commit that made it, not the file) and, while its file is healthy and open, written there
(``write_on_loop``): a page-cache write costs less than handing each record to a thread
(``bench/fsync.py``, docs/benchmarks.md). One writer thread, shared by all sessions, does
all that can wait: open, fsync, close, truncate after a failure, retry held records. Who
writes a file is its ``inline`` flag, changed only under ``Store._own`` (never held across
I/O): the producer turns it off for a record it must queue (a file's first, its footer) or a
write that fails or is slower than ``SLOW_WRITE_SECONDS``; the thread before anything beyond
an fsync, and on again only once nothing of the file is queued. A killed proxy loses at most
what was queued.

A file is created exclusively (``O_EXCL``, on the caller's thread, so a session whose file
exists is refused) and is never corrupt in the middle: a failed or short write is truncated
back to the last complete record, and the records since are held and retried every
``RETRY_INTERVAL`` seconds; past ``MAX_HELD_BYTES`` or ``MAX_HELD_SECONDS`` the file is
*degraded* and ends at its last good record (a later record behind a gap could not be joined
to the graph). Each record is one msgpack map whose last entry is a checksum chained to the
record before it (``trace/records.py``): a reader stops cleanly at a torn tail, and
``verify`` finds a byte changed later.

Fsyncs are grouped: at most one per file every ``fsync_interval`` seconds (as Redis's
``appendfsync everysec``). Nothing waits on them: only a crash of the machine loses the
window, and the rollout's sandbox dies with it. ``close`` and ``flush``/``drained`` fsync at
once; a failed fsync is a failed write (back to the last fsynced offset, all since held).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import math
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from interceptor.trace.escape import ESCAPE_UTF8, escape
from interceptor.trace.records import (
    BIG_INT_EXT,
    CHECKSUM_KEY,
    DIGEST_BYTES,
    MAX_RECORD_BYTES,
    PLACEHOLDER,
    seal_record,
)

log = logging.getLogger(__name__)

FSYNC_POLICIES = ("never", "turn", "seal")
TRACE_WRITES = ("loop", "thread")  # who writes a record into the page cache (``write_on_loop``)
# Open files kept by the writer; beyond this the least recently written one is closed (and
# reopened for append when its session writes again), so thousands of idle sessions never
# exhaust file descriptors.
MAX_OPEN_FILES = 256
# While a file cannot be written: how often the writer tries again, and how much it holds
# before it gives up on the file (see the module docstring).
RETRY_INTERVAL = 1.0
MAX_HELD_BYTES = 64 << 20
MAX_HELD_SECONDS = 600.0
# The longest a record that asked for an fsync waits for it (the module docstring).
FSYNC_INTERVAL = 1.0
# One file's write and fsync taking longer than this: the writer is stalled (``Store.stalled``).
STALL_SECONDS = 10.0
# A write done by the producer (``write_on_loop``) that takes longer than this: the disk makes
# writers wait (dirty-page throttling, a network filesystem), so from then on the thread writes
# every record; the event loop waits for this once at most.
SLOW_WRITE_SECONDS = 0.05
# In the warning that says so (health's ``trace_writes`` says "thread" from then on).
FELL_BACK = "the writer thread writes every record from now on"
# Test hook, never set in production: write each record in two halves this many seconds
# apart, so a test can SIGKILL the proxy in the middle of a record and check the reader.
TORN_WRITE_PAUSE = float(os.environ.get("INTERCEPT_TEST_TORN_WRITES") or 0)
# Test hook, set by the test suite for every store and proxy it runs: a value msgpack cannot
# pack is an error there (the record is not written, and the test sees it), instead of being
# written as its string, which a reader would take for data.
STRICT_PACK = bool(os.environ.get("INTERCEPT_TEST_STRICT_PACK"))
UNPACKABLE = "msgpack cannot pack"  # in the error, so a test can look for it


class TraceExistsError(FileExistsError):
    """A new trace's file exists already: a trace is never overwritten, moved or appended to
    by another one, so the new trace (its session) is refused."""


def _default(value: Any) -> Any:
    """A value msgpack cannot pack (a model a hook left in a rewrite, a set, a Path) is
    written in its JSON-ish form rather than losing the whole record (``STRICT_PACK``: an
    error instead). A big int is data, not a mistake: always its extension type."""
    if isinstance(value, int) and not isinstance(value, bool):
        return msgpack.ExtType(BIG_INT_EXT, str(value).encode())
    if STRICT_PACK:
        raise TypeError(f"a trace record holds a {type(value).__name__}, which {UNPACKABLE}")
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json", exclude_defaults=True)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


_ESCAPE_LEAD = ESCAPE_UTF8[:1]


def pack(record: dict[str, Any], prev: int = 0) -> bytes:
    """One record's bytes, its checksum chained to ``prev`` (the checksum of the record before
    it in its file, 0 for a header; ``trace/records.py``) as its last entry. ``use_bin_type``
    keeps str and bytes apart for other readers. Text UTF-8 cannot carry (a lone surrogate) is
    escaped reversibly (``trace/escape.py``); the rare record that needs it is packed twice,
    every other one once. A record over ``MAX_RECORD_BYTES`` is refused (``ValueError``): the
    readers take any record up to that size, so nothing the writer writes is unreadable."""
    record = {**record, CHECKSUM_KEY: PLACEHOLDER}
    try:
        data = msgpack.packb(record, use_bin_type=True, default=_default)
    except UnicodeEncodeError:
        data = b""
    # The marker's first byte alone first: a one-byte search is memchr, many times faster
    # than the four-byte one, and the byte (a UTF-8 lead for U+100000 and up) is rare
    # outside the marker itself.
    if not data or (_ESCAPE_LEAD in data and ESCAPE_UTF8 in data):
        data = msgpack.packb(escape(record), use_bin_type=True, default=lambda v: escape(_default(v)))
    if len(data) > MAX_RECORD_BYTES:
        raise ValueError(f"a trace record of {len(data)} bytes is over the {MAX_RECORD_BYTES} bytes "
                         f"a record may take (MAX_RECORD_BYTES)")
    return seal_record(data, prev)


def checksum(data: bytes) -> int:
    """The checksum a packed record carries: the next record's ``prev``."""
    return int.from_bytes(data[-DIGEST_BYTES:], "big")


def create(path: Path) -> bool:
    """Create a new trace's file, empty, or refuse with ``TraceExistsError`` if there is one:
    ``O_EXCL``, so no trace (another session's, an earlier run's, one another proxy on the
    same folder writes) is ever truncated, moved or appended to. False: the file could not be
    made now (its folder cannot be, the disk refuses); the writer thread makes it, exclusively
    too, when the disk lets it (its records held meanwhile, as for a failed write)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        if not path.parent.is_dir():
            return False  # a file where its folder should be: the writer's failure to report
        raise TraceExistsError(
            f"the trace file {path} exists already; a trace is never overwritten: choose another "
            f"session id, or another intercept_trace_dir") from None
    except OSError:
        return False
    os.close(fd)
    return True


@dataclass
class WriteHealth:
    """What the writer could do for one file; read by summaries and ``health``."""

    error: str | None = None  # the last failure, while records are held or after degrading
    held: int = 0  # records waiting for the disk, in order
    lost: int = 0  # records given up on: the file is degraded and ends before them
    late: int = 0  # records that were written after being held

    @property
    def degraded(self) -> bool:
        return self.lost > 0

    @property
    def ok(self) -> bool:
        return self.held == 0 and self.lost == 0

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "error": self.error, "held": self.held, "lost": self.lost,
                "late": self.late, "degraded": self.degraded}


@dataclass(eq=False)
class _File:
    """The state of one file: the writer thread's, and the producer's while ``inline``."""

    path: Path
    health: WriteHealth
    fd: int | None = None
    good: int | None = None  # end of the last complete record (None: the file's size)
    out: list[tuple[bytes, bool, bool]] = field(default_factory=list)  # (data, sync, close)
    out_bytes: int = 0
    failing_since: float | None = None
    # Group commit: the records written since the last fsync (kept while one is due, so a
    # failed fsync can write them again), that fsync's offset, and when the next one is due.
    unsynced: list[tuple[bytes, bool, bool]] = field(default_factory=list)
    synced: int | None = None
    due: float | None = None
    inline: bool = False  # the producer writes it (see the module docstring)
    make: bool = False  # ``create`` could not make the file: the writer does, exclusively
    torn: bool = False  # a producer's write failed part-way: cut back to ``good`` before the next


class _Barrier:
    """Set by the writer once everything queued before it was written (or tried once);
    ``then`` also runs then, on the writer's thread."""

    def __init__(self, then: Callable[[], None] | None = None) -> None:
        self.done = threading.Event()
        self.then = then

    def set(self) -> None:
        self.done.set()
        if self.then is not None:
            try:
                self.then()
            except RuntimeError:  # the waiter's event loop is closed: nobody waits any more
                pass


_WAKE = object()  # queued to make the writer look at its fsyncs again (no record)
MADE, MAKE = 1, 2  # a queued first record: its file was made by ``create``, or the writer makes it


class Store:
    """The writer thread, its open files, and the producer's writes to them.

    ``append`` is all the event loop calls. A file is opened on its first record and closed
    after a record marked ``close`` (the footer). A write failure holds that file's records
    (see the module docstring) and never stops the thread: one full disk must not stop the
    other sessions' traces.
    """

    def __init__(self, fsync_interval: float = FSYNC_INTERVAL, write_on_loop: bool = True) -> None:
        # The longest an asked-for fsync waits (0: after each write); read by the writer, so
        # it may be changed while it runs.
        self.fsync_interval = fsync_interval
        # Healthy open files are written by the producer (the module docstring); off, or
        # turned off by a slow write, every record goes through the writer thread.
        self.write_on_loop = write_on_loop
        self._own = threading.Lock()  # who writes which file (``_File.inline``), see above
        self._queued: dict[Path, int] = {}  # records queued and not yet taken by the writer
        self._due: dict[Path, _File] = {}  # the files whose ``due`` is set: the writer's index
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._state: dict[Path, _File] = {}
        self._files: OrderedDict[Path, _File] = OrderedDict()  # LRU of open descriptors
        self._health: dict[Path, WriteHealth] = {}
        self.errors: dict[Path, str] = {}  # path -> the first failure's message
        self.bytes_written = 0
        self.records_written = 0
        self.died: str | None = None  # the error that ended a writer thread (see ``stopped``)
        self._busy: tuple[float, Path] | None = None  # (since, file) while the writer does I/O
        atexit.register(self._atexit)

    # --- producer side (event loop) --------------------------------------------------

    def append(self, path: Path, record: dict[str, Any], *, sync: bool = False,
               close: bool = False, new: bool = False, prev: int = 0) -> int:
        """Pack one record now (raising if it cannot be packed), its checksum chained to
        ``prev`` (the one this returned for the file's record before), and write it to ``path``
        here (an open, healthy file the producer writes: ``_write_here``) or queue it for the
        writer thread. ``new`` marks the first record of a trace: its file is created here,
        exclusively (``create``: ``TraceExistsError`` if there is one, and nothing is queued);
        ``sync`` asks for an fsync after it; ``close`` closes the file after it. Returns the
        record's checksum. The caller keeps the chain, not the store: a record may land after
        the store forgot the file (``forget``), and it must still chain on."""
        data = pack(record, 0 if new else prev)
        if not isinstance(path, Path):
            # The caller's Path kept (a Recorder's, every record of the trace): a new one
            # computes its string and hash again at each lookup.
            path = Path(path)
        made = create(path) if new else True  # on the caller's thread: a session is refused before it exists
        if new or path not in self._health:
            self._health[path] = WriteHealth()
        if not (new or close) and self.write_on_loop and self._write_here(path, data, sync):
            return checksum(data)
        with self._own:
            self._queued[path] = self._queued.get(path, 0) + 1
            f = self._state.get(path)
            if f is not None:
                f.inline = False  # this record is queued: the ones after it must follow it
        self._start()
        self._queue.put((path, data, sync, close, (MADE if made else MAKE) if new else 0))
        return checksum(data)

    def _write_here(self, path: Path, data: bytes, sync: bool) -> bool:
        """Write one record on the caller's thread if the file is the producer's (``inline``);
        False: queue it. A failed or slow write hands the file to the thread (the record that
        failed is queued by the caller, after the thread cuts the file back to ``good``)."""
        with self._own:
            f = self._state.get(path)
            if f is None or not f.inline:
                return False
            t0 = time.monotonic()
            try:
                _write_all(f.fd, data)  # type: ignore[arg-type]  # open while inline
            except BaseException as e:  # noqa: BLE001 - anything: the thread writes it again
                f.inline, f.torn = False, True
                log.warning("trace store: writing %s failed (%s: %s); the writer thread takes "
                            "the file over", path, type(e).__name__, e)
                if isinstance(e, KeyboardInterrupt):
                    raise
                return False
            now = time.monotonic()
            f.good += len(data)  # type: ignore[operator]  # known once open
            self.bytes_written += len(data)
            self.records_written += 1
            wake = False
            if f.due is not None or sync:
                f.unsynced.append((data, sync, False))
                if f.due is None:
                    f.due = now + self.fsync_interval
                    self._due[path] = f
                    # The writer sleeps up to RETRY_INTERVAL without looking at new dues.
                    wake = self.fsync_interval < RETRY_INTERVAL
            if now - t0 > SLOW_WRITE_SECONDS:
                self.write_on_loop = False
                f.inline = False
                log.warning("trace store: a write of %s took %.0f ms; %s", path, (now - t0) * 1000, FELL_BACK)
        if wake:
            self._start()
            self._queue.put(_WAKE)
        return True

    def health(self, path: Path) -> WriteHealth:
        return self._health.get(Path(path)) or WriteHealth()

    def forget(self, path: Path) -> None:
        """The trace at ``path`` is done with (its session dropped from memory, its summary read
        from the file from now on): its account goes. Kept, a night of rollouts would hold one
        per trace ever written (with the registry's ``Path``).
        Records of it the writer still holds (a slow or failed disk) are written all the same:
        the writer's own state has the account too, and a failure is in the log."""
        self._health.pop(path, None)
        self.errors.pop(path, None)

    @property
    def pending(self) -> int:
        """Records queued and not yet written (approximate while the writer is mid-batch):
        the proxy's status line shows it as the writer's lag."""
        return self._queue.qsize()

    @property
    def stopped(self) -> str | None:
        """Why the writer thread is gone while records may wait for it (its last error), or
        None. ``_run`` never lets an error end it, so this is a bug's (or the interpreter's)
        doing; the next ``append`` starts a new writer, and until then health says so."""
        thread = self._thread
        if thread is None or thread.is_alive():
            return None
        return self.died or "the trace writer thread stopped"

    @property
    def stalled(self) -> str | None:
        """The write (or fsync) the writer has been inside for more than ``STALL_SECONDS``, or
        None: a disk that takes that long for one file's batch holds every session's records
        behind it, and health must not say ok meanwhile."""
        busy = self._busy
        if busy is None or time.monotonic() - busy[0] < STALL_SECONDS:
            return None
        return f"the trace writer has been writing {busy[1]} for {time.monotonic() - busy[0]:.0f}s"

    @property
    def trouble(self) -> str | None:
        """Why records may not reach the disk whatever the files' health says (``stopped``,
        ``stalled``), or None."""
        return self.stopped or self.stalled

    def flush(self, timeout: float | None = None) -> None:
        """Block until everything queued so far was written, or tried once (held records
        stay held). Raises ``TimeoutError`` if the writer did not get there in ``timeout``,
        at once if there is no writer alive to get there (a dead one never would)."""
        if self._thread is None:
            return
        barrier = self._barrier()
        deadline = time.monotonic() + (math.inf if timeout is None else timeout)
        while not barrier.done.wait(min(0.5, max(0.0, deadline - time.monotonic()))):
            self._not_yet(deadline, timeout)

    async def drained(self, timeout: float) -> None:
        """``flush`` for the event loop: waits without a thread of its own (the default
        executor may be busy with hooks), with the same errors."""
        if self._thread is None:
            return
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle() -> None:
            if not done.done():
                done.set_result(None)

        self._barrier(lambda: loop.call_soon_threadsafe(settle))
        deadline = time.monotonic() + timeout
        while True:
            try:
                await asyncio.wait_for(asyncio.shield(done), min(0.5, max(0.0, deadline - time.monotonic())))
                return
            except TimeoutError:
                self._not_yet(deadline, timeout)

    def _barrier(self, then: Callable[[], None] | None = None) -> _Barrier:
        self._start()  # a writer that died is replaced: its queue and files carry on
        barrier = _Barrier(then)
        self._queue.put(barrier)
        return barrier

    def _not_yet(self, deadline: float, timeout: float | None) -> None:
        """A wait for a barrier goes on, or ends in the ``TimeoutError`` of ``flush``."""
        if self.stopped:
            raise TimeoutError(f"trace writer stopped before it drained: {self.stopped}") from None
        if time.monotonic() >= deadline:
            raise TimeoutError(f"trace writer did not drain within {timeout}s") from None

    def close(self) -> None:
        """Drain, stop the thread and close every file. A later ``append`` restarts it."""
        with self._lock:
            thread = self._thread
            if thread is None:
                return
            self._queue.put(None)
        thread.join()
        with self._lock:
            self._thread = None

    def _atexit(self) -> None:
        try:
            self.flush(timeout=10)
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: report, never raise
            log.exception("trace store: could not drain at exit")

    def _start(self) -> None:
        thread = self._thread
        if thread is not None and thread.is_alive():
            return
        with self._lock:
            thread = self._thread
            if thread is None or not thread.is_alive():
                if thread is not None:
                    log.error("trace store: the writer thread had stopped (%s); starting a new one",
                              self.died or "no error seen")
                self._thread = threading.Thread(
                    target=self._guarded_run, name="interceptor-trace-writer", daemon=True)
                self._thread.start()

    # --- writer thread -----------------------------------------------------------------

    def _guarded_run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - recorded for stopped/health; the thread ends
            self.died = f"{type(e).__name__}: {e}"
            log.exception("trace store: the writer thread stopped")

    def _run(self) -> None:
        if self.died:  # a writer before this one stopped: carry on where it was
            for f in list(self._state.values()):
                self._close(f)  # reopened, it is cut back to its last complete record
                self._drain(f)
        while True:
            try:
                # Never an unbounded wait, even with nothing held: whatever kept a writer from
                # waking (CI once saw one that never wrote again; the cause is not known) costs
                # one interval, not every later record. An idle wake-up a second costs nothing.
                item = self._queue.get(timeout=self._wait())
            except queue.Empty:
                for f in list(self._state.values()):
                    self._drain(f)
                self._sync_due()
                continue
            batch = [item]
            # Drain what is already queued so a burst costs one write per file, not one
            # per record.
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if self._write_batch(batch):
                for f in list(self._state.values()):
                    self._drain(f)
                    self._give_up(f, "the proxy stopped before the disk took them")
                    self._close(f)
                self._state.clear()
                return
            self._sync_due()

    def _wait(self) -> float:
        """How long the writer may wait for a record: until the next fsync is due, at most
        ``RETRY_INTERVAL``."""
        with self._own:  # the producer adds to ``_due``
            dues = [f.due for f in self._due.values()]
        if not dues:
            return RETRY_INTERVAL
        return min(RETRY_INTERVAL, max(0.0, min(dues) - time.monotonic()))  # type: ignore[type-var]

    def _sync_due(self, everything: bool = False) -> None:
        now = time.monotonic()
        with self._own:
            files = list(self._due.values())
        for f in files:
            due = f.due
            if due is not None and (everything or due <= now):
                self._sync(f)

    def _sync(self, f: _File) -> bool:
        """fsync what ``f`` wrote since its last one; on failure roll it back to that offset
        and hold those records (written again, in order, as after a failed write). The
        producer may go on writing an ``inline`` file meanwhile: what it writes after the
        snapshot waits for the next fsync (or is held with the rest if this one fails)."""
        with self._own:
            self._due.pop(f.path, None)
            if f.due is None:
                return True
            f.due = None
            fd, upto, covered = f.fd, f.good, len(f.unsynced)
        # Restored after, not cleared: an fsync of a file evicted from the LRU runs inside
        # another file's write (``_drain`` -> ``_fd``), whose stall must stay visible.
        busy, self._busy = self._busy, (time.monotonic(), f.path)
        try:
            if fd is None:
                raise OSError(5, "the file was closed before its fsync")
            os.fsync(fd)  # only this thread closes descriptors: ``fd`` stays ``f``'s
        except Exception as e:  # noqa: BLE001 - as a failed write (``_drain``)
            if not isinstance(e, OSError) and f.failing_since is None:
                log.exception("trace store: fsync of %s failed", f.path)
            with self._own:
                f.inline = False
                f.out[:0] = f.unsynced
                f.out_bytes += sum(len(d) for d, _, _ in f.unsynced)
                f.unsynced = []
                f.good = f.synced
                if f.due is not None:  # set by the producer after the snapshot: held now
                    f.due = None
                    self._due.pop(f.path, None)
            self._failed(f, e)
            return False
        finally:
            self._busy = busy
        with self._own:
            del f.unsynced[:covered]
            f.synced = upto
        return True

    def _write_batch(self, batch: list) -> bool:
        barriers: list[_Barrier] = []
        touched: dict[Path, _File] = {}
        stop = False
        taken: list[Path] = []
        for item in batch:
            if item is None:
                stop = True
                continue
            if item is _WAKE:
                continue
            if isinstance(item, _Barrier):
                barriers.append(item)
                continue
            path, data, sync, close, new = item
            taken.append(path)
            f = self._state.get(path)
            if new:
                if f is not None:  # its file was removed and a new trace made there: the old one's descriptor goes
                    self._drain(f)
                    self._close(f)
                f = self._state[path] = _File(path, self._health.get(path) or WriteHealth(), make=new == MAKE)
            elif f is None:
                f = self._state[path] = _File(path, self._health.setdefault(path, WriteHealth()))
            f.out.append((data, sync, close))
            f.out_bytes += len(data)
            touched[path] = f
        with self._own:
            for path in taken:
                left = self._queued.pop(path) - 1
                if left:
                    self._queued[path] = left
        for f in touched.values():
            self._drain(f)  # never raises an Exception: a failed file is held (``_failed``)
        if barriers:
            self._sync_due(everything=True)  # a flush means on the disk, as the policy says
        for b in barriers:
            b.set()
        return stop

    def _drain(self, f: _File) -> None:
        """Append everything ``f`` has to write in one write, or roll the file back to its
        last good offset and hold it all."""
        if not f.out:
            return
        if f.health.degraded:  # the file ends at its last good record; see the docstring
            f.health.lost += len(f.out)
            f.out.clear()
            f.out_bytes = 0
            return
        data = b"".join(d for d, _, _ in f.out)
        self._busy = (time.monotonic(), f.path)
        try:
            fd = self._fd(f)
            if f.torn:  # the producer's write failed part-way: its bytes go first
                os.ftruncate(fd, f.good)  # type: ignore[arg-type]  # known once open
                f.torn = False
            if TORN_WRITE_PAUSE:
                _write_in_halves(fd, data)
            else:
                _write_all(fd, data)
        except Exception as e:  # noqa: BLE001 - OSError: the disk; anything else a bug, held alike
            if not isinstance(e, OSError) and f.failing_since is None:
                log.exception("trace store: writing %s failed", f.path)
            self._failed(f, e)
            return
        finally:
            self._busy = None
        f.good = (f.good or 0) + len(data)
        n = len(f.out)
        closing = any(c for _, _, c in f.out)
        if f.due is not None or any(s for _, s, _ in f.out):
            f.unsynced += f.out  # until the fsync that covers them (``_sync``)
            if f.due is None:
                f.due = time.monotonic() + self.fsync_interval
                self._due[f.path] = f
        f.out = []
        f.out_bytes = 0
        with self._own:  # the producer counts its writes too
            self.bytes_written += len(data)
            self.records_written += n
        if f.failing_since is not None:
            f.failing_since = None
            f.health.late += f.health.held
            log.warning("trace store: %s is writable again; %d held records written in order",
                        f.path, f.health.held)
            f.health.held = 0
            f.health.error = None
        if f.due is not None and (closing or self.fsync_interval <= 0) and not self._sync(f):
            return  # held, the footer too: written and closed when the disk takes them
        if closing:
            self._close(f)
            self._state.pop(f.path, None)
        elif self.write_on_loop and not TORN_WRITE_PAUSE and f.fd is not None:
            with self._own:  # nothing of it queued: the producer may write the next record
                if not self._queued.get(f.path) and self._state.get(f.path) is f:
                    f.inline = True

    def _failed(self, f: _File, e: OSError) -> None:
        message = f"{type(e).__name__}: {e}"
        if f.fd is not None and f.good is not None:
            try:
                os.ftruncate(f.fd, f.good)  # no half record stays in the middle of the file
            except OSError:
                self._close(f)  # reopened (and truncated) before the next attempt
        f.health.error = message
        f.health.held = len(f.out)
        self.errors.setdefault(f.path, message)
        now = time.monotonic()
        if f.failing_since is None:
            f.failing_since = now
            log.error("trace store: cannot write %s (%s); holding its records and retrying "
                      "every %gs", f.path, message, RETRY_INTERVAL)
        if f.out_bytes > MAX_HELD_BYTES or now - f.failing_since > MAX_HELD_SECONDS:
            self._give_up(f, f"held {f.out_bytes} bytes for {now - f.failing_since:.0f}s")

    def _give_up(self, f: _File, why: str) -> None:
        if not f.out:
            return
        f.health.lost += len(f.out)
        f.health.held = 0
        f.out.clear()
        f.out_bytes = 0
        log.error("trace store: %s is degraded: %d records lost (%s); the file ends at its "
                  "last complete record", f.path, f.health.lost, why)

    def _fd(self, f: _File) -> int:
        if f.fd is not None:
            self._files.move_to_end(f.path)
            return f.fd
        # Never O_TRUNC, and O_CREAT only with O_EXCL: ``create`` made the file when its trace
        # began (or could not, and the writer makes it now); a file that is gone since is an
        # error (held and retried), not a new one.
        if f.make:
            f.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(f.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)
            f.make = False
        else:
            fd = os.open(f.path, os.O_WRONLY | os.O_APPEND)
        size = os.fstat(fd).st_size
        if f.good is None:
            f.good = size
        if f.synced is None:
            f.synced = f.good  # what was there before this writer's records
        if size > f.good:
            os.ftruncate(fd, f.good)  # a failed write whose roll-back could not be done then
        f.fd = fd
        self._files[f.path] = f
        while len(self._files) > MAX_OPEN_FILES:
            self._close(next(iter(self._files.values())))
        return fd

    def _close(self, f: _File) -> None:
        with self._own:
            f.inline = False  # the thread's from here: the producer queues its next record
        if f.due is not None and f.fd is not None:
            self._sync(f)  # before its descriptor goes (an idle file evicted, the proxy stopping)
        self._files.pop(f.path, None)
        fd, f.fd = f.fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError as e:
                log.error("trace store: close of %s failed: %s", f.path, e)


def _write_all(fd: int, data: bytes) -> None:
    """``data`` to ``fd`` whole, or an OSError (a short write that cannot continue is one)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(28, "short write")
        view = view[n:]


def _write_in_halves(fd: int, data: bytes) -> None:
    """The ``INTERCEPT_TEST_TORN_WRITES`` hook: half a record reaches the file, then a pause."""
    half = len(data) // 2
    _write_all(fd, data[:half])
    time.sleep(TORN_WRITE_PAUSE)
    _write_all(fd, data[half:])

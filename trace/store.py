"""Append trace records to msgpack files from one writer thread.

The proxy's event loop must never wait for a disk: a slow fsync would stall every stream of
every session. So recorders only put records on a queue; one thread, shared by all sessions,
packs and appends them and flushes after each batch, so a killed proxy loses at most what was
still queued (the turn in flight). Each record is one msgpack map, self-framing: a reader
stops cleanly at a torn tail.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, BinaryIO

import msgpack

log = logging.getLogger(__name__)

FSYNC_POLICIES = ("never", "turn", "seal")
# Open files kept by the writer; beyond this the least recently written one is closed (and
# reopened for append when its session writes again), so thousands of idle sessions never
# exhaust file descriptors.
MAX_OPEN_FILES = 256
# Test hook, never set in production: write each record in two halves this many seconds
# apart, so a test can SIGKILL the proxy in the middle of a record and check the reader.
TORN_WRITE_PAUSE = float(os.environ.get("INTERCEPT_TEST_TORN_WRITES") or 0)


def _default(value: Any) -> Any:
    """A value msgpack cannot pack (a model a hook left in a rewrite, a set, a Path) is
    written in its JSON-ish form rather than losing the whole record."""
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json", exclude_defaults=True)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


def pack(record: dict[str, Any]) -> bytes:
    """One record's bytes. ``use_bin_type`` keeps str and bytes apart for other readers."""
    return msgpack.packb(record, use_bin_type=True, default=_default)


class _Barrier:
    def __init__(self) -> None:
        self.done = threading.Event()


class Store:
    """The writer thread and its open files.

    ``append`` is all the event loop calls. A file is opened on its first record and closed
    after a record marked ``close`` (the footer). Write failures are logged and kept in
    ``errors`` (path -> message) instead of killing the thread: one full disk must not stop
    the other sessions' traces.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._files: OrderedDict[Path, BinaryIO] = OrderedDict()
        self.errors: dict[Path, str] = {}
        self.bytes_written = 0
        self.records_written = 0
        atexit.register(self._atexit)

    # --- producer side (event loop) --------------------------------------------------

    def append(self, path: Path, record: dict[str, Any], *, sync: bool = False,
               close: bool = False, new: bool = False) -> None:
        """Queue one record for ``path``. ``new`` marks the first record of a trace (an
        existing file there is moved aside, never appended to); ``sync`` asks for an fsync
        after it; ``close`` closes the file after it."""
        self._start()
        self._queue.put((Path(path), record, sync, close, new))

    def flush(self, timeout: float | None = None) -> None:
        """Block until everything queued so far is written (and fsynced where asked).
        Raises ``TimeoutError`` if the writer did not get there in ``timeout`` seconds."""
        if self._thread is None:
            return
        barrier = _Barrier()
        self._queue.put(barrier)
        if not barrier.done.wait(timeout):
            raise TimeoutError(f"trace writer did not drain within {timeout}s")

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
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="interceptor-trace-writer", daemon=True)
                self._thread.start()

    # --- writer thread -----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            # Drain what is already queued so a burst costs one flush per file, not one
            # per record.
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = self._write_batch(batch)
            if stop:
                for f in self._files.values():
                    self._safe_close(f)
                self._files.clear()
                return

    def _write_batch(self, batch: list) -> bool:
        dirty: dict[Path, bool] = {}  # path -> needs fsync
        barriers: list[_Barrier] = []
        stop = False
        for item in batch:
            if item is None:
                stop = True
                continue
            if isinstance(item, _Barrier):
                barriers.append(item)
                continue
            path, record, sync, close, new = item
            try:
                f = self._file(path, new, dirty)
                data = pack(record)
                if TORN_WRITE_PAUSE:
                    _write_in_halves(f, data)
                else:
                    f.write(data)
                self.bytes_written += len(data)
                self.records_written += 1
                dirty[path] = dirty.get(path, False) or sync
                if close:
                    self._finish(path, dirty.pop(path))
            except Exception as e:  # noqa: BLE001 - keep the writer alive for others
                self.errors[path] = f"{type(e).__name__}: {e}"
                log.error("trace store: cannot write %s: %s", path, e)
        for path, sync in dirty.items():
            f = self._files.get(path)
            if f is None:
                continue
            try:
                f.flush()
                if sync:
                    os.fsync(f.fileno())
            except OSError as e:
                self.errors[path] = f"{type(e).__name__}: {e}"
                log.error("trace store: cannot flush %s: %s", path, e)
        for b in barriers:
            b.done.set()
        return stop

    def _file(self, path: Path, new: bool, dirty: dict[Path, bool]) -> BinaryIO:
        f = self._files.get(path)
        if f is not None and not new:
            self._files.move_to_end(path)
            return f
        if f is not None:
            self._finish(path, dirty.pop(path, False))
        if new:
            _move_aside(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "ab")
        self._files[path] = f
        while len(self._files) > MAX_OPEN_FILES:
            oldest = next(iter(self._files))
            self._finish(oldest, dirty.pop(oldest, False))
        return f

    def _finish(self, path: Path, sync: bool) -> None:
        f = self._files.pop(path)
        f.flush()
        if sync:
            os.fsync(f.fileno())
        f.close()

    @staticmethod
    def _safe_close(f: BinaryIO) -> None:
        try:
            f.close()
        except OSError as e:
            log.error("trace store: close failed: %s", e)


def _write_in_halves(f: BinaryIO, data: bytes) -> None:
    """The ``INTERCEPT_TEST_TORN_WRITES`` hook: half a record reaches the file, then a pause."""
    half = len(data) // 2
    f.write(data[:half])
    f.flush()
    time.sleep(TORN_WRITE_PAUSE)
    f.write(data[half:])


def _move_aside(path: Path) -> None:
    """A session id reused across proxy runs must not append a second trace to the first
    one's file (the reader would see two headers) nor overwrite it: keep the old file as
    ``<stem>.<n><suffix>``."""
    try:
        if path.stat().st_size == 0:
            return
    except FileNotFoundError:
        return
    n = 1
    while True:
        aside = path.with_name(f"{path.stem}.{n}{path.suffix}")
        if not aside.exists():
            break
        n += 1
    os.replace(path, aside)
    log.warning("trace store: %s existed; kept the old trace as %s", path, aside)

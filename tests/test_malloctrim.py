"""MallocTrim (addons/malloctrim.py): a seal arms one trim, a burst of seals one trim, never on
the caller's thread; ``intercept_malloc_trim 0`` never trims; glibc's own call gives freed heap
back. What it does for a proxy's resident set is bench/scale.py's ``--trim-ab`` (docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from pathlib import Path

import pytest
from mitmproxy import exceptions
from mitmproxy.test import taddons

from interceptor.addons.malloctrim import MallocTrim
from interceptor.addons.session import Registry, SessionConfig


class Calls:
    def __init__(self) -> None:
        self.threads: list[str] = []
        self.done = threading.Event()

    def __call__(self, pad: int) -> int:
        assert pad == 0
        self.threads.append(threading.current_thread().name)
        self.done.set()
        return 1


def _trim(interval: float) -> tuple[MallocTrim, Registry, Calls]:
    registry = Registry()
    trim = MallocTrim(registry)
    calls = Calls()
    trim._trim = calls
    trim.interval = interval
    return trim, registry, calls


def test_a_burst_of_seals_is_one_trim_off_the_callers_thread():
    trim, registry, calls = _trim(0.2)
    assert registry.on_release == trim.soon
    for _ in range(50):
        registry.on_release()
    assert calls.threads == []  # nothing on the caller's (the event loop's) thread
    assert calls.done.wait(5)
    time.sleep(0.4)
    assert calls.threads == ["interceptor-malloc-trim"]
    # the next seal arms the next trim, no sooner than one interval after the last
    calls.done.clear()
    t0 = time.monotonic()
    trim.soon()
    assert calls.done.wait(5) and time.monotonic() - t0 >= 0.19
    assert len(calls.threads) == 2 and trim.trims == 2
    registry.store.close()


def test_retire_calls_it():
    trim, registry, calls = _trim(0.05)
    with tempfile.TemporaryDirectory() as d:
        s = registry.create(SessionConfig(), Path(d), "never")
        s.seal()
        s.release()
        registry.retire(s)
        assert calls.done.wait(5)
        registry.store.close()


def test_off_never_trims_and_a_negative_interval_is_refused():
    trim, registry, calls = _trim(0.05)
    with taddons.context(trim) as tctx:
        tctx.configure(trim, intercept_malloc_trim=0)
        trim.soon()
        time.sleep(0.3)
        assert calls.threads == []
        with pytest.raises(exceptions.OptionsError, match="intercept_malloc_trim"):
            tctx.configure(trim, intercept_malloc_trim=-1)
    registry.store.close()


def test_the_real_call_returns_freed_heap():
    """glibc's own malloc_trim, in this process: memory freed in small blocks (which free()
    alone keeps) is given back."""
    from interceptor.addons.malloctrim import _malloc_trim

    fn = _malloc_trim()
    if fn is None:
        pytest.skip("not glibc: no malloc_trim")

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    # ~100 MiB in 4 KiB byte strings (malloc'd, below the mmap threshold), one in 64 kept so
    # the heap's top cannot shrink by itself; then the rest freed
    blocks = [bytes(4000) for _ in range(25_000)]
    keep = blocks[::64]
    del blocks
    base = rss()
    fn(0)
    assert rss() < base - 50 * 2**20, (base, rss())
    del keep


@pytest.mark.parametrize("connections,collects", [({}, True), ({"c1": object()}, False)])
def test_a_full_collection_first_only_when_no_connection_is_open(monkeypatch, connections, collects):
    """Between waves (no client connection open) the cyclic garbage of the finished
    connections is collected before the trim, on the event loop's thread; with one open,
    never (it would stall it)."""
    trim, registry, calls = _trim(0.05)
    trim._proxyserver = type("Proxyserver", (), {"connections": connections})()
    loop = asyncio.new_event_loop()
    serving = threading.Thread(target=loop.run_forever, name="event-loop")
    serving.start()
    trim._loop = loop
    order: list[str] = []
    monkeypatch.setattr("interceptor.addons.malloctrim.gc.collect",
                        lambda: order.append(f"collect on {threading.current_thread().name}") or 0)
    real = trim._trim
    trim._trim = lambda pad: order.append("trim") or real(pad)
    try:
        trim.soon()
        assert calls.done.wait(5)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        serving.join(5)
        loop.close()
    # the collection on the loop's thread: the finalizers it runs touch the loop
    assert order == (["collect on event-loop", "trim"] if collects else ["trim"])
    registry.store.close()

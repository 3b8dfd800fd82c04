"""RuntimeTuning (addons/mitm/tuning.py): what the switch sets and that it is undone or never done
when off; dead flows collected by bytes and by count; a trim after seals, off the caller's
thread; and with the switch off a real proxy serves, retries and records as with it on.

Behaviour only: what was set, asked for or called, waited for on an event or a log line; no
figure that depends on time, load or when Python's own collector runs."""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import tempfile
import threading
import weakref
from pathlib import Path

import pytest
from mitmproxy import exceptions
from mitmproxy.test import taddons, tflow

from interceptor.addons.mitm import tuning
from interceptor.addons.gateway.sessions.session import Registry, SessionConfig
from interceptor.trace import read_trace
from provider import Reply
from test_connect_error_log import wait_for_line

MIB = 1 << 20


class Mallopt:
    """glibc's mallopt as the addon calls it, recorded (the real thresholds are the process's)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


class Trims:
    """glibc's malloc_trim, recorded with the thread that called it."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def __call__(self, pad: int) -> int:
        assert pad == 0
        self.threads.append(threading.current_thread().name)
        return 1


@pytest.fixture
def mallopt(monkeypatch) -> Mallopt:
    calls = Mallopt()
    monkeypatch.setattr(tuning, "mallopt", lambda: calls)
    return calls


@pytest.fixture
def fresh(monkeypatch, mallopt):
    """A process that has not tuned yet, glibc recorded; the collector restored afterwards."""
    monkeypatch.setattr(tuning, "_process", tuning._Process())
    threshold = gc.get_threshold()
    registry = Registry()
    addon = tuning.RuntimeTuning(registry)
    addon._trim = Trims()
    gc.unfreeze()
    yield addon, registry
    addon._cancel()
    registry.store.close()
    gc.unfreeze()
    gc.set_threshold(*threshold)


def _ended(size: int) -> tflow.HTTPFlow:
    flow = tflow.tflow(resp=True)
    flow.request.content = b"x" * size
    flow.response.content = b"{}"
    return flow


class _Cycle:
    """Garbage as a dead flow is: freed by the collector only."""

    def __init__(self) -> None:
        self.me = self


def _cycle() -> weakref.ref:
    return weakref.ref(_Cycle())


HEAP = [(tuning.M_MMAP_THRESHOLD, tuning.HEAP_MIB * MIB), (tuning.M_TRIM_THRESHOLD, tuning.HEAP_MIB * MIB)]
START = [(tuning.M_MMAP_THRESHOLD, tuning.GLIBC_START), (tuning.M_TRIM_THRESHOLD, tuning.GLIBC_START)]


def test_on_freezes_start_up_once_and_sets_the_thresholds(fresh, mallopt, caplog):
    addon, _ = fresh
    caplog.set_level("INFO")
    with taddons.context(addon):
        early = [1]
        addon.running()
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # this process's modules, at least
        assert gc.get_threshold()[0] == tuning.THRESHOLD0
        assert mallopt.calls == HEAP  # both: the mmap threshold alone leaves the heap's top trimmed
        assert "objects alive after start-up frozen" in caplog.text
        late = [2]  # what a flow allocates later is the collector's as usual
        reloaded = Registry()
        tuning.RuntimeTuning(reloaded).running()  # a reloaded script: nothing more frozen
        reloaded.store.close()
        assert gc.get_freeze_count() == frozen
        seen = gc.get_objects()
        assert not any(o is early for o in seen) and any(o is late for o in seen)


def test_off_at_start_sets_nothing_and_asks_for_nothing(fresh, mallopt, caplog):
    addon, registry = fresh
    caplog.set_level("INFO")
    threshold = gc.get_threshold()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, intercept_runtime_tuning=False)
        addon.running()
        assert gc.get_freeze_count() == 0 and gc.get_threshold() == threshold and mallopt.calls == []
        assert "runtime tuning off" in caplog.text
        addon.response(_ended(4 * tuning.COLLECT_MIB * MIB))
        for _ in range(2 * tuning.FLOWS):
            addon.error(_ended(100))
        registry.on_release()
        assert addon.pending is None and addon.collections == 0 and addon.timer is None


def test_turned_off_while_running_is_undone_and_on_again_all_but_the_freeze(fresh, mallopt):
    addon, registry = fresh
    threshold = gc.get_threshold()
    addon.trim_interval = 3600  # armed, never run here

    async def run() -> None:
        with taddons.context(addon) as tctx:
            addon.running()
            addon.response(_ended(tuning.COLLECT_MIB * MIB))
            registry.on_release()
            armed = addon.timer
            assert addon.pending is not None and armed is not None
            tctx.configure(addon, intercept_runtime_tuning=False)
            assert gc.get_freeze_count() == 0 and gc.get_threshold() == threshold
            assert mallopt.calls == HEAP + START
            assert addon.pending is None and addon.timer is None and armed.finished.is_set()  # cancelled
            addon.response(_ended(tuning.COLLECT_MIB * MIB))
            registry.on_release()
            assert addon.pending is None and addon.timer is None
            tctx.configure(addon, intercept_runtime_tuning=True)
            assert gc.get_threshold()[0] == tuning.THRESHOLD0 and mallopt.calls == HEAP + START + HEAP
            assert gc.get_freeze_count() == 0  # a later freeze would pin the flows in flight

    asyncio.run(run())


def _with_only_asked_collections(addon, body) -> None:
    """``body()`` on a started addon with Python's own passes off, so that only the
    collections the addon asks for can free a cycle."""

    async def run() -> None:
        with taddons.context(addon):
            addon.running()
            gc.disable()
            await body()

    try:
        asyncio.run(run())
    finally:
        gc.enable()


def test_ended_bodies_past_the_budget_are_collected_after_the_hook(fresh):
    addon, _ = fresh

    async def body() -> None:
        dead = _cycle()
        addon.response(_ended(tuning.COLLECT_MIB * MIB // 2))  # under the budget: nothing asked
        assert addon.pending is None
        addon.error(_ended(tuning.COLLECT_MIB * MIB // 2))  # the budget reached: asked, not run yet
        assert addon.pending is not None and dead() is not None
        addon.response(_ended(tuning.COLLECT_MIB * MIB))  # one collection for both
        await asyncio.wait_for(addon.collected.wait(), 30)
        assert dead() is None and addon.collections == 1 and addon.pending is None
        addon.response(_ended(100))  # the count starts over
        assert addon.pending is None

    _with_only_asked_collections(addon, body)


def test_flows_past_the_count_are_collected_whatever_their_size(fresh):
    """Small flows (the control API's, a short turn's) leave the same cyclic garbage as large
    ones, and Python's young count falls with every old object freed (a burst of seals)."""
    addon, _ = fresh

    async def body() -> None:
        dead = _cycle()
        for _ in range(tuning.FLOWS - 1):
            addon.response(_ended(100))
        assert addon.pending is None  # one flow short
        addon.error(_ended(100))
        assert addon.pending is not None
        await asyncio.wait_for(addon.collected.wait(), 30)
        assert dead() is None and addon.collections == 1

    _with_only_asked_collections(addon, body)


def test_a_burst_of_seals_is_one_trim_off_the_callers_thread(fresh):
    addon, registry = fresh
    with taddons.context(addon):
        addon.running()
    addon.trim_interval = 0.05
    assert registry.on_release == addon.soon
    for _ in range(50):
        registry.on_release()
    armed = addon.timer
    assert armed is not None and armed.interval == 0.05
    assert addon._trim.threads == []  # nothing on the caller's (the event loop's) thread
    assert addon.trimmed.wait(30)
    armed.join(30)
    assert addon._trim.threads == ["interceptor-malloc-trim"] and addon.trims == 1 and addon.timer is None
    registry.on_release()  # the next seal arms the next trim, one interval on
    assert addon.timer is not None and addon.timer is not armed and addon.timer.interval == 0.05


def test_a_released_session_is_trimmed(fresh):
    addon, registry = fresh
    with taddons.context(addon):
        addon.running()
    addon.trim_interval = 0.05
    with tempfile.TemporaryDirectory() as d:
        s = registry.create(SessionConfig(), Path(d), "never")
        s.seal()
        s.release()
        registry.retire(s)
        assert addon.trimmed.wait(30) and addon.trims == 1


def test_nothing_armed_outlives_the_addon(fresh):
    """A reloaded script or a shutdown removes the addon (mitmproxy's ``done``): its armed
    trim and its asked-for collection are cancelled."""
    addon, registry = fresh
    addon.trim_interval = 3600

    async def run() -> None:
        with taddons.context(addon):
            addon.running()
            addon.response(_ended(tuning.COLLECT_MIB * MIB))
            registry.on_release()
            pending, armed = addon.pending, addon.timer
            addon.done()
            assert pending.cancelled() and armed.finished.is_set()
            assert addon.pending is None and addon.timer is None

    asyncio.run(run())


def test_trim_zero_never_trims_and_a_negative_interval_is_refused(fresh):
    addon, registry = fresh
    with taddons.context(addon) as tctx:
        addon.running()
        tctx.configure(addon, intercept_malloc_trim=0)
        registry.on_release()
        assert addon.timer is None
        with pytest.raises(exceptions.OptionsError, match="intercept_malloc_trim"):
            tctx.configure(addon, intercept_malloc_trim=-1)


@pytest.mark.parametrize("open_connections,collects", [(0, True), (1, False)])
def test_a_full_collection_before_the_trim_only_when_no_connection_is_open(fresh, monkeypatch, open_connections, collects):
    """Between waves (no client connection open) the finished connections' cyclic garbage is
    collected before the trim, on the event loop's thread; with one open, never (it would
    stall it). The count is mitmproxy's client_connected and client_disconnected hooks'."""
    addon, _ = fresh
    with taddons.context(addon):
        addon.running()
    for _ in range(open_connections + 1):
        addon.client_connected(None)
    addon.client_disconnected(None)
    loop = asyncio.new_event_loop()
    serving = threading.Thread(target=loop.run_forever, name="event-loop")
    serving.start()
    addon._loop = loop
    order: list[str] = []
    monkeypatch.setattr(tuning.gc, "collect", lambda *a: order.append(f"collect on {threading.current_thread().name}") or 0)
    trims = addon._trim
    addon._trim = lambda pad: order.append("trim") or trims(pad)
    addon.trim_interval = 0.05
    try:
        addon.soon()
        assert addon.trimmed.wait(30)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        serving.join(30)
        loop.close()
    assert order == (["collect on event-loop", "trim"] if collects else ["trim"])


# glibc itself, in a process of its own (its thresholds and heap are the process's)
GLIBC = """
import json
from interceptor.addons.mitm import tuning
fn = tuning.malloc_trim()
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
took = tuning.heap_thresholds(tuning.HEAP_MIB << 20)
# ~100 MiB in 4 KiB byte strings (below the mmap threshold), one in 64 kept so the heap's top
# cannot shrink by itself; the rest freed and then trimmed
blocks = [bytes(4000) for _ in range(25_000)]
keep = blocks[::64]
del blocks
before = rss()
fn(0)
print(json.dumps({"took": took, "given_back": before - rss()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or tuning.mallopt() is None, reason="glibc only")
def test_glibc_takes_the_heap_thresholds_and_trims_freed_heap():
    out = subprocess.run([sys.executable, "-c", GLIBC], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["took"]  # glibc took both thresholds
    assert got["given_back"] > 50 * MIB, got


def test_the_proxy_tunes_collects_dead_flows_and_trims_after_a_seal(start_proxy):
    proxy = start_proxy({"termlog_verbosity": "debug", "intercept_malloc_trim": 1})
    line = wait_for_line(proxy, r"interceptor: runtime tuning: .*", timeout=120)
    assert int(line.split("tuning: ")[1].split()[0]) > 10_000, line  # mitmproxy and its libraries frozen
    assert f"every {tuning.THRESHOLD0} allocations" in line
    if sys.platform.startswith("linux") and tuning.mallopt() is not None:
        assert f"glibc's blocks below {tuning.HEAP_MIB} MiB" in line
    for _ in range(tuning.FLOWS):  # control-API flows end as any flow does
        assert proxy.api("GET", "sessions")[0] == 200
    wait_for_line(proxy, rf"interceptor: gc: generation \d collected after \d+ ended flows", timeout=120)
    session = proxy.create_session()
    assert proxy.api("DELETE", f"sessions/{session['id']}")[0] == 200
    wait_for_line(proxy, r"interceptor: malloc_trim: freed heap returned to the system", timeout=120)


def test_with_tuning_off_a_turn_a_stream_and_a_retry_are_served_and_recorded(sim, start_proxy, harness_env):
    import openai

    from test_retry import raw_post

    proxy = start_proxy({"intercept_runtime_tuning": "false"})
    wait_for_line(proxy, r"interceptor: runtime tuning off", timeout=120)
    assert "objects alive after start-up frozen" not in proxy.log()
    session = proxy.create_session(upstream={"base_url": sim.url("/v1")})
    harness_env(session["env"])
    sim.script(Reply(text="plain answer"), Reply(text=["streamed ", "answer"]))
    oai = openai.OpenAI(api_key=session["model_secret"], max_retries=0)
    turn = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "one"}])
    assert turn.choices[0].message.content == "plain answer"
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "two"}]}
    status, _, streamed = raw_post(proxy, session, "/v1/chat/completions", body, 0)
    assert status == 200 and b"streamed " in streamed and b"[DONE]" in streamed
    status, headers, again = raw_post(proxy, session, "/v1/chat/completions", body, 1)  # the SDK's retry
    assert status == 200 and again == streamed and "x-interceptor-replay" in headers
    assert len(sim.model_requests()) == 2
    assert proxy.api("DELETE", f"sessions/{session['id']}")[0] == 200
    trace = read_trace(session["trace_path"])
    assert trace.num_turns == 2
    replays = [c for c in trace.calls if c.replay_of]
    assert len(trace.calls) == 3 and len(replays) == 1 and replays[0].replay_of == trace.calls[1].id

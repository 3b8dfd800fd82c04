"""GcTuning (addons/gctuning.py): what is alive after start-up is frozen once, the young
generation is collected less often, and ``intercept_gc_tuning false`` keeps Python's defaults."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import pytest
from mitmproxy.test import taddons

from interceptor.addons import gctuning
from mitm import MitmProcess

GCWATCH = Path(__file__).with_name("gcwatch.py")


@pytest.fixture
def fresh(monkeypatch):
    """A process that has not tuned yet; the collector's state restored afterwards."""
    monkeypatch.setattr(gctuning, "_done", False)
    threshold = gc.get_threshold()
    yield gctuning.GcTuning()
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_start_up_is_frozen_once_and_young_collections_are_rarer(fresh):
    gc.unfreeze()
    with taddons.context(fresh):
        early = [1]
        fresh.running()
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # this process's modules, at least
        assert gc.get_threshold()[0] == gctuning.THRESHOLD0
        late = [2]  # what a flow allocates later is the collector's as usual
        fresh.running()  # a reloaded script runs ``running`` again: nothing more is frozen
        assert gc.get_freeze_count() == frozen
        seen = gc.get_objects()  # the frozen are out of the collector's sight
        assert not any(o is early for o in seen) and any(o is late for o in seen)


def test_off_keeps_the_defaults(fresh):
    gc.unfreeze()
    threshold = gc.get_threshold()
    with taddons.context(fresh) as tctx:
        tctx.configure(fresh, intercept_gc_tuning=False)
        fresh.running()
        assert gc.get_freeze_count() == 0 and gc.get_threshold() == threshold


def test_the_proxy_freezes_its_start_up():
    with MitmProcess() as proxy:
        deadline = time.time() + 120  # generous: the line follows start-up, a loaded machine is slow
        while "objects alive after start-up frozen" not in proxy.log() and time.time() < deadline:
            time.sleep(0.2)
        lines = [x for x in proxy.log().splitlines() if "objects alive after start-up frozen" in x]
        assert lines, proxy.log()[-2000:]
        line = lines[0]
        assert int(line.split("gc: ")[1].split()[0]) > 10_000  # mitmproxy and its libraries


class _Cycle:
    """Garbage as a dead flow is: freed by the collector only."""

    def __init__(self) -> None:
        self.me = self


def _ended(size: int):
    from mitmproxy.test import tflow
    flow = tflow.tflow(resp=True)
    flow.request.content = b"x" * size
    flow.response.content = b"{}"
    return flow


def _with_only_asked_collections(fresh, body, **options) -> None:
    """``body(dead)`` on a GcTuning started with ``options``, Python's own passes off so that
    only the collections the addon asks for can free ``dead()``'s cycle (an automatic young
    pass could free it early and pass or fail a test by chance)."""
    import asyncio
    import weakref

    gc.unfreeze()

    async def run() -> None:
        with taddons.context(fresh) as tctx:
            if options:
                tctx.configure(fresh, **options)
            fresh.running()
            gc.disable()
            garbage = _Cycle()
            dead = weakref.ref(garbage)
            del garbage
            await body(dead)

    try:
        asyncio.run(run())
    finally:
        gc.enable()


def test_ended_bodies_past_the_budget_are_collected_once_the_hook_returns(fresh):
    import asyncio
    import weakref

    async def body(dead) -> None:
        fresh.response(_ended((gctuning.COLLECT_MIB << 20) // 2))  # under the budget: nothing asked
        await asyncio.sleep(2 * gctuning.GRACE)
        assert dead() is not None
        fresh.error(_ended((gctuning.COLLECT_MIB << 20) // 2))  # the budget reached: asked, not run yet
        assert dead() is not None
        fresh.response(_ended((gctuning.COLLECT_MIB << 20)))  # one collection for both
        await asyncio.sleep(2 * gctuning.GRACE)
        assert dead() is None
        again = _Cycle()
        dead = weakref.ref(again)
        del again
        fresh.response(_ended(100))  # the count starts over
        await asyncio.sleep(2 * gctuning.GRACE)
        assert dead() is not None

    _with_only_asked_collections(fresh, body)


@pytest.mark.parametrize("off", [{"intercept_gc_tuning": False}, {"intercept_gc_collect_mib": 0}])
def test_off_asks_for_no_collection(fresh, off):
    """Off, neither the bodies' bytes nor the flows' count asks for a collection."""
    import asyncio

    async def body(dead) -> None:
        fresh.response(_ended(4 * (gctuning.COLLECT_MIB << 20)))
        for _ in range(2 * gctuning.FLOWS):
            fresh.response(_ended(100))
        await asyncio.sleep(2 * gctuning.GRACE)
        assert dead() is not None

    _with_only_asked_collections(fresh, body, **off)


def test_a_negative_budget_is_refused(fresh):
    from mitmproxy import exceptions

    with taddons.context(fresh) as tctx, pytest.raises(exceptions.OptionsError, match="intercept_gc_collect_mib"):
        tctx.configure(fresh, intercept_gc_collect_mib=-1)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_a_long_rollout_of_large_requests_does_not_grow_the_proxy(proxy, sim, new_session, harness_env):
    """A rollout whose first message is a 2.5 MB document, restated every turn: each turn's
    dead flow holds its request body and the proxy's copies of it (~7.5 MB) until the
    collector frees it. Counted by objects alone, that was one collection in ~40 turns, and
    the proxy grew by each turn's (86 MB over these 12). Once the first turns have laid out
    the heap, the proxy stays flat. (A collection on the very next pass of the loop, while
    mitmproxy still holds the flow, passes this too: it frees each flow ten turns late, and
    the heap, grown by then, reuses its blocks. GRACE's doc says what that cost.)"""
    import openai

    from provider import Reply

    sim.default = Reply(text="noted")
    s = new_session(model="gpt-4o-mini")
    harness_env(s["env"])
    oai = openai.OpenAI(api_key=s["model_secret"], max_retries=0)
    messages = [{"role": "user", "content": "document: " + "lorem ipsum " * (2_500_000 // 12)}]

    def turn(k: int) -> None:
        messages.append({"role": "user", "content": f"turn {k}: go on"})
        r = oai.chat.completions.create(model="gpt-4o", messages=messages)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})

    for k in range(8):
        turn(k)
    start = _rss_mb(proxy.proc.pid)
    for k in range(8, 20):
        turn(k)
    grown = _rss_mb(proxy.proc.pid) - start
    assert grown < 20, f"the proxy grew {grown:.0f} MB over 12 turns of a 2.5 MB history"
    assert len(sim.model_requests()) == 20


def test_flows_past_the_count_are_collected_whatever_their_size(fresh):
    """Small flows (the control API's, a short turn's) leave the same cyclic garbage as large
    ones: every ``FLOWS`` of them the young generation is collected, bytes or not."""
    import asyncio

    async def body(dead) -> None:
        for _ in range(gctuning.FLOWS - 1):
            fresh.response(_ended(100))
        await asyncio.sleep(2 * gctuning.GRACE)
        assert dead() is not None  # one flow short
        fresh.error(_ended(100))
        await asyncio.sleep(2 * gctuning.GRACE)
        assert dead() is None

    _with_only_asked_collections(fresh, body)


def test_a_burst_of_seals_leaves_no_pile_for_one_collection(start_proxy, sim):
    """Sealing a session frees its graph, old objects freed by reference counting, over one
    control-API flow that leaves ~200 young objects in cycles. Python counts the young
    generation as allocations minus deallocations of any generation, so a burst of seals kept
    its count under the threshold while the flows piled up, and the first collection after it
    freed them all at once (300 seals: ~67,000 objects, a 70 ms stall of every stream; 900:
    ~240,000, 300 ms). Counted by flows, no collection frees much more than one threshold's worth."""
    import concurrent.futures

    import httpx2 as httpx

    from provider import Reply

    sim.default = Reply(text="noted")
    proxy = start_proxy(extra_scripts=[GCWATCH])
    sessions = [proxy.create_session(upstream={"base_url": sim.url("/v1")}) for _ in range(200)]
    ca = str(proxy.ca_bundle)

    def rollout(s: dict) -> None:
        messages = [{"role": "user", "content": "a task " + "detail " * 300}]
        with httpx.Client(proxy=proxy.url, verify=ca, timeout=60) as c:
            for k in range(4):
                r = c.post("https://api.openai.com/v1/chat/completions", json={"model": "gpt-4o", "messages": messages},
                           headers={"authorization": f"Bearer {s['model_secret']}"})
                r.raise_for_status()
                messages += [r.json()["choices"][0]["message"], {"role": "user", "content": f"go on {k}"}]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(rollout, sessions))
    before = len(proxy.log().splitlines())
    with httpx.Client(timeout=60) as c:  # the burst: one keep-alive connection, as an orchestrator's client
        for s in sessions:
            c.delete(f"{proxy.url}/_interceptor/sessions/{s['id']}",
                     headers={"authorization": f"Bearer {proxy.admin_token}"}).raise_for_status()
    rollout(proxy.create_session(upstream={"base_url": sim.url("/v1")}))  # the next rollout's turns
    deadline = time.time() + 30
    while time.time() < deadline:
        after = [line for line in proxy.log().splitlines()[before:] if "GCWATCH" in line]
        if after:
            break
        time.sleep(0.2)
    time.sleep(1)
    after = [line for line in proxy.log().splitlines()[before:] if "GCWATCH" in line]
    assert after, "no collection after the burst"
    freed = [int(line.split("collected=")[1].split()[0]) for line in after]
    assert max(freed) < 20_000, f"one collection freed {max(freed)} objects after 200 seals: {after}"

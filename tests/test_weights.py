"""An upstream's Weights in process: held requests go in arrival order, a hold limit gives
the request up and its place, a drain reports what still runs, and versions order as
declared (numbers as numbers, names by their first declaration, the unknown as older)."""

from __future__ import annotations

import asyncio

import pytest

from interceptor.addons.gateway.sessions.weights import HoldExpired, Weights, parse_version


def test_resume_releases_the_held_requests_in_the_order_they_arrived():
    async def run() -> list[int]:
        weights, order = Weights("vllm"), []

        async def request(k: int) -> None:
            await weights.hold(k, None)
            order.append(k)

        weights.pause()
        tasks = []
        for k in range(6):
            tasks.append(asyncio.create_task(request(k)))
            while len(weights.held) < k + 1:  # each is held before the next arrives
                await asyncio.sleep(0)
        assert weights.resume() == 6 and not weights.paused
        await asyncio.gather(*tasks)
        assert await weights.hold("after", None) is None  # not paused: no wait at all
        return order

    assert asyncio.run(run()) == list(range(6))


def test_a_request_held_past_its_limit_gives_up_its_place():
    async def run() -> None:
        weights = Weights("vllm")
        weights.pause()
        with pytest.raises(HoldExpired):
            await weights.hold("a", 0.01)
        assert not weights.held and weights.resume() == 0

    asyncio.run(run())


def test_a_drain_waits_for_the_sent_requests_and_says_which_still_run():
    async def run() -> None:
        weights = Weights("vllm")
        assert await weights.drained(5) == []  # idle: at once
        weights.sent("c1", "s1")
        weights.sent("c2", "s2")
        draining = asyncio.create_task(weights.drained(30))
        await asyncio.sleep(0)
        weights.finished("c1")
        assert not draining.done()
        weights.finished("c2")
        assert await draining == []
        weights.sent("c3", "s3")
        [running] = await weights.drained(0.01)
        assert running["call"] == "c3" and running["session"] == "s3"

    asyncio.run(run())


def test_versions_order_as_declared():
    weights = Weights("vllm")
    for v in ("base", "ckpt-a", 5, "ckpt-b"):
        weights.declare(v)
    assert weights.older(3, 5) and not weights.older(5, 5) and not weights.older(6, 5)
    assert weights.older("base", "ckpt-a") and weights.older("ckpt-a", "ckpt-b") and not weights.older("ckpt-b", "ckpt-a")
    assert weights.older(5, "ckpt-b") and not weights.older("ckpt-b", 5)  # a number beside a name: by declaration
    assert weights.older(None, 1) and weights.older("never-declared", "base") and weights.older("base", "never-declared")
    assert not weights.older("never-declared", "never-declared")
    assert parse_version(" 12 ") == 12 and parse_version("v12") == "v12"


def test_a_harness_that_leaves_while_its_request_waits_makes_its_next_identical_request_that_requests_retry():
    """Pause's ``client_disconnected``: the waiting request's Retry record says its client left,
    so Retry's undelivered rule coalesces the harness's unflagged resend on it (not a second
    sample); another client's leaving marks nothing."""
    from types import SimpleNamespace

    from mitmproxy.test import tflow

    from interceptor.addons.gateway.exchange import KEY, Exchange
    from interceptor.addons.gateway.policy.pause import Pause
    from interceptor.addons.gateway.retry import RECORDED_KEY, Recorded
    from interceptor.addons.gateway.sessions.weights import Fleet

    async def run() -> None:
        fleet = Fleet()
        weights = fleet.of("vllm")
        weights.pause()
        flow = tflow.tflow()
        ex = Exchange(session=SimpleNamespace(id="s"), route=None)
        recorded = ex.own[RECORDED_KEY] = Recorded(digest="d", call_id="c")
        flow.metadata[KEY] = ex
        waiting = asyncio.create_task(weights.hold(flow, None))
        while not weights.held:
            await asyncio.sleep(0)
        pause = Pause(fleet)
        pause.client_disconnected(tflow.tclient_conn())  # another harness
        assert not recorded.left
        pause.client_disconnected(flow.client_conn)
        assert recorded.left
        weights.resume()
        assert await waiting is not None

    asyncio.run(run())


def test_an_answer_from_older_weights_than_the_session_accepts_is_an_error_on_the_record_however_it_came(tmp_path):
    """The record's own rule (record.py's commit), for an answer Pause's header check did not
    see (a WebSocket frame, an answer read on after the harness left): an error call, no turn."""
    from mitmproxy.test import tflow

    from interceptor.addons.gateway.exchange import Exchange
    from interceptor.addons.gateway.record import commit
    from interceptor.addons.gateway.sessions.session import Registry, SessionConfig
    from interceptor.dialects import DIALECTS, Route
    from interceptor.trace.messages import Message, Request, Response

    registry = Registry()
    registry.weights.of("default").declare(3)
    for minimum, turns in ((4, 0), (3, 1)):
        session = registry.create(SessionConfig(min_version=minimum), tmp_path, "never")
        assert [v.version for v in session.recorder.trace.versions] == [3]
        ex = Exchange(session=session, route=Route(DIALECTS["chat"], "model"))
        ex.request = Request(messages=[Message(role="user", content="q")])
        commit(ex, tflow.tflow(resp=True), Response(message=Message(role="assistant", content="a")))
        trace = session.recorder.trace
        assert trace.num_turns == turns and trace.calls[0].policy_version == 3
        assert (trace.calls[0].error.type if trace.calls[0].error else None) == (None if turns else "stale_version")
        registry.store.flush(timeout=10)

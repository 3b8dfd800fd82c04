"""Fail closed, by fault injection into the real mitmdump.

``tests/faults.py`` makes each hook of each addon that touches a model flow raise in turn
(or return early without doing its work). For each: the harness's real SDK gets an error in
the dialect's shape (500, ``x-should-retry: false``, the step named, no secret), nothing left
the proxy unprepared, the trace verifies with the exchange as one error call, and the next
request of the same session works and is recorded.
"""

from __future__ import annotations

import json
import os
import ssl
import time
from pathlib import Path

import anthropic
import httpx
import httpx2
import pytest

from interceptor.addons.mitm.gate import FLOW_HOOKS
from interceptor.scripts.replay_trace import main as replay_main
from interceptor.trace import read_trace
from interceptor.trace.verify import problems
from clients import KEY_ENV, REAL_KEY
from mitm import MitmProcess
from provider import ProviderSimulator, Reply
from waiting import wait_until

FAULTS = Path(__file__).with_name("faults.py")
IMPOSED = "imposed-model"


def hooks_of(*names: str) -> list[str]:
    """``Addon.hook`` for every flow hook the addon classes define (found, not listed, so a
    hook added later is injected too)."""
    from interceptor.addons.gateway import feedback, retry, rewrite
    from interceptor.addons.gateway.answer import collect, tee
    from interceptor.addons.gateway.transport import wsrelay
    from interceptor.addons.mitm import claim, control, reach, tlsguard

    classes = [control.Control, tlsguard.TlsGuard, claim.Claim, rewrite.Rewrite, reach.Reach,
               wsrelay.WsRelay, feedback.Feedback, tee.Tee, collect.Collect, retry.Retry]
    return [f"{c.__name__}.{h}" for c in classes for h in sorted(FLOW_HOOKS)
            if h in names and callable(getattr(c, h, None))]


REQUEST_SIDE = hooks_of("requestheaders", "request")
RESPONSE_SIDE = hooks_of("responseheaders", "response")


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    """One simulator and one proxy (with the fault script) for the whole module."""
    faults = tmp_path_factory.mktemp("faults") / "faults.json"
    faults.write_text("{}")
    with ProviderSimulator() as sim:
        proc = MitmProcess(options={"intercept_upstream": sim.url("/v1"), "intercept_api_key_env": KEY_ENV,
                                    "faults_file": str(faults)},
                           env={KEY_ENV: REAL_KEY}, extra_scripts=[FAULTS])
        proc.start(timeout=90)  # one start for the module: worth waiting for on a loaded machine
        try:
            yield sim, proc, faults
        finally:
            proc.cleanup()


class Rig:
    def __init__(self, rig, monkeypatch, **config):
        self.sim, self.proxy, self.faults = rig
        self.session = self.proxy.create_session(
            model=IMPOSED, upstream={"base_url": self.sim.url("/v1")}, **config)
        for k, v in self.session["env"].items():
            monkeypatch.setenv(k, v)
        self.client = anthropic.Anthropic(api_key=self.session["model_secret"], max_retries=0, timeout=30)
        self.sim.clear()

    def inject(self, spec: dict) -> None:
        self.faults.write_text(json.dumps(spec))
        os.utime(self.faults, ns=(1, os.stat(self.faults).st_mtime_ns + 1))

    def ask(self, text: str, stream: bool = False):
        kwargs = dict(model="claude-harness", max_tokens=64, messages=[{"role": "user", "content": text}])
        if stream:
            with self.client.messages.stream(**kwargs) as s:
                return s.get_final_message()
        return self.client.messages.create(**kwargs)

    def forwarded_prepared(self) -> None:
        """Whatever reached the provider was rewritten: the session's model, the real key."""
        for r in self.sim.requests:
            assert r.headers.get("x-api-key") == REAL_KEY
            assert self.session["model_secret"] not in r.body.decode("utf-8", "replace") + str(r.headers)
            if r.is_model_request:
                assert r.json["model"] == IMPOSED

    def sealed(self):
        status, _ = self.proxy.api("DELETE", f"sessions/{self.session['id']}")
        assert status == 200
        trace = read_trace(self.session["trace_path"])
        assert problems(trace) == []
        return trace


def assert_refused_in_shape(err: anthropic.APIStatusError, rig: Rig, step: str) -> None:
    assert err.status_code == 500
    assert err.response.headers["x-should-retry"] == "false"
    assert step in err.response.headers["x-interceptor-fault"]
    body = err.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "api_error"
    assert step in body["error"]["message"] and "nothing was forwarded" in body["error"]["message"]
    assert rig.session["model_secret"] not in err.response.text and REAL_KEY not in err.response.text


@pytest.fixture
def r(rig, monkeypatch):
    out = Rig(rig, monkeypatch)
    yield out
    out.inject({})


def test_every_hook_is_found():
    assert {"Rewrite.request", "Claim.requestheaders", "Retry.request", "Tee.responseheaders",
            "Tee.response"} <= set(REQUEST_SIDE + RESPONSE_SIDE)


# The steps a model request cannot leave without (Exchange.done, checked by the Gate). The
# others may be skipped harmlessly for this request: Control and Collect act on other flows,
# Reach only probes, Retry's requestheaders only notes that the connection was reused.
MUST_COMPLETE = {"Claim.requestheaders", "Rewrite.request", "Retry.request"}
BEFORE_CLAIM = {"Control.requestheaders", "Claim.requestheaders"}  # no session known yet


@pytest.mark.parametrize("how", ["raise", "skip"])
@pytest.mark.parametrize("step", REQUEST_SIDE)
def test_a_request_side_fault_forwards_nothing_and_the_next_turn_records(r, step, how):
    refused = how == "raise" or step in MUST_COMPLETE
    r.sim.script(Reply(text="first"))
    r.inject({how: step})
    try:
        answer = r.ask("one")
    except anthropic.APIStatusError as e:
        assert refused, f"{how} {step}: refused"
        assert_refused_in_shape(e, r, step if how == "raise" else step.split(".")[0])
        assert r.sim.model_requests() == []  # nothing left the proxy
    else:
        assert not refused, f"{how} {step}: forwarded"
        assert answer.content[0].text == "first"
    r.forwarded_prepared()
    r.inject({})
    r.sim.clear_scripts()
    r.sim.script(Reply(text="next"))
    assert r.ask("two").content[0].text == "next"
    r.forwarded_prepared()
    trace = r.sealed()
    kinds = [c.error.type if c.error else "turn" for c in trace.calls]
    if not refused:
        assert kinds == ["turn", "turn"]
    elif step in BEFORE_CLAIM:
        assert kinds == ["turn"]  # refused all the same, but no session to record it on
    else:
        assert kinds == ["internal_error", "turn"] and trace.calls[0].status == 500
    assert trace.nodes[trace.calls[-1].node].message.text() == "next"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("step", RESPONSE_SIDE)
def test_a_response_side_fault_never_delivers_an_unrecorded_answer(r, step, stream):
    r.sim.script(Reply(text="first"), Reply(text="second"))
    r.inject({"raise": step})
    try:
        answer = r.ask("one", stream=stream)
        delivered = True
        assert answer.content[0].text == "first"
    except anthropic.APIStatusError as e:
        assert_refused_in_shape(e, r, step)
        delivered = False
    r.inject({})
    assert r.ask("two", stream=stream).content[0].text == "second"
    r.forwarded_prepared()
    trace = r.sealed()
    first, second = trace.calls
    # The harness got the answer exactly when the record has it as a turn.
    assert (first.node is not None) == delivered
    if not delivered:
        assert first.error.type == "internal_error"
    assert second.node is not None and trace.nodes[second.node].message.text() == "second"


@pytest.mark.parametrize("policy", ["stop", "pass"])
@pytest.mark.parametrize("boundary", ["request", "response"])
@pytest.mark.parametrize("raised", ["SystemExit(3)", "KeyboardInterrupt()", "asyncio.CancelledError()",
                                    "GeneratorExit()", "Custom()"])
def test_a_session_hook_raising_any_base_exception_fails_closed(rig, monkeypatch, tmp_path, raised, boundary, policy):
    """The evaluator's hooks are in the class too: whatever one raises, a BaseException no
    ``except Exception`` stops included, is its session's ``hook_error`` under ``on_hook_error``:
    ``stop`` refuses a streamed request in Anthropic's shape (nothing forwarded for a request
    hook), ``pass`` serves the answer; the trace verifies, and the proxy serves the next session."""
    path = tmp_path / "raising.py"
    path.write_text("import asyncio\nfrom interceptor.hooks import Request, Response, intercept\n"
                    "class Custom(BaseException):\n    pass\n"
                    f"@intercept\ndef h({boundary}: {boundary.title()}):\n    raise {raised}\n")
    r = Rig(rig, monkeypatch, hooks={"module": str(path)}, on_hook_error=policy)
    r.sim.script(Reply(text="first"))
    if policy == "pass":
        assert r.ask("one", stream=True).content[0].text == "first"
    else:
        with pytest.raises(anthropic.InternalServerError) as e:
            r.ask("one", stream=True)
        assert e.value.response.headers["x-should-retry"] == "false"
        assert f"hook h: raised {raised.split('(')[0].split('.')[-1]}" in e.value.message
        if boundary == "request":
            assert r.sim.model_requests() == []
    r.forwarded_prepared()
    trace = r.sealed()
    assert [c.error.type if c.error else "turn" for c in trace.calls] == ["turn" if policy == "pass" else "hook_error"]
    after = Rig(rig, monkeypatch)
    after.sim.clear_scripts()  # "first" is still queued where nothing was forwarded
    after.sim.script(Reply(text="next"))
    assert after.ask("two", stream=True).content[0].text == "next"


def test_a_websocket_frame_fault_drops_the_frame_and_the_next_frame_records(r):
    from wsclient import WSClient

    r.sim.script(Reply(text="after"))
    r.inject({"raise": "WsRelay.websocket_message"})
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    create = {"type": "response.create", "model": "gpt-harness", "stream": True, "input": [user]}
    with WSClient("wss://api.openai.com/v1/responses",
                  headers={"Authorization": f"Bearer {r.session['model_secret']}"},
                  proxy=r.proxy.url, cafile=str(r.proxy.ca_bundle)) as ws:
        ws.send_json(create)
        (error,) = ws.until("error")
        assert error["status"] == 500 and "WsRelay.websocket_message" in error["error"]["message"]
        assert [f for f in r.sim.requests if f.transport == "websocket" and f.route != "websocket"] == []
        r.inject({})
        ws.send_json(create)
        events = ws.until("response.completed")
    assert "".join(e.get("delta", "") for e in events if e["type"] == "response.output_text.delta") == "after"
    frames = [f for f in r.sim.requests if f.transport == "websocket" and f.route != "websocket"]
    assert len(frames) == 1 and frames[0].json["model"] == IMPOSED
    trace = r.sealed()
    assert [c.error.type if c.error else "turn" for c in trace.calls] == ["internal_error", "turn"]


def test_an_unclaimed_provider_flow_never_leaves(r):
    """Claim answering nothing (skipped) on a provider host: the Gate refuses it, in shape,
    even with no exchange to look at."""
    r.inject({"skip": "Claim.requestheaders"})
    proxy = r.proxy.url
    with httpx.Client(proxy=proxy, verify=ssl.create_default_context(cafile=str(r.proxy.ca_bundle))) as http:
        resp = http.post("https://api.openai.com/v1/chat/completions",
                         headers={"authorization": f"Bearer {r.session['model_secret']}"},
                         json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 500 and resp.json()["error"]["type"] == "server_error"
    assert resp.headers["x-should-retry"] == "false"
    assert r.sim.requests == []


@pytest.mark.parametrize("depth,where", [(1500, "messages"), (500, "metadata")])
def test_a_deeply_nested_body_is_refused_in_shape_not_forwarded_as_sent(r, depth, where):
    """A body nested ~1,500 levels deep anywhere, or ~500 inside a small top-level value, is
    refused in shape: Rewrite failing on it must not let mitmproxy forward the request as sent,
    unrewritten and with the session secret."""
    nested = "[" * depth + "]" * depth
    body = ('{"model": "gpt-harness", "messages": [{"role": "user", "content": "hi", "x": %s}]}' % nested
            if where == "messages" else
            '{"model": "gpt-harness", "messages": [{"role": "user", "content": "hi"}], "metadata": %s}' % nested)
    with httpx.Client(proxy=r.proxy.url, verify=ssl.create_default_context(cafile=str(r.proxy.ca_bundle))) as http:
        resp = http.post("https://api.openai.com/v1/chat/completions", content=body.encode(),
                         headers={"authorization": f"Bearer {r.session['model_secret']}",
                                  "content-type": "application/json"})
    assert resp.status_code == 400 and "nested too deeply" in resp.json()["error"]["message"], resp.text
    assert resp.headers["x-should-retry"] == "false"
    assert set(resp.json()["error"]) >= {"message", "type"}
    assert r.session["model_secret"] not in resp.text
    assert r.sim.requests == []
    r.sim.script(Reply(text="fine"))
    assert r.ask("after").content[0].text == "fine"
    trace = r.sealed()
    assert trace.num_turns == 1


def test_a_full_disk_mid_session_loses_no_turn_and_health_says_so_while_it_lasts(r):
    """A full disk (ENOSPC) loses no turn: no half record is left mid-file with later turns
    unreadable behind it, health answers 503 while the disk is full, and the sealed trace
    verifies with every turn once the writes succeed again. 20 turns of one conversation,
    the disk full for turns 8..13 (every write puts half its bytes down, then fails)."""
    history: list[dict] = []
    health_while_full = []
    for k in range(20):
        if k == 8:
            r.inject({"disk_full": True})
        if k == 14:
            r.inject({})
        r.sim.script(Reply(text=f"answer {k}"))
        history.append({"role": "user", "content": f"question {k}"})
        answer = r.client.messages.create(model="claude-harness", max_tokens=64, messages=history)
        assert answer.content[0].text == f"answer {k}"
        history.append({"role": "assistant", "content": answer.content[0].text})
        if 9 <= k < 14:
            health_while_full.append(r.proxy.api("GET", "health", token=None))
    for status, body in health_while_full:
        assert status == 503 and body["ok"] is False and body["store"][r.session["id"]]["held"] >= 1
    status, summary = r.proxy.api("GET", f"sessions/{r.session['id']}")
    # the writer retries every second
    wait_until(lambda: r.proxy.api("GET", "health", token=None)[0] == 200, 10, "health ok once the writer wrote")
    trace = r.sealed()
    assert trace.num_turns == 20 and len(trace.branches) == 1 and not trace.errors
    assert [trace.nodes[c.node].message.text() for c in trace.calls] == [f"answer {k}" for k in range(20)]
    assert replay_main(["verify", r.session["trace_path"]]) == 0
    status, summary = r.proxy.api("GET", f"sessions/{r.session['id']}")
    assert summary["store"]["late"] >= 5 and summary["store"]["lost"] == 0
    assert r.proxy.log().count(f"cannot write {r.session['trace_path']}") == 1  # once per session


def test_a_writer_thread_that_ends_is_reported_replaced_and_loses_no_turn(r):
    """The trace writer's thread ends in the middle of a write (once, from a module-scoped
    proxy, this left every later DELETE waiting out its flush and health saying ok): health
    names it (503) while it lasts, the next record starts a new writer that writes what the
    old one held, in order, and the DELETE answers in time."""
    r.sim.script(Reply(text="one"), Reply(text="two"), Reply(text="three"))
    r.inject({"writer_dies": True})
    assert r.ask("first").content[0].text == "one"
    status, body = wait_until(lambda: (health := r.proxy.api("GET", "health", token=None))[0] != 200 and health, 10,
                              "health saying the writer died")
    assert status == 503 and body["ok"] is False and "SystemExit: injected" in body["writer"]
    r.inject({})
    history = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "one"},
               {"role": "user", "content": "second"}]
    assert r.client.messages.create(model="claude-harness", max_tokens=64, messages=history).content[0].text == "two"
    history += [{"role": "assistant", "content": "two"}, {"role": "user", "content": "third"}]
    assert r.client.messages.create(model="claude-harness", max_tokens=64, messages=history).content[0].text == "three"
    assert r.proxy.api("GET", "health", token=None)[0] == 200
    trace = r.sealed()
    assert [trace.nodes[c.node].message.text() for c in trace.calls] == ["one", "two", "three"]
    assert len(trace.branches) == 1 and not trace.errors
    assert "the writer thread stopped" in r.proxy.log() and "starting a new one" in r.proxy.log()


@pytest.mark.parametrize("step", hooks_of("error"))
def test_a_fault_in_an_error_hook_still_leaves_one_error_call(r, step):
    """The upstream cuts the stream (mitmproxy's ``error`` hook) and the hook that would
    record it raises: the Gate records the exchange instead, once; the next turn records."""
    r.sim.script(Reply(text=["a ", "b ", "c ", "d"], cut_after=3), Reply(text="whole"))
    r.inject({"raise": step})
    with pytest.raises((anthropic.APIError, httpx2.HTTPError)):  # the SDK's own httpx
        r.ask("one", stream=True)
    r.inject({})
    assert r.ask("two", stream=True).content[0].text == "whole"
    trace = r.sealed()
    kinds = [c.error.type if c.error else "turn" for c in trace.calls]
    assert len(kinds) == 2 and kinds[0] != "turn" and kinds[1] == "turn"


def test_a_failure_while_fetching_a_json_answer_is_a_500_and_the_request_is_not_sent_again(r):
    """Fetch (addons/gateway/transport/relay.py) sends a JSON exchange itself in the request hook: an error
    after the request went out cannot hand the flow on (the relay would send it a second
    time, and a second sample is a fork). The harness gets a 500 in its dialect's shape that
    its SDK does not retry; the upstream saw the request once; the record has one error call;
    the next turn records."""
    r.inject({"fetch_fails": True})
    with pytest.raises(anthropic.InternalServerError) as e:
        r.ask("fetched")
    assert e.value.response.headers["x-should-retry"] == "false"
    body = e.value.response.json()
    assert body["type"] == "error" and "not sent again" in body["error"]["message"]
    assert "InjectedFault" in body["error"]["message"]
    assert r.session["model_secret"] not in e.value.response.text and REAL_KEY not in e.value.response.text
    assert len(r.sim.model_requests()) == 1
    r.inject({})
    assert r.ask("next").content[0].text
    r.forwarded_prepared()
    trace = r.sealed()
    assert trace.num_turns == 1 and [c.status for c in trace.calls] == [500, 200]

"""The proxy says what it does: the status line in mitmdump's log, and each flow's annotation
in mitmweb's flow list (its own API, ``GET /flows``), for a turn, a replayed retry and a
refused request; the proxy's own answers marked as such."""

from __future__ import annotations

import json
import re
import secrets
import time
import urllib.request

import anthropic
import openai
import pytest

from interceptor.client.proxy import free_port
from clients import KEY_ENV, REAL_KEY, session_clients
from mitm import MitmProcess
from provider import Reply
from waiting import wait_until

STATUS = re.compile(r"interceptor status: .*")


def status_lines(proxy: MitmProcess) -> list[str]:
    return STATUS.findall(proxy.log())


def three_turns(sim, new_session, harness_env) -> dict:
    sim.script(*[Reply(text=f"answer {k}") for k in range(3)])
    s = new_session()
    harness_env(s["env"])
    oai, _ = session_clients(s)
    for k in range(3):
        oai.chat.completions.create(model="m", messages=[{"role": "user", "content": f"question {k}"}])
    return s


@pytest.mark.parametrize("proxy", [{"intercept_status": 1}], indirect=True)
def test_status_line_while_traffic_flows_then_quiet(sim, proxy, new_session, harness_env):
    assert status_lines(proxy) == []  # a live default session alone is idle: nothing said
    three_turns(sim, new_session, harness_env)
    line = wait_until(lambda: next((l for l in status_lines(proxy) if "totals 3 turns" in l), None), 20,
                      lambda: f"a status line with 'totals 3 turns' in {status_lines(proxy)}")
    assert "last minute 3 turns, 3 calls" in line and "0 errors, 0 replays, 0 refused" in line
    assert re.search(r"sessions 2 live, 0 sealed", line)  # the default session and ours
    assert re.search(r"trace \d+\.\d (KB|MB) written, [1-9]\d* records, \d+ queued", line)
    # idle: one last line saying so, then nothing
    wait_until(lambda: status_lines(proxy)[-1].endswith("· idle"), 10, lambda: f"'idle' last in {status_lines(proxy)}")
    said = len(status_lines(proxy))
    time.sleep(2.5)
    assert len(status_lines(proxy)) == said


@pytest.mark.parametrize("proxy", [{"intercept_status": 0}], indirect=True)
def test_status_zero_turns_it_off(sim, proxy, new_session, harness_env):
    three_turns(sim, new_session, harness_env)
    time.sleep(2.5)
    assert status_lines(proxy) == []


def test_a_negative_interval_stops_the_proxy_with_the_reason():
    proc = MitmProcess(options={"intercept_status": -1})
    try:
        proc.start(expect_failure=True)
        assert proc.wait(30) != 0
        assert "intercept_status must be a number of seconds >= 0" in proc.log()
    finally:
        proc.cleanup()


@pytest.fixture
def proxy(start_proxy, request):
    return start_proxy(getattr(request, "param", None))


# --- mitmweb -------------------------------------------------------------------------------

@pytest.fixture
def web(sim):
    password = secrets.token_hex(12)
    port = free_port()
    proc = MitmProcess(program="mitmweb", env={KEY_ENV: REAL_KEY}, options={
        "intercept_upstream": sim.url("/v1"), "intercept_api_key_env": KEY_ENV,
        "web_port": port, "web_host": "127.0.0.1", "web_open_browser": "false", "web_password": password})
    proc.start()

    def flows() -> list[dict]:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/flows",
                                     headers={"Authorization": f"Bearer {password}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.load(r)

    proc.flows = flows
    yield proc
    proc.cleanup()


def test_mitmweb_lists_each_flow_with_what_the_proxy_did(sim, web, harness_env):
    sim.script(Reply(text="first answer"), Reply(text="second answer"))
    s = web.create_session(upstream={"base_url": sim.url("/v1")})
    harness_env(s["env"])
    oai, _ = session_clients(s)
    msgs = [{"role": "user", "content": "summarise"}]
    oai.chat.completions.create(model="gpt-4o", messages=msgs)  # turn 1
    oai.chat.completions.create(model="gpt-4o", messages=msgs + [{"role": "assistant", "content": "first answer"},
                                                                 {"role": "user", "content": "more"}])  # turn 2
    again = oai.chat.completions.create(model="gpt-4o", messages=msgs + [
        {"role": "assistant", "content": "first answer"}, {"role": "user", "content": "more"}],
        extra_headers={"x-stainless-retry-count": "1"})  # the SDK's retry: replayed
    assert again.choices[0].message.content == "second answer" and len(sim.model_requests()) == 2
    bad = anthropic.Anthropic(api_key="sk-ic-m-not-a-session", max_retries=0, timeout=30)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model="claude-x", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):  # a non-model path of a provider host
        oai.files.list()

    def model_flows():
        # (a forwarded flow's host is the upstream's by now: the simulator's)
        got = [f for f in web.flows() if not f["request"]["path"].startswith("/_interceptor/")]
        return got if len(got) == 5 else None

    turn1, turn2, replay, refused, local = wait_until(model_flows, 20, "the five model flows in mitmweb")
    sid = s["id"]
    assert turn1["marked"] == turn2["marked"] == "🟢"
    assert turn1["comment"].startswith(f"interceptor: session {sid} · turn 1 · call 1 (")
    assert f"session {sid} · turn 2 · call 2 (" in turn2["comment"]
    assert "rewritten: model" not in turn1["comment"]  # the session imposes no model here
    call2 = re.search(r"call 2 \((\w+)\)", turn2["comment"]).group(1)
    assert replay["marked"] == "🔁"
    assert re.fullmatch(rf"interceptor: session {sid} · call 3 \(\w+\) · "
                        rf"replayed: the recorded answer of call {call2}, no second sample", replay["comment"])
    assert refused["marked"] == "⛔"
    assert refused["comment"] == ("interceptor: refused 401: unknown session secret: it matches no session of "
                                  "this proxy; nothing forwarded")
    assert local["marked"] == "🤖" and "answered by the proxy (not a model route)" in local["comment"]


def test_a_session_model_shows_as_a_rewrite(sim, web, harness_env):
    sim.script(Reply(text="ok"))
    s = web.create_session(model="session-model", sampling={"temperature": 0.25},
                           upstream={"base_url": sim.url("/v1")})
    harness_env(s["env"])
    oai, _ = session_clients(s)
    oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], temperature=1.0)
    flow = wait_until(lambda: next((f for f in web.flows() if f["request"]["path"] == "/v1/chat/completions"), None),
                      20, "the chat flow in mitmweb")
    assert "rewritten: model, temperature" in flow["comment"]


def test_the_turn_number_counts_committed_calls_in_any_order_of_answers():
    """Annotate's turn number is counted on from its last count (not a pass over every call
    at every turn); an answer that finishes before an earlier one still gets its own number."""
    from types import SimpleNamespace

    from interceptor.addons.mitm.annotate import _turn_number

    session = SimpleNamespace(state={})
    calls = [SimpleNamespace(node=n) for n in (1, None, 3, 5, None, 7, 9)]
    expected = [sum(1 for c in calls[:k + 1] if c.node is not None) for k in range(len(calls))]
    for k in (0, 2, 3, 6, 5, 3, 0):  # in order, then answers that finished late
        assert _turn_number(session, calls, k) == expected[k], k
    assert _turn_number(SimpleNamespace(state={}), calls, 6) == 5


def test_the_last_minute_counts_only_the_flows_inside_it(monkeypatch):
    """The line's "last minute" figures, kept as flows come and leave the window (not counted
    again each tick), say what the window holds at every tick, however ticks and flows interleave."""
    import types

    from mitmproxy.test import tflow

    from interceptor.addons.mitm import status as status_mod
    from interceptor.addons.gateway.sessions.session import Registry

    clock = [1000.0]
    monkeypatch.setattr(status_mod.time, "monotonic", lambda: clock[0])
    kinds = iter(["turn", "turn", "call", "turn", "replay", "turn"])
    monkeypatch.setattr(status_mod, "outcome", lambda flow, numbers: types.SimpleNamespace(kind=next(kinds)))
    st = status_mod.Status(Registry())
    st.interval = 5

    def at(t: float) -> str:
        clock[0] = 1000.0 + t
        return re.search(r"last minute (\d+) turns, (\d+) calls", st.line()).group(1, 2)

    for t in (0, 10):
        clock[0] = 1000.0 + t
        st.response(tflow.tflow(resp=True))  # a turn counts as a turn and a call
    assert at(20) == ("2", "2")
    clock[0] = 1030.0
    st.response(tflow.tflow(resp=True))  # a call
    st.error(tflow.tflow(resp=True))  # a turn
    assert at(65) == ("2", "3")  # the first turn left the window
    assert at(80) == ("1", "2")  # and the second
    clock[0] = 1085.0
    st.response(tflow.tflow(resp=True))  # a replay
    st.response(tflow.tflow(resp=True))  # a turn
    assert at(95) == ("1", "1")  # what came at 30 left; the replay is no turn or call
    assert at(200) == ("0", "0") and min(st.minute.values()) == 0
    assert st.totals["turn"] == 4 and st.totals["replay"] == 1

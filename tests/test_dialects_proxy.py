"""The dialects at the proxy level: a real mitmdump with the entry script, real SDKs (or a
raw HTTP client where the exact bytes matter) through HTTPS_PROXY, the simulator as the
provider.

- overrides: the request the provider receives carries the session's settings and nothing
  it would reject; a conforming request goes through byte for byte; the record says what
  changed and why, and holds no credential;
- stream faults (cut, ``error`` event after 200, malformed event, invalid UTF-8 split across
  chunks): the harness gets exactly the upstream's bytes, the record shows the error, no turn
  is committed, the proxy keeps serving;
- side routes (token counting, model lists): claimed, given the session's model, relayed,
  never recorded;
- content encoding: the harness gets the provider's encoded bytes, the record the decoded
  answer.

One simulator and one proxy serve the whole module (a session per test keeps tests apart),
so the file runs in seconds, not a mitmdump start per test.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx2 as httpx  # the HTTP client the SDKs themselves use
import openai
import pytest

import provider.wire
from clients import KEY_ENV, REAL_KEY, dead_upstream, session_clients
from interceptor.trace import read_trace
from mitm import MitmProcess
from provider import ProviderSimulator, Reply

SSE = "text/event-stream; charset=utf-8"
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
APIS = list(PATHS)


# -- one simulator, one proxy ------------------------------------------------------------


@pytest.fixture(scope="module")
def msim() -> Iterator[ProviderSimulator]:
    """Strict: every rewritten request must be one the real API accepts (tests/provider/strict.py)."""
    with ProviderSimulator(strict=True) as s:
        yield s


@pytest.fixture(scope="module")
def mproxy(msim: ProviderSimulator) -> Iterator[MitmProcess]:
    proc = MitmProcess(options={"intercept_upstream": msim.url("/v1"), "intercept_api_key_env": KEY_ENV,
                                "intercept_upstreams": dead_upstream()}, env={KEY_ENV: REAL_KEY})
    with proc:
        yield proc


@pytest.fixture
def sim(msim: ProviderSimulator) -> ProviderSimulator:
    msim.clear()
    msim.clear_scripts()
    msim.refuse.clear()
    return msim


@pytest.fixture
def make_session(mproxy: MitmProcess, sim: ProviderSimulator, harness_env):
    """A fresh session on the shared proxy, its environment applied to this process."""

    def create(**config) -> dict:
        config.setdefault("upstream", {"base_url": sim.url("/v1")})
        session = mproxy.create_session(**config)
        harness_env(session["env"])
        return session

    return create


def sealed(proxy: MitmProcess, session: dict):
    status, _ = proxy.api("DELETE", f"sessions/{session['id']}")
    assert status == 200
    return read_trace(session["trace_path"])


def summary(proxy: MitmProcess, session: dict) -> dict:
    status, body = proxy.api("GET", f"sessions/{session['id']}")
    assert status == 200
    return body


def assert_no_credentials(proxy: MitmProcess, session: dict) -> None:
    """Neither the session secret nor the real key is in the trace file or the proxy's log."""
    data = Path(session["trace_path"]).read_bytes()
    log = proxy.log()
    for secret in (session["model_secret"], session["state_secret"], REAL_KEY):
        assert secret.encode() not in data
        assert secret not in log


# -- raw HTTP, for byte comparisons ---------------------------------------------------------


def harness_headers(api: str, secret: str) -> dict[str, str]:
    if api == "messages":
        return {"x-api-key": secret, "anthropic-version": "2023-06-01", "content-type": "application/json"}
    return {"authorization": f"Bearer {secret}", "content-type": "application/json"}


def host_of(api: str) -> str:
    return "https://api.anthropic.com" if api == "messages" else "https://api.openai.com"


def fetch(client: httpx.Client, url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict, bytes, str | None]:
    """POST and read the body as it came off the wire (transfer coding undone, content
    coding kept); a body that breaks off is returned as far as it got, with the error."""
    got = bytearray()
    with client.stream("POST", url, content=body, headers=headers) as r:
        try:
            for chunk in r.iter_raw():
                got += chunk
        except httpx.HTTPError as e:
            return r.status_code, dict(r.headers), bytes(got), type(e).__name__
        return r.status_code, dict(r.headers), bytes(got), None


def direct(sim: ProviderSimulator, api: str, body: dict) -> tuple[int, dict, bytes, str | None]:
    """What the simulator sends for the next scripted reply, with no proxy in between."""
    with httpx.Client(timeout=20) as c:
        return fetch(c, sim.url(PATHS[api]), json.dumps(body).encode(), harness_headers(api, "direct"))


def proxied(proxy: MitmProcess, session: dict, api: str, body: dict | bytes) -> tuple[int, dict, bytes, str | None]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with httpx.Client(proxy=proxy.url, verify=ssl.create_default_context(cafile=str(proxy.ca_bundle)), timeout=20) as c:
        return fetch(c, host_of(api) + PATHS[api], raw, harness_headers(api, session["model_secret"]))


def request_body(api: str, prompt: str, *, stream: bool = True) -> dict:
    if api == "responses":
        body = {"model": "gpt-4o", "input": prompt}
    else:
        body = {"model": "gpt-4o" if api == "chat" else "claude-x", "messages": [{"role": "user", "content": prompt}]}
        if api == "messages":
            body["max_tokens"] = 64
    if stream:
        body["stream"] = True
    return body


# ===================================================================================== 1
# Overrides: the provider receives the session's settings and nothing it would reject.

THINKING = {"type": "enabled", "budget_tokens": 1024}
SEARCH_TOOL = {"name": "search", "description": "look it up",
               "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}


def anthropic_call(session: dict, **harness) -> None:
    """One Messages request through the proxy with the SDK (its settings in ``harness``)."""
    harness.setdefault("max_tokens", 200)
    _, ant = session_clients(session)
    r = ant.messages.create(model="claude-harness", messages=[{"role": "user", "content": "think first"}], **harness)
    assert r.content


def received(sim: ProviderSimulator) -> dict:
    [seen] = sim.model_requests()
    assert seen.headers.get("x-api-key") in (None, REAL_KEY)
    return seen.json


def the_call(proxy: MitmProcess, session: dict):
    trace = sealed(proxy, session)
    [call] = trace.calls
    assert call.error is None and trace.num_turns == 1
    assert_no_credentials(proxy, session)
    for o in call.overrides:
        assert o.key.lower() not in ("authorization", "x-api-key", "api-key")
    return call


def provider_reasons(call) -> dict[str, dict]:
    """The overrides made for a provider constraint (not plain session authority), by key."""
    return {o.key: o.model_dump() for o in call.overrides if o.reason != "session"}


@pytest.mark.parametrize("temperature,sent", [(0.5, None), (1, 1)])
def test_anthropic_thinking_takes_no_temperature_but_1(make_session, sim, mproxy, temperature, sent):
    session = make_session(model="claude-sim", sampling={"thinking": THINKING, "max_tokens": 4096, "temperature": temperature})
    anthropic_call(session, extra_body={"temperature": 0.2})
    body = received(sim)
    assert body.get("temperature") == sent
    assert body["thinking"] == THINKING and body["model"] == "claude-sim"
    call = the_call(mproxy, session)
    assert {"key": "temperature", "old": 0.2, "new": temperature, "reason": "session"} in [o.model_dump() for o in call.overrides]
    if sent is None:
        o = provider_reasons(call)["temperature"]
        assert (o["old"], o["new"]) == (0.5, None) and "thinking" in o["reason"]
    else:
        assert "temperature" not in provider_reasons(call)
    assert call.sampling.temperature == sent and call.sampling.thinking == THINKING


def test_anthropic_thinking_takes_no_top_k(make_session, sim, mproxy):
    session = make_session(sampling={"thinking": THINKING, "top_k": 40})
    anthropic_call(session, extra_body={"top_k": 5})
    body = received(sim)
    assert "top_k" not in body and body["thinking"] == THINKING
    call = the_call(mproxy, session)
    o = provider_reasons(call)["top_k"]
    assert (o["old"], o["new"]) == (40, None) and "top_k" in o["reason"]
    assert call.sampling.top_k is None


@pytest.mark.parametrize("who", ["harness", "session"])
def test_anthropic_thinking_turns_a_forced_tool_choice_to_auto(make_session, sim, mproxy, who):
    sampling = {"thinking": THINKING}
    harness = {"tools": [SEARCH_TOOL]}
    if who == "harness":
        harness["tool_choice"] = {"type": "tool", "name": "search", "disable_parallel_tool_use": True}
        forced = harness["tool_choice"]
        expected = {"type": "auto", "disable_parallel_tool_use": True}
    else:
        sampling["tool_choice"] = "required"
        forced = {"type": "any"}
        expected = {"type": "auto"}
    session = make_session(sampling=sampling)
    anthropic_call(session, **harness)
    body = received(sim)
    assert body["tool_choice"] == expected and body["tools"][0]["name"] == "search"
    call = the_call(mproxy, session)
    o = provider_reasons(call)["tool_choice"]
    assert (o["old"], o["new"]) == (forced, expected) and "forced tool choice" in o["reason"]


@pytest.mark.parametrize("top_p,sent", [(0.5, 0.95), (0.97, 0.97), (1, 1)])
def test_anthropic_thinking_clamps_top_p(make_session, sim, mproxy, top_p, sent):
    session = make_session(sampling={"thinking": THINKING, "top_p": top_p})
    anthropic_call(session, extra_body={"top_p": 0.1})
    assert received(sim)["top_p"] == sent
    call = the_call(mproxy, session)
    if sent != top_p:
        o = provider_reasons(call)["top_p"]
        assert (o["old"], o["new"]) == (top_p, sent) and "[0.95, 1]" in o["reason"]
    else:
        assert "top_p" not in provider_reasons(call)


@pytest.mark.parametrize("session_max", [None, 1500])
def test_anthropic_thinking_budget_stays_below_max_tokens(make_session, sim, mproxy, session_max):
    thinking = {"type": "enabled", "budget_tokens": 2048}
    sampling = {"thinking": thinking} | ({"max_tokens": session_max} if session_max else {})
    session = make_session(sampling=sampling)
    anthropic_call(session, max_tokens=1000)  # required: the harness's value stays without the session's
    body = received(sim)
    asked = session_max or 1000
    assert body["thinking"] == thinking
    assert body["max_tokens"] == 2048 + asked > body["thinking"]["budget_tokens"]
    call = the_call(mproxy, session)
    o = provider_reasons(call)["max_tokens"]
    assert (o["old"], o["new"]) == (asked, 2048 + asked) and "budget_tokens" in o["reason"]
    assert call.sampling.max_tokens == 2048 + asked


@pytest.mark.parametrize("model", ["o3", "gpt-5", "gpt-5-mini"])
def test_openai_reasoning_model_chat_gets_max_completion_tokens_and_no_temperature(make_session, sim, mproxy, model):
    session = make_session(model=model, sampling={"temperature": 0.7, "top_p": 0.9, "max_tokens": 500, "reasoning_effort": "low"})
    oai, _ = session_clients(session)
    oai.chat.completions.create(model="gpt-4o", temperature=1.0, max_tokens=50,
                                messages=[{"role": "user", "content": "hi"}])
    body = received(sim)
    assert body["model"] == model
    assert body["max_completion_tokens"] == 500 and "max_tokens" not in body
    assert "temperature" not in body and "top_p" not in body
    assert body["reasoning_effort"] == "low"
    call = the_call(mproxy, session)
    reasons = provider_reasons(call)
    assert set(reasons) == {"temperature", "top_p"}
    assert reasons["temperature"]["old"] == 0.7 and reasons["temperature"]["new"] is None
    assert "reasoning model" in reasons["temperature"]["reason"]
    assert {"key": "max_tokens", "old": 50, "new": None, "reason": "session"} in [o.model_dump() for o in call.overrides]
    assert {"key": "max_completion_tokens", "old": None, "new": 500, "reason": "session"} in [o.model_dump() for o in call.overrides]
    assert call.sampling.temperature is None and call.sampling.max_tokens == 500


def test_openai_chat_model_keeps_temperature(make_session, sim, mproxy):
    """The non-reasoning sibling (``gpt-5-chat-latest``) takes temperature: nothing dropped."""
    session = make_session(model="gpt-5-chat-latest", sampling={"temperature": 0.7, "max_tokens": 500})
    oai, _ = session_clients(session)
    oai.chat.completions.create(model="gpt-4o", max_tokens=50, messages=[{"role": "user", "content": "hi"}])
    body = received(sim)
    assert body["temperature"] == 0.7 and body["max_completion_tokens"] == 500 and "max_tokens" not in body
    assert provider_reasons(the_call(mproxy, session)) == {}


@pytest.mark.parametrize("model", ["o3", "gpt-5", "gpt-4.1"])
def test_responses_gets_max_output_tokens_and_reasoning_effort(make_session, sim, mproxy, model):
    session = make_session(model=model, sampling={"temperature": 0.3, "max_tokens": 300, "reasoning_effort": "high"})
    oai, _ = session_clients(session)
    oai.responses.create(model="gpt-4o", input="hi", temperature=1.0, max_output_tokens=20,
                         reasoning={"effort": "low", "summary": "auto"})
    body = received(sim)
    assert body["model"] == model
    assert body["max_output_tokens"] == 300 and "max_tokens" not in body
    reasoning_model = model != "gpt-4.1"
    # The session's effort; the harness's own summary request is not a sampling setting. A
    # model that does not reason refuses `reasoning` (models.json), so it goes whole.
    assert body.get("reasoning") == ({"effort": "high", "summary": "auto"} if reasoning_model else None)
    assert body.get("temperature") == (None if reasoning_model else 0.3)
    call = the_call(mproxy, session)
    overrides = [o.model_dump() for o in call.overrides]
    assert {"key": "reasoning.effort", "old": "low", "new": "high", "reason": "session"} in overrides
    assert {"key": "max_output_tokens", "old": 20, "new": 300, "reason": "session"} in overrides
    assert set(provider_reasons(call)) == ({"temperature"} if reasoning_model else {"reasoning"})
    assert call.sampling.reasoning_effort == ("high" if reasoning_model else None)
    assert call.sampling.max_tokens == 300


# A request that already satisfies its session, spelled the way no serializer of ours
# would (spaces, key order, escaped non-ASCII): any re-encoding would show.
CONFORMING = {
    "chat": (
        {"model": "o3", "sampling": {"max_tokens": 500, "reasoning_effort": "low", "seed": 7}},
        b'{ "messages" : [ {"role":"user", "content":"caf\\u00e9 \xe2\x82\xac"} ],\n'
        b'  "seed": 7, "reasoning_effort":"low", "max_completion_tokens": 500, "model":"o3" }',
    ),
    "responses": (
        {"model": "gpt-5", "sampling": {"max_tokens": 300, "reasoning_effort": "high"}},
        b'{"input":"caf\\u00e9",  "reasoning": {"summary":"auto", "effort":"high"},'
        b' "max_output_tokens":300, "model":"gpt-5", "store": false}',
    ),
    "messages": (
        {"model": "claude-sim", "sampling": {"thinking": {"type": "enabled", "budget_tokens": 1024},
                                             "temperature": 1, "top_p": 0.97, "max_tokens": 4096}},
        b'{"max_tokens": 4096, "model": "claude-sim", "top_p": 0.97, "temperature": 1,\n'
        b' "thinking": {"budget_tokens": 1024, "type": "enabled"}, "tool_choice": {"type": "auto"},\n'
        b' "tools": [{"name": "search", "input_schema": {"type": "object"}}],\n'
        b' "messages": [{"role": "user", "content": [{"type": "text", "text": "caf\\u00e9"}]}]}',
    ),
}


@pytest.mark.parametrize("api", APIS)
def test_conforming_request_is_forwarded_byte_for_byte(make_session, sim, mproxy, api):
    config, raw = CONFORMING[api]
    session = make_session(**config)
    status, _, data, err = proxied(mproxy, session, api, raw)
    assert status == 200 and err is None, data
    [seen] = sim.model_requests()
    assert seen.body == raw
    assert seen.path.startswith(PATHS[api])
    call = the_call(mproxy, session)
    assert call.overrides == []
    assert call.model == config["model"]


# ===================================================================================== 2
# Stream faults: the harness gets the upstream's bytes, the record the error, no turn.

TEXT = ["Hel", "lo ", "wor", "ld, ", "how ", "are ", "you?"]


def clean_stream(sim: ProviderSimulator, api: str) -> bytes:
    """A complete, well-formed stream of this API as the simulator writes it."""
    sim.script(Reply(text=TEXT))
    status, _, data, err = direct(sim, api, request_body(api, "template"))
    assert status == 200 and err is None
    return data


def malformed(api: str) -> bytes:
    if api == "messages":
        return b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_de\n\n'
    return b'data: {"id":"chatcmpl-x","choices":[{"index":0,"delta":{"content":"tru\n\n'


def with_bad_utf8(events: list[bytes]) -> tuple[list[bytes], int]:
    """The events with ``wor`` in one text delta made ``w\\xe2\\x82r`` (a three-byte
    sequence broken off after two bytes), and the position of the split: between
    ``\\xe2`` and ``\\x82``, so the bad sequence straddles two network chunks."""
    for i, ev in enumerate(events):
        if b'"wor"' in ev:
            bad = ev.replace(b'"wor"', b'"w\xe2\x82r"')
            return events[:i] + [bad] + events[i + 1:], i
    raise AssertionError("no delta with 'wor'")


FAULTS = {
    # fault: (what the record says, does the harness see the body break off)
    "cut": ("incomplete_stream", True),
    "error_event": (None, False),  # the provider's own error type, checked below
    "malformed_event": ("malformed_event", False),
    "invalid_utf8_split": ("malformed_event", False),
}
ERROR_EVENT_TYPE = {"chat": "server_error", "responses": "server_error", "messages": "overloaded_error"}


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("api", APIS)
def test_stream_fault_is_relayed_verbatim_recorded_and_survived(make_session, sim, mproxy, monkeypatch, api, fault):
    events = provider.wire.split_events(clean_stream(sim, api))
    assert len(events) >= 6
    chunks = None
    if fault == "cut":
        reply = Reply(raw=b"".join(events), content_type=SSE, cut_after=len(events) // 2)
    elif fault == "error_event":
        # The simulator's own error event for this API after three events of a real answer.
        sim.script(Reply(text=TEXT, error_after=3))
        _, _, upstream, err = direct(sim, api, request_body(api, "template"))
        assert err is None and upstream.count(b"\n\n") == 4
        reply = Reply(raw=upstream, content_type=SSE)
    elif fault == "malformed_event":
        reply = Reply(raw=b"".join(events[:3] + [malformed(api)] + events[3:]), content_type=SSE)
    else:
        bad, i = with_bad_utf8(events)
        cut = bad[i].index(b"\xe2") + 1
        chunks = bad[:i] + [bad[i][:cut], bad[i][cut:]] + bad[i + 1:]
        reply = Reply(raw=b"".join(chunks), content_type=SSE, delay=0.02)
    if chunks is not None:
        # The simulator writes one chunk per event; this fault needs a split inside one.
        original = provider.wire.split_events
        monkeypatch.setattr(provider.wire, "split_events",
                            lambda body: list(chunks) if body == b"".join(chunks) else original(body))

    sim.script(reply, reply)
    reference = direct(sim, api, request_body(api, "template"))
    session = make_session()
    got = proxied(mproxy, session, api, request_body(api, "faulty"))
    status, headers, data, broke = got
    assert status == 200
    assert data == reference[2], "the harness must get exactly the bytes the upstream sent"
    assert headers["content-type"] == reference[1]["content-type"]
    expected_type, breaks = FAULTS[fault]
    assert (broke is not None) == breaks == (reference[3] is not None)
    assert summary(mproxy, session)["turns"] == 0

    # The proxy keeps serving the same session: a normal request commits a turn.
    oai, ant = session_clients(session)
    if api == "chat":
        text = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "again"}]).choices[0].message.content
    elif api == "responses":
        text = oai.responses.create(model="m", input="again").output_text
    else:
        text = ant.messages.create(model="m", max_tokens=20, messages=[{"role": "user", "content": "again"}]).content[0].text
    assert text == "You said: again"
    assert summary(mproxy, session)["turns"] == 1

    trace = sealed(mproxy, session)
    bad_call, good_call = trace.calls
    assert bad_call.error is not None and bad_call.node is None
    assert bad_call.error.type == (expected_type or ERROR_EVENT_TYPE[api])
    assert bad_call.status == 200 and bad_call.stream
    assert good_call.error is None and good_call.node is not None
    assert trace.num_turns == 1
    assert "faulty" not in " ".join(n.message.text() for n in trace.nodes)


@pytest.mark.parametrize("api", APIS)
def test_valid_utf8_split_across_chunks_is_a_clean_turn(make_session, sim, mproxy, monkeypatch, api):
    """The control for the fault above: a character split between chunks is not damage."""
    euro = "€".encode()
    events = provider.wire.split_events(clean_stream(sim, api).replace(b"wor", b"w" + euro + b"r"))
    i = next(i for i, ev in enumerate(events) if euro in ev)
    cut = events[i].index(euro) + 2  # between the second and third byte of the character
    chunks = events[:i] + [events[i][:cut], events[i][cut:]] + events[i + 1:]
    original = provider.wire.split_events
    monkeypatch.setattr(provider.wire, "split_events",
                        lambda body: list(chunks) if body == b"".join(chunks) else original(body))
    sim.script(Reply(raw=b"".join(chunks), content_type=SSE, delay=0.02))
    session = make_session()
    status, _, data, err = proxied(mproxy, session, api, request_body(api, "split"))
    assert status == 200 and err is None and data == b"".join(chunks)
    trace = sealed(mproxy, session)
    [call] = trace.calls
    assert call.error is None and trace.num_turns == 1
    assert trace.nodes[call.node].message.text() == "".join(TEXT).replace("wor", "w€r")


# ===================================================================================== 3
# Side routes: claimed, the session's model, relayed, never a turn or a call.


def test_side_routes_are_claimed_relayed_with_the_session_model_and_not_recorded(make_session, sim, mproxy):
    session = make_session(model="side-model")
    oai, ant = session_clients(session)

    counted = ant.messages.count_tokens(model="claude-harness", messages=[{"role": "user", "content": "count these words"}])
    assert counted.input_tokens > 0
    counted = oai.responses.input_tokens.count(model="gpt-harness", input="count these words")
    assert counted.input_tokens > 0
    assert "gpt-5" in [m.id for m in oai.models.list()]
    assert ant.models.list().data[0].type == "model"
    assert oai.models.retrieve("gpt-5").id == "gpt-5"

    seen = sim.requests
    assert [r.route for r in seen] == ["count_tokens", "input_tokens", "models", "models", "model"]
    assert [r.json["model"] for r in seen[:2]] == ["side-model", "side-model"]
    # Each provider's own key header, with the real key; never the session secret.
    keys = [r.headers.get("x-api-key") or r.headers.get("authorization") for r in seen]
    assert keys == [REAL_KEY, f"Bearer {REAL_KEY}", f"Bearer {REAL_KEY}", REAL_KEY, f"Bearer {REAL_KEY}"]
    for r in seen:
        assert session["model_secret"] not in json.dumps(dict(r.headers))

    assert summary(mproxy, session)["calls"] == 0
    trace = sealed(mproxy, session)
    assert trace.calls == [] and trace.num_turns == 0 and trace.nodes == []
    assert_no_credentials(mproxy, session)


@pytest.mark.parametrize("secret", ["none", "unknown"])
@pytest.mark.parametrize("route", ["count_tokens", "input_tokens", "models-openai", "models-anthropic"])
def test_side_routes_are_refused_without_a_session_secret(make_session, sim, mproxy, route, secret):
    make_session()  # for the proxy and CA in the environment
    key = "sk-not-a-session" if secret == "unknown" else "placeholder"
    oai = openai.OpenAI(api_key=key, max_retries=0)
    ant = anthropic.Anthropic(api_key=key, max_retries=0)
    if secret == "none":
        oai = oai.with_options(default_headers={"Authorization": ""})
        ant = ant.with_options(default_headers={"x-api-key": ""})
    calls = {
        "count_tokens": lambda: ant.messages.count_tokens(model="m", messages=[{"role": "user", "content": "x"}]),
        "input_tokens": lambda: oai.responses.input_tokens.count(model="m", input="x"),
        "models-openai": lambda: oai.models.list(),
        "models-anthropic": lambda: ant.models.list(),
    }
    error = anthropic.AuthenticationError if route in ("count_tokens", "models-anthropic") else openai.AuthenticationError
    with pytest.raises(error) as e:
        calls[route]()
    assert e.value.status_code == 401 and e.value.response.headers["x-should-retry"] == "false"
    assert sim.requests == []


# ===================================================================================== 4
# Content encoding: the harness gets the provider's bytes, the record the decoded answer.


def sdk_call(oai: openai.OpenAI, ant: anthropic.Anthropic, api: str, stream: bool, prompt: str):
    """(text, content-encoding the harness received) through the SDK's raw-response API."""
    if api == "chat":
        raw = oai.chat.completions.with_raw_response.create(
            model="m", stream=stream, messages=[{"role": "user", "content": prompt}])
        parsed = raw.parse()
        text = "".join(c.choices[0].delta.content or "" for c in parsed if c.choices) if stream else parsed.choices[0].message.content
    elif api == "responses":
        raw = oai.responses.with_raw_response.create(model="m", stream=stream, input=prompt)
        parsed = raw.parse()
        text = "".join(e.delta for e in parsed if e.type == "response.output_text.delta") if stream else parsed.output_text
    else:
        raw = ant.messages.with_raw_response.create(
            model="m", max_tokens=50, stream=stream, messages=[{"role": "user", "content": prompt}])
        parsed = raw.parse()
        if stream:
            text = "".join(e.delta.text for e in parsed if e.type == "content_block_delta")
        else:
            text = parsed.content[0].text
    return text, raw.headers.get("content-encoding")


@pytest.mark.parametrize("encoding", ["gzip", "br", "zstd", "deflate"])
def test_content_encoding_reaches_the_harness_and_the_record_is_decoded(make_session, sim, mproxy, encoding):
    session = make_session()
    oai, ant = session_clients(session)
    expected = []
    for api in APIS:
        for stream in (True, False):
            words = [f"{api} ", "stream " if stream else "json ", encoding, " ünïcode"]
            sim.script(Reply(text=words, content_encoding=encoding))
            text, sent_encoding = sdk_call(oai, ant, api, stream, f"{api}-{stream}")
            assert text == "".join(words)
            assert sent_encoding == encoding
            expected.append("".join(words))
    # The same encoded bytes through the proxy as straight from the simulator (a body
    # scripted verbatim: generated ones carry fresh ids per request).
    for api, stream in (("chat", True), ("messages", False)):
        sim.script(Reply(text="ü" * 300))
        _, _, plain, _ = direct(sim, api, request_body(api, "template", stream=stream))
        reply = Reply(raw=plain, content_type=SSE if stream else "application/json", content_encoding=encoding)
        sim.script(reply, reply)
        ref = direct(sim, api, request_body(api, "raw", stream=stream))
        got = proxied(mproxy, session, api, request_body(api, f"raw-{api}-{stream}", stream=stream))
        assert got[0] == ref[0] == 200
        assert got[1]["content-encoding"] == ref[1]["content-encoding"] == encoding
        assert got[2] == ref[2] and got[3] is None
        assert len(got[2]) < len(plain)  # encoded, not passed on decoded
    trace = sealed(mproxy, session)
    assert all(c.error is None for c in trace.calls) and len(trace.calls) == 8
    assert [trace.nodes[c.node].message.text() for c in trace.calls] == expected + ["ü" * 300] * 2
    assert all(c.usage and c.usage.output_tokens > 0 for c in trace.calls)


def test_side_route_to_a_dead_upstream_is_a_502_and_still_not_recorded(make_session, sim, mproxy):
    session = make_session(upstream="dead")
    _, ant = session_clients(session)
    with pytest.raises(anthropic.APIStatusError) as e:
        ant.messages.count_tokens(model="m", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 502 and e.value.body["type"] == "error"
    trace = sealed(mproxy, session)
    assert trace.calls == [] and trace.num_turns == 0

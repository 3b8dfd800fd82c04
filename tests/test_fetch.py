"""A JSON exchange is fetched in mitmproxy's request hook (addons/gateway/transport/relay.py, ``Fetch``): no
loopback hop, the same answer, the same record. A stream is sent from there too,
and the loopback carries only its request's head.

The relay used to carry every model exchange as two HTTP exchanges, mitmproxy's with the
relay on loopback and the relay's with the upstream. A JSON answer is read whole before any
of it goes to the harness, so the first one only cost time; now the relay's own upstream
connection is used from the request hook and the answer handed to mitmproxy. What must hold:
mitmproxy opens no connection of its own for it (streams still go through the relay), the
harness and the record get what the upstream sent (an answer that is a stream after all goes
down as it came), and a broken answer is an error in the dialect's shape, sent once. The
client-goes-away cases (read on, recorded as undelivered, the retry coalesced, bounded by
``intercept_drain_timeout``) are tests/test_early_close.py's, run through this path too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import anthropic
import httpx2 as httpx
import openai
import pytest

from clients import session_clients
from interceptor.trace import read_trace
from faults import BLIND_SAID, UNWATCHED_SAID
from provider import Reply
from waiting import wait_until

MESSAGES = [{"role": "user", "content": "count"}]
FAULTS = Path(__file__).with_name("faults.py")
LOOPBACK = Path(__file__).with_name("loopback.py")


def server_connects(proxy) -> list[str]:
    """The connections mitmproxy opened itself (its debug log names each one)."""
    return re.findall(r"server connect (\S+)", proxy.log())


def recorded_calls(session) -> int:
    """The calls on the record so far (the proxy reads on after the client left)."""
    try:
        return len(read_trace(session["trace_path"]).calls)
    except Exception:  # noqa: BLE001 - a record being written
        return 0


def chat_sse(*texts: str) -> str:
    """A Chat Completions stream as the API sends it: a chunk per text, the stop, ``[DONE]``."""
    chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    events = [{**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": t}, "finish_reason": None}]}
              for t in texts]
    events.append({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def abandoned_stream(sim, start_proxy, tmp_path, faults: dict, text: str):
    """A proxy with tests/faults.py set to ``faults``; a JSON request answered, after 1.2 s, by a
    stream that its client (0.4 s read timeout) gave up on; back once the exchange is on the
    record. The proxy and the session."""
    spec = tmp_path / "faults.json"
    spec.write_text(json.dumps(faults))
    proxy = start_proxy({"faults_file": str(spec)}, extra_scripts=[FAULTS])
    session = proxy.create_session(upstream={"base_url": sim.url("/v1")})
    sim.script(Reply(raw=chat_sse(text), content_type="text/event-stream", first_byte_delay=1.2))
    with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=httpx.Timeout(30.0, read=0.4)) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("https://api.openai.com/v1/chat/completions", json={"model": "m", "messages": MESSAGES},
                        headers={"authorization": f"Bearer {session['model_secret']}"})
    wait_until(lambda: recorded_calls(session), 20, "the abandoned exchange on the record")
    return proxy, session


def sealed(proxy, session):
    status, _ = proxy.api("DELETE", f"sessions/{session['id']}")
    assert status == 200
    return read_trace(session["trace_path"])


def test_json_exchanges_open_no_mitmproxy_connection_and_streams_go_through_the_relay(
        sim, start_proxy, harness_env):
    proxy = start_proxy({"termlog_verbosity": "debug"})
    session = proxy.create_session(upstream={"base_url": sim.url("/v1")})
    harness_env(session["env"])
    oai, ant = session_clients(session)
    sim.script(Reply(text="one"), Reply(text="two"), Reply(text=["thr", "ee"]), Reply(text="four"))
    assert oai.chat.completions.create(model="m", messages=MESSAGES).choices[0].message.content == "one"
    assert ant.messages.create(model="c", max_tokens=16, messages=MESSAGES).content[0].text == "two"
    assert server_connects(proxy) == []  # answered from the request hook: no hop to the relay
    with oai.chat.completions.stream(model="m", messages=MESSAGES) as s:
        assert s.get_final_completion().choices[0].message.content == "three"
    hops = server_connects(proxy)
    assert len(hops) == 1 and hops[0].startswith("127.0.0.1:")  # the stream: mitmproxy to the relay
    assert oai.chat.completions.create(model="m", messages=MESSAGES).choices[0].message.content == "four"
    assert server_connects(proxy) == hops
    trace = sealed(proxy, session)
    assert [c.status for c in trace.calls] == [200] * 4 and trace.num_turns == 4
    assert [trace.nodes[c.node].message.text() for c in trace.calls] == ["one", "two", "three", "four"]
    assert all(c.delivered for c in trace.calls)


def test_a_stream_is_sent_from_the_request_hook_and_the_loopback_carries_only_its_head(
        sim, start_proxy, harness_env, tmp_path):
    """A streamed turn's request goes upstream from Fetch; the relay passes the stream down
    and never reads the body mitmproxy sends it, so mitmproxy sends an empty one: a 200 KB
    history crossed the loopback twice a turn. The upstream gets the whole body, the harness
    the stream, and every observer (the flow at the answer's headers and at its end, the
    flow file) the request as it went upstream. Chat and Anthropic, two turns each."""
    from mitmproxy.io import FlowReader

    flows = tmp_path / "flows.out"
    proxy = start_proxy({"save_stream_file": str(flows)}, extra_scripts=[LOOPBACK])
    session = proxy.create_session(upstream={"base_url": sim.url("/v1")}, model="imposed")
    harness_env(session["env"])
    oai, ant = session_clients(session)
    history = [{"role": "user", "content": "a long document: " + "word " * 40_000}]
    sim.script(*[Reply(text=["stre", "amed"]) for _ in range(4)])
    for k in range(2):
        with oai.chat.completions.stream(model="m", messages=history + [{"role": "user", "content": f"c{k}"}]) as s:
            assert s.get_final_completion().choices[0].message.content == "streamed"
        with ant.messages.stream(model="c", max_tokens=16,
                                 messages=history + [{"role": "user", "content": f"a{k}"}]) as s:
            assert s.get_final_message().content[0].text == "streamed"
    sent = sim.model_requests()
    assert len(sent) == 4 and all(len(r.body) > 200_000 and r.json["model"] == "imposed" for r in sent)
    log = proxy.log()
    assert re.findall(r"LOOPBACK body=(\d+) length=(\S+)", log) == [("0", "0")] * 4
    observed = re.findall(r"OBSERVED body=(\d+) length=(\S+) at=(\S+)", log)
    assert len(observed) == 8  # the answer's headers and its end, per turn
    bodies = [len(r.body) for r in sent]
    upstream = sim.url("/v1").split("/")[2]  # the simulator's host:port, not the relay's
    assert observed == [(str(n), str(n), upstream) for n in bodies for _ in range(2)]
    proxy.stop()
    with flows.open("rb") as f:
        saved = [f for f in FlowReader(f).stream() if f.request.path.endswith(("/completions", "/messages"))]
    assert [f.request.raw_content for f in saved] == [r.body for r in sent]
    assert all(f.request.headers["content-length"] == str(len(f.request.raw_content)) for f in saved)


def test_a_stream_answer_to_a_json_request_goes_down_as_it_came(sim, proxy, new_session, harness_env):
    """The upstream streams though the request did not ask for it: the relay passes the
    stream on as the upstream sent it (not read whole first), sent once, recorded as a turn."""
    session = new_session()
    harness_env(session["env"])
    raw = chat_sse("str", "eamed")
    sim.script(Reply(raw=raw, content_type="text/event-stream"))
    oai, _ = session_clients(session)
    got = oai.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
    assert got.headers["content-type"].startswith("text/event-stream")
    assert got.http_response.text == raw
    assert len(sim.model_requests()) == 1
    trace = sealed(proxy, session)
    assert trace.num_turns == 1 and trace.nodes[trace.calls[0].node].message.text() == "streamed"


@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
def test_a_json_answer_cut_mid_body_is_a_502_in_the_dialects_shape_sent_once(dialect, sim, proxy, new_session,
                                                                            harness_env):
    session = new_session()
    harness_env(session["env"])
    oai, ant = session_clients(session)
    sim.script(Reply(text="a long answer that will not arrive whole", cut_after=40, chunked=False))
    with pytest.raises(openai.InternalServerError if dialect == "openai" else anthropic.InternalServerError) as e:
        if dialect == "openai":
            oai.chat.completions.create(model="m", messages=MESSAGES)
        else:
            ant.messages.create(model="c", max_tokens=16, messages=MESSAGES)
    response = e.value.response
    assert response.status_code == 502 and response.headers["x-should-retry"] == "true"
    body = response.json()
    assert (body["error"]["type"] == "api_error") if dialect == "anthropic" else ("message" in body["error"])
    assert "broke the connection before the answer's end" in body["error"]["message"]
    assert session["model_secret"] not in response.text
    assert len(sim.model_requests()) == 1
    trace = sealed(proxy, session)
    assert trace.num_turns == 0 and [c.status for c in trace.calls] == [502]


def test_an_http2_client_is_fetched_and_streamed_with_its_authority_as_host(sim, proxy, new_session):
    """An HTTP/2 client (as Rust and Go SDKs negotiate) sends no Host header: the request the
    proxy sends upstream carries its authority, for a fetched JSON answer and a stream alike."""
    session = new_session()
    sim.script(Reply(text="over h2"), Reply(text=["h2 ", "stream"]))
    with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), http2=True, timeout=30) as client:
        headers = {"authorization": f"Bearer {session['model_secret']}"}
        r = client.post("https://api.openai.com/v1/chat/completions", headers=headers,
                        json={"model": "m", "messages": MESSAGES})
        assert r.http_version == "HTTP/2" and r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == "over h2"
        with client.stream("POST", "https://api.openai.com/v1/chat/completions", headers=headers,
                           json={"model": "m", "messages": MESSAGES, "stream": True}) as s:
            assert s.http_version == "HTTP/2" and b"stream" in s.read()
    netloc = sim.url("/").split("/")[2]  # 127.0.0.1:<port>, as an HTTP/1.1 client's request says it
    assert [r.headers.get("host") for r in sim.model_requests()] == [netloc, netloc]
    trace = sealed(proxy, session)
    assert [trace.nodes[c.node].message.text() for c in trace.calls] == ["over h2", "h2 stream"]


def test_the_same_body_sent_at_once_by_a_client_that_gave_up_gets_the_first_answer(sim, start_proxy, tmp_path):
    """A plain HTTP client gives up on a slow JSON answer and sends the same body again at
    once, with no retry header: mitmproxy reports the first client's disconnection while the
    answer is still fetched, so the second request is known for a retry of it, waits for the
    answer the proxy reads on, and gets it. One generation, one turn, undelivered, replayed."""
    # mitmproxy logs each client's disconnection at debug; Fetch's own look at the client's
    # connection every 0.25 s is off (tests/faults.py), so only mitmproxy's report can tell it.
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"fetch_unwatched": True}))
    proxy = start_proxy({"termlog_verbosity": "debug", "faults_file": str(faults)}, extra_scripts=[FAULTS])
    session = proxy.create_session(upstream={"base_url": sim.url("/v1")})
    sim.script(Reply(text="the slow answer", first_byte_delay=1.5), Reply(text="a second sample"))
    url, body = "https://api.openai.com/v1/chat/completions", {"model": "m", "messages": MESSAGES}
    headers = {"authorization": f"Bearer {session['model_secret']}"}
    with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=30) as again:
        # Its tunnel and TLS first (a path the proxy answers itself), so that the body sent
        # again arrives within milliseconds of the first client's close.
        again.get("https://api.openai.com/v1/models", headers=headers)
        with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle),
                          timeout=httpx.Timeout(30.0, read=0.5)) as first:
            closed = proxy.log().count("client disconnect")
            with pytest.raises(httpx.ReadTimeout):
                first.post(url, json=body, headers=headers)  # httpx closes the connection that timed out
        # Sent again as soon as mitmproxy has read the close (its log says so as it runs the
        # client_disconnected hook).
        wait_until(lambda: proxy.log().count("client disconnect") > closed, 10,
                   "mitmproxy logging the first client's disconnection")
        r = again.post(url, json=body, headers=headers)
    assert r.json()["choices"][0]["message"]["content"] == "the slow answer"
    assert len(sim.model_requests()) == 1
    trace = sealed(proxy, session)
    turns = [c for c in trace.calls if c.node is not None]
    assert trace.num_turns == 1 and len(turns) == 1 and turns[0].delivered is False
    assert [c.replay_of for c in trace.calls if c.replay_of] == [turns[0].id]
    assert UNWATCHED_SAID in proxy.log()  # the poll was off: mitmproxy's report alone told Fetch


def test_a_client_gone_just_as_the_answer_was_read_whole_still_leaves_one_undelivered_turn(
        sim, start_proxy, tmp_path, monkeypatch):
    """The client leaves in the moment between the answer read whole and mitmproxy's answer
    hooks (here: Fetch made blind to the client's leaving, tests/faults.py): mitmproxy's
    ``error`` is then the first word of it, with the answer already on the flow and no turn
    committed. The Drain takes it over: one turn, undelivered, the SDK's retry replayed."""
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"fetch_blind": True}))
    proxy = start_proxy({"faults_file": str(faults)}, extra_scripts=[FAULTS])
    session = proxy.create_session(upstream={"base_url": sim.url("/v1")})
    for k, v in session["env"].items():
        monkeypatch.setenv(k, v)
    sim.script(Reply(text=["slow ", "answer"], first_byte_delay=1.8), Reply(text="a second generation"))
    oai = openai.OpenAI(api_key=session["model_secret"], max_retries=3, timeout=1.0)
    got = oai.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
    assert got.parse().choices[0].message.content == "slow answer"
    assert got.headers["x-interceptor-replay"] and got.headers["content-type"] == "application/json"
    assert len(sim.model_requests()) == 1
    trace = sealed(proxy, session)
    turns = [c for c in trace.calls if c.node is not None]
    assert trace.num_turns == 1 and len(turns) == 1 and turns[0].delivered is False and turns[0].error is None
    assert turns[0].first_byte_at and turns[0].first_byte_at - turns[0].started_at > 1.5  # the answer's hooks ran
    assert [c.replay_of for c in trace.calls if c.replay_of] and all(
        c.replay_of == turns[0].id for c in trace.calls if c.replay_of)
    assert BLIND_SAID in proxy.log()  # the race was made, not passed by Fetch seeing the client go


@pytest.mark.parametrize("blind", [False, True], ids=["gone-before-its-head", "gone-as-it-went-to-the-relay"])
def test_a_stream_answer_to_a_json_request_whose_client_left_is_recorded_whole(blind, sim, start_proxy, tmp_path):
    """The upstream streams though the request asked for JSON, and the client has gone by the
    time the head arrives (Fetch reads it whole itself), or goes just as Fetch hands the stream
    to the relay (Fetch blind to it: mitmproxy's ``error`` comes before the flow reaches the
    relay, so the Drain reads the stream itself): one turn, whole, undelivered, asked once."""
    proxy, session = abandoned_stream(sim, start_proxy, tmp_path, {"fetch_blind": blind}, "left behind")
    trace = sealed(proxy, session)
    assert len(trace.calls) == 1 and trace.num_turns == 1
    call = trace.calls[0]
    assert call.error is None and call.delivered is False
    assert trace.nodes[call.node].message.text() == "left behind"
    assert len(sim.model_requests()) == 1
    assert (BLIND_SAID in proxy.log()) is blind  # the blind case made its race


def test_a_failure_reading_on_an_abandoned_stream_is_one_error_call_not_a_lost_exchange(sim, start_proxy, tmp_path):
    """The Drain reads on, in a task of its own, a stream whose client left just as Fetch handed
    it to the relay; a bug there (tests/faults.py ``read_on_fails``) must still end the exchange
    on the record, as an error call, not leave it unrecorded with its retries waiting."""
    proxy, session = abandoned_stream(sim, start_proxy, tmp_path, {"fetch_blind": True, "read_on_fails": True}, "lost")
    trace = sealed(proxy, session)
    assert trace.num_turns == 0 and len(trace.calls) == 1
    assert "reading it failed (InjectedFault)" in trace.calls[0].error.message and trace.calls[0].delivered is False


def test_the_fetched_answer_is_the_response_mitmproxys_constructor_makes():
    """The relay builds an answer's ``Response`` with mitmproxy's public constructor: the object
    is the one it makes (state, headers in order, body, repr), and a value of the wrong type is
    refused by mitmproxy's own check (it runs unless Python runs with -O), never carried into a
    flow that mitmproxy then serialises or sends."""
    from mitmproxy import http

    from interceptor.addons.gateway.transport import relay

    fields = ((b"Content-Type", b"application/json"), (b"x-request-id", b"abc"), (b"x-request-id", b"def"))
    mine = relay._response(201, b"Created", fields, version=b"HTTP/1.0", started=1.5, ended=2.5)
    theirs = http.Response(http_version=b"HTTP/1.0", status_code=201, reason=b"Created", headers=http.Headers(fields),
                           content=None, trailers=None, timestamp_start=1.5, timestamp_end=2.5)
    for r in (mine, theirs):
        r.raw_content = b'{"ok": true}'
    assert type(mine) is http.Response and type(mine.data) is http.ResponseData
    assert mine.get_state() == theirs.get_state() and mine.data == theirs.data
    assert mine.headers.get_all("x-request-id") == ["abc", "def"] and mine.json() == {"ok": True}
    assert repr(mine) == repr(theirs) and mine.http_version == "HTTP/1.0" and mine.timestamp_end == 2.5
    with pytest.raises(TypeError):
        relay._response("201", b"Created", fields, started=1.5)  # a status code that is not an int

"""What the model generated is recorded, even when the harness stops reading.

A client that closes once it has what it needs (litellm's sync Anthropic stream after
``message_delta``; any caller that stops iterating), or that times out while the upstream is
still generating, must leave exactly one turn, whole, marked undelivered; the SDK's retry gets
the recorded answer, not a second generation. Real mitmdump, real SDKs (and litellm), the
strict simulator with a delay between events so the terminal event comes after the close.
"""

from __future__ import annotations

import json
import time

import anthropic
import httpx2 as httpx
import openai
import pytest

from clients import session_clients
from interceptor.trace import read_trace
from provider import Reply
from waiting import wait_until

MESSAGES = [{"role": "user", "content": "count to three"}]
# The simulator's Messages stream for three text pieces is nine events (message_start,
# content_block_start, ping, three deltas, content_block_stop, message_delta, message_stop):
# message_stop comes 3 s after message_delta, so a client that closes after message_delta has
# closed before it even on a loaded machine (0.4 s was once not enough while CI ran beside).
CLOSE_AFTER_DELTA = [0.2] * 7 + [3.0]


def sealed_trace(proxy, session):
    proxy.api("DELETE", f"sessions/{session['id']}")
    return read_trace(session["trace_path"])


def wait_for_calls(session, n: int, timeout: float = 15.0) -> None:
    """The proxy reads on after the client left: wait until its records are written."""
    def enough() -> bool:
        try:
            return len(read_trace(session["trace_path"]).calls) >= n
        except Exception:  # noqa: BLE001 - a record being written
            return False
    wait_until(enough, timeout, f"{n} calls on the record")


def one_undelivered_turn(trace, text: str):
    turns = [c for c in trace.calls if c.node is not None]
    assert trace.num_turns == 1 and len(turns) == 1, trace.calls
    call = turns[0]
    assert call.error is None and call.finish_reason == "stop"
    assert trace.nodes[call.node].message.text() == text
    assert call.delivered is False
    return call


def test_anthropic_stream_abandoned_after_message_delta_is_one_whole_turn(sim, proxy, new_session, harness_env):
    """The anthropic SDK's caller stops at ``message_delta`` (as litellm does) and closes the
    stream: ``message_stop`` comes 3 s later, read by the proxy itself."""
    sim.script(Reply(text=["one ", "two ", "three"], delay=CLOSE_AFTER_DELTA))
    session = new_session()
    harness_env(session["env"])
    _, ant = session_clients(session)
    seen = []
    stream = ant.messages.create(model="claude-sonnet-4-5", max_tokens=64, messages=MESSAGES, stream=True)
    for event in stream:
        seen.append(event.type)
        if event.type == "message_delta":
            break
    stream.close()
    assert "message_stop" not in seen and seen[-1] == "message_delta"
    wait_for_calls(session, 1)
    # The same request again (the SDK's first attempt, no retry flag): the harness cannot have
    # read the answer whole, so it is its retry, answered from the record.
    again = ant.messages.create(model="claude-sonnet-4-5", max_tokens=64, messages=MESSAGES, stream=True)
    events = list(again)
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == "one two three"
    assert events[-1].type == "message_stop"  # the replay is the whole answer, terminal event too
    assert len(sim.model_requests()) == 1
    trace = sealed_trace(proxy, session)
    call = one_undelivered_turn(trace, "one two three")
    replays = [c for c in trace.calls if c.replay_of]
    assert [c.replay_of for c in replays] == [call.id] and replays[0].delivered


def test_litellm_sync_anthropic_stream_is_recorded_whole(sim, proxy, new_session, harness_env, monkeypatch):
    """litellm's sync Anthropic stream closes the connection after ``message_delta``."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before the import: no price-list download
    litellm = pytest.importorskip("litellm", reason="the harness extra (mini-swe-agent) brings litellm")
    sim.script(Reply(text=["one ", "two ", "three"], delay=CLOSE_AFTER_DELTA))
    session = new_session()
    harness_env(session["env"])
    monkeypatch.setenv("SSL_VERIFY", str(session["env"]["SSL_CERT_FILE"]))
    chunks = litellm.completion(model="anthropic/claude-sonnet-4-5", messages=MESSAGES, max_tokens=64,
                                stream=True, api_key=session["model_secret"])
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == "one two three"
    wait_for_calls(session, 1)
    assert len(sim.model_requests()) == 1
    one_undelivered_turn(sealed_trace(proxy, session), "one two three")


def test_openai_chat_stream_abandoned_before_done_is_one_whole_turn(sim, proxy, new_session, harness_env):
    sim.script(Reply(text=["one ", "two ", "three"], delay=0.4))
    session = new_session()
    harness_env(session["env"])
    oai, _ = session_clients(session)
    text = ""
    stream = oai.chat.completions.create(model="gpt-4.1", messages=MESSAGES, stream=True)
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            if chunk.choices[0].finish_reason:
                break
    stream.close()  # before [DONE]
    assert text == "one two three"
    wait_for_calls(session, 1)
    flag = {"x-stainless-retry-count": "1"}
    with oai.chat.completions.stream(model="gpt-4.1", messages=MESSAGES, extra_headers=flag) as s:
        assert s.get_final_completion().choices[0].message.content == "one two three"
    assert len(sim.model_requests()) == 1
    trace = sealed_trace(proxy, session)
    call = one_undelivered_turn(trace, "one two three")
    assert [c.replay_of for c in trace.calls if c.replay_of] == [call.id]


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_timeout_then_the_sdk_retry_is_one_turn_replayed(stream, sim, proxy, new_session, harness_env):
    """The model takes 1.8 s; the SDK gives up at 1 s and retries (retry count 1) while the
    proxy still reads the first attempt's answer: the retry waits for it and gets it."""
    sim.script(Reply(text=["slow ", "answer"], first_byte_delay=1.8), Reply(text="a second generation"))
    session = new_session()
    harness_env(session["env"])
    oai = openai.OpenAI(api_key=session["model_secret"], max_retries=3, timeout=1.0)
    started = time.monotonic()
    if stream:
        with oai.chat.completions.stream(model="gpt-4.1", messages=MESSAGES) as s:
            text = s.get_final_completion().choices[0].message.content
    else:
        text = oai.chat.completions.create(model="gpt-4.1", messages=MESSAGES).choices[0].message.content
    assert text == "slow answer"
    assert time.monotonic() - started > 1.0  # the first attempt did time out
    assert len(sim.model_requests()) == 1
    trace = sealed_trace(proxy, session)
    call = one_undelivered_turn(trace, "slow answer")
    replays = [c for c in trace.calls if c.replay_of]
    assert replays and all(c.replay_of == call.id for c in replays)
    assert call.first_byte_at and call.first_byte_at - call.started_at > 1.5


def test_the_drain_is_bounded_by_intercept_drain_timeout(sim, start_proxy):
    """After the client left, the proxy reads on for intercept_drain_timeout seconds at most:
    then the exchange is one error call, and no turn."""
    proxy = start_proxy({"intercept_drain_timeout": "2"})
    sim.script(Reply(text="too late", first_byte_delay=8.0))
    session = proxy.create_session(upstream={"base_url": sim.url("/v1")})
    # Only the wait for the answer times out (a loaded machine may take a while to connect).
    client = httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=httpx.Timeout(30.0, read=1.0))
    with pytest.raises(httpx.TimeoutException):
        client.post("https://api.openai.com/v1/chat/completions", json={"model": "m", "messages": MESSAGES},
                    headers={"authorization": f"Bearer {session['model_secret']}"})
    client.close()
    wait_for_calls(session, 1, timeout=30)
    trace = sealed_trace(proxy, session)
    assert trace.num_turns == 0 and len(trace.calls) == 1
    assert "intercept_drain_timeout" in trace.calls[0].error.message and trace.calls[0].delivered is False


@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
def test_an_upstream_that_hangs_up_gives_a_502_in_the_dialects_shape(dialect, sim, proxy, new_session, harness_env):
    sim.script(Reply(hang_up=True))
    session = new_session()
    harness_env(session["env"])
    oai, ant = session_clients(session)
    if dialect == "openai":
        with pytest.raises(openai.InternalServerError) as e:
            oai.chat.completions.create(model="gpt-4.1", messages=MESSAGES)
    else:
        with pytest.raises(anthropic.InternalServerError) as e:
            ant.messages.create(model="claude-sonnet-4-5", max_tokens=16, messages=MESSAGES)
    response = e.value.response
    assert response.status_code == 502 and response.headers["x-should-retry"] == "true"
    body = json.loads(response.content)
    assert "closed the connection without answering" in (body["error"]["message"])
    assert session["model_secret"] not in response.text
    trace = sealed_trace(proxy, session)
    assert trace.num_turns == 0 and [c.status for c in trace.calls] == [502]


def test_a_pooled_connection_the_upstream_closed_is_not_used_and_a_hang_up_on_one_is_not_resent(
        sim, proxy, new_session, harness_env):
    """The upstream closes kept-alive connections idle for 0.3 s (as uvicorn does after 5 s):
    the next turn goes out on a new connection, not as a 502 from the dead one. An upstream
    that reads a request on a pooled connection and hangs up is the 502, and the request is
    not sent again (it may have been sampled)."""
    session = new_session()
    harness_env(session["env"])
    oai, _ = session_clients(session)
    ask = lambda text: oai.chat.completions.create(model="gpt-4.1", messages=[{"role": "user", "content": text}])  # noqa: E731
    opened = lambda: sim.connections()["accepted"] - sim.connections()["probes"]  # noqa: E731
    sim.script(Reply(text="one"), Reply(text="two"), Reply(text="three"), Reply(hang_up=True))
    assert ask("first").choices[0].message.content == "one"
    first = opened()
    assert ask("second").choices[0].message.content == "two"  # on the pooled connection
    assert opened() == first
    sim.keep_alive = 0.3
    closed = sim.connections()["closed"]
    assert ask("third").choices[0].message.content == "three"  # the pooled one, then idle...
    wait_until(lambda: sim.connections()["closed"] > closed, 10, "the upstream closing the idle connection")  # ... and closed
    with pytest.raises(openai.InternalServerError) as e:
        ask("fourth")  # a new connection (the closed one is not used), which the upstream hangs up
    assert "closed the connection without answering" in e.value.body["message"]
    assert opened() == first + 1
    assert len(sim.model_requests()) == 4  # the hang-up was not sent again
    trace = sealed_trace(proxy, session)
    assert trace.num_turns == 3 and [c.status for c in trace.calls] == [200, 200, 200, 502]

"""Retries never fork the graph: flagged retries replay, identical fresh requests resample.
Real mitmdump, real SDKs, simulator faults."""

from __future__ import annotations

import json
import random
import socket
import ssl
import threading
from pathlib import Path

import anthropic
import httpx2 as httpx  # the HTTP client the SDKs use
import openai
import pytest

from clients import session_clients
from test_early_close import wait_for_calls
from interceptor.trace import read_trace
from provider import Reply
from waiting import wait_until

FIXTURES = Path(__file__).resolve().parent / "fixtures"
RETRY_EXCHANGE = FIXTURES / "anthropic-exchanges" / "retry-429-429-200-stream.json"


def sealed_trace(proxy, session):
    proxy.api("DELETE", f"sessions/{session['id']}")
    return read_trace(session["trace_path"])


def raw_post(proxy, session, path, body: dict, retry_count: int, *, read: bool = True, extra_headers=None):
    """A request as an SDK sends it, through the proxy, with full control over the
    connection: ``read=False`` takes the headers and closes the connection at once, before
    the body's end (the harness went away)."""
    headers = {
        "authorization": f"Bearer {session['model_secret']}",
        "content-type": "application/json",
        "x-stainless-retry-count": str(retry_count),
        **(extra_headers or {}),
    }
    client = httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=20)
    try:
        with client.stream("POST", f"https://api.openai.com{path}", content=json.dumps(body).encode(), headers=headers) as r:
            if not read:
                return r.status_code, dict(r.headers), None
            data = r.read()
            return r.status_code, dict(r.headers), data
    finally:
        client.close()


def test_anthropic_429_429_then_stream_is_one_turn_three_exchanges(sim, proxy, new_session, harness_env):
    sim.script_exchange_file(RETRY_EXCHANGE)
    request = json.loads(RETRY_EXCHANGE.read_text())[0]["request"]["body"]
    session = new_session()
    harness_env(session["env"])
    ant = anthropic.Anthropic(api_key=session["model_secret"], max_retries=2)
    with ant.messages.stream(model=request["model"], max_tokens=request["max_tokens"], messages=request["messages"]) as s:
        final = s.get_final_message()
    assert final.content[0].text
    assert [r.headers.get("x-stainless-retry-count") for r in sim.model_requests()] == ["0", "1", "2"]
    trace = sealed_trace(proxy, session)
    assert trace.num_turns == 1
    assert len(trace.calls) == 3
    assert [c.status for c in trace.calls] == [429, 429, 200]
    assert [c.error is not None for c in trace.calls] == [True, True, False]
    assert trace.calls[0].error.type == "rate_limit_error"


@pytest.mark.parametrize("stream", [True, False])
def test_flagged_retry_after_delivery_replays_byte_for_byte(stream, sim, proxy, new_session):
    sim.script(Reply(text=["one ", "two ", "three"]))
    session = new_session()
    body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "count"}]}
    status, headers, first = raw_post(proxy, session, "/v1/chat/completions", body, 0)
    assert status == 200
    status2, headers2, again = raw_post(proxy, session, "/v1/chat/completions", body, 1)
    assert status2 == 200 and again == first
    assert headers2["content-type"] == headers["content-type"]
    assert "x-interceptor-replay" in headers2
    assert len(sim.model_requests()) == 1
    trace = sealed_trace(proxy, session)
    assert trace.num_turns == 1
    replays = [c for c in trace.calls if c.replay_of]
    assert len(replays) == 1 and replays[0].replay_of == trace.calls[0].id


@pytest.mark.parametrize("stream", [True, False])
def test_committed_but_undelivered_turn_is_replayed_to_the_sdk(stream, sim, proxy, new_session, harness_env):
    sim.script(Reply(text=["fine ", "answer"]))
    session = new_session()
    harness_env(session["env"])
    oai = openai.OpenAI(api_key=session["model_secret"], max_retries=0)
    messages = [{"role": "user", "content": "q"}]
    # The harness goes away after the headers: the upstream completes, the turn commits (it
    # is on the record), the harness never reads it.
    if stream:
        with oai.chat.completions.stream(model="m", messages=messages):
            wait_for_calls(session, 1)
    else:
        with oai.chat.completions.with_streaming_response.create(model="m", messages=messages) as r:
            assert r.status_code == 200
            wait_for_calls(session, 1)
    assert len(sim.model_requests()) == 1
    # The SDK's own retry of the same request: its helper must accept the recorded bytes.
    flag = {"x-stainless-retry-count": "1"}  # per request: the SDK's own value loses to it
    if stream:
        with oai.chat.completions.stream(model="m", messages=messages, extra_headers=flag) as s:
            text = s.get_final_completion().choices[0].message.content
    else:
        text = oai.chat.completions.create(model="m", messages=messages, extra_headers=flag).choices[0].message.content
    assert text == "fine answer"
    assert len(sim.model_requests()) == 1
    assert sealed_trace(proxy, session).num_turns == 1


def test_retry_while_streaming_coalesces_and_both_get_the_same_bytes(sim, proxy, new_session):
    resume = threading.Event()  # the upstream holds its stream after three events until the retry came
    sim.script(Reply(text=[f"w{i} " for i in range(6)], delay=0.15, pause_before=3, resume=resume))
    session = new_session()
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "slow"}]}
    results = {}

    def ask(name: str, retry_count: int) -> threading.Thread:
        def post() -> None:
            results[name] = raw_post(proxy, session, "/v1/chat/completions", body, retry_count)
        thread = threading.Thread(target=post)
        thread.start()
        return thread

    first = ask("first", 0)
    sim.wait_for_requests(1)
    connected = proxy.log().count("client connect")
    retry = ask("retry", 1)  # mid-stream
    wait_until(lambda: proxy.log().count("client connect") > connected, 10, "the retry's connection")
    resume.set()
    first.join()
    retry.join()
    assert results["first"][0] == results["retry"][0] == 200
    assert results["first"][2] == results["retry"][2]
    assert b"w5" in results["retry"][2]
    assert len(sim.model_requests()) == 1
    assert sealed_trace(proxy, session).num_turns == 1


def test_coalesced_retry_of_a_failed_attempt_gets_a_retryable_503(sim, proxy, new_session):
    # The cut comes ~2 s in: the retry must arrive while the first attempt is still in flight,
    # even on a loaded machine (at 0.45 s it sometimes came after the failure, and resampled).
    sim.script(Reply(text=[f"w{i} " for i in range(20)], delay=0.2, cut_after=10))
    session = new_session()
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "cut"}]}
    first: dict = {}

    def attempt() -> None:
        # An assertion in a thread cannot fail the test: keep the outcome for the test to check.
        try:
            first["result"] = raw_post(proxy, session, "/v1/chat/completions", body, 0)
        except Exception as e:  # noqa: BLE001 - the cut stream is what this attempt must see
            first["error"] = e

    t = threading.Thread(target=attempt)
    t.start()
    sim.wait_for_requests(1)
    status, headers, data = raw_post(proxy, session, "/v1/chat/completions", body, 1)
    t.join()
    # The cut reaches the harness as a broken body (the proxy relays it), never as a whole answer.
    assert isinstance(first.get("error"), httpx.HTTPError), first
    assert status == 503 and headers["x-should-retry"] == "true"
    assert json.loads(data)["error"]["message"]
    trace = sealed_trace(proxy, session)
    assert trace.num_turns == 0 and trace.calls[0].error is not None


def test_identical_unflagged_body_after_delivery_is_a_new_turn_and_its_retry_replays_it(sim, proxy, new_session, harness_env):
    sim.script(Reply(text="first answer"), Reply(text="second answer"))
    session = new_session()
    harness_env(session["env"])
    oai, _ = session_clients(session)
    msgs = [{"role": "user", "content": "summarise"}]
    a = oai.chat.completions.create(model="m", messages=msgs).choices[0].message.content
    b = oai.chat.completions.create(model="m", messages=msgs).choices[0].message.content
    assert (a, b) == ("first answer", "second answer")
    retried = oai.chat.completions.create(model="m", messages=msgs, extra_headers={"x-stainless-retry-count": "1"})
    assert retried.choices[0].message.content == "second answer"
    assert len(sim.model_requests()) == 2
    trace = sealed_trace(proxy, session)
    assert trace.num_turns == 2


def test_a_fresh_identical_body_forgets_the_old_answer_so_its_retry_after_a_429_resamples(sim, proxy, new_session):
    """The same body again without a flag is a new turn; when its first attempt is refused
    (429) the SDK's flagged retry must reach the provider, not get the previous turn's answer."""
    sim.script(Reply(text="first answer"), Reply(status=429, retry_after="0"), Reply(text="second answer"))
    session = new_session()
    body = {"model": "m", "messages": [{"role": "user", "content": "summarise"}]}
    keep_alive = httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=20)  # as an SDK's pool
    headers = {"authorization": f"Bearer {session['model_secret']}", "x-stainless-retry-count": "0"}
    url = "https://api.openai.com/v1/chat/completions"
    with keep_alive:
        first = keep_alive.post(url, json=body, headers=headers)
        refused = keep_alive.post(url, json=body, headers=headers)
        retried = keep_alive.post(url, json=body, headers={**headers, "x-stainless-retry-count": "1"})
    assert first.json()["choices"][0]["message"]["content"] == "first answer"
    assert refused.status_code == 429
    assert "x-interceptor-replay" not in retried.headers
    assert retried.json()["choices"][0]["message"]["content"] == "second answer"
    assert len(sim.model_requests()) == 3
    trace = sealed_trace(proxy, session)
    assert trace.num_turns == 2 and [c.status for c in trace.calls] == [200, 429, 200]


def disconnects(proxy) -> int:
    """Client connections mitmproxy has seen close (its log says so as it runs the
    ``client_disconnected`` hook)."""
    return proxy.log().count("client disconnect")


def until_disconnected(proxy, before: int) -> None:
    """Wait until mitmproxy has seen one more client go: the old rule's condition for calling a
    delivered answer undelivered, so a test of the rule does not depend on a race."""
    wait_until(lambda: disconnects(proxy) > before, 10, "mitmproxy logging the client's disconnection")


ASKS = 4


def answers(n: int) -> list[Reply]:
    return [Reply(text=["sample ", str(k)]) for k in range(n)]


def check_new_samples(proxy, sim, session, got: list[str]) -> None:
    """Each ask reached the upstream and got its own sample, and each is a turn (siblings under
    the same prompt: the graph forks where the harness asked again, as it should)."""
    assert got == [f"sample {k}" for k in range(ASKS)]
    assert len(sim.model_requests()) == ASKS
    trace = sealed_trace(proxy, session)
    assert trace.num_turns == ASKS and not [c for c in trace.calls if c.replay_of]
    assert all(c.delivered for c in trace.calls)


@pytest.mark.parametrize("stream", [True, False])
def test_a_best_of_n_loop_with_a_fresh_client_per_call_gets_a_new_sample_each_time(stream, sim, proxy, new_session, harness_env):
    """The answer was handed over in full, then the SDK client closed its connection: that is
    delivery, not an answer the harness left, so the same body again is sampled again."""
    sim.script(*answers(ASKS))
    session = new_session()
    harness_env(session["env"])
    messages = [{"role": "user", "content": "best of n"}]
    got = []
    for _ in range(ASKS):
        before = disconnects(proxy)
        with openai.OpenAI(api_key=session["model_secret"], max_retries=0, timeout=30) as oai:
            if stream:
                with oai.chat.completions.stream(model="m", messages=messages) as s:
                    got.append(s.get_final_completion().choices[0].message.content)
            else:
                got.append(oai.chat.completions.create(model="m", messages=messages).choices[0].message.content)
        until_disconnected(proxy, before)
    check_new_samples(proxy, sim, session, got)


def test_a_shared_client_past_its_keep_alive_gets_a_new_sample_each_time(sim, proxy, new_session, harness_env):
    """One SDK client whose pool drops an idle connection at once (as every pool does after its
    keep-alive expiry): each call comes on a new connection after the last one closed."""
    sim.script(*answers(ASKS))
    session = new_session()
    harness_env(session["env"])
    http_client = openai.DefaultHttpxClient(limits=httpx.Limits(max_keepalive_connections=0))
    messages = [{"role": "user", "content": "again, on one client"}]
    got = []
    with openai.OpenAI(api_key=session["model_secret"], max_retries=0, timeout=30, http_client=http_client) as oai:
        for _ in range(ASKS):
            before = disconnects(proxy)
            with oai.chat.completions.stream(model="m", messages=messages) as s:
                got.append(s.get_final_completion().choices[0].message.content)
            until_disconnected(proxy, before)
    check_new_samples(proxy, sim, session, got)


@pytest.mark.parametrize("connection", ["close", "keep-alive"])
def test_raw_http_one_connection_per_request_gets_a_new_sample_each_time(connection, sim, proxy, new_session):
    """curl's way: one connection per request, read to its end and closed (told to close, or
    just closed); no retry flag."""
    sim.script(*answers(ASKS))
    session = new_session()
    body = {"model": "m", "messages": [{"role": "user", "content": "curl loop"}]}
    got = []
    for _ in range(ASKS):
        before = disconnects(proxy)
        status, headers, data = raw_post(proxy, session, "/v1/chat/completions", body, 0,
                                         extra_headers={"connection": connection})
        assert status == 200 and "x-interceptor-replay" not in headers
        got.append(json.loads(data)["choices"][0]["message"]["content"])
        until_disconnected(proxy, before)
    check_new_samples(proxy, sim, session, got)


@pytest.mark.parametrize("undelivered_option", [True, False])
def test_unflagged_resend_after_client_went_away(undelivered_option, sim, start_proxy, tmp_path):
    proxy = start_proxy({"intercept_retry_undelivered": str(undelivered_option).lower()})
    # The answer's events come 1 s apart: the client is gone long before its terminal event.
    sim.script(Reply(text=["kept ", "answer"], delay=1.0), Reply(text="resampled"))
    session = proxy.create_session(upstream={"base_url": sim.url("/v1")})
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "go"}]}
    before = disconnects(proxy)
    raw_post(proxy, session, "/v1/chat/completions", body, 0, read=False)
    until_disconnected(proxy, before)  # as a harness's retry comes after its own timeout
    status, headers, data = raw_post(proxy, session, "/v1/chat/completions", body, 0)
    assert status == 200
    if undelivered_option:
        assert b"kept" in data and b"answer" in data and "x-interceptor-replay" in headers
        assert len(sim.model_requests()) == 1
        trace = sealed_trace(proxy, session)
        assert trace.num_turns == 1 and [c.delivered for c in trace.calls] == [False, True]
    else:
        assert b"resampled" in data
        assert len(sim.model_requests()) == 2
        wait_for_calls(session, 2)  # the first answer, read on by the proxy after its client left
        assert sealed_trace(proxy, session).num_turns == 2


def test_idempotency_header_flags_a_retry(sim, start_proxy):
    proxy = start_proxy({"intercept_retry_headers": "Idempotency-Key"})
    sim.script(Reply(text="once"), Reply(text="twice"))
    session = proxy.create_session(upstream={"base_url": sim.url("/v1")})
    body = {"model": "m", "messages": [{"role": "user", "content": "k"}]}
    h = {"idempotency-key": "abc-1"}
    _, _, first = raw_post(proxy, session, "/v1/chat/completions", body, 0, extra_headers=h)
    _, headers, second = raw_post(proxy, session, "/v1/chat/completions", body, 0, extra_headers=h)
    assert first == second and "x-interceptor-replay" in headers
    _, _, third = raw_post(proxy, session, "/v1/chat/completions", body, 0, extra_headers={"idempotency-key": "abc-2"})
    assert b"twice" in third


def test_32_sessions_20_turns_with_faults_never_fork(sim, proxy, new_session, harness_env):
    """Random 429 / 500 / cut streams / slow first bytes with client timeouts and SDK
    retries, 32 sessions at once: every trace is one branch of exactly 20 turns, and every
    answer a session received was its own."""
    sessions = [new_session(info={"n": i}) for i in range(32)]
    harness_env(sessions[0]["env"])
    faults = ["none", "none", "429", "500", "cut", "slow"]
    failures: list[str] = []

    def answer_for(record) -> Reply:
        # Successes are derived from the question, so a spare reply can never leak into a
        # later turn; only the faults are queued.
        question = record.json["messages"][-1]["content"]
        key, _, turn = question.split()
        return Reply(text=[f"{key} ", f"answer {turn}"])

    sim.default = answer_for

    def rollout(idx: int, session: dict) -> None:
        rng = random.Random(idx)
        key = f"s{idx}"
        client = openai.OpenAI(api_key=session["model_secret"], max_retries=8, timeout=1.5,
                               default_headers={"x-sim-key": key})
        messages = [{"role": "system", "content": f"session {idx}"}]
        try:
            for turn in range(20):
                fault = rng.choice(faults)
                answer = f"{key} answer {turn}"
                stream = rng.random() < 0.5
                if fault == "429":
                    sim.script(Reply(status=429, retry_after="0"), key=key)
                elif fault == "500":
                    sim.script(Reply(status=500, retry_after="0"), key=key)
                elif fault == "cut":
                    sim.script(Reply(text=[f"{key} ", f"answer {turn}"], cut_after=2), key=key)
                elif fault == "slow":
                    sim.script(Reply(text=[f"{key} ", f"answer {turn}"], first_byte_delay=2.0), key=key)
                messages.append({"role": "user", "content": f"{key} question {turn}"})
                for attempt in range(4):  # the harness's own loop around the SDK's retries
                    try:
                        if stream:
                            with client.chat.completions.stream(model="m", messages=messages) as s:
                                text = s.get_final_completion().choices[0].message.content
                        else:
                            text = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
                        break
                    except (openai.APIError, httpx.HTTPError):
                        if attempt == 3:
                            raise
                if text != answer:
                    failures.append(f"{key} turn {turn}: got {text!r}")
                messages.append({"role": "assistant", "content": text})
        except Exception as e:
            failures.append(f"{key}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=rollout, args=(i, s)) for i, s in enumerate(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:5]
    # The faults really happened: more attempts than turns, failed exchanges on the record.
    assert len(sim.model_requests()) > 32 * 20
    error_calls = 0
    for i, session in enumerate(sessions):
        trace = sealed_trace(proxy, session)
        assert len(trace.branches) == 1, session["id"]
        assert trace.num_turns == 20, (session["id"], trace.num_turns)
        texts = [n.message.text() for n in trace.nodes if n.sampled]
        assert all(t.startswith(f"s{i} ") for t in texts)
        error_calls += sum(1 for c in trace.calls if c.error is not None)
    assert error_calls > 32

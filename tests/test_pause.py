"""Pause and drain: an orchestrator pauses an upstream for a weight swap while rollouts stream
through it. New requests wait at the proxy (nothing reaches the upstream), the ones already
sent finish and are recorded, the pause call answers once they have, and after resume every
client completes with no error and no forked graph; a request held past its limit gets a
retryable error, and the SDK's retry waits again and is answered once. Real SDK clients
through HTTPS_PROXY, a real mitmdump, the simulator counting what reaches it."""

from __future__ import annotations

import json
import threading

import anthropic
import httpx
import openai
import pytest

from interceptor.client.proxy import call as control_api
from interceptor.trace import read_trace
from clients import KEY_ENV
from provider import Reply
from test_retry import disconnects
from waiting import wait_until

SESSIONS = 8


@pytest.fixture
def paused_upstream(start_proxy, sim, harness_env):
    upstreams = json.dumps({"vllm": {"base_url": sim.url("/v1"), "api_key_env": KEY_ENV}})
    proxy = start_proxy({"intercept_upstreams": upstreams})

    def open_session(**config):
        s = proxy.create_session(upstream="vllm", **config)
        harness_env(s["env"])  # the same HTTPS_PROXY and CA for every session; the key is each one's
        return s

    def state() -> dict:
        status, body = proxy.api("GET", "upstreams/vllm")
        assert status == 200, body
        return body

    return proxy, open_session, state


def converse(kind: str, secret: str, errors: list, done: list) -> None:
    """Two streamed turns of one conversation, the second after the first's answer."""
    try:
        if kind == "openai":
            client = openai.OpenAI(api_key=secret, timeout=120)
            messages = [{"role": "user", "content": "first"}]
            for follow in ("second", None):
                parts = client.chat.completions.create(model="policy", messages=messages, stream=True)
                text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
                messages += [{"role": "assistant", "content": text}]
                if follow:
                    messages += [{"role": "user", "content": follow}]
        else:
            client = anthropic.Anthropic(api_key=secret, timeout=120)
            messages = [{"role": "user", "content": "first"}]
            for follow in ("second", None):
                with client.messages.stream(model="policy", max_tokens=64, messages=messages) as stream:
                    text = stream.get_final_text()
                messages += [{"role": "assistant", "content": text}]
                if follow:
                    messages += [{"role": "user", "content": follow}]
        done.append(secret)
    except Exception as e:  # noqa: BLE001 - the test asserts there is none
        errors.append(e)


def test_a_pause_holds_new_requests_drains_the_sent_ones_and_resume_completes_every_client(paused_upstream, sim):
    proxy, open_session, state = paused_upstream
    midway = threading.Event()
    # Each first turn streams two events, then waits mid-answer until the test lets it go on.
    sim.script(*[Reply(text="one two three four", pause_before=2, resume=midway) for _ in range(SESSIONS)],
               *[Reply(text="after the swap") for _ in range(SESSIONS)])
    sessions = [open_session() for _ in range(SESSIONS)]
    errors: list = []
    done: list = []
    threads = [threading.Thread(target=converse, args=("openai" if k % 2 else "anthropic", s["model_secret"], errors, done))
               for k, s in enumerate(sessions)]
    for t in threads:
        t.start()
    sim.wait_for_requests(SESSIONS, timeout=60)  # every first turn is streaming, held mid-answer

    answer: dict = {}
    pausing = threading.Thread(target=lambda: answer.update(
        zip(("status", "body"), control_api(proxy.url, proxy.admin_token, "POST", "upstreams/vllm/pause",
                                            {"timeout": 120}, timeout=150))))
    pausing.start()
    wait_until(lambda: state()["paused"] and state()["in_flight"] == SESSIONS, 60, "every session in flight")
    assert pausing.is_alive() and not answer  # eight answers are still streaming: not drained

    midway.set()  # the sent answers finish; each client asks its next turn at once, and it waits
    pausing.join(150)
    assert answer["status"] == 200 and answer["body"]["drained"] is True and answer["body"]["running"] == []
    wait_until(lambda: state()["held"] == SESSIONS, 60, "every request held")
    assert len(sim.model_requests()) == SESSIONS  # nothing reached the upstream while paused
    for s in sessions:  # the answers in flight at the pause were recorded whole
        assert proxy.api("GET", f"sessions/{s['id']}")[1]["turns"] == 1

    status, resumed = proxy.api("POST", "upstreams/vllm/resume")
    assert status == 200 and resumed["released"] == SESSIONS and not resumed["paused"]
    for t in threads:
        t.join(120)
    assert errors == [] and len(done) == SESSIONS
    assert len(sim.model_requests()) == 2 * SESSIONS

    for s in sessions:
        assert proxy.api("DELETE", f"sessions/{s['id']}")[0] == 200
        trace = read_trace(s["trace_path"])
        assert trace.num_turns == 2 and trace.errors == []
        assert len(trace.branches) == 1  # no forked graph
        first, second = trace.calls
        assert first.held_ms is None and second.held_ms is not None and second.held_ms > 0


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_request_held_past_its_limit_is_told_to_retry_and_its_retry_waits_and_is_answered_once(
        paused_upstream, sim, kind):
    proxy, open_session, state = paused_upstream
    sim.script(Reply(text="answered once"))
    s = open_session(pause_limit=1.0)
    status, body = control_api(proxy.url, proxy.admin_token, "POST", "upstreams/vllm/pause", {"timeout": 5})
    assert status == 200 and body["drained"] and body["paused"]

    got: list = []
    errors: list = []

    def ask() -> None:
        try:
            if kind == "openai":
                client = openai.OpenAI(api_key=s["model_secret"], max_retries=8, timeout=60)
                got.append(client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "hi"}]).choices[0].message.content)
            else:
                client = anthropic.Anthropic(api_key=s["model_secret"], max_retries=8, timeout=60)
                got.append(client.messages.create(model="policy", max_tokens=64,
                                                  messages=[{"role": "user", "content": "hi"}]).content[0].text)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    asking = threading.Thread(target=ask)
    asking.start()
    # The first attempt waited past the limit and was told to retry; the SDK's retry waits again.
    wait_until(lambda: proxy.api("GET", f"sessions/{s['id']}")[1]["errors"] >= 1 and state()["held"] == 1, 60,
               "the hold limit's answer on the record and the retry held")
    assert sim.model_requests() == []
    proxy.api("POST", "upstreams/vllm/resume")
    asking.join(60)
    assert errors == [] and got == ["answered once"]
    assert len(sim.model_requests()) == 1  # sampled once

    assert proxy.api("DELETE", f"sessions/{s['id']}")[0] == 200
    trace = read_trace(s["trace_path"])
    *refused, answered = trace.calls
    assert refused and all(c.error.type == "upstream_paused" and c.status == 503 and c.held_ms >= 1000
                           for c in refused)
    assert answered.error is None and answered.node is not None and answered.held_ms > 0
    assert trace.num_turns == 1 and len(trace.branches) == 1


@pytest.mark.parametrize("retry_count", [1, 0], ids=["flagged", "unflagged"])
def test_a_client_that_left_while_its_request_waited_gets_its_answer_on_the_retry_sampled_once(
        paused_upstream, sim, retry_count):
    """An SDK that timed out while its request waited retries it (flagged); Claude Code's own
    loop sends it again unflagged. Either way the retry is the waiting request's (it coalesces
    on it, or is answered from its record), never a second sample."""
    proxy, open_session, state = paused_upstream
    sim.script(Reply(text="one sample"))
    s = open_session()
    assert control_api(proxy.url, proxy.admin_token, "POST", "upstreams/vllm/pause", {})[0] == 200
    body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "hi"}]}).encode()
    headers = {"authorization": f"Bearer {s['model_secret']}", "content-type": "application/json"}

    def post(count: int, timeout: httpx.Timeout) -> httpx.Response:
        with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=timeout) as client:
            return client.post("https://api.openai.com/v1/chat/completions", content=body,
                               headers={**headers, "x-stainless-retry-count": str(count)})

    before = disconnects(proxy)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up on the waiting request and goes
        post(0, httpx.Timeout(20, read=0.5))
    wait_until(lambda: disconnects(proxy) > before and state()["held"] == 1
               and "left while its request waited" in proxy.log(), 60, "the harness's leaving seen by Pause")

    answer: list = []
    retrying = threading.Thread(target=lambda: answer.append(post(retry_count, httpx.Timeout(60))))
    retrying.start()
    proxy.api("POST", "upstreams/vllm/resume")
    retrying.join(60)
    [retried] = answer
    assert retried.status_code == 200 and retried.json()["choices"][0]["message"]["content"] == "one sample"
    assert len(sim.model_requests()) == 1

    assert proxy.api("DELETE", f"sessions/{s['id']}")[0] == 200
    trace = read_trace(s["trace_path"])
    turn, replay = trace.calls
    assert turn.node is not None and turn.delivered is False and turn.held_ms > 0
    assert replay.replay_of == turn.id and trace.num_turns == 1

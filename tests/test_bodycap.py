"""intercept_max_body: a request over the cap (200 MB here) is answered 413 in the dialect's
shape before the body is held, so mitmdump's memory barely moves; nothing is forwarded and
nothing recorded but a count. A 60 MB body still passes, and a chunked one over the cap is
refused in shape too.
Memory is read from /proc (VmRSS now, VmHWM the peak) of the real mitmdump."""

from __future__ import annotations

import ssl

import httpx

from interceptor.trace import read_trace
from clients import session_clients
from provider import Reply

MB = 1 << 20



def body_of(size: int) -> bytes:
    head = b'{"model": "claude-harness", "max_tokens": 8, "messages": [{"role": "user", "content": "'
    tail = b'"}]}'
    return head + b"a" * (size - len(head) - len(tail)) + tail


def test_a_200mb_body_is_refused_in_shape_without_being_held(proxy, new_session, sim, harness_env):
    session = new_session(model="imposed-model")
    before = proxy.memory()
    context = ssl.create_default_context(cafile=str(proxy.ca_bundle))
    with httpx.Client(proxy=proxy.url, verify=context, timeout=120) as client:
        resp = client.post("https://api.anthropic.com/v1/messages", content=body_of(200 * MB),
                           headers={"x-api-key": session["model_secret"], "anthropic-version": "2023-06-01",
                                    "content-type": "application/json"})
    after = proxy.memory()
    assert resp.status_code == 413, resp.text
    assert resp.headers["x-should-retry"] == "false"
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == "request_too_large"
    assert "intercept_max_body" in body["error"]["message"] and session["model_secret"] not in resp.text
    assert sim.requests == []
    # Never held whole: the peak grew by far less than the body, and what stays is near the start.
    assert after["VmHWM"] - before["VmHWM"] < 50 * MB, (before, after)
    assert after["VmRSS"] < 2 * before["VmRSS"], (before, after)
    status, summary = proxy.api("GET", f"sessions/{session['id']}")
    assert summary["oversized_requests"] == 1 and summary["calls"] == 0
    # The session goes on.
    sim.script(Reply(text="small"))
    harness_env(session["env"])
    _, ant = session_clients(session)
    assert ant.messages.create(model="x", max_tokens=8, messages=[{"role": "user", "content": "hi"}]).content[0].text == "small"
    status, _ = proxy.api("DELETE", f"sessions/{session['id']}")
    trace = read_trace(session["trace_path"])
    assert trace.num_turns == 1 and len(trace.calls) == 1


def test_a_60mb_body_passes_and_is_recorded(proxy, new_session, sim, harness_env):
    session = new_session(model="imposed-model")
    sim.script(Reply(text="read it"))
    harness_env(session["env"])
    _, ant = session_clients(session)
    text = "b" * (60 * MB)
    answer = ant.messages.create(model="x", max_tokens=8, messages=[{"role": "user", "content": text}])
    assert answer.content[0].text == "read it"
    (req,) = sim.model_requests()
    assert req.json["model"] == "imposed-model" and len(req.json["messages"][0]["content"]) == 60 * MB
    status, summary = proxy.api("GET", f"sessions/{session['id']}")
    assert summary.get("oversized_requests", 0) == 0 and summary["turns"] == 1


def test_a_chunked_body_over_the_cap_is_refused_in_shape_too(start_proxy, sim):
    """No Content-Length: mitmproxy reads it whole first, the cap still refuses it before
    anything leaves (an option makes the cap small enough to test cheaply)."""
    small = start_proxy({"intercept_max_body": "1m"})
    status, created = small.api("POST", "sessions", {"model": "m", "upstream": {"base_url": sim.url("/v1")}})
    assert status == 201
    context = ssl.create_default_context(cafile=str(small.ca_bundle))

    def chunks():
        yield body_of(2 * MB)

    with httpx.Client(proxy=small.url, verify=context, timeout=60) as client:
        resp = client.post("https://api.openai.com/v1/chat/completions", content=chunks(),
                           headers={"authorization": f"Bearer {created['model_secret']}",
                                    "content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["type"] == "invalid_request_error"
    assert sim.requests == []


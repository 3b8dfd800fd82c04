"""Codex's Responses WebSocket served by the proxy itself (addons/gateway/transport/wsserve.py), through the real
mitmdump, when the session's upstream serves no socket: a Chat Completions upstream in vLLM
mode (the frames translated, token ids collected), and a Responses upstream over HTTP only
(declared so, or found so at the first upgrade). A dropped socket's resent frame is replayed,
not a second turn; a bad frame gets an error frame and nothing leaves."""

from __future__ import annotations

import json
import time

import pytest

from clients import KEY_ENV
from provider import Reply, ToolCall
from test_trace_proxy import FakeVLLM, check_branch_tokens, sealed_trace
from wsclient import Rejected, WSClient

URL = "wss://api.openai.com/v1/responses"
USER = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list the files"}]}
TOOL = {"type": "function", "name": "shell", "description": "run a command", "strict": False,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}


def _client(proxy, session, **kw) -> WSClient:
    return WSClient(URL, headers={"Authorization": f"Bearer {session['model_secret']}"},
                    proxy=proxy.url, cafile=str(proxy.ca_bundle), **kw)


def _create(**fields) -> dict:
    return {"type": "response.create", "model": "gpt-harness", "stream": True, **fields}


@pytest.fixture
def served(start_proxy, sim):
    """``served(upstream_spec, **session)``: a proxy whose upstream ``up`` is ``upstream_spec``
    (the simulator's URL and key added) and a session on it."""

    def make(spec: dict | None = None, **config):
        upstreams = json.dumps({"up": {"base_url": sim.url("/v1"), "api_key_env": KEY_ENV, **(spec or {})}})
        proxy = start_proxy({"intercept_upstreams": upstreams})
        return proxy, proxy.create_session(upstream="up", **config)

    return make


def _task(ws) -> list[list[dict]]:
    """Warm-up, then two turns chained on previous_response_id, as Codex sends them."""
    ws.send_json(_create(generate=False, input=[USER], tools=[TOOL], instructions="Be brief."))
    warm = ws.until("response.completed")
    assert warm[-1]["response"]["output"] == [] and warm[-1]["response"]["status"] == "completed"
    ws.send_json(_create(previous_response_id=warm[-1]["response"]["id"], input=[]))
    first = ws.until("response.completed")
    done = first[-1]["response"]
    call = next(i for i in done["output"] if i["type"] == "function_call")
    ws.send_json(_create(previous_response_id=done["id"], input=[
        {"type": "function_call_output", "call_id": call["call_id"], "output": "a b"}]))
    return [first, ws.until("response.completed")]


def test_a_chat_upstream_serves_codex_socket_with_token_ids(served, sim):
    sim.strict = False  # vLLM's return_token_ids and logprobs are no OpenAI parameters
    vllm = sim.default = FakeVLLM([
        Reply(reasoning="look first", tool_calls=[ToolCall(name="shell", arguments={"cmd": "ls"})]),
        Reply(text=["two ", "files"])])
    proxy, session = served({"dialect": "chat"}, model="policy", collect_tokens=True)
    with _client(proxy, session) as ws:
        first, second = _task(ws)
    # Each event its own frame, in the Responses API's order.
    assert first[0]["type"] == "response.created" and "response.output_item.added" in [e["type"] for e in first]
    assert second[-1]["response"]["output"][-1]["content"][0]["text"] == "two files"
    assert "token_ids" not in json.dumps(first + second)  # the harness never sees token fields
    # Only Chat reached the upstream, one POST per turn (the warm-up went nowhere), each the
    # whole conversation the chain ends.
    assert [(r.method, r.route, r.transport) for r in sim.requests] == [("POST", "chat", "http")] * 2
    bodies = [r.json for r in sim.requests]
    assert bodies[0]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert [m["role"] for m in bodies[1]["messages"]] == ["system", "user", "assistant", "tool"]
    assert all(b["model"] == "policy" and b.get("return_token_ids") for b in bodies)
    trace = sealed_trace(proxy, session)
    assert trace.num_turns == 2 and len(trace.branches) == 1 and not trace.errors
    assert all((c.dialect, c.upstream_dialect) == ("responses", "chat") for c in trace.calls)
    check_branch_tokens(trace, vllm)


def test_a_dropped_socket_and_its_resent_frame_leave_one_turn(served, sim):
    sim.script(Reply(text=["one ", "two ", "three ", "four"], delay=0.4), Reply(text="next"))
    proxy, session = served({"dialect": "chat"})
    with _client(proxy, session) as ws:
        ws.send_json(_create(generate=False, input=[USER]))
        warm = ws.until("response.completed")[-1]["response"]["id"]
        frame = _create(previous_response_id=warm, input=[])
        ws.send_json(frame)
        assert ws.recv_json()["type"] == "response.created"  # the answer is under way: drop the socket
    with _client(proxy, session) as ws:  # Codex reconnects and resends the frame
        ws.send_json(frame)
        again = ws.until("response.completed")[-1]["response"]
        assert again["output"][-1]["content"][0]["text"] == "one two three four"
        ws.send_json(_create(previous_response_id=again["id"], input=[USER]))
        assert ws.until("response.completed")[-1]["response"]["output"][-1]["content"][0]["text"] == "next"
    assert len(sim.requests) == 2  # the resent frame was answered from the record
    trace = sealed_trace(proxy, session)
    assert trace.num_turns == 2 and len(trace.branches) == 1
    assert [m.role for m in trace.branches[0].messages] == ["user", "assistant", "user", "assistant"]


def test_bad_frames_get_error_frames_and_nothing_leaves(served, sim):
    proxy, session = served({"dialect": "chat"})
    with _client(proxy, session) as ws:
        ws._send(__import__("wsproto.events", fromlist=["TextMessage"]).TextMessage(data="{not json"))
        error = ws.recv_json()
        assert (error["type"], error["status"], error["error"]["type"]) == ("error", 400, "invalid_request_error")
        ws.send_json(_create(previous_response_id="resp_nobody_made", input=[USER]))
        error = ws.recv_json()
        assert (error["type"], error["status"], error["error"]["code"]) == ("error", 400, "previous_response_not_found")
        ws.send_json(_create(input=5))  # not translatable: refused in shape by the proxy's POST path
        error = ws.recv_json()
        assert error["type"] == "error" and error["status"] == 400
        sim.script(Reply(status=429, retry_after=7, error_message="slow down"))
        ws.send_json(_create(input=[USER]))
        error = ws.recv_json()
        assert (error["type"], error["status"]) == ("error", 429) and error["headers"]["retry-after"] == "7"
        sim.script(Reply(text="still usable"))
        ws.send_json(_create(input=[USER]))  # the socket stays usable
        assert ws.until("response.completed")[-1]["response"]["status"] == "completed"
    assert [r.route for r in sim.requests] == ["chat", "chat"]  # the 429 and the answer
    trace = sealed_trace(proxy, session)
    assert trace.num_turns == 1 and [c.status for c in trace.calls] == [429, 200]


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "found"])
def test_a_responses_upstream_without_websockets_gets_http(served, sim, declared):
    sim.websockets = False
    sim.script(Reply(tool_calls=[ToolCall(name="shell", arguments={"cmd": "ls"})]), Reply(text=["two ", "files"]))
    proxy, session = served({"websocket": False} if declared else None, model="imposed")
    if not declared:
        with pytest.raises(Rejected) as refused:  # the upstream's own refusal, once
            _client(proxy, session)
        assert refused.value.status == 404
    start = time.monotonic()
    with _client(proxy, session) as ws:
        _task(ws)
    assert time.monotonic() - start < 20
    posts = [r for r in sim.requests if r.method == "POST"]
    assert [(r.route, r.transport) for r in posts] == [("responses", "http")] * 2
    assert len([r for r in sim.requests if r.method == "GET"]) == (0 if declared else 1)  # the refused upgrade
    assert all(r.json["model"] == "imposed" and "previous_response_id" not in r.json for r in posts)
    assert len(posts[1].json["input"]) == 3  # the chain resolved by the proxy: user, call, output
    trace = sealed_trace(proxy, session)
    assert trace.num_turns == 2 and len(trace.branches) == 1 and not trace.errors

"""Codex's transport without Codex: the Responses API over a WebSocket through the real
mitmdump, frame by frame (claim by the upgrade's credential, rewrite each response.create,
relay server frames unchanged, commit before response.completed, warm-ups are no turns,
previous_response_id resolved to the whole conversation)."""

from __future__ import annotations


import openai
import pytest

from interceptor.trace import read_trace
from clients import REAL_KEY
from provider import Reply, ToolCall
from waiting import wait_until
from wsclient import Rejected, WSClient

SESSION = {"model": "ws-imposed-model", "sampling": {"temperature": 0.25, "max_tokens": 321}}
URL = "wss://api.openai.com/v1/responses"
USER = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list the files"}]}
TOOL = {"type": "custom", "name": "exec", "description": "run JavaScript", "format": {"type": "text"}}


def _client(proxy, session, **kw) -> WSClient:
    return WSClient(URL, headers={"Authorization": f"Bearer {session['model_secret']}"},
                    proxy=proxy.url, cafile=str(proxy.ca_bundle), **kw)


def _create(**fields) -> dict:
    # Harness settings the session must replace.
    return {"type": "response.create", "model": "gpt-harness", "temperature": 1.5, "stream": True, **fields}


def _sealed(proxy, session):
    status, _ = proxy.api("DELETE", f"sessions/{session['id']}")
    assert status == 200
    return read_trace(session["trace_path"])


def _script_task(sim) -> None:
    sim.script(Reply(reasoning="look first", tool_calls=[ToolCall(name="exec", arguments="ls -a", type="custom", id="call_ls")]),
               Reply(text=["two ", "files"], delay=0.05))


def _ws_task(proxy, session) -> list[list[dict]]:
    """Warm-up, then two turns chained on previous_response_id (Codex's shape)."""
    answers = []
    with _client(proxy, session) as ws:
        ws.send_json(_create(generate=False, input=[USER], tools=[TOOL]))
        warm = ws.until("response.completed")
        ws.send_json(_create(previous_response_id=warm[-1]["response"]["id"], input=[]))
        answers.append(ws.until("response.completed"))
        first = answers[0][-1]["response"]
        call = next(i for i in first["output"] if i["type"] == "custom_tool_call")
        ws.send_json(_create(previous_response_id=first["id"],
                             input=[{"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "a b"}]))
        answers.append(ws.until("response.completed"))
    return answers


def test_websocket_turns_are_rewritten_relayed_and_recorded(proxy, new_session, sim):
    session = new_session(**SESSION)
    _script_task(sim)
    answers = _ws_task(proxy, session)
    assert "".join(e.get("delta", "") for e in answers[1] if e["type"] == "response.output_text.delta") == "two files"
    # Relayed unchanged: the events the client got are the simulator's, numbered without gaps.
    assert [e["sequence_number"] for e in answers[1]] == list(range(len(answers[1])))

    frames = [r for r in sim.requests if r.transport == "websocket" and r.route != "websocket"]
    assert [r.route for r in frames] == ["responses_warmup", "responses", "responses"]
    for r in sim.requests:
        assert r.headers["authorization"] == f"Bearer {REAL_KEY}"
        assert session["model_secret"] not in r.body.decode() + str(r.headers)
    for r in frames:
        assert r.json["model"] == "ws-imposed-model"
        assert r.json["temperature"] == 0.25 and r.json["max_output_tokens"] == 321

    trace = _sealed(proxy, session)
    assert trace.num_turns == 2 and len(trace.calls) == 2 and not trace.errors
    assert len(trace.branches) == 1
    roles = [m.role for m in trace.branches[0].messages]
    assert roles == ["user", "assistant", "tool", "assistant"]
    call_node, result_node = trace.branches[0].messages[1], trace.branches[0].messages[2]
    assert call_node.tool_calls[0].name == "exec" and call_node.tool_calls[0].arguments == "ls -a"
    assert result_node.content == "a b"
    assert [t.name for t in trace.tools] == ["exec"]  # carried over to the chained frames
    for call in trace.calls:
        assert call.status == 200 and call.model == "ws-imposed-model" and call.stream
        assert call.usage is not None and call.usage.input_tokens > 0 and not call.usage.estimated
        assert call.sampling.temperature == 0.25
        assert call.first_byte_at and call.first_byte_at <= call.ended_at
    assert trace.calls[1].ended_at - trace.calls[1].first_byte_at >= 0.05  # the stream's own pace


def test_websocket_and_sse_give_the_same_trace(proxy, new_session, sim, harness_env):
    ws_session = new_session(**SESSION)
    _script_task(sim)
    _ws_task(proxy, ws_session)

    sse_session = new_session(**SESSION)
    harness_env(sse_session["env"])
    _script_task(sim)
    client = openai.OpenAI(api_key=sse_session["model_secret"], max_retries=0, timeout=30)
    with client.responses.stream(model="gpt-harness", input=[USER], tools=[TOOL]) as s:
        first = s.get_final_response()
    items = [i.model_dump(exclude_none=True) for i in first.output]
    call = next(i for i in items if i["type"] == "custom_tool_call")
    with client.responses.stream(model="gpt-harness", tools=[TOOL], input=[
            USER, *items, {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "a b"}]) as s:
        s.get_final_response()

    ws_trace, sse_trace = _sealed(proxy, ws_session), _sealed(proxy, sse_session)
    assert len(ws_trace.branches) == len(sse_trace.branches) == 1
    strip = lambda m: m.model_dump(exclude={"reasoning"})  # noqa: E731 (encrypted blobs differ per answer)
    assert [strip(m) for m in ws_trace.branches[0].messages] == [strip(m) for m in sse_trace.branches[0].messages]
    assert [(c.finish_reason, c.model, c.status) for c in ws_trace.calls] == \
           [(c.finish_reason, c.model, c.status) for c in sse_trace.calls]


def test_an_error_frame_is_a_call_and_the_retry_is_the_turn(proxy, new_session, sim):
    session = new_session(**SESSION)
    sim.script(Reply(status=529, error_message="Overloaded"), Reply(text="fine now"))
    with _client(proxy, session) as ws:
        ws.send_json(_create(input=[USER]))
        error = ws.recv_json()
    assert error["type"] == "error" and error["status"] == 529
    with _client(proxy, session) as ws:  # Codex drops the socket on an error and reconnects
        ws.send_json(_create(input=[USER]))
        assert ws.until("response.completed")[-1]["response"]["status"] == "completed"
    trace = _sealed(proxy, session)
    assert [c.status for c in trace.calls] == [529, 200]
    assert trace.calls[0].error is not None and trace.calls[0].error.status == 529 and trace.calls[0].node is None
    assert trace.num_turns == 1 and len(trace.branches) == 1


def test_a_socket_closed_mid_answer_is_an_error_on_the_record(proxy, new_session, sim):
    session = new_session(**SESSION)
    sim.script(Reply(text=["a", "b", "c", "d"], cut_after=4))
    with _client(proxy, session) as ws:
        ws.send_json(_create(input=[USER]))
        with pytest.raises(ConnectionError):
            ws.until("response.completed")
    wait_until(lambda: proxy.api("GET", f"sessions/{session['id']}")[1]["calls"] >= 1, 5, "the call on the record")
    trace = _sealed(proxy, session)
    assert trace.num_turns == 0 and len(trace.calls) == 1
    assert trace.calls[0].error.type == "incomplete_stream"


def test_an_unknown_secret_is_refused_at_the_upgrade(proxy, new_session, sim):
    session = new_session(**SESSION)
    with pytest.raises(Rejected) as refused:
        _client(proxy, {"model_secret": "sk-ic-m-not-a-session"})
    assert refused.value.status == 401 and b"unknown session secret" in refused.value.body
    assert sim.requests == []
    assert _sealed(proxy, session).calls == []


def test_an_upstream_without_websockets_records_nothing_and_says_so(proxy, new_session, sim):
    sim.websockets = False
    session = new_session(**SESSION)
    with pytest.raises(Rejected) as refused:
        _client(proxy, session)
    assert refused.value.status == 404
    assert _sealed(proxy, session).calls == []
    # The next upgrade is the proxy's own (tests/test_wsserve.py): no fallback delay for Codex.
    assert "the proxy serves the session's next upgrade itself" in proxy.log()


def test_a_frame_the_dialect_cannot_read_is_refused_not_forwarded(proxy, new_session, sim):
    session = new_session(**SESSION)
    with _client(proxy, session) as ws:
        ws.send_json(_create(input=5))  # not a list of items: the session's model cannot be imposed
        error = ws.recv_json()
        assert error["type"] == "error" and error["status"] == 400
        assert "not understood" in error["error"]["message"]
        sim.script(Reply(text="still usable"))
        ws.send_json(_create(input=[USER]))  # the socket stays usable
        assert ws.until("response.completed")[-1]["response"]["status"] == "completed"
    assert [r.route for r in sim.requests if r.route != "websocket"] == ["responses"]
    trace = _sealed(proxy, session)
    assert len(trace.calls) == 1 and trace.num_turns == 1


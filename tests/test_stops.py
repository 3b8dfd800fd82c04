"""Limits and stops: a rollout's budget ends it cleanly, at the boundary.

Through a real mitmdump, the real openai and anthropic SDKs, and the simulator. The refusal
is a 400 in the dialect's shape that the SDKs do not retry; nothing reaches the simulator;
every later request gets the same; the refused request's tool results are on the trace; a
flagged retry of an answered turn is still replayed.
"""

from __future__ import annotations

import threading

import anthropic
import openai
import pytest

from interceptor.trace import read_trace
from clients import session_clients
from provider import Reply, ToolCall
from test_trace_proxy import mproxy, msim, session  # noqa: F401 (one simulator and proxy for the module)

TOOLS = [{"type": "function", "function": {
    "name": "bash", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]


def tool_turn(k: int) -> Reply:
    return Reply(tool_calls=[ToolCall(name="bash", arguments={"cmd": f"step {k}"}, id=f"call_{k}")])


def chat_step(oai, msgs: list, **kw):
    """One agent step: ask, then append the reply and its tool result to ``msgs``."""
    r = oai.chat.completions.create(model="x", messages=msgs, tools=TOOLS, **kw)
    msg = r.choices[0].message
    msgs.append(msg.model_dump(exclude_none=True))
    for call in msg.tool_calls or ():
        msgs.append({"role": "tool", "tool_call_id": call.id, "content": f"output of {call.id}"})
    return r


def seal(mproxy, s) -> dict:
    status, summary = mproxy.api("DELETE", f"sessions/{s['id']}")
    assert status == 200, summary
    return summary


def test_max_turns_refuses_the_third_request(session, msim, mproxy):
    s = session(limits={"max_turns": 2})
    msim.script(tool_turn(1), tool_turn(2), tool_turn(3))
    oai = openai.OpenAI(api_key=s["model_secret"], max_retries=2, timeout=30)  # would retry a retryable answer
    msgs = [{"role": "user", "content": "three steps"}]
    chat_step(oai, msgs)
    chat_step(oai, msgs)
    with pytest.raises(openai.BadRequestError) as e:
        chat_step(oai, msgs)
    err = e.value
    assert err.status_code == 400 and "rollout stopped: max_turns" in err.message
    assert err.body["type"] == "interceptor_stopped"
    assert err.response.headers["x-should-retry"] == "false"
    assert err.response.headers["x-interceptor-stop"] == "max_turns"
    assert len(msim.model_requests()) == 2  # the third never reached the simulator, and was not retried
    # every later model request gets the same, whatever it holds
    with pytest.raises(openai.BadRequestError, match="rollout stopped: max_turns"):
        oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "something else"}])
    assert len(msim.model_requests()) == 2
    summary = seal(mproxy, s)
    assert summary["stop_condition"] == "max_turns" and summary["stopped_by"] == "limit" and summary["truncated"]
    trace = read_trace(s["trace_path"])
    assert (trace.stop_condition, trace.stopped_by, trace.truncated) == ("max_turns", "limit", True)
    assert trace.num_turns == 2 and len(trace.branches) == 2  # the unrelated request is its own root
    # the third request's tool result is on the trace, after the second reply
    main = trace.branches[0]
    assert [m.role for m in main.messages] == ["user", "assistant", "tool", "assistant", "tool"]
    assert main.messages[-1].content == "output of call_2"
    refused = [c for c in trace.calls if c.error is not None]
    assert [c.error.type for c in refused] == ["interceptor_stopped"] * 2 and all(c.status == 400 for c in refused)
    assert trace.stop is not None and trace.stop.condition == "max_turns" and trace.stop.by == "limit"
    assert trace.stop.call == refused[0].id
    assert trace.num_turns == 2 and trace.timing.model > 0


def test_anthropic_refusal_is_in_its_own_shape(session, msim, mproxy):
    s = session(limits={"max_turns": 1})
    msim.script(Reply(text="one"))
    _, ant = session_clients(s)
    ant.messages.create(model="claude-x", max_tokens=50, messages=[{"role": "user", "content": "a"}])
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(model="claude-x", max_tokens=50, messages=[{"role": "user", "content": "b"}])
    assert e.value.body == {"type": "error", "error": {"type": "interceptor_stopped",
                                                       "message": "rollout stopped: max_turns"}}
    assert len(msim.model_requests()) == 1


def test_parallel_requests_at_the_last_turn_admit_exactly_one(session, msim, mproxy):
    s = session(limits={"max_turns": 3})
    oai, _ = session_clients(s)
    msim.script(Reply(text="one"), Reply(text="two"))
    oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "a"}])
    oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "b"}])
    # one turn left; two sub-agents ask at once, and the first is still being answered
    msim.script(Reply(text="slow", first_byte_delay=1.0), Reply(text="slow"))
    results: dict[str, object] = {}

    def ask(name: str) -> None:
        try:
            results[name] = oai.chat.completions.create(model="x", messages=[{"role": "user", "content": name}])
        except openai.BadRequestError as e:
            results[name] = e

    threads = [threading.Thread(target=ask, args=(n,)) for n in ("p1", "p2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    errors = [r for r in results.values() if isinstance(r, openai.BadRequestError)]
    assert len(results) == 2 and len(errors) == 1, results
    assert "rollout stopped: max_turns" in errors[0].message
    assert len(msim.model_requests()) == 3
    assert seal(mproxy, s)["turns"] == 3


def test_a_flagged_retry_after_the_stop_is_still_replayed(session, msim, mproxy):
    s = session(limits={"max_turns": 2})
    msim.script(tool_turn(1), tool_turn(2))
    oai, _ = session_clients(s)
    msgs = [{"role": "user", "content": "go"}]
    chat_step(oai, msgs)
    second = list(msgs)
    r2 = chat_step(oai, msgs)
    with pytest.raises(openai.BadRequestError, match="max_turns"):
        chat_step(oai, msgs)
    # the SDK's retry of the second request (same body, retry count 1): the answer it was owed
    raw = oai.chat.completions.with_raw_response.create(
        model="x", messages=second, tools=TOOLS, extra_headers={"x-stainless-retry-count": "1"})
    assert raw.headers.get("x-interceptor-replay")
    assert raw.parse().choices[0].message.tool_calls[0].id == r2.choices[0].message.tool_calls[0].id
    assert len(msim.model_requests()) == 2
    seal(mproxy, s)  # the file is whole when DELETE answers
    trace = read_trace(s["trace_path"])
    assert [c.replay_of is not None for c in trace.calls] == [False, False, False, True]


def test_context_too_long_is_recorded_and_stops_when_asked(session, msim, mproxy):
    message = "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens."
    too_long = Reply(status=400, error_code="context_length_exceeded", error_message=message)
    for stops in (False, True):
        s = session(limits={"context_length_stops": stops})
        oai, _ = session_clients(s)
        msim.script(too_long, Reply(text="after"))
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "long"}])
        assert e.value.message.endswith(message) and e.value.code == "context_length_exceeded"  # unchanged
        if stops:
            with pytest.raises(openai.BadRequestError, match="rollout stopped: context_length"):
                oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "short"}])
        else:
            oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "short"}])
        summary = seal(mproxy, s)
        trace = read_trace(s["trace_path"])
        assert trace.calls[0].error.type == "context_length" and trace.calls[0].error.status == 400
        if stops:
            assert (summary["stop_condition"], summary["stopped_by"]) == ("context_length", "upstream")
            assert trace.truncated and trace.stop.by == "upstream"
        else:
            assert summary["stop_condition"] == "deleted" and trace.stop is None
            assert trace.num_turns == 1


def test_output_budget_stops_and_clamps(session, msim, mproxy):
    s = session(limits={"max_output_tokens": 50, "clamp_max_tokens": True})
    oai, _ = session_clients(s)
    msim.script(Reply(text="a", output_tokens=30), Reply(text="b", output_tokens=25), Reply(text="c"))
    oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "a"}])
    oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "b"}], max_tokens=1000)
    with pytest.raises(openai.BadRequestError, match="rollout stopped: max_output_tokens"):
        oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "c"}])
    sent = [r.json for r in msim.model_requests()]
    assert sent[0]["max_completion_tokens"] == 50  # none asked: the whole budget
    assert sent[1]["max_completion_tokens"] == 20 and "max_tokens" not in sent[1]  # 50 - 30 left
    seal(mproxy, s)
    trace = read_trace(s["trace_path"])
    # overlay mode keeps the harness's max_tokens; the clamp replaces it by its current name
    assert [(o.key, o.old, o.new) for o in trace.calls[1].overrides if o.reason == "limit"] \
        == [("max_tokens", 1000, None), ("max_completion_tokens", None, 20)]
    assert trace.num_output_tokens == 55 and trace.stop_condition == "max_output_tokens"


@pytest.mark.parametrize("limits, says", [
    ({"max_turns": 0}, "limits.max_turns"),
    ({"max_trns": 3}, "limits.max_trns"),
    ({"clamp_max_tokens": True}, "clamp_max_tokens needs"),
])
def test_bad_limits_are_refused_at_creation(mproxy, limits, says):
    status, answer = mproxy.api("POST", "sessions", {"limits": limits})
    assert status == 400 and says in answer["error"]["message"], answer


def test_websocket_refusal_is_an_error_frame(session, msim, mproxy):
    from wsclient import WSClient

    s = session(limits={"max_turns": 1})
    msim.script(Reply(tool_calls=[ToolCall(name="exec", arguments="ls", type="custom", id="call_ls")]), Reply(text="no"))
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list"}]}
    tool = {"type": "custom", "name": "exec", "format": {"type": "text"}}
    with WSClient("wss://api.openai.com/v1/responses", headers={"Authorization": f"Bearer {s['model_secret']}"},
                  proxy=mproxy.url, cafile=str(mproxy.ca_bundle)) as ws:
        ws.send_json({"type": "response.create", "model": "m", "stream": True, "input": [user], "tools": [tool]})
        first = ws.until("response.completed")[-1]["response"]
        ws.send_json({"type": "response.create", "model": "m", "stream": True, "previous_response_id": first["id"],
                      "input": [{"type": "custom_tool_call_output", "call_id": "call_ls", "output": "a b"}]})
        error = ws.until("error", "response.completed")[-1]
    assert error["type"] == "error" and error["status"] == 400
    assert error["error"]["type"] == "interceptor_stopped" and error["error"]["message"] == "rollout stopped: max_turns"
    frames = [r for r in msim.requests if r.transport == "websocket" and r.route == "responses"]
    assert len(frames) == 1
    seal(mproxy, s)
    trace = read_trace(s["trace_path"])
    assert trace.stop_condition == "max_turns" and trace.num_turns == 1
    assert trace.branches[0].messages[-1].role == "tool" and trace.branches[0].messages[-1].content == "a b"

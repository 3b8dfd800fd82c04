"""The tool route: a harness asks ``POST /_interceptor/tool`` before and after each
tool call with its own credential; the session's request hooks decide (allow, block,
rewrite, stop), and the decision is enforced at the model boundary: whatever the harness then
sends for that call, the model reads the decided content, and the graph holds it once.

An SDK-driven agent loop (the openai SDK) through a real mitmdump against the simulator."""

from __future__ import annotations

import json
import textwrap
import urllib.error
import urllib.request

import openai
import pytest

from interceptor.trace import read_trace
from clients import session_clients
from provider import Reply, ToolCall
from test_trace_proxy import ANTHROPIC_TOOLS, SYSTEM, TOOLS, mproxy, msim, session  # noqa: F401

BLOCKED = "blocked by the evaluator: rm is not allowed here"
REDACTED = "[redacted by the evaluator]"
POLICE = '''
import json
from interceptor.hooks import HookContext, Request, intercept

@intercept
def police(request: Request, ctx: HookContext):
    last = request.messages[-1]
    if last.role != "tool":
        return None
    call = next(tc for m in request.messages if m.role == "assistant" for tc in m.tool_calls
                if tc.id == last.tool_call_id)
    command = json.loads(call.arguments).get("cmd", "")
    if ctx.tool_phase == "before" and command.startswith("rm "):
        last.content, last.is_error = BLOCKED, True
    elif "SECRET" in last.text():
        last.content = REDACTED
    return request
'''.replace("BLOCKED", repr(BLOCKED)).replace("REDACTED", repr(REDACTED))


def route(mproxy, token: str | None, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"{mproxy.url}/_interceptor/tool", data=data, method="POST",
                                 headers={"content-type": "application/json",
                                          **({"authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_block_and_rewrite_are_enforced_at_the_model_boundary(session, msim, mproxy, tmp_path):
    hooks = tmp_path / "police.py"
    hooks.write_text(textwrap.dedent(POLICE))
    s = session(hooks={"module": str(hooks)})
    oai, _ = session_clients(s)
    secret = s["model_secret"]
    msim.script(Reply(tool_calls=[ToolCall(name="bash", arguments={"cmd": "rm -rf victim"}, id="call_rm")]),
                Reply(tool_calls=[ToolCall(name="bash", arguments={"cmd": "cat notes"}, id="call_cat")]),
                Reply(text="done"))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "clean up"}]

    def turn():
        r = oai.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
        messages.append(r.choices[0].message.model_dump(exclude_none=True))

    turn()
    # before -> block: the harness honours it and sends the block content as the result.
    status, answer = route(mproxy, secret, {"phase": "before", "tool_call_id": "call_rm", "name": "bash",
                                            "arguments": {"cmd": "rm -rf victim"}})
    assert (status, answer) == (200, {"action": "block", "content": BLOCKED, "is_error": True})
    messages.append({"role": "tool", "tool_call_id": "call_rm", "content": answer["content"]})
    turn()
    # after -> rewrite, and the harness deliberately sends the original output.
    assert route(mproxy, secret, {"phase": "before", "tool_call_id": "call_cat"})[1] == {"action": "allow"}
    status, answer = route(mproxy, secret, {"phase": "after", "tool_call_id": "call_cat", "content": "SECRET=42"})
    assert (status, answer) == (200, {"action": "rewrite", "content": REDACTED, "is_error": False})
    messages.append({"role": "tool", "tool_call_id": "call_cat", "content": "SECRET=42"})
    turn()

    sent = [[m["content"] for m in r.json["messages"] if m["role"] == "tool"] for r in msim.model_requests()]
    assert sent == [[], [BLOCKED], [BLOCKED, REDACTED]]
    # The refusals: unknown id, the wrong secrets, a malformed body.
    assert route(mproxy, secret, {"phase": "after", "tool_call_id": "call_nobody"})[0] == 404
    status, answer = route(mproxy, s["state_secret"], {"phase": "before", "tool_call_id": "call_rm"})
    assert status == 401 and "model secret" in answer["error"]["message"]
    assert route(mproxy, None, {"phase": "before", "tool_call_id": "call_rm"})[0] == 401
    for bad in ({"phase": "during", "tool_call_id": "call_rm"}, {"phase": "before", "tool_call_id": "call_rm", "x": 1},
                b"{not json"):
        assert route(mproxy, secret, bad)[0] == 400, bad

    mproxy.api("DELETE", f"sessions/{s['id']}")
    trace = read_trace(s["trace_path"])
    assert len(trace.branches) == 1
    tools = [m for m in trace.branches[0].messages if m.role == "tool"]
    assert [(m.tool_call_id, m.text()) for m in tools] == [("call_rm", BLOCKED), ("call_cat", REDACTED)]
    assert [(d.phase, d.tool_call_id, d.action, d.hooks) for d in trace.tool_decisions] == [
        ("before", "call_rm", "block", ["police"]), ("before", "call_cat", "allow", []),
        ("after", "call_cat", "rewrite", ["police"])]
    assert trace.tool_decisions[-1].content == "SECRET=42"  # what the harness reported, on the record
    assert "SECRET=42" not in json.dumps([n.message.model_dump() for n in trace.nodes])
    rewrites = {r.tool_call_id: r for r in trace.request_rewrites}
    assert rewrites["call_cat"].by == "tool_route" and rewrites["call_cat"].original == "SECRET=42"


def test_a_blocked_tool_run_anyway_still_reaches_the_model_as_blocked(session, msim, mproxy, tmp_path):
    hooks = tmp_path / "police.py"
    hooks.write_text(textwrap.dedent(POLICE))
    s = session(hooks={"module": str(hooks)})
    oai, _ = session_clients(s)
    msim.script(Reply(tool_calls=[ToolCall(name="bash", arguments={"cmd": "rm -rf victim"}, id="call_rm")]),
                Reply(text="done"))
    messages = [{"role": "user", "content": "clean up"}]
    r = oai.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
    assert route(mproxy, s["model_secret"], {"phase": "before", "tool_call_id": "call_rm"})[1]["action"] == "block"
    messages += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": "call_rm", "content": "removed 3 files"}]  # it ran it anyway
    oai.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
    assert [m["content"] for m in msim.model_requests()[1].json["messages"] if m["role"] == "tool"] == [BLOCKED]


STAMP = '''
from interceptor.hooks import HookContext, Request, intercept

@intercept
def stamp(request: Request, ctx: HookContext):
    for m in request.messages[len(ctx.messages):]:  # the new messages, the only ones a hook may change
        if m.role == "tool" and ctx.tool_phase == "after":
            m.content = "decided by the route"
        elif m.role == "tool" and ctx.tool_phase is None:
            m.content = "decided at the model boundary"
    return request
'''


def test_a_route_decision_is_final_at_the_model_boundary(session, msim, mproxy, tmp_path):
    hooks = tmp_path / "stamp.py"
    hooks.write_text(STAMP)
    s = session(hooks={"module": str(hooks)})
    oai, _ = session_clients(s)
    msim.script(Reply(tool_calls=[ToolCall(name="bash", arguments={"cmd": "ls"}, id="call_a"),
                                  ToolCall(name="bash", arguments={"cmd": "pwd"}, id="call_b")]),
                Reply(text="done"))
    messages = [{"role": "user", "content": "look"}]
    r = oai.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
    # call_a goes through the route; call_b never does, so the boundary's hooks decide it.
    assert route(mproxy, s["model_secret"], {"phase": "after", "tool_call_id": "call_a", "content": "a.txt"})[1] == {
        "action": "rewrite", "content": "decided by the route", "is_error": False}
    messages += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": "call_a", "content": "a.txt"},
                 {"role": "tool", "tool_call_id": "call_b", "content": "/work"}]
    oai.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
    assert [m["content"] for m in msim.model_requests()[1].json["messages"] if m["role"] == "tool"] == [
        "decided by the route", "decided at the model boundary"]
    mproxy.api("DELETE", f"sessions/{s['id']}")
    trace = read_trace(s["trace_path"])
    rewrites = {r.tool_call_id: r for r in trace.request_rewrites}
    assert (rewrites["call_a"].by, rewrites["call_b"].by) == ("tool_route", "hook")
    # Both on the record with the call that carried them, at the nodes the model read.
    call = trace.calls[1]
    assert set(call.rewrites) == {rewrites["call_a"].id, rewrites["call_b"].id}
    for r in rewrites.values():
        assert r.call == call.id and trace.nodes[r.node].message.tool_call_id == r.tool_call_id


RAISES = '''
from interceptor.hooks import Request, intercept

@intercept
def broken(request: Request):
    if request.messages[-1].role == "tool":
        raise RuntimeError("grader down")
'''


def test_a_hook_error_at_the_route_is_a_500_that_stops_the_rollout(session, msim, mproxy, tmp_path):
    hooks = tmp_path / "raises.py"
    hooks.write_text(RAISES)
    s = session(hooks={"module": str(hooks)})
    oai, _ = session_clients(s)
    msim.script(Reply(tool_calls=[ToolCall(name="bash", arguments={"cmd": "ls"}, id="call_x")]), Reply(text="done"))
    messages = [{"role": "user", "content": "look"}]
    r = oai.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
    req = urllib.request.Request(f"{mproxy.url}/_interceptor/tool", method="POST",
                                 data=json.dumps({"phase": "before", "tool_call_id": "call_x"}).encode(),
                                 headers={"x-api-key": s["model_secret"], "content-type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=30)
        raise AssertionError("not refused")
    except urllib.error.HTTPError as e:
        assert (e.code, e.headers["x-should-retry"]) == (500, "false")
        answer = json.loads(e.read())
    assert answer["error"]["type"] == "hook_error" and "grader down" in answer["error"]["message"]
    # The rollout is stopped: the route says so, and the next model request is refused.
    assert route(mproxy, s["model_secret"], {"phase": "after", "tool_call_id": "call_x", "content": "x"})[1] == {
        "action": "stop", "reason": "hook_error"}
    messages += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": "call_x", "content": "x"}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
    assert "rollout stopped: hook_error" in e.value.message
    assert len(msim.model_requests()) == 1
    mproxy.api("DELETE", f"sessions/{s['id']}")
    assert route(mproxy, s["model_secret"], {"phase": "before", "tool_call_id": "call_x"})[0] == 409
    trace = read_trace(s["trace_path"])
    assert [(d.action, d.hooks) for d in trace.tool_decisions] == [("error", ["broken"]), ("stop", [])]
    assert (trace.stop_condition, trace.stopped_by) == ("hook_error", "hook")


def test_an_anthropic_harness_that_runs_a_blocked_tool_anyway(session, msim, mproxy, tmp_path):
    """Anthropic Messages carries the error flag: the model reads the block content as an
    error result, though the harness sent its own output as a success, restated on later turns."""
    hooks = tmp_path / "police.py"
    hooks.write_text(textwrap.dedent(POLICE))
    s = session(hooks={"module": str(hooks)})
    _, ant = session_clients(s)
    msim.script(Reply(tool_calls=[ToolCall(name="bash", arguments={"cmd": "rm -rf victim"}, id="toolu_rm")]),
                Reply(text="noted"), Reply(text="done"))
    kw = dict(model="claude-x", max_tokens=200, system=SYSTEM, tools=ANTHROPIC_TOOLS)
    messages = [{"role": "user", "content": "clean up"}]
    r = ant.messages.create(messages=messages, **kw)
    assert route(mproxy, s["model_secret"], {"phase": "before", "tool_call_id": "toolu_rm"})[1]["action"] == "block"
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_rm",
                                               "content": "removed 3 files"}]}]
    r = ant.messages.create(messages=messages, **kw)
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                 {"role": "user", "content": "and now?"}]
    ant.messages.create(messages=messages, **kw)
    for request in msim.model_requests()[1:]:
        results = [b for m in request.json["messages"] if isinstance(m["content"], list)
                   for b in m["content"] if b.get("type") == "tool_result"]
        assert [(b["content"], b.get("is_error")) for b in results] == [(BLOCKED, True)], results
    mproxy.api("DELETE", f"sessions/{s['id']}")
    trace = read_trace(s["trace_path"])
    assert len(trace.branches) == 1
    [tool] = [m for m in trace.branches[0].messages if m.role == "tool"]
    assert (tool.text(), tool.is_error) == (BLOCKED, True)
    [rewrite] = trace.request_rewrites
    assert (rewrite.by, rewrite.reason, rewrite.is_error, rewrite.call) == ("tool_route", "block", True,
                                                                            trace.calls[1].id)
    assert all(rewrite.id in c.rewrites for c in trace.calls[1:])


def test_an_id_two_current_branches_issued_is_a_409(session, msim, mproxy):
    s = session()
    oai, _ = session_clients(s)
    msim.script(*[Reply(tool_calls=[ToolCall(name="bash", arguments={"cmd": "ls"}, id="call_same")])] * 2)
    for task in ("first task", "a sub-agent's task"):  # two conversations: two leaves
        oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": task}], tools=TOOLS)
    status, answer = route(mproxy, s["model_secret"], {"phase": "before", "tool_call_id": "call_same"})
    assert status == 409 and "2 current branches" in answer["error"]["message"]
    # Without request hooks there is nothing to decide, but the id is still checked.
    assert route(mproxy, s["model_secret"], {"phase": "before", "tool_call_id": "call_other"})[0] == 404


QUIET = '''
from interceptor.hooks import HookContext, Request, intercept

@intercept
def quiet(request: Request, ctx: HookContext):
    last = request.messages[-1]
    if last.role == "tool" and ctx.tool_phase == "before":
        last.content = "not run: " + last.tool_call_id  # a block that says nothing of is_error
        if last.tool_call_id.endswith("_ok"):
            last.is_error = False  # the hook says otherwise
    return request
'''


def test_a_block_is_an_error_unless_the_hook_says_otherwise(session, msim, mproxy, tmp_path):
    """A hook that blocks a tool only by writing its result: the route answers is_error true
    and the model (Anthropic carries the flag) reads an error result, though the harness sends
    the block content as a plain result; a hook that sets is_error false is taken at its word."""
    hooks = tmp_path / "quiet.py"
    hooks.write_text(textwrap.dedent(QUIET))
    s = session(hooks={"module": str(hooks)})
    _, ant = session_clients(s)
    msim.script(Reply(tool_calls=[ToolCall(name="bash", arguments={"cmd": "rm -rf victim"}, id="toolu_rm")]),
                Reply(tool_calls=[ToolCall(name="bash", arguments={"cmd": "ls"}, id="toolu_ok")]),
                Reply(text="done"))
    kw = dict(model="claude-x", max_tokens=200, system=SYSTEM, tools=ANTHROPIC_TOOLS)
    messages = [{"role": "user", "content": "clean up"}]
    for call_id, flag in (("toolu_rm", True), ("toolu_ok", False)):
        r = ant.messages.create(messages=messages, **kw)
        status, answer = route(mproxy, s["model_secret"], {"phase": "before", "tool_call_id": call_id})
        assert (status, answer) == (200, {"action": "block", "content": f"not run: {call_id}", "is_error": flag})
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id,
                                                   "content": answer["content"]}]}]
    ant.messages.create(messages=messages, **kw)
    last = msim.model_requests()[-1].json["messages"]
    results = [b for m in last if isinstance(m["content"], list) for b in m["content"] if b.get("type") == "tool_result"]
    assert [(b["tool_use_id"], b.get("is_error", False)) for b in results] == [("toolu_rm", True), ("toolu_ok", False)]
    mproxy.api("DELETE", f"sessions/{s['id']}")
    trace = read_trace(s["trace_path"])
    assert [(m.tool_call_id, m.is_error) for m in trace.branches[0].messages if m.role == "tool"] == [
        ("toolu_rm", True), ("toolu_ok", False)]
    assert {r.tool_call_id: r.is_error for r in trace.request_rewrites} == {"toolu_rm": True, "toolu_ok": None}

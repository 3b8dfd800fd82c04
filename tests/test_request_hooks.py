"""Request hooks: a hook rewrites a tool result once; the rewrite is remembered.

Through a real mitmdump and the real SDKs against the simulator (strict): the rewritten
result reaches the simulator, the next two turns that restate the original get the
replacement spliced in without the hook seeing the original again, the graph is one branch
holding the delivered content, and one ``rewrite`` record keeps the original. For Chat,
Anthropic ``tool_result``, Responses ``function_call_output`` and over Codex's WebSocket.
Then the contract: what a hook may not change is a hook error (500, nothing forwarded), and
only the changed content is re-encoded.
"""

from __future__ import annotations

import json
import textwrap

import httpx
import openai
import pytest

from interceptor.trace import read_trace
from interceptor.trace.verify import problems
from clients import chat_turns, session_clients
from provider import Reply, ToolCall
from test_trace_proxy import ANTHROPIC_TOOLS, SYSTEM, TOOLS, mproxy, msim, session  # noqa: F401

SECRET = "SECRET: the answer is 42"
REDACTED = "[redacted by the evaluator]"

REDACT = """
import pathlib
from interceptor.hooks import HookContext, Request, intercept

@intercept(priority=5)
def redact(request: Request, ctx: HookContext):
    for m in request.messages:
        if m.role == "tool" and "SECRET" in m.text():
            with pathlib.Path(ctx.config["log"]).open("a") as f:
                f.write(m.text() + "\\n")  # every original this hook was shown
            m.content = ctx.config["replacement"]
    return request
"""


def hooks_file(tmp_path, body: str, name: str = "rewrite_hooks.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


@pytest.fixture
def redacting(session, tmp_path):
    """A session whose hook replaces any tool result holding SECRET; returns (session, log)."""
    log = tmp_path / "seen.log"
    log.write_text("")
    s = session(hooks={"module": hooks_file(tmp_path, REDACT),
                       "config": {"log": str(log), "replacement": REDACTED}})
    return s, log


def sealed(mproxy, s):
    status, _ = mproxy.api("DELETE", f"sessions/{s['id']}")
    assert status == 200
    return read_trace(s["trace_path"])


def assert_remembered(trace, log, sent_results: list[str]):
    """What every dialect's test checks on the simulator's side and on the trace."""
    assert sent_results == [REDACTED] * 3  # the rewritten turn and the two that restate the original
    assert log.read_text().splitlines() == [SECRET]  # the hook saw the original once
    assert len(trace.branches) == 1 and problems(trace) == []
    [rewrite] = trace.request_rewrites
    assert rewrite.by == "hook" and rewrite.hooks == ["redact"] and rewrite.target == "tool"
    assert rewrite.original == SECRET and not rewrite.original_truncated
    assert rewrite.size_before == len(SECRET) and rewrite.size_after == len(REDACTED)
    assert rewrite.digest_before != rewrite.digest_after
    node = trace.nodes[rewrite.node]
    assert node.message.role == "tool" and node.message.text() == REDACTED
    assert node.message.tool_call_id == rewrite.tool_call_id
    turns = [c for c in trace.calls if c.node is not None]
    assert [c.rewrites for c in turns] == [[], [rewrite.id], [rewrite.id], [rewrite.id]]
    assert rewrite.call == turns[1].id
    assert SECRET not in json.dumps([n.message.model_dump() for n in trace.nodes])


def test_chat_tool_result(redacting, msim, mproxy):
    s, log = redacting
    oai, _ = session_clients(s)
    msim.script(Reply(tool_calls=[ToolCall(name="bash", arguments={"cmd": "cat answer"}, id="call_1")]),
                Reply(text="noted"), Reply(text="still noted"), Reply(text="done"))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "find the answer"}]
    r = oai.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
    messages += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": "call_1", "content": SECRET}]
    for follow_up in ("go on", "and finish"):
        r = oai.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": follow_up}]
    oai.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
    sent = [[m["content"] for m in r.json["messages"] if m["role"] == "tool"] for r in msim.model_requests()]
    assert sent[0] == []
    assert_remembered(sealed(mproxy, s), log, [t for [t] in sent[1:]])


def test_anthropic_tool_result(redacting, msim, mproxy):
    s, log = redacting
    _, ant = session_clients(s)
    msim.script(Reply(tool_calls=[ToolCall(name="bash", arguments={"cmd": "cat answer"}, id="toolu_1")]),
                Reply(text="noted"), Reply(text="still noted"), Reply(text="done"))
    kw = dict(model="claude-x", max_tokens=200, system=SYSTEM, tools=ANTHROPIC_TOOLS)
    messages = [{"role": "user", "content": "find the answer"}]
    r = ant.messages.create(messages=messages, **kw)
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": SECRET},
                                              {"type": "text", "text": "what now?"}]}]
    for follow_up in ("go on", "and finish"):
        r = ant.messages.create(messages=messages, **kw)
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                     {"role": "user", "content": follow_up}]
    ant.messages.create(messages=messages, **kw)
    sent = [[b["content"] for m in r.json["messages"] if isinstance(m["content"], list)
             for b in m["content"] if b.get("type") == "tool_result"] for r in msim.model_requests()]
    assert sent[0] == []
    trace = sealed(mproxy, s)
    assert_remembered(trace, log, [t for [t] in sent[1:]])
    # the text block beside the tool result is the harness's, untouched
    assert msim.model_requests()[1].json["messages"][2]["content"][1] == {"type": "text", "text": "what now?"}


def test_responses_function_call_output(redacting, msim, mproxy):
    s, log = redacting
    oai, _ = session_clients(s)
    msim.script(Reply(tool_calls=[ToolCall(name="bash", arguments={"cmd": "cat answer"}, id="call_1")]),
                Reply(text="noted"), Reply(text="still noted"), Reply(text="done"))
    tools = [{"type": "function", "name": "bash", "description": "run a command",
              "parameters": TOOLS[0]["function"]["parameters"]}]
    items: list = [{"role": "user", "content": "find the answer"}]
    r = oai.responses.create(model="gpt-4o", input=items, tools=tools, instructions=SYSTEM)
    call = next(o for o in r.output if o.type == "function_call")
    items += [{"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": SECRET}]
    for follow_up in ("go on", "and finish"):
        r = oai.responses.create(model="gpt-4o", input=items, tools=tools, instructions=SYSTEM)
        items += [{"role": "assistant", "content": r.output_text}, {"role": "user", "content": follow_up}]
    oai.responses.create(model="gpt-4o", input=items, tools=tools, instructions=SYSTEM)
    sent = [[i["output"] for i in r.json["input"] if i.get("type") == "function_call_output"]
            for r in msim.model_requests()]
    assert sent[0] == []
    assert_remembered(sealed(mproxy, s), log, [t for [t] in sent[1:]])


def test_codex_websocket_function_call_output(redacting, msim, mproxy):
    """Codex's transport: the result arrives in a frame chained on previous_response_id; two
    later frames restate the whole input (as after a reconnect) and still get the replacement."""
    from wsclient import WSClient

    s, log = redacting
    msim.script(Reply(tool_calls=[ToolCall(name="bash", arguments={"cmd": "cat answer"}, id="call_ws")]),
                Reply(text="noted"), Reply(text="still noted"), Reply(text="done"))
    tools = [{"type": "function", "name": "bash", "description": "run a command",
              "parameters": TOOLS[0]["function"]["parameters"]}]
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "find the answer"}]}
    create = {"type": "response.create", "model": "gpt-4o", "stream": True, "tools": tools}
    with WSClient("wss://api.openai.com/v1/responses", headers={"Authorization": f"Bearer {s['model_secret']}"},
                  proxy=mproxy.url, cafile=str(mproxy.ca_bundle)) as ws:
        ws.send_json({**create, "input": [user]})
        first = ws.until("response.completed")[-1]["response"]
        call = next(o for o in first["output"] if o["type"] == "function_call")
        result = {"type": "function_call_output", "call_id": call["call_id"], "output": SECRET}
        ws.send_json({**create, "previous_response_id": first["id"], "input": [result]})
        answer = ws.until("response.completed")[-1]["response"]
        history = [user, {k: call[k] for k in ("type", "call_id", "name", "arguments")}, result]
        for follow_up in ("go on", "and finish"):
            text = answer["output"][0]["content"][0]["text"]
            history += [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]},
                        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": follow_up}]}]
            ws.send_json({**create, "input": history})
            answer = ws.until("response.completed")[-1]["response"]
    frames = [r for r in msim.model_requests() if r.transport == "websocket"]
    assert len(frames) == 4
    sent = [[i["output"] for i in r.json["input"] if i.get("type") == "function_call_output"] for r in frames]
    assert sent[0] == []
    assert_remembered(sealed(mproxy, s), log, [t for [t] in sent[1:]])


def test_only_the_changed_content_is_re_encoded(redacting, msim, mproxy):
    """A body with the harness's own spacing and escapes: the simulator gets it byte for byte
    except the rewritten tool result."""
    s, _ = redacting
    msim.script(Reply(text="ok"))
    raw = ('{"model": "gpt-4o",  "messages": [\n  {"role": "user", "content": "caf\\u00e9 \\/ x"},\n'
           '  {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", '
           '"function": {"name": "bash", "arguments": "{\\"cmd\\": \\"cat\\"}"}}]},\n'
           f'  {{"role": "tool", "tool_call_id": "c1", "content": "{SECRET}"}}  ]\n}}').encode()
    client = httpx.Client(proxy=s["env"]["HTTPS_PROXY"], verify=s["env"]["SSL_CERT_FILE"], timeout=30)
    r = client.post("https://api.openai.com/v1/chat/completions", content=raw,
                    headers={"authorization": f"Bearer {s['model_secret']}", "content-type": "application/json"})
    assert r.status_code == 200, r.text
    [got] = msim.model_requests()
    assert got.body == raw.replace(json.dumps(SECRET).encode(), json.dumps(REDACTED).encode())


@pytest.mark.parametrize("change, says", [
    ("request.messages.append(Message(role='user', content='more'))", "may not add or remove messages"),
    ("request.messages[0].content = 'a new task'", "message 0 (user) is in the conversation already"),
    ("request.messages[1].tool_calls[0].arguments = '{}'", "part of a message in the conversation already"),
    ("request.messages[1].tool_calls.append(request.messages[1].tool_calls[0])", "in the conversation already"),
    ("request.messages[0] = request.messages[0].model_copy(update={'content': 'a new task'})",
     "message 0 (user) is in the conversation already"),
    ("request.messages[-1].tool_call_id = 'other'", "only content and is_error may change, not tool_call_id"),
    ("request.tools = []", "may not change the request's tools"),
    ("request.tools[0].description = 'other'", "tool 'bash': a request hook may not change the request's tools"),
    ("request.tools[0].parameters['properties'] = {}", "may not change"),
    ("request.messages[-1].is_error = True", "chat has no error flag"),
])
def test_what_a_hook_may_not_change_is_a_hook_error(session, msim, mproxy, tmp_path, change, says):
    path = hooks_file(tmp_path, f"""
        from interceptor.hooks import Message, Request, intercept

        @intercept
        def meddle(request: Request):
            if request.messages[-1].role == "tool":
                {change}
    """)
    s = session(hooks={"module": path})
    oai = openai.OpenAI(api_key=s["model_secret"], max_retries=2, timeout=30)
    msim.script(Reply(tool_calls=[ToolCall(name="bash", arguments={"cmd": "ls"}, id="call_1")]), Reply(text="never"))
    messages = [{"role": "user", "content": "list"}]
    r = oai.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
    messages += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": "call_1", "content": "a b"}]
    with pytest.raises(openai.InternalServerError) as e:
        oai.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
    assert e.value.response.headers["x-should-retry"] == "false" and e.value.body["type"] == "hook_error"
    assert "hook meddle: " in e.value.message and says in e.value.message
    assert len(msim.model_requests()) == 1  # the second request never left, and was not retried
    trace = sealed(mproxy, s)
    assert trace.stopped_by == "hook" and trace.calls[-1].error.type == "hook_error"
    assert trace.request_rewrites == []


KEEPER = """
import json, pathlib
from interceptor.hooks import HookContext, ReadOnly, Request, intercept

kept = []

@intercept
def keeper(request: Request, ctx: HookContext):
    log = pathlib.Path(ctx.config["log"])
    first = request.messages[0]
    n = len([line for line in log.read_text().splitlines() if "call" in line])
    seen = [i for i, m in enumerate(kept) if m is first]
    with log.open("a") as f:
        f.write(json.dumps({"call": n, "same_as": seen}) + "\\n")
    kept.append(first)
    if n == ctx.config["meddle_at"]:
        try:
            kept[-2].content = "a task the hook made up"  # a copy it was handed on the call before
        except ReadOnly as e:
            with log.open("a") as f:
                f.write(json.dumps({"refused": str(e)}) + "\\n")
            raise
"""


def test_a_hook_is_handed_the_same_copies_and_a_changed_one_is_caught(session, msim, mproxy, tmp_path):
    """Each turn a hook is handed the same copies of the messages the graph holds (only the
    new ones are copied anew), read-only: changing one, even one handed on an earlier call,
    raises ``ReadOnly`` where it is changed, the hook's error, and the next call gets fresh
    copies. The model only ever reads the harness's messages."""
    log = tmp_path / "keeper.log"
    log.write_text("")
    s = session(hooks={"module": hooks_file(tmp_path, KEEPER, "keeper_hooks.py"),
                       "config": {"log": str(log), "meddle_at": 3}}, on_hook_error="pass")
    oai, _ = session_clients(s)
    msim.script(*[Reply(text=f"answer {k}") for k in range(6)])
    chat_turns(oai, "the task", 6)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    # Call 0 has no stored message; from call 2 on the first message is a copy handed before
    # (the one call 1 was handed), until call 3 tried to change it; call 4 has fresh ones.
    assert [c["same_as"] for c in lines if "call" in c] == [[], [], [1], [1, 2], [], [4]]
    assert [c["refused"] for c in lines if "refused" in c] == [
        "message 0 (user) is in the conversation already; a request hook may change only the new user and "
        "tool messages"]
    assert [r.json["messages"][0]["content"] for r in msim.model_requests()] == ["the task"] * 6
    trace = sealed(mproxy, s)
    assert [c.error is None for c in trace.calls] == [True] * 6  # pass: the request went on
    assert trace.nodes[0].message.content == "the task" and len(trace.branches) == 1

"""Request hooks over a long rollout: the rewrites accumulate, and every turn that
restates their originals gets each one spliced in where it was, while the proxy goes on from
the last request's pass instead of looking up every message again (``LastPass`` in
``addons/gateway/policy/memory.py``).

Through a real mitmdump and the real SDKs against the simulator (strict): a hook redacts
SECRET in user messages (remembered by parent and hash) and in tool results (by tool call id);
over 14 turns, Chat and Anthropic (whose system prompt is parsed anew every turn, and whose
tool results sit inside user turns beside text), the simulator never reads SECRET, reads
every redaction at its place on every turn, the hook is shown each original once, and the
graph is one branch. Then a tool route decision made after its result was already on the
record: the next restatement delivers it (a rewrite remembered since the last request
applies to a message that request already had).
"""

from __future__ import annotations

import json
import textwrap

import httpx
import openai
import pytest

from interceptor.trace import read_trace
from interceptor.trace.verify import problems
from clients import session_clients
from provider import Reply, ToolCall
from test_tool_route import route
from test_trace_proxy import (  # noqa: F401
    ANTHROPIC_TOOLS, SYSTEM, TOOLS, FakeVLLM, assert_no_training_fields, chat_turn, check_branch_tokens, mproxy, msim,
    session, step_reply)

REDACTED = "[redacted]"
REDACT = """
import pathlib
from interceptor.hooks import HookContext, Request, intercept

@intercept
def redact(request: Request, ctx: HookContext):
    for m in request.messages:
        if m.role in ("user", "tool") and "SECRET" in m.text():
            with pathlib.Path(ctx.config["log"]).open("a") as f:
                f.write(json.dumps(m.text()) + "\\n")  # every original this hook was shown
            m.content = m.text().replace("SECRET", ctx.config["replacement"])
    return request
""".replace("import pathlib", "import json\nimport pathlib")

TURNS = 14


def _said(k: int) -> str:
    """The user's message of turn k: every third holds SECRET."""
    return f"turn {k}: SECRET {k} is yours" if k % 3 == 1 else f"turn {k}: go on"


def _script(msim) -> None:
    """Every fourth answer a tool call (its result holds SECRET), the others text."""
    msim.script(*[Reply(tool_calls=[ToolCall(name="bash", arguments={"cmd": f"cat {k}"}, id=f"call_{k}")])
                  if k % 4 == 2 else Reply(text=f"reply {k}") for k in range(TURNS)])


def _redacting(session, tmp_path):
    log = tmp_path / "seen.log"
    log.write_text("")
    (tmp_path / "redact.py").write_text(textwrap.dedent(REDACT))
    return session(hooks={"module": str(tmp_path / "redact.py"),
                          "config": {"log": str(log), "replacement": REDACTED}}), log


def _check_rollout(mproxy, msim, s, log, texts) -> None:
    """Every upstream request: no SECRET, and each user and tool text as the harness sent it
    with SECRET redacted, in order; the hook saw each original once; one branch."""
    requests = msim.model_requests()
    assert len(requests) == TURNS
    originals = []
    for k, (request, sent) in enumerate(zip(requests, texts)):
        got = texts_of(request.json)
        assert "SECRET" not in json.dumps(request.json), k
        assert got == [t.replace("SECRET", REDACTED) for t in sent], k
        originals += [t for t in sent if "SECRET" in t and t not in originals]
    assert [json.loads(line) for line in log.read_text().splitlines()] == originals
    mproxy.api("DELETE", f"sessions/{s['id']}")
    trace = read_trace(s["trace_path"])
    assert len(trace.branches) == 1 and problems(trace) == []
    assert len(trace.request_rewrites) == len(originals)
    assert "SECRET" not in json.dumps([n.message.model_dump() for n in trace.nodes])


def texts_of(body: dict) -> list[str]:
    """The user and tool texts of a Chat or Anthropic body, in order."""
    out = []
    for m in body["messages"]:
        if m["role"] in ("user", "tool"):
            content = m["content"]
            for b in [content] if isinstance(content, str) else content:
                if isinstance(b, str):
                    out.append(b)
                elif b.get("type") == "text":
                    out.append(b["text"])
                elif b.get("type") == "tool_result":
                    out.append(b["content"])
    return out


def test_chat_rewrites_accumulate_over_a_rollout(session, msim, mproxy, tmp_path):
    s, log = _redacting(session, tmp_path)
    oai, _ = session_clients(s)
    _script(msim)
    messages = [{"role": "system", "content": SYSTEM}]
    texts = []
    for k in range(TURNS):
        last = messages[-1] if len(messages) > 1 else None
        if last is not None and last.get("tool_calls"):
            call = last["tool_calls"][0]["id"]
            messages.append({"role": "tool", "tool_call_id": call, "content": f"SECRET output of {call}"})
        messages.append({"role": "user", "content": _said(k)})
        texts.append([m["content"] for m in messages if m["role"] in ("user", "tool")])
        r = oai.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
    _check_rollout(mproxy, msim, s, log, texts)


def test_anthropic_rewrites_accumulate_over_a_rollout(session, msim, mproxy, tmp_path):
    s, log = _redacting(session, tmp_path)
    _, ant = session_clients(s)
    _script(msim)
    kw = dict(model="claude-x", max_tokens=200, system=SYSTEM, tools=ANTHROPIC_TOOLS)
    messages: list[dict] = []
    texts = []
    for k in range(TURNS):
        blocks = []
        uses = [b for b in (messages[-1]["content"] if messages else []) if b["type"] == "tool_use"]
        for use in uses:
            blocks.append({"type": "tool_result", "tool_use_id": use["id"], "content": f"SECRET output of {use['id']}"})
        blocks.append({"type": "text", "text": _said(k)})
        messages.append({"role": "user", "content": blocks})
        texts.append(texts_of({"messages": messages}))
        r = ant.messages.create(messages=messages, **kw)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
    _check_rollout(mproxy, msim, s, log, texts)


ROUTE = '''
from interceptor.hooks import HookContext, Request, intercept

@intercept
def decide(request: Request, ctx: HookContext):
    last = request.messages[-1]
    if ctx.tool_phase == "after":
        last.content = "decided by the route"
    elif ctx.tool_phase is None and last.role == "user" and "SECRET" in last.text():
        last.content = "[redacted]"
    return request
'''


def test_a_rewrite_remembered_since_the_last_request_applies_to_a_message_it_had(session, msim, mproxy, tmp_path):
    """The tool route decides call X on a branch where X's result is not sent yet, while
    another branch already holds a result for X as a node, and the last request restated
    it. The decision applies to whatever the harness sends for X from then on: the next
    request on that branch delivers it, though the last one's pass had that message as a
    plain node (``LastPass`` rereads a message a rewrite was remembered for since)."""
    (tmp_path / "route.py").write_text(ROUTE)
    s = session(hooks={"module": str(tmp_path / "route.py")})
    oai, _ = session_clients(s)
    msim.script(Reply(tool_calls=[ToolCall(name="bash", arguments={"cmd": "ls"}, id="call_x")]), Reply(text="one"),
                Reply(tool_calls=[ToolCall(name="bash", arguments={"cmd": "ls -a"}, id="call_x")]), Reply(text="two"),
                Reply(text="three"))
    ask = {"role": "user", "content": "look, SECRET"}  # a rewrite keyed by parent and hash: the pass is kept
    r = oai.chat.completions.create(model="gpt-4o", messages=[ask], tools=TOOLS)
    branch = [ask, r.choices[0].message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": "call_x", "content": "a.txt"}]
    r = oai.chat.completions.create(model="gpt-4o", messages=branch, tools=TOOLS)
    branch += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "go on"}]
    oai.chat.completions.create(model="gpt-4o", messages=[ask], tools=TOOLS)  # a second sample issues call_x again
    r = oai.chat.completions.create(model="gpt-4o", messages=branch, tools=TOOLS)  # the first branch goes on
    branch += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "and on"}]
    status, answer = route(mproxy, s["model_secret"], {"phase": "after", "tool_call_id": "call_x", "content": "b.txt"})
    assert (status, answer.get("action")) == (200, "rewrite"), answer  # on the second sample's branch, the one that awaits it
    oai.chat.completions.create(model="gpt-4o", messages=branch, tools=TOOLS)
    requests = msim.model_requests()
    assert [[m["content"] for m in r.json["messages"] if m["role"] == "tool"] for r in requests] == [
        [], ["a.txt"], [], ["a.txt"], ["decided by the route"]]
    assert all(r.json["messages"][0]["content"] == "[redacted]" for r in requests)
    # The graph holds what each turn read: the last one's branch forks at the tool result.
    assert mproxy.api("DELETE", f"sessions/{s['id']}")[0] == 200
    trace = read_trace(s["trace_path"])
    assert problems(trace) == []
    read = {tuple(m.text() for m in b.messages if m.role == "tool") for b in trace.branches}
    assert read == {(), ("a.txt",), ("decided by the route",)}
    last = next(b for b in trace.branches if b.calls[-1] == trace.calls[-1].id)
    assert [m.text() for m in last.messages if m.role == "tool"] == ["decided by the route"]


def test_a_history_written_anew_each_turn_gets_its_own_bytes_back(session, msim, mproxy, tmp_path):
    """A harness that serialises its history differently from turn to turn (spacing, escapes):
    the restated messages are equal, not the same bytes, so each rewrite is written into this
    body's element, every other byte the harness's (a rewrite's edit keeps the element it
    was last written into; another one's text is not that one)."""
    s, _ = _redacting(session, tmp_path)
    msim.script(Reply(text="reply 0"), Reply(text="reply 1"), Reply(text="reply 2"))
    client = httpx.Client(proxy=s["env"]["HTTPS_PROXY"], verify=s["env"]["SSL_CERT_FILE"], timeout=30)
    messages = [{"role": "user", "content": "caf\u00e9: SECRET one"}]
    styles = [dict(separators=(",", ":")), dict(indent=1), dict(ensure_ascii=False)]
    sent = []
    for k, style in enumerate(styles):
        raw = json.dumps({"model": "gpt-4o", "messages": messages}, **style).encode()
        r = client.post("https://api.openai.com/v1/chat/completions", content=raw,
                        headers={"authorization": f"Bearer {s['model_secret']}", "content-type": "application/json"})
        assert r.status_code == 200, r.text
        sent.append(raw)
        messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"turn {k + 1}: SECRET {k + 1}"}]
    got = [r.body for r in msim.model_requests()]
    for k, (raw, style, body) in enumerate(zip(sent, styles, got)):
        expected = raw
        for m in messages:
            if "SECRET" in m["content"]:  # the value written anew, as the proxy writes JSON
                was = json.dumps(m["content"], ensure_ascii=style.get("ensure_ascii", True)).encode()
                now = json.dumps(m["content"].replace("SECRET", REDACTED), ensure_ascii=False).encode()
                expected = expected.replace(was, now)
        assert b"SECRET" not in body and body == expected, k


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_hooked_request_carries_the_sessions_settings_whether_or_not_a_hook_rewrote_it(
        session, msim, mproxy, tmp_path, stream):
    """A hooked request's body is written once, by Stops, with the session's model, sampling
    and Collect's keys and the hooks' edits: on the first turn, which no hook changes
    (nothing to splice), on the turn one does (a tool result), and on the turns that restate
    it. Neither the harness's model nor SECRET reaches the upstream, every other message is
    as the harness sent it, and the branch holds every token id."""
    log = tmp_path / "seen.log"
    (tmp_path / "redact.py").write_text(textwrap.dedent(REDACT))
    s = session(model="imposed-model", sampling={"temperature": 0.25}, collect_tokens=True,
                hooks={"module": str(tmp_path / "redact.py"), "config": {"log": str(log), "replacement": REDACTED}})
    vllm = msim.default = FakeVLLM([step_reply(k, 3) for k in range(4)])
    oai, _ = session_clients(s)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "fix the bug"}]
    seen, sent = [], []
    for k in range(4):
        sent.append(list(messages))
        assistant, got, _ = chat_turn(oai, messages, stream=stream)
        seen += got
        messages.append(assistant)
        for call in assistant.get("tool_calls", []):
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"step {k}: SECRET={k}"
                             if k == 0 else f"step {k}: done"})
    assert_no_training_fields(seen)
    requests = msim.model_requests()
    assert len(requests) == 4
    for k, (request, harness) in enumerate(zip(requests, sent)):
        body = request.json
        assert (body["model"], body["temperature"]) == ("imposed-model", 0.25), k
        assert body["return_token_ids"] is True and body["logprobs"] is True, k
        assert "SECRET" not in json.dumps(body), k
        expected = [dict(m, content=m["content"].replace("SECRET", REDACTED)) if m["role"] == "tool" else m
                    for m in harness]
        assert body["messages"] == expected, k
    assert log.read_text().count("SECRET") == 1  # the hook saw the original once
    assert mproxy.api("DELETE", f"sessions/{s['id']}")[0] == 200
    trace = read_trace(s["trace_path"])
    assert len(trace.branches) == 1 and problems(trace) == []
    check_branch_tokens(trace, vllm)


MEDDLE = """
from interceptor.hooks import Request, intercept

@intercept
def meddle(request: Request):
    for m in request.messages:
        if m.role == "user" and "SECRET" in m.text():
            m.content = m.text().replace("SECRET", "[redacted]")
    if request.messages[-1].text() == "now meddle":
        request.messages[-2].content = "a reply the hook made up"  # the restated reply: a node already
    return request
"""


def test_the_messages_a_hook_may_change_begin_after_the_last_node(session, msim, mproxy, tmp_path):
    """In a session that remembers a rewrite (the pass ``remembered`` made is what the hooks'
    walk takes), the first message a hook may change is the first one the graph does not
    hold: changing the restated reply just before it is a hook error naming it as in the
    conversation already, and nothing is forwarded."""
    (tmp_path / "meddle.py").write_text(MEDDLE)
    s = session(hooks={"module": str(tmp_path / "meddle.py")})
    oai, _ = session_clients(s)
    msim.script(Reply(text="one"), Reply(text="two"), Reply(text="never"))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello, SECRET"}]
    for follow_up in ("go on", "now meddle"):
        r = oai.chat.completions.create(model="gpt-4o", messages=messages)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": follow_up}]
    with pytest.raises(openai.InternalServerError) as e:
        oai.chat.completions.create(model="gpt-4o", messages=messages)
    assert e.value.body["type"] == "hook_error"
    assert "message 4 (assistant) is in the conversation already" in e.value.message
    assert len(msim.model_requests()) == 2


def test_a_main_agent_and_its_sub_agent_take_turns(session, msim, mproxy, tmp_path):
    """Two conversations on one session, turn about (a main agent and a sub-agent it
    started, each with its own system prompt), each redacted every other turn: every request
    of either reads each redaction at its place and no SECRET, the hook is shown each
    original once, and the trace holds the two conversations, one branch each."""
    s, log = _redacting(session, tmp_path)
    oai, _ = session_clients(s)
    msim.script(*[Reply(text=f"reply {k}") for k in range(16)])
    agents = {name: [{"role": "system", "content": f"You are the {name} agent."}] for name in ("main", "sub")}
    texts = []
    for k in range(16):
        messages = agents["main" if k % 2 == 0 else "sub"]
        messages.append({"role": "user", "content": f"turn {k}: SECRET {k}" if k % 4 < 2 else f"turn {k}"})
        texts.append([m["content"] for m in messages if m["role"] == "user"])
        r = oai.chat.completions.create(model="gpt-4o", messages=messages)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    requests = msim.model_requests()
    originals = []
    for k, (request, sent) in enumerate(zip(requests, texts)):
        assert "SECRET" not in json.dumps(request.json), k
        assert texts_of(request.json) == [t.replace("SECRET", REDACTED) for t in sent], k
        originals += [t for t in sent if "SECRET" in t and t not in originals]
    assert [json.loads(line) for line in log.read_text().splitlines()] == originals
    assert mproxy.api("DELETE", f"sessions/{s['id']}")[0] == 200
    trace = read_trace(s["trace_path"])
    assert len(trace.branches) == 2 and problems(trace) == []
    assert len(trace.request_rewrites) == len(originals) == 8


SAME = """
import json, pathlib
from interceptor.hooks import HookContext, Request, intercept

last = {}

tools = {}

@intercept
def same(request: Request, ctx: HookContext):
    first = request.messages[0]
    with pathlib.Path(ctx.config["log"]).open("a") as f:
        f.write(json.dumps([first.content, last.get(first.content) is first,
                            tools.get(first.content) is request.tools]) + "\\n")
    last[first.content] = first
    tools[first.content] = request.tools
"""


def test_each_conversation_keeps_its_hooks_copies(session, msim, mproxy, tmp_path):
    """Turn about, a main agent and a sub-agent: a hook is handed, in each, the copies it was
    handed in that conversation's last turn (not copies made anew at every switch), of the
    messages and of the tools."""
    log = tmp_path / "same.log"
    (tmp_path / "same.py").write_text(SAME)
    s = session(hooks={"module": str(tmp_path / "same.py"), "config": {"log": str(log)}})
    oai, _ = session_clients(s)
    msim.script(*[Reply(text=f"reply {k}") for k in range(8)])
    agents = {name: [{"role": "system", "content": name}] for name in ("main", "sub")}
    for k in range(8):
        messages = agents["main" if k % 2 == 0 else "sub"]
        messages.append({"role": "user", "content": f"turn {k}"})
        r = oai.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    # A conversation's system prompt is new on its first turn (a plain copy) and stored from
    # its second (a read-only copy made then); from its third on, the hook gets that copy.
    # The tools (the same each turn) get the read-only copy made on its first turn.
    assert [json.loads(line) for line in log.read_text().splitlines()] == [
        ["main", False, False], ["sub", False, False], ["main", False, True], ["sub", False, True]] + [
        ["main", True, True], ["sub", True, True]] * 2


EVERY = """
from interceptor.hooks import Request, intercept

@intercept
def every(request: Request):
    for m in request.messages:  # every tool result, the stored ones too (redacted already: the same text)
        if m.role == "tool":
            m.content = m.text().replace("SECRET", "[redacted]")
    return request
"""


def test_a_hook_that_sets_every_message_to_what_it_holds_is_no_error(session, msim, mproxy, tmp_path):
    """A hook that runs its redaction over every tool result, the stored ones included, sets
    those to the text they hold already (they were redacted when new): that changes nothing,
    so it is no hook error, though the stored ones are handed read-only."""
    (tmp_path / "every.py").write_text(EVERY)
    s = session(hooks={"module": str(tmp_path / "every.py")})
    oai, _ = session_clients(s)
    msim.script(*[Reply(tool_calls=[ToolCall(name="bash", arguments={"cmd": f"cat {k}"}, id=f"call_{k}")])
                  for k in range(3)], Reply(text="done"))
    messages = [{"role": "user", "content": "look"}]
    for k in range(4):
        r = oai.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        if k < 3:
            messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": f"SECRET {k}"})
    sent = [[m["content"] for m in r.json["messages"] if m["role"] == "tool"] for r in msim.model_requests()]
    assert sent == [[f"[redacted] {j}" for j in range(k)] for k in range(4)]
    assert mproxy.api("DELETE", f"sessions/{s['id']}")[0] == 200
    trace = read_trace(s["trace_path"])
    assert all(c.error is None for c in trace.calls) and len(trace.branches) == 1

"""The restated history recognised from its bytes (trace/prefix.py): the request, the body
and the graph come out exactly as a full parse makes them, while each turn parses only its
new messages (counted, not timed)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import interceptor.dialects.anthropic as anthropic
import interceptor.dialects.chat as chat
import interceptor.dialects.gemini as gemini
import interceptor.dialects.responses as responses
from interceptor.addons.gateway.rewrite import prepare
from interceptor.addons.gateway.sessions.session import SessionConfig
from interceptor.dialects import ANTHROPIC, CHAT, GEMINI, RESPONSES
from interceptor.dialects.body import parse_body
from interceptor.trace import Message, ModelCall, Recorder, Response, Store, Usage
from interceptor.trace.prefix import Prefixes

PATH = "/v1/chat/completions"
PATHS = {"chat": PATH, "anthropic": "/v1/messages", "gemini": "/v1beta/models/gemini-2.5-pro:generateContent",
         "responses": "/v1/responses"}


def reply_of(k: int) -> dict:
    if k % 3 == 1:
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{k}", "type": "function", "function": {"name": "bash", "arguments": f'{{"cmd": "ls {k}"}}'}}]}
    return {"role": "assistant", "content": f"answer {k} é ✓"}


def follow_up(k: int, reply: dict) -> dict:
    if reply.get("tool_calls"):
        return {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": f"out {k}"}
    return {"role": "user", "content": f"next {k}"}


class Session:
    """A recorder driven as the proxy drives it: prepare (Rewrite), then commit (Record)."""

    def __init__(self, path: Path, fast: bool, dialect=CHAT):
        self.store = Store()
        self.rec = Recorder(path, {"id": path.stem}, store=self.store, fsync="never")
        self.fast = fast
        self.dialect = dialect

    def turn(self, body: dict, reply: Message, **dump_kw):
        raw = json.dumps(body, **dump_kw).encode()
        p = prepare(raw, self.dialect, "model", SessionConfig(), PATHS[self.dialect.name],
                    prefixes=self.rec.prefixes if self.fast else None)
        assert p.refusal is None
        call = ModelCall(id=uuid.uuid4().hex[:12], started_at=1.0, ended_at=2.0)
        response = Response(message=reply, usage=Usage(input_tokens=1, output_tokens=1))
        self.rec.commit_turn(p.request, response, call, p.listed if self.fast else None)
        return p

    def close(self):
        self.store.close()


def graph_of(rec: Recorder):
    return [(n.parent, n.message, n.sampled) for n in rec.trace.nodes]


def check_one_branch(fast: Session, full: Session) -> None:
    """The recognising session's graph is the full parse's, one branch; both closed."""
    assert graph_of(fast.rec) == graph_of(full.rec)
    assert len(fast.rec.trace.branches) == 1
    fast.close(), full.close()


def test_a_growing_conversation_parses_only_its_new_messages(tmp_path, monkeypatch):
    parsed = []
    original = chat._message
    monkeypatch.setattr(chat, "_message", lambda m: parsed.append(m) or original(m))
    fast, full = Session(tmp_path / "fast.msgpack", True), Session(tmp_path / "full.msgpack", False)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "go"}]
    for k in range(40):
        body = {"model": "gpt-4o", "messages": messages, "temperature": 0.2}
        reply = CHAT.parse_response({"choices": [{"index": 0, "message": reply_of(k), "finish_reason": "stop"}]}).message
        parsed.clear()
        a = fast.turn(body, reply)
        fast_parsed = len(parsed)
        parsed.clear()
        b = full.turn(body, reply)
        assert a.request == b.request and a.body == b.body  # the same request, the same body
        assert a.listed.ends == b.listed.ends and a.listed.items == b.listed.items
        if k >= 1:
            # the reply restated and its follow-up: never the history before them
            assert a.listed.known == len(messages) - 2 and fast_parsed == 2, (k, fast_parsed)
            assert len(parsed) == len(messages)
        messages = messages + [reply_of(k), follow_up(k, reply_of(k))]
    check_one_branch(fast, full)


def test_a_session_that_delivers_other_messages_remembers_what_it_parsed(tmp_path, monkeypatch):
    """A session with request hooks delivers a rewritten message where the harness restates
    its original (addons/gateway/policy/intercept.py): its lists are remembered as parsed (``Listed.sent``),
    so a restated original is read as the original again, never handed back as what was
    delivered for it, while the graph holds what was delivered, one branch, and each turn
    parses only its new messages. Nodes that do not hold the delivered messages are not used."""
    parsed = []
    original = chat._message
    monkeypatch.setattr(chat, "_message", lambda m: parsed.append(m) or original(m))
    s = Session(tmp_path / "hooked.msgpack", True)
    messages = [{"role": "user", "content": "go"}]
    delivered: list[list[Message]] = []
    for k in range(12):
        body = {"model": "gpt-4o", "messages": messages}
        reply = CHAT.parse_response({"choices": [{"index": 0, "message": reply_of(k), "finish_reason": "stop"}]}).message
        parsed.clear()
        p = prepare(json.dumps(body).encode(), CHAT, "model", SessionConfig(), PATH, prefixes=s.rec.prefixes)
        assert [m.content for m in p.request.messages] == [m["content"] or "" for m in messages]  # as sent, always
        if k >= 1:
            assert p.listed.known == len(messages) - 2 and len(parsed) == 2, (k, len(parsed))
        p.listed.sent = p.request.messages
        # every user message is delivered rewritten (as a hook's remembered rewrite is)
        sent = [m.model_copy(update={"content": f"{m.content} [rewritten]"}) if m.role == "user" else m
                for m in p.request.messages]
        if k >= 1:
            held = s.rec.held_path(p.listed, sent)
            assert len(held) == len(messages) - 2  # checked against what was delivered: all held
            assert s.rec.held_path(p.listed, p.request.messages) == []  # the originals: none held
        delivered.append(sent)
        request = p.request.model_copy(update={"messages": sent})
        call = ModelCall(id=uuid.uuid4().hex[:12], started_at=1.0, ended_at=2.0)
        s.rec.commit_turn(request, Response(message=reply, usage=Usage(input_tokens=1, output_tokens=1)), call, p.listed)
        messages = messages + [reply_of(k), follow_up(k, reply_of(k))]
    trace = s.rec.trace
    assert len(trace.branches) == 1 and len(trace.calls) == 12
    path = [trace.nodes[i].message for i in trace.path(trace.calls[-1].node)]
    assert path[:-1] == delivered[-1]  # the graph holds what was delivered
    s.close()


# Histories of a few messages, each request sent with one of three spacings, possibly with
# an edited or dropped message: whatever the harness does, recognising the history must give
# what a full parse gives.
edits = st.lists(st.tuples(st.sampled_from(["append", "edit", "drop", "respace", "fork"]),
                           st.integers(0, 30)), min_size=1, max_size=12)


def check_edits(tmp: Path, dialect, steps, items: list[dict], body, edited, turn) -> None:
    """Drive a fast and a full session through ``steps`` (editing ``items``, the message
    list; ``edited(x)`` is an element put in place of another, ``turn(n)`` the reply and the
    elements it adds, ``body(items, n, system)`` the request) and hold them equal."""
    fast, full = Session(tmp / "fast.msgpack", True, dialect), Session(tmp / "full.msgpack", False, dialect)
    system, spacing = "sys", {}
    for n, (op, x) in enumerate(steps):
        if op == "edit" and len(items) > 1:
            j = x % len(items)
            items = items[:j] + [edited(x)] + items[j + 1:]
        elif op == "drop" and len(items) > 2:
            j = 1 + x % (len(items) - 1)
            items = items[:j] + items[j + 1:]
        elif op == "respace":  # the spacing, and with it the lead (a system prompt outside the list)
            # ... or with its non-ASCII characters as they are: the remembered lists of the
            # requests before and after are views of ASCII bytes, or copies of their text.
            spacing = [{}, {"indent": 1}, {"separators": (",", ":")}, {"ensure_ascii": False}][x % 4]
            system = f"sys {x % 2}"
        elif op == "fork":
            items = items[: 1 + x % len(items)]
        reply, added = turn(n)
        a, b = fast.turn(body(items, n, system), reply, **spacing), full.turn(body(items, n, system), reply, **spacing)
        assert a.request == b.request and a.body == b.body
        assert a.listed.ends == b.listed.ends and a.listed.marks == b.listed.marks
        items = items + added
    assert graph_of(fast.rec) == graph_of(full.rec)
    fast.close(), full.close()


@settings(max_examples=60, deadline=None)
@given(steps=edits)
def test_any_history_edit_gives_what_a_full_parse_gives(tmp_path_factory, steps):
    check_edits(tmp_path_factory.mktemp("p"), CHAT, steps,
                [{"role": "system", "content": "sys"}, {"role": "user", "content": "u0"}],
                lambda items, n, system: {"messages": items, "model": "m"},
                lambda x: {"role": "user", "content": f"edited {x} é"},
                lambda n: (Message(role="assistant", content=f"r{n}"),
                           [{"role": "assistant", "content": f"r{n}"}, {"role": "user", "content": f"u{n + 1}"}]))


def test_ascii_and_other_bodies_recognise_each_others_history(tmp_path):
    """A list remembered from an ASCII body is a view of its bytes, one from any other body
    (a key with a non-ASCII character written as it is) a copy of its text: a request of
    either kind recognises a history remembered from either."""
    s = Session(tmp_path / "a.msgpack", True)
    messages = [{"role": "system", "content": "sys"}] + [{"role": "user", "content": f"m{k}"} for k in range(4)]
    first = s.turn({"messages": messages, "model": "m"}, Message(role="assistant", content="a"))
    assert first.parsed.listed.raw is not None  # ASCII: remembered as a view
    for k, other in enumerate((True, False, True, True, False)):
        messages += [{"role": "assistant", "content": "abcdefgh"[k]}, {"role": "user", "content": f"n{k}"}]
        body = {"messages": messages, "model": "m", **({"user": "é"} if other else {})}
        p = s.turn(body, Message(role="assistant", content="abcdefgh"[k + 1]), ensure_ascii=not other)
        assert (p.parsed.listed.raw is None) is other
        assert p.listed.known == len(messages) - 2, k  # all but the new reply and message
    s.close()


def test_an_edited_message_keeps_the_history_before_it(tmp_path):
    s = Session(tmp_path / "e.msgpack", True)
    messages = [{"role": "system", "content": "sys"}] + [{"role": "user", "content": f"m{k}"} for k in range(9)]
    s.turn({"messages": messages}, Message(role="assistant", content="a"))
    edited = messages[:6] + [{"role": "user", "content": "changed"}] + messages[7:]
    p = s.turn({"messages": edited}, Message(role="assistant", content="b"))
    assert p.listed.known == 6  # bisected to the last whole element before the edit
    assert [m.content for m in p.request.messages] == [m["content"] for m in edited]
    trace = s.rec.trace
    assert len(trace.branches) == 2 and trace.nodes[trace.branches[1].nodes[6]].message.content == "changed"
    assert trace.branches[1].nodes[:6] == trace.branches[0].nodes[:6]
    s.close()


def test_an_element_that_goes_on_past_the_known_text_is_parsed_again():
    """A number ends where the text stops matching, not where its digits stop: ``[12`` is a
    prefix of ``[123``. The element is parsed again, never taken as known."""
    prefixes = Prefixes()
    first = parse_body(b'{"messages": [1, 12]}', "messages", prefixes)
    first.listed.marks = [1, 2]  # one message each, as a dialect's parse_request counts them
    prefixes.remember(first.listed, [Message(role="user", content="1"), Message(role="user", content="12")], [0, 1])
    again = parse_body(b'{"messages": [1, 123]}', "messages", prefixes)
    assert again.data == {"messages": [1, 123]} and again.listed.known == 1
    bad = parse_body(b'{"messages": [1, 12, "x"]}', "messages", prefixes)
    assert bad.data["messages"] == [1, 12, "x"] and bad.listed.known == 2
    with pytest.raises(ValueError):
        parse_body(b'{"messages": [1, 12,]}', "messages", prefixes)  # json.loads refuses it too


def test_nodes_from_before_a_rollback_are_never_used(tmp_path):
    """A scan made before the session's prefixes were cleared (a rolled-back turn, a released
    graph) keeps its parsed messages but not its nodes: the graph walk decides."""
    s = Session(tmp_path / "g.msgpack", True)
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    s.turn({"messages": messages}, Message(role="assistant", content="a"))
    messages += [{"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}]
    p = prepare(json.dumps({"messages": messages}).encode(), CHAT, "model", SessionConfig(), PATH, prefixes=s.rec.prefixes)
    assert p.listed.known == 2 and p.listed.nodes == [0, 1]
    p.listed.nodes = [0, 0]  # what a stale scan could hold: nodes that mean something else now
    s.rec.prefixes.clear()
    call = ModelCall(id="c2", started_at=1.0, ended_at=2.0)
    s.rec.commit_turn(p.request, Response(message=Message(role="assistant", content="b")), call, p.listed)
    assert s.rec.trace.branches[-1].nodes[:3] == [0, 1, 2]  # walked: system, user, the reply
    assert len(s.rec.trace.branches) == 1
    s.close()


# -- Anthropic Messages: a system prompt before the list, and one element, several messages --

def claude_turn(k: int) -> tuple[dict, dict]:
    """Turn ``k`` of a Claude Code-like loop: the assistant's blocks, then the user turn that
    answers them (two tool results and a text block, or plain text)."""
    if k % 2:
        return ({"role": "assistant", "content": [
                    {"type": "thinking", "thinking": f"think {k}", "signature": f"sig{k}"},
                    {"type": "tool_use", "id": f"toolu_{k}a", "name": "Bash", "input": {"command": f"ls {k}"}},
                    {"type": "tool_use", "id": f"toolu_{k}b", "name": "Read", "input": {"path": f"f{k}"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": f"toolu_{k}a", "content": f"out {k} é"},
                    {"type": "tool_result", "tool_use_id": f"toolu_{k}b", "content": [{"type": "text", "text": "x"}],
                     "is_error": True},
                    {"type": "text", "text": f"note {k}"}]})
    return ({"role": "assistant", "content": [{"type": "text", "text": f"answer {k} ✓"}]},
            {"role": "user", "content": f"next {k}"})


def claude_body(messages: list[dict], k: int, system: str = "You are Claude Code.") -> dict:
    """As Claude Code sends it: a billing header that changes every request, and the
    cache_control marker on the newest block only (it moves every turn)."""
    marked = [dict(m) for m in messages]
    last = marked[-1]
    content = last["content"] if isinstance(last["content"], list) else [{"type": "text", "text": last["content"]}]
    last["content"] = content[:-1] + [{**content[-1], "cache_control": {"type": "ephemeral"}}]
    return {"model": "claude-x", "max_tokens": 64, "stream": True,
            "system": [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2; cch={k:05x};"},
                       {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
            "messages": marked}


def test_a_claude_code_loop_parses_only_its_new_messages(tmp_path, monkeypatch):
    """The marker moves off the restated message every turn, so that one element is read
    again; the history before it never is, and the request, body and graph are a full parse's."""
    parsed = []
    original = anthropic._element
    monkeypatch.setattr(anthropic, "_element", lambda m, before=None: parsed.append(m) or original(m, before))
    fast = Session(tmp_path / "fast.msgpack", True, ANTHROPIC)
    full = Session(tmp_path / "full.msgpack", False, ANTHROPIC)
    messages = [{"role": "user", "content": "fix the bug"},
                {"role": "system", "content": "# Environment\nworking directory: /w"}]
    for k in range(30):
        body = claude_body(messages, k)
        reply_body, follow = claude_turn(k)
        reply = ANTHROPIC.parse_response({"type": "message", "role": "assistant", "content": reply_body["content"],
                                          "stop_reason": "end_turn"}).message
        parsed.clear()
        a = fast.turn(body, reply)
        fast_parsed = len(parsed)
        b = full.turn(body, reply)
        assert a.request == b.request and a.body == b.body
        assert a.listed.lead == 1 and a.listed.marks == b.listed.marks
        if k >= 1:
            # the element that lost its marker, the reply restated and its follow-up
            assert a.listed.known == len(messages) - 3 and fast_parsed == 3, (k, a.listed.known, fast_parsed)
        messages = messages + [reply_body, follow]
        assert len(fast.rec.prefixes) == 1  # the history's text once, not once per turn
    check_one_branch(fast, full)


def test_a_new_system_prompt_keeps_the_parse_but_not_the_nodes(tmp_path):
    """The list's nodes hang under the system prompt's: with another prompt the same history
    is a new branch from a new root, as a full parse makes it."""
    fast = Session(tmp_path / "fast.msgpack", True, ANTHROPIC)
    full = Session(tmp_path / "full.msgpack", False, ANTHROPIC)
    messages = [{"role": "user", "content": "go"}]
    for k, system in enumerate(["one", "one", "two", "two", "one"]):
        body = claude_body(messages, k, system)
        reply = Message(role="assistant", content=f"r{k}")
        a, b = fast.turn(body, reply), full.turn(body, reply)
        assert a.request == b.request and a.body == b.body
        if k >= 2:  # (the first request's one element carried the marker)
            assert a.listed.known == len(messages) - 3  # the history is never parsed again...
        messages = messages + [{"role": "assistant", "content": f"r{k}"}, {"role": "user", "content": f"u{k}"}]
    assert graph_of(fast.rec) == graph_of(full.rec)  # ...and its nodes are the graph's own
    roots = {fast.rec.trace.nodes[b.nodes[0]].message.content[0].text for b in fast.rec.trace.branches}
    assert roots == {"one", "two"}
    fast.close(), full.close()


@settings(max_examples=60, deadline=None)
@given(steps=edits)
def test_any_anthropic_history_edit_gives_what_a_full_parse_gives(tmp_path_factory, steps):
    check_edits(tmp_path_factory.mktemp("a"), ANTHROPIC, steps, [{"role": "user", "content": "u0"}], claude_body,
                lambda x: claude_turn(x)[1],
                lambda n: (Message(role="assistant", content=f"r{n}"),
                           [{"role": "assistant", "content": f"r{n}"}, claude_turn(n)[1]]))


def test_a_sub_agent_in_between_does_not_cost_the_main_loop_its_history(tmp_path, monkeypatch):
    """Claude Code's Task tool: a sub-agent's requests (their own list) come between the main
    loop's. The main loop's next request, its marker moved, is still recognised up to the
    element that lost it, not only as far as the newest remembered list (the sub-agent's)."""
    parsed = []
    original = anthropic._element
    monkeypatch.setattr(anthropic, "_element", lambda m, before=None: parsed.append(m) or original(m, before))
    s = Session(tmp_path / "s.msgpack", True, ANTHROPIC)
    main = [{"role": "user", "content": "fix the bug"}]
    for k in range(6):
        s.turn(claude_body(main, k), Message(role="assistant", content=f"r{k}"))
        main += [{"role": "assistant", "content": f"r{k}"}, {"role": "user", "content": f"u{k}"}]
    sub = [{"role": "user", "content": "search the code"}]
    s.turn(claude_body(sub, 0, "You are a sub-agent."), Message(role="assistant", content="found"))
    parsed.clear()
    p = s.turn(claude_body(main, 7), Message(role="assistant", content="r7"))
    assert p.listed.known == len(main) - 3 and len(parsed) == 3
    assert len(s.rec.trace.branches) == 2  # the main loop's and the sub-agent's
    # The main loop's history once, the sub-agent's list for its next request, and the main
    # loop's first request (its one element carried the marker, so nothing restates it).
    assert sorted(len(e.ends) for e in s.rec.prefixes._entries) == [1, 1, len(main)]
    s.close()



# -- Gemini: a function response is paired with the model turn right before it --

def gemini_turn(k: int) -> tuple[dict, dict]:
    """A model turn and the user turn answering it: two calls of one name answered in order
    (paired by rank), or one call with a wire id answered by it, or plain text."""
    if k % 3 == 1:
        return ({"role": "model", "parts": [
                    {"functionCall": {"name": "run", "args": {"cmd": f"ls {k}"}}, "thoughtSignature": f"s{k}"},
                    {"functionCall": {"name": "run", "args": {"cmd": f"ls {k}"}}}]},
                {"role": "user", "parts": [{"functionResponse": {"name": "run", "response": {"out": f"a{k}"}}},
                                           {"functionResponse": {"name": "run", "response": {"out": f"b{k}"}}}]})
    if k % 3 == 2:  # answered out of order: only the wire ids pair them right
        return ({"role": "model", "parts": [{"functionCall": {"id": f"w{k}a", "name": "read", "args": {"p": k}}},
                                            {"functionCall": {"id": f"w{k}b", "name": "read", "args": {"p": -k}}}]},
                {"role": "user", "parts": [{"functionResponse": {"id": f"w{k}b", "name": "read", "response": {"x": -k}}},
                                           {"functionResponse": {"id": f"w{k}a", "name": "read", "response": {"x": k}}},
                                           {"text": f"and {k}"}]})
    return {"role": "model", "parts": [{"text": f"answer {k}"}]}, {"role": "user", "parts": [{"text": f"next {k}"}]}


def gemini_body(contents: list[dict], system: str = "You are Gemini CLI.") -> dict:
    return {"systemInstruction": {"parts": [{"text": system}]}, "contents": contents,
            "generationConfig": {"temperature": 0}}


def test_a_gemini_cli_loop_parses_only_its_new_messages(tmp_path, monkeypatch):
    """Each turn reads its model turn and the user turn after it; the function responses
    pair with their calls as a full parse pairs them (the model turn before is one element)."""
    parsed = []
    original = gemini._element
    monkeypatch.setattr(gemini, "_element", lambda c, before: parsed.append(c) or original(c, before))
    fast = Session(tmp_path / "fast.msgpack", True, GEMINI)
    full = Session(tmp_path / "full.msgpack", False, GEMINI)
    contents = [{"role": "user", "parts": [{"text": "fix the bug"}]}]
    for k in range(30):
        model, follow = gemini_turn(k)
        reply = GEMINI.parse_response({"candidates": [{"content": model, "finishReason": "STOP"}]}).message
        parsed.clear()
        a = fast.turn(gemini_body(contents), reply)
        fast_parsed = len(parsed)
        b = full.turn(gemini_body(contents), reply)
        assert a.request == b.request and a.body == b.body
        if k >= 1:
            assert a.listed.known == len(contents) - 2 and fast_parsed == 2, (k, a.listed.known, fast_parsed)
            tools = [m for m in a.request.messages if m.role == "tool"]
            assert not any("unpaired" in m.tool_call_id for m in tools)
            if k % 3 == 0:  # the last model turn was answered out of order, by wire id
                calls = a.request.messages[-4].tool_calls
                assert [m.tool_call_id for m in a.request.messages[-3:-1]] == [calls[1].id, calls[0].id]
        contents = contents + [model, follow]
    check_one_branch(fast, full)


@settings(max_examples=60, deadline=None)
@given(steps=edits)
def test_any_gemini_history_edit_gives_what_a_full_parse_gives(tmp_path_factory, steps):
    """Edits that move a user turn away from its model turn (or next to another) change its
    pairing: the element is then read with its new neighbour, as a full parse reads it."""

    def turn(n: int) -> tuple[Message, list[dict]]:
        model, follow = gemini_turn(n)
        return GEMINI.parse_response({"candidates": [{"content": model, "finishReason": "STOP"}]}).message, [model, follow]

    check_edits(tmp_path_factory.mktemp("g"), GEMINI, steps, [{"role": "user", "parts": [{"text": "u0"}]}],
                lambda items, n, system: gemini_body(items, system), lambda x: gemini_turn(x)[x % 2], turn)



# -- Responses: a run of assistant items (reasoning, calls, a message) is one message --

def responses_turn(k: int) -> tuple[list[dict], list[dict]]:
    """The reply's output items and the input items that answer them: a reasoning item and
    two calls answered by their outputs, or a message answered by the user."""
    if k % 2:
        return ([{"type": "reasoning", "id": f"rs_{k}", "summary": [], "encrypted_content": f"enc{k}"},
                 {"type": "function_call", "call_id": f"c{k}a", "name": "shell", "arguments": f'{{"cmd": "ls {k}"}}'},
                 {"type": "function_call", "call_id": f"c{k}b", "name": "shell", "arguments": "{}"}],
                [{"type": "function_call_output", "call_id": f"c{k}a", "output": f"out {k}"},
                 {"type": "function_call_output", "call_id": f"c{k}b", "output": "ok"}])
    return ([{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"answer {k}"}]}],
            [{"role": "user", "content": f"next {k}"}])


def responses_body(items: list[dict], n: int = 0, system: str = "You are an agent.") -> dict:
    return {"model": "gpt-5", "instructions": system, "input": items, "stream": True, "store": False}


def test_an_agent_loop_over_responses_parses_only_its_new_items(tmp_path, monkeypatch):
    """Codex's tools as an input item, then turns: each request reads only the reply's items
    and what answers them; the tools the known items carry are the request's still."""
    parsed = []
    original = responses._items
    monkeypatch.setattr(responses, "_items", lambda items, marks=None: parsed.extend(items) or original(items, marks))
    fast = Session(tmp_path / "fast.msgpack", True, RESPONSES)
    full = Session(tmp_path / "full.msgpack", False, RESPONSES)
    items = [{"type": "additional_tools", "tools": [{"type": "function", "name": "shell", "parameters": {}}]},
             {"role": "user", "content": "fix the bug"}]
    for k in range(20):
        output, follow = responses_turn(k)
        reply = RESPONSES.parse_response({"status": "completed", "output": output}).message
        parsed.clear()
        a = fast.turn(responses_body(items), reply)
        if k:  # the last reply's items and what answers them
            assert parsed == previous and a.listed.known == len(items) - len(previous)
        b = full.turn(responses_body(items), reply)
        assert a.request == b.request and a.body == b.body and [t.name for t in a.request.tools] == ["shell"]
        assert a.listed.lead == 1 and a.listed.marks == b.listed.marks
        previous = output + follow
        items = items + previous
    check_one_branch(fast, full)


@settings(max_examples=60, deadline=None)
@given(steps=edits)
def test_any_responses_history_edit_gives_what_a_full_parse_gives(tmp_path_factory, steps):
    """Edits that put a run's items next to other run items (so they are one message now)
    or split a run: the known items stop where a run may go on."""

    def turn(n: int) -> tuple[Message, list[dict]]:
        output, follow = responses_turn(n)
        return RESPONSES.parse_response({"status": "completed", "output": output}).message, output + follow

    def edited(x: int) -> dict:
        output, follow = responses_turn(x)
        return (output + follow)[x % (len(output) + len(follow))]

    check_edits(tmp_path_factory.mktemp("r"), RESPONSES, steps, [{"role": "user", "content": "u0"}],
                responses_body, edited, turn)

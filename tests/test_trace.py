"""The Trace model and its message graph, at unit level (no proxy).

A harness restates its whole history every turn; these tests drive a Recorder the way the
addon does (canonical Request in, canonical Response out) and check the graph keeps one node
per distinct message, forks only where a prompt really diverges, and keeps token arrays
aligned when an upstream returns token ids. Helpers here are imported by the other
test_trace_*.py files.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from interceptor.trace import (
    Choice,
    Message,
    ModelCall,
    Reasoning,
    Recorder,
    Request,
    Response,
    Store,
    Tool,
    ToolCall,
    Usage,
    read_trace,
)
from interceptor.trace.verify import problems

SYSTEM = Message(role="system", content="You are a careful agent.")
TOOLS = [Tool(name="bash", description="run a command",
              parameters={"type": "object", "properties": {"cmd": {"type": "string"}}})]


class Rollout:
    """A recorder plus a harness-like history: ``turn`` sends the whole history, appends the
    reply and what comes back for it (tool results or a user message)."""

    def __init__(self, path: Path, store: Store | None = None, fsync: str = "turn", **header):
        self.store = store or Store()
        header.setdefault("id", path.stem)
        self.recorder = Recorder(path, header, store=self.store, fsync=fsync)
        self.path = path

    def send(self, messages: list[Message], reply: Message, *, usage: Usage | None = None,
             tools=TOOLS, **response_fields) -> ModelCall:
        call = ModelCall(id=uuid.uuid4().hex[:12], dialect="openai_chat",
                         endpoint="/v1/chat/completions", model="m", started_at=100.0,
                         ended_at=101.5, status=200)
        response = Response(message=reply, finish_reason="tool_calls" if reply.tool_calls else "stop",
                            usage=usage, **response_fields)
        return self.recorder.commit_turn(
            Request(messages=list(messages), tools=list(tools)), response, call)

    def read(self):
        self.store.flush(timeout=10)
        return read_trace(self.path)


def tool_turns(n: int) -> list[tuple[list[Message], Message]]:
    """A ``n``-turn tool-using conversation: (prompt, reply) per turn, each prompt restating
    everything before it (tool-call arguments restated with other whitespace, as another
    SDK would)."""
    history = [SYSTEM, Message(role="user", content="fix the bug")]
    turns = []
    for k in range(n):
        args = {"cmd": f"step {k}"}
        reply = Message(role="assistant", content=f"thinking {k}",
                        tool_calls=[ToolCall(id=f"call_{k}", name="bash",
                                             arguments=json.dumps(args))])
        turns.append((list(history), reply))
        restated = reply.model_copy(deep=True)
        restated.tool_calls[0].arguments = json.dumps(args, indent=2)
        history += [restated, Message(role="tool", tool_call_id=f"call_{k}", content=f"out {k}")]
    return turns


def test_ten_turn_tool_conversation_is_one_branch(tmp_path):
    r = Rollout(tmp_path / "t.msgpack")
    for prompt, reply in tool_turns(10):
        r.send(prompt, reply, usage=Usage(input_tokens=100, output_tokens=10))
    trace = r.recorder.trace
    assert trace.num_turns == 10
    assert len(trace.branches) == 1
    # system + user + 10 * (assistant, tool) minus the last tool result (never sent)
    assert len(trace.nodes) == 2 + 10 * 2 - 1
    assert [n.sampled for n in trace.nodes].count(True) == 10
    assert trace.messages[-1].content == "thinking 9"
    assert [c.node for c in trace.calls] == [i for i, n in enumerate(trace.nodes) if n.sampled]
    assert problems(trace) == []


def test_compaction_forks_after_the_shared_system_node(tmp_path):
    r = Rollout(tmp_path / "c.msgpack")
    turns = tool_turns(4)
    for prompt, reply in turns:
        r.send(prompt, reply)
    before = len(r.recorder.trace.nodes)
    summary = [SYSTEM, Message(role="user", content="Summary so far: ran 4 steps.")]
    r.send(summary, Message(role="assistant", content="continuing"))
    trace = r.recorder.trace
    assert len(trace.branches) == 2
    assert len(trace.nodes) == before + 2  # only the summary and the reply are new
    a, b = trace.branches
    assert a.nodes[0] == b.nodes[0] == 0  # one system node, shared
    assert a.nodes[1] != b.nodes[1]
    assert trace.messages[-1].content == "continuing"


def test_interleaved_subagents_make_two_branches(tmp_path):
    r = Rollout(tmp_path / "s.msgpack")
    main = [SYSTEM, Message(role="user", content="main task")]
    sub = [Message(role="system", content="You are a sub-agent."),
           Message(role="user", content="search the code")]
    for k in range(3):
        reply = Message(role="assistant", content=f"main {k}")
        r.send(main, reply)
        main = main + [reply, Message(role="user", content=f"go on {k}")]
        reply = Message(role="assistant", content=f"sub {k}")
        r.send(sub, reply)
        sub = sub + [reply, Message(role="user", content=f"more {k}")]
    trace = r.recorder.trace
    assert trace.num_turns == 6
    assert len(trace.branches) == 2
    assert sorted(len(b.calls) for b in trace.branches) == [3, 3]
    assert len(trace.nodes) == 2 * (2 + 3 + 2)  # per agent: 2 prompt, 3 replies, 2 follow-ups


def test_identical_request_reuses_every_node(tmp_path):
    """An unflagged identical request is a new turn; an identical answer adds no node."""
    r = Rollout(tmp_path / "i.msgpack")
    prompt = [SYSTEM, Message(role="user", content="hi")]
    first = r.send(prompt, Message(role="assistant", content="hello"))
    second = r.send(prompt, Message(role="assistant", content="hello"))
    third = r.send(prompt, Message(role="assistant", content="hey"))
    trace = r.recorder.trace
    assert first.node == second.node != third.node
    assert trace.num_turns == 3
    assert len(trace.nodes) == 4
    assert len(trace.branches) == 2


def test_input_tokens_count_each_fed_token_once(tmp_path):
    r = Rollout(tmp_path / "u.msgpack")
    turns = tool_turns(3)
    inputs = [100, 130, 170]
    for (prompt, reply), n in zip(turns, inputs):
        r.send(prompt, reply, usage=Usage(input_tokens=n, output_tokens=10))
    # a compaction restarts the count on its own branch
    r.send([SYSTEM, Message(role="user", content="summary")],
           Message(role="assistant", content="ok"), usage=Usage(input_tokens=40, output_tokens=5))
    trace = r.recorder.trace
    assert trace.num_input_tokens == 100 + (130 - 110) + (170 - 140) + 40
    assert trace.num_output_tokens == 35
    assert trace.num_total_tokens == trace.num_input_tokens + 35
    assert trace.usage.input_tokens == 440  # billed: restated prefixes each time


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["go on", "fork", "again", "choices", "take choice", "no usage"]),
                                st.integers(0, 20), st.integers(1, 400)), min_size=1, max_size=25))
def test_input_tokens_kept_count_equals_a_count_from_every_call(tmp_path_factory, steps):
    """``num_input_tokens`` is read every turn (hooks, limits): it counts only the calls
    since it was last read, and that always equals counting every call again (so do the
    turns, the output tokens and the current branch, each kept between reads), whatever the
    graph does: forks, an earlier prompt answered the same again after the harness went on
    from that answer (its sampled node reused, with another usage), an earlier choice
    sampled as a call's reply, a call with no usage."""
    r = Rollout(tmp_path_factory.mktemp("inputs") / "t.msgpack")
    history = [SYSTEM, Message(role="user", content="start")]
    sent = []  # each call's prompt, reply and other choice
    taken = []  # each turn's branch as a hook's context takes it, and as it was then
    for k, (op, at, n) in enumerate(steps):
        prompt, reply, choices = history, Message(role="assistant", content=f"reply {k}"), []
        if op == "fork":
            prompt = history[:1 + 2 * (at % (len(history) // 2))] + [Message(role="user", content=f"fork {k}")]
        elif op == "again" and sent:
            prompt, reply, _ = sent[at % len(sent)]
        elif op == "choices":
            choices = [Choice(index=1, message=Message(role="assistant", content=f"other {k}"))]
        elif op == "take choice" and any(c for _, _, c in sent):
            prompt, _, reply = [x for x in sent if x[2] is not None][at % sum(1 for x in sent if x[2] is not None)]
        r.send(prompt, reply, usage=None if op == "no usage" else Usage(input_tokens=n, output_tokens=3),
               choices=choices)
        trace = r.recorder.trace
        assert trace.num_input_tokens == trace._count_input_tokens()[0], (k, op)
        # so do the other counts and the branch hooks are handed, each kept between reads
        assert trace.num_turns == len([c for c in trace.calls if c.node is not None])
        assert trace.num_output_tokens == sum(c.usage.output_tokens for c in trace.calls if c.usage is not None)
        last = next(c.node for c in reversed(trace.calls) if c.node is not None)
        assert trace.messages == [trace.nodes[i].message for i in trace.path(last)]
        # what a hook's context took of it (a shared list and its length) reads the same
        # whatever later turns do: the list only grows at its end
        taken.append((*trace.messages_now(), trace.messages))
        assert all(shared[:n] == then for shared, n, then in taken)
        sent.append((prompt, reply, choices[0].message if choices else None))
        # the harness goes on from the reply (or, now and then, from the other choice)
        went = choices[0].message if choices and at % 2 else reply
        history = prompt + [went, Message(role="user", content=f"next {k}")]


def test_a_long_session_counts_its_input_tokens_from_the_new_calls_only(tmp_path, monkeypatch):
    from interceptor.trace.model import Trace
    r = Rollout(tmp_path / "long.msgpack")
    fresh = []
    count = Trace._count_input_tokens
    monkeypatch.setattr(Trace, "_count_input_tokens", lambda self: fresh.append(1) or count(self))
    history = [SYSTEM, Message(role="user", content="start")]
    for k in range(30):
        reply = Message(role="assistant", content=f"reply {k}")
        r.send(history, reply, usage=Usage(input_tokens=100 + 10 * k, output_tokens=3))
        assert r.recorder.trace.num_input_tokens == 100 + 7 * k  # 10 more a turn, less the 3 fed back
        history = history + [reply, Message(role="user", content=f"next {k}")]
    assert len(fresh) == 1  # the first read; every later one counted the new call alone


def test_missing_usage_is_estimated_and_marked(tmp_path):
    r = Rollout(tmp_path / "e.msgpack")
    prompt = [SYSTEM, Message(role="user", content="count these words please " * 20)]
    call = r.send(prompt, Message(role="assistant", content="there are many words"))
    assert call.usage.estimated
    assert call.usage.input_tokens > 80
    assert 4 < call.usage.output_tokens < 20
    assert r.recorder.trace.usage.estimated


def test_extra_choices_become_sibling_samples(tmp_path):
    r = Rollout(tmp_path / "n.msgpack")
    prompt = [SYSTEM, Message(role="user", content="name a colour")]
    call = r.send(prompt, Message(role="assistant", content="red"),
                  choices=[Choice(index=1, message=Message(role="assistant", content="blue"))])
    trace = r.recorder.trace
    assert len(call.choice_nodes) == 1
    assert trace.nodes[call.choice_nodes[0]].parent == trace.nodes[call.node].parent
    assert len(trace.branches) == 2
    assert r.read() == trace


def test_to_record_is_plain_json(tmp_path):
    r = Rollout(tmp_path / "j.msgpack", agent={"name": "a"})
    for prompt, reply in tool_turns(2):
        r.send(prompt, reply, usage=Usage(input_tokens=10, output_tokens=2))
    record = r.recorder.trace.to_record()
    back = json.loads(json.dumps(record))
    assert back["num_turns"] == 2 and len(back["branches"]) == 1
    assert back["agent"] == {"name": "a"}


def test_conversation_by_response_id_for_chained_requests(tmp_path):
    r = Rollout(tmp_path / "p.msgpack")
    prompt = [SYSTEM, Message(role="user", content="hi")]
    reply = Message(role="assistant", content="hello")
    r.send(prompt, reply, id="resp_1")
    assert r.recorder.conversation("resp_1") == prompt + [reply]
    assert r.recorder.conversation("resp_unknown") is None
    chained = r.recorder.conversation("resp_1") + [Message(role="user", content="more")]
    r.send(chained, Message(role="assistant", content="sure"), id="resp_2")
    assert len(r.recorder.trace.branches) == 1
    assert r.recorder.trace.calls[0].response_id == "resp_1"


def test_reply_restated_without_its_reasoning_stays_on_its_branch(tmp_path):
    """A Chat harness never sends vLLM's reasoning_content back: its restatement matches
    the sampled reply, which keeps the reasoning the model produced."""
    r = Rollout(tmp_path / "r.msgpack")
    history = [SYSTEM, Message(role="user", content="go")]
    for k in range(4):
        reply = Message(role="assistant", content=f"step {k}", reasoning=[Reasoning(text=f"why {k}")])
        r.send(history, reply)
        history += [reply.model_copy(update={"reasoning": []}),
                    Message(role="user", content=f"next {k}")]
    trace = r.recorder.trace
    assert len(trace.branches) == 1 and trace.num_turns == 4
    assert len(trace.nodes) == 2 + 4 + 3
    assert [n.message.reasoning[0].text for n in trace.nodes if n.sampled] == [f"why {k}" for k in range(4)]
    assert r.read().branches == trace.branches  # the reader's graph agrees


def test_reply_restated_with_other_reasoning_is_another_message(tmp_path):
    r = Rollout(tmp_path / "o.msgpack")
    prompt = [SYSTEM, Message(role="user", content="go")]
    reply = Message(role="assistant", content="done", reasoning=[Reasoning(text="because")])
    r.send(prompt, reply)
    edited = reply.model_copy(update={"reasoning": [Reasoning(text="another story")]})
    r.send(prompt + [edited, Message(role="user", content="more")], Message(role="assistant", content="ok"))
    assert len(r.recorder.trace.branches) == 2


class _CountingEq:
    """Counts ``Message.__eq__`` calls and fails as soon as ``budget`` is exceeded, so a
    linear scan of 10,000 siblings fails at once instead of running for minutes."""

    def __init__(self, monkeypatch, budget: int):
        self.calls, self.budget = 0, budget
        original = Message.__eq__

        def counting(a, b):
            self.calls += 1
            assert self.calls <= self.budget, f"more than {self.budget} message comparisons"
            return original(a, b)

        monkeypatch.setattr(Message, "__eq__", counting)


def test_matching_among_ten_thousand_siblings_costs_constant_comparisons(monkeypatch):
    """A session reused for 10,000 independent requests has 10,000 roots: finding the one
    a restated prompt continues must not compare it with every one of them."""
    from interceptor.trace.graph import Graph
    from interceptor.trace.model import Trace

    n = 10_000
    graph = Graph(Trace(id="wide"))
    count = _CountingEq(monkeypatch, budget=4 * n)  # O(1) per turn; a scan would be n²/2
    for k in range(n):
        graph.add_turn([Message(role="user", content=f"task {k}")], Message(role="assistant", content=f"done {k}"))
    assert len(graph.children[None]) == n and len(graph.trace.nodes) == 2 * n

    count.calls, count.budget = 0, 8
    prompt = [Message(role="user", content="task 7777"), Message(role="assistant", content="done 7777"),
              Message(role="user", content="and then?")]
    turn = graph.add_turn(prompt, Message(role="assistant", content="then this"))
    assert turn.prompt_path[:2] == [2 * 7777, 2 * 7777 + 1]  # the stored root and its reply
    assert turn.added == [2 * n, 2 * n + 1] and graph.trace.nodes[2 * n].parent == 2 * 7777 + 1
    assert count.calls <= 8


def test_an_equal_sibling_wins_over_one_that_only_hashes_the_same():
    """A single text part and a plain string are the same message to the hash; the stored
    sibling equal to the restatement is the one reused, as a scan of the children chose."""
    from interceptor.trace.graph import FEW_CHILDREN, Graph
    from interceptor.trace.messages import Part
    from interceptor.trace.model import Trace

    graph = Graph(Trace(id="same"))
    for k in range(FEW_CHILDREN + 2):  # beyond the few compared directly: the index decides
        graph.add_turn([Message(role="user", content=f"other {k}")], Message(role="assistant", content="ok"))
    plain = graph.add_turn([Message(role="user", content="x")], Message(role="assistant", content="a")).prompt_path[0]
    parts = graph.add_turn([Message(role="user", content=[Part(text="x")])],
                           Message(role="assistant", content="b")).prompt_path[0]
    assert plain == parts  # one message to the graph: the second request reused the node
    # Stored once more under the same parent as a sibling with parts (a rebuilt index keeps
    # both); a restatement with parts takes the equal one, a plain one the first.
    trace = graph.trace
    trace.nodes.append(trace.nodes[parts].model_copy(update={"message": Message(role="user", content=[Part(text="x")])}))
    graph = Graph(trace)
    twin = len(trace.nodes) - 1
    assert graph._match(None, Message(role="user", content=[Part(text="x")]), None, 0) == twin
    assert graph._match(None, Message(role="user", content="x"), None, 0) == plain


def test_long_strings_hash_by_their_own_digest_and_still_tell_messages_apart():
    """``message_hash`` stands a long string in by its digest (a JSON dump of it cost six
    times a sha256): messages that differ in one character of a long content or tool output
    still hash apart, equal ones (however restated) alike, at lengths below, at and above the
    threshold."""
    from interceptor.trace.messages import _LONG, Part, ToolCall, message_hash

    for n in (_LONG - 1, _LONG, _LONG + 1, 20_000, 300_000):
        text = "é" * (n - 1) + "a"
        other = "é" * (n - 1) + "b"
        assert message_hash(Message(role="user", content=text)) != message_hash(Message(role="user", content=other))
        assert message_hash(Message(role="user", content=text)) == message_hash(
            Message(role="user", content=[Part(text=text)]))
        assert message_hash(Message(role="user", content=text)) != message_hash(Message(role="tool", content=text))
        call = ToolCall(id="c1", name="write", arguments=json.dumps({"body": text}))
        spaced = ToolCall(id="c1", name="write", arguments=json.dumps({"body": text}, indent=2))
        changed = ToolCall(id="c1", name="write", arguments=json.dumps({"body": other}))
        assert message_hash(Message(role="assistant", tool_calls=[call])) == message_hash(
            Message(role="assistant", tool_calls=[spaced]))
        assert message_hash(Message(role="assistant", tool_calls=[call])) != message_hash(
            Message(role="assistant", tool_calls=[changed]))


@settings(max_examples=300, deadline=None)
@given(role=st.sampled_from(["system", "user", "assistant", "tool"]),
       content=st.one_of(st.text(max_size=40), st.text(min_size=1020, max_size=1100),
                         st.text(alphabet="ab\ud800é", min_size=1020, max_size=1100)))
def test_a_plain_message_hashes_as_its_full_dump_and_a_change_forgets_the_hash(role, content):
    """``message_hash`` reads a message of a role and a text without dumping it:
    the hash is the one the general path (``model_dump``) gives, empty and long texts and
    lone surrogates included; assigning any field forgets the cached hash, so a message
    that gains a name, a tool call id or other content hashes as what it is now."""
    import hashlib

    from interceptor.trace.escape import utf8
    from interceptor.trace.messages import _digest_long_strings, _dumped, _plain, canonical_json, message_hash

    def general(m: Message) -> str:
        return hashlib.sha256(utf8(canonical_json(_digest_long_strings(_dumped(m))))).hexdigest()

    m = Message(role=role, content=content)
    assert _plain(m)
    assert message_hash(m) == general(m)
    m.name = "helper"
    assert not _plain(m) and message_hash(m) == general(m) != message_hash(Message(role=role, content=content))
    m.name = None
    m.content = content + "!"
    assert message_hash(m) == general(m) == message_hash(Message(role=role, content=content + "!"))
    copy = m.model_copy(update={"content": content})
    assert message_hash(copy) == message_hash(Message(role=role, content=content)) != message_hash(m)

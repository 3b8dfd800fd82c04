"""vLLM's prompt ids read past the ones the session's last answer carried (dialects/prompt_ids.py).

The reader must give exactly what ``json.loads`` gives, whatever the bytes; the part it does
not parse must be the ids the record holds for the very same bytes; and a collect_tokens
session must take that way from its second turn on (the point: ``bench/rollout.py
--collect-tokens``), JSON and streamed, while a fork, another spelling or a rolled-back
record fall back to the whole read with the same record.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from interceptor.dialects import prompt_ids
from interceptor.dialects.prompt_ids import Pending, Prior
from interceptor.addons.gateway.answer.tee import TEE_KEY
from interceptor.addons.gateway.exchange import exchange_of
from interceptor.addons.gateway.sessions.session import PROMPTS_KEPT
from interceptor.dialects.sse import SSEEvent
from mitmproxy import http
from interceptor.trace import Recorder
from interceptor.trace.graph import KnownIds

from test_addons import CHAT_URL, World, flow_for, world  # noqa: F401 (the fixture)

ids_lists = st.lists(st.integers(0, 2**31), max_size=40)
spellings = st.sampled_from([(",", ":"), (", ", ": ")])


def _body(ids: list[int], sep: tuple[str, str], before: bool) -> bytes:
    """An answer with the ids at the top level, before or after ``choices``, as vLLM puts them."""
    head = {"id": "c", "object": "chat.completion"}
    choices = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "stop"}]}
    body = {**head, "prompt_token_ids": ids, **choices} if before else {**head, **choices, "prompt_token_ids": ids}
    return json.dumps(body, separators=sep).encode()


def _prior(payload: bytes, held: list[int] | None) -> Prior:
    """The prior of an answer whose ids the record holds as ``held`` (None: no longer)."""
    _, read = prompt_ids.load(payload)
    assert read is not None
    return Prior(read, 0, None, _Held(held))


class _Held:
    """A record that holds ``held`` as a prior's ids (None: no longer)."""

    def __init__(self, held: list[int] | None) -> None:
        self.held = held

    def prompt_ids(self, leaf, node, into: list[int]) -> bool:
        return self.holds(leaf, node) and (into.extend(self.held) or True)

    def holds(self, leaf, node) -> bool:
        return self.held is not None


@settings(max_examples=300, deadline=None)
@given(ids_lists, ids_lists, spellings, spellings, st.booleans(), st.integers(0, 40), st.booleans())
def test_the_reader_gives_what_json_gives_and_reuses_only_the_very_same_bytes(first, more, sep1, sep2, before, change,
                                                                               longer):
    """Turn 1's ids, then turn 2's that start with them (or, ``change`` in range, with one of
    them changed: one more, or the last ``longer`` by two digits, so the bytes begin the same): equal to
    ``json.loads`` every time; the known ids reused, as the record's own objects, exactly when
    the bytes began the same way and another id follows them."""
    one = _body(first, sep1, before)
    held = json.loads(one)["prompt_token_ids"]
    second = first + more
    changed = change < len(first)
    if changed:
        second = list(second)
        if longer:  # turn 1's last id, a digit longer: the known bytes end inside a number
            second[len(first) - 1] = second[len(first) - 1] * 100 + 17
        else:
            second[change] += 1
    two = _body(second, sep2, not before)
    got, read = prompt_ids.load(two, [_prior(one, held)])
    assert got == json.loads(two)
    assert read is not None and read.count == len(second)
    reused = type(got["prompt_token_ids"]) is KnownIds
    known = json.dumps(first, separators=sep1)[:-1]  # through the last id
    now = json.dumps(second, separators=sep2)
    assert reused == (bool(first) and now.startswith(known) and now[len(known):].lstrip().startswith(","))
    assert not (reused and changed)
    if reused:
        assert all(a is b for a, b in zip(got["prompt_token_ids"], held))


@pytest.mark.parametrize(("last", "now"), [
    (b"[1,2,3]", b"[1,2,34]"),  # the known bytes end inside a number
    (b"[1,2,3]", b"[1,2,345,6]"),
    (b"[1,2,3]", b"[1,2,3,]"),  # a trailing comma is no JSON
    (b"[1,2,3]", b"[1,2,3,true]"),  # a bool is not an id: the whole read, where pydantic judges it
    (b"[1,2,3]", b"[1,2,3,4.0]"),
    (b"[1,2,3]", b"[1,2,3 , 4]"),  # spaces around the comma are JSON
])
def test_the_reader_keeps_to_json_at_the_edges(last, now):
    one = b'{"prompt_token_ids":' + last + b"}"
    two = b'{"prompt_token_ids":' + now + b"}"
    prior = _prior(one, json.loads(last))
    try:
        expected = json.loads(two)
    except ValueError:
        with pytest.raises(ValueError):
            prompt_ids.load(two, [prior])
        return
    got, _ = prompt_ids.load(two, [prior])
    assert got == expected
    assert (type(got["prompt_token_ids"]) is KnownIds) == (now == b"[1,2,3 , 4]")


def test_a_nested_key_of_that_name_is_not_taken_for_the_top_level_one():
    payload = b'{"choices":[{"prompt_token_ids":[9,9]}],"prompt_token_ids":[1,2]}'
    got, read = prompt_ids.load(payload)
    assert got == json.loads(payload) and read is None
    inner_only = b'{"choices":[{"prompt_token_ids":[9,9]}]}'
    assert prompt_ids.load(inner_only) == (json.loads(inner_only), None)


@pytest.mark.parametrize("held", [None, [1, 2]], ids=["record gone", "count differs"])
def test_a_record_that_no_longer_holds_the_ids_means_the_whole_read(held):
    one, two = b'{"prompt_token_ids":[1,2,3]}', b'{"prompt_token_ids":[1,2,3,4]}'
    got, _ = prompt_ids.load(two, [_prior(one, held)])
    assert got == {"prompt_token_ids": [1, 2, 3, 4]} and type(got["prompt_token_ids"]) is list


# --------------------------------------------------------------------------------------
# A collect_tokens session, in process through the Tee and the recorder

ROLES = {"system": 900_001, "user": 900_002, "assistant": 900_003}


def _words(text: str) -> list[int]:
    return [100_000 + len(w) * 1000 + sum(map(ord, w)) for w in text.split()]


def _template(messages: list[dict]) -> list[int]:
    """A chat template with the prefix property: ``[role] words`` per message, then
    ``[assistant]``, so a prompt begins with the last one and its reply's ids (``_words``)."""
    out: list[int] = []
    for m in messages:
        out += [ROLES[m["role"]], *_words(m["content"])]
    return out + [ROLES["assistant"]]


def _answer(prompt: list[int], reply: str, compact: bool) -> tuple[bytes, list[bytes]]:
    """The same vLLM answer as JSON and as a stream (the ids on the first chunk)."""
    sep = (",", ":") if compact else (", ", ": ")
    body = {"id": "c", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                         "finish_reason": "stop", "token_ids": _words(reply)}],
            "prompt_token_ids": prompt}
    chunks = [{"id": "c", "object": "chat.completion.chunk", "model": "m",
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": reply}, "finish_reason": None,
                            "token_ids": _words(reply)}], "prompt_token_ids": prompt},
              {"id": "c", "object": "chat.completion.chunk", "model": "m",
               "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
    events = [SSEEvent(data=json.dumps(c, separators=sep)).encode() for c in chunks] + [b"data: [DONE]\n\n"]
    return json.dumps(body, separators=sep).encode(), events


def _spy_reads(monkeypatch) -> list[bool]:
    """For each array read, whether it was read past a prior's ids."""
    reads: list[bool] = []
    real = prompt_ids.ids

    def spy(array, priors, *later):
        out = real(array, priors, *later)
        reads.append(out is not None and type(out[0]) in (KnownIds, Pending))
        return out

    monkeypatch.setattr(prompt_ids, "ids", spy)
    return reads


def _spy_commits(monkeypatch) -> list[list[int]]:
    """Each committed turn's prompt ids, as the recorder got them (the list itself)."""
    committed: list[list[int]] = []
    commit_turn = Recorder.commit_turn
    monkeypatch.setattr(Recorder, "commit_turn", lambda self, request, response, *a, **k: (
        committed.append(response.prompt_token_ids), commit_turn(self, request, response, *a, **k))[1])
    return committed


def test_a_collect_tokens_session_parses_only_the_new_ids_from_its_second_turn(world, monkeypatch):
    """Six turns, JSON and streamed in turn, then a fork that restates another history and a
    turn whose upstream spells the JSON differently: every branch's ids are the template's
    exactly, and the known ids were taken from the record on every turn whose bytes began
    with the last answer's."""
    reads = _spy_reads(monkeypatch)
    committed = _spy_commits(monkeypatch)
    session = world.session(collect_tokens=True)
    headers = {"authorization": f"Bearer {session.model_secret}"}

    def turn(messages: list[dict], reply: str, stream: bool, compact: bool = True) -> list[int]:
        flow = world.send(flow_for("POST", CHAT_URL, {"model": "gpt-4o", "messages": messages, "stream": stream},
                                   headers))
        prompt = _template(messages)
        body, events = _answer(prompt, reply, compact)
        got = (world.answer(flow, chunks=events, ctype="text/event-stream") if stream
               else world.answer(flow, body=body) and flow.response.content)
        assert b"token_ids" not in got and reply.encode() in got  # stripped for the harness
        assert committed[-1] == prompt  # every id, those taken from the record too
        return prompt + _words(reply)

    messages = [{"role": "system", "content": "be brief"}]
    for k in range(6):
        messages.append({"role": "user", "content": f"question number {k} please"})
        sample = turn(messages, f"answer {k}", stream=k % 2 == 1)
        messages.append({"role": "assistant", "content": f"answer {k}"})
    assert reads == [False, True, True, True, True, True]
    trace = session.recorder.trace
    assert len(trace.branches) == 1 and trace.branches[0].token_ids == sample

    fork = [messages[0], {"role": "user", "content": "another question entirely"}]
    forked = turn(fork, "elsewhere", stream=False)
    assert reads[-1] is False  # the bytes began otherwise: read whole
    messages.append({"role": "user", "content": "and once more"})
    spelled = turn(messages, "spelled", stream=True, compact=False)
    assert reads[-1] is False  # the last answer's bytes were the fork's
    messages += [{"role": "assistant", "content": "spelled"}, {"role": "user", "content": "last"}]
    last = turn(messages, "done", stream=False, compact=False)
    assert reads[-1] is True  # the same spelling as the turn before
    branches = sorted((b.token_ids for b in trace.branches), key=len)
    assert branches == sorted([forked, last], key=len)
    assert spelled == last[:len(spelled)]


def test_each_turn_extends_the_list_the_last_one_carried(world, monkeypatch):
    """From the third turn on (the second's list is the first that is the record's own), a
    turn's ids are the very list the turn before carried, extended in place: no join from
    the path's nodes. Two prompts off the same last answer: the first takes the list, the
    second joins its own from the nodes, and both are exact."""
    committed = _spy_commits(monkeypatch)
    joins: list[bool] = []
    real_ids = Recorder.prompt_ids
    monkeypatch.setattr(Recorder, "prompt_ids",
                        lambda self, leaf, node, into: joins.append(real_ids(self, leaf, node, into)) or joins[-1])
    session = world.session(collect_tokens=True)
    headers = {"authorization": f"Bearer {session.model_secret}"}

    def turn(messages: list[dict], reply: str, stream: bool) -> http.HTTPFlow:
        flow = world.send(flow_for("POST", CHAT_URL, {"model": "gpt-4o", "messages": messages, "stream": stream},
                                   headers))
        body, events = _answer(_template(messages), reply, True)
        if stream:
            world.answer(flow, chunks=events, ctype="text/event-stream")
        else:
            world.answer(flow, body=body)
        assert committed[-1] == _template(messages)
        return flow

    messages = [{"role": "system", "content": "be brief"}]
    for k in range(6):
        messages.append({"role": "user", "content": f"question number {k} please"})
        turn(messages, f"answer {k}", stream=k % 2 == 1)
        messages.append({"role": "assistant", "content": f"answer {k}"})
    assert type(committed[0]) is list and type(committed[1]) is KnownIds
    assert all(committed[k] is committed[1] for k in range(2, 6))
    assert joins == [True]  # the second turn's, from the first turn's nodes
    assert session.last_prompts[0].ids is committed[-1]

    # Two streams off the same last answer, both read past its ids before either ends: the
    # first to be assembled takes the kept list, the other joins the nodes' ids.
    flows, prompts = [], []
    for text in ("one way", "another way"):
        asked = [*messages, {"role": "user", "content": text}]
        flow = world.send(flow_for("POST", CHAT_URL, {"model": "gpt-4o", "messages": asked, "stream": True}, headers))
        prompts.append(_template(asked))
        flow.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
        world.tee.responseheaders(flow)
        flow.response.stream(_answer(prompts[-1], "ok", True)[1][0])  # the ids: read past the last answer's
        assert type(exchange_of(flow).own[TEE_KEY].assembler.prompt_token_ids) is Pending
        flows.append(flow)
    for flow, prompt in zip(flows, prompts):
        for chunk in [*_answer(prompt, "ok", True)[1][1:], b""]:
            flow.response.stream(chunk)
        world.tee.response(flow)
        assert committed[-1] == prompt
    assert committed[-2] is committed[1] and committed[-1] is not committed[1]
    assert joins == [True, True]
    trace = session.recorder.trace
    assert sorted(b.token_ids for b in trace.branches) == sorted(p + _words("ok") for p in prompts)


def test_a_rolled_back_prompt_node_is_not_taken_for_the_ids(world, monkeypatch):
    """The last prompt's node went with a rollback and its index came back for another node:
    the record no longer holds those ids there, so the next answer's ids are read whole, and
    the record is the same."""
    reads: list[bool] = []
    real = prompt_ids.ids
    monkeypatch.setattr(prompt_ids, "ids", lambda array, prior, *later: reads.append(bool(prior))
                        or real(array, prior, *later))
    session = world.session(collect_tokens=True)
    headers = {"authorization": f"Bearer {session.model_secret}"}

    def turn(messages: list[dict], reply: str) -> None:
        flow = world.send(flow_for("POST", CHAT_URL, {"model": "gpt-4o", "messages": messages}, headers))
        world.answer(flow, body=_answer(_template(messages), reply, True)[0])

    messages = [{"role": "user", "content": "one two"}]
    turn(messages, "three")
    last, held = session.last_prompts[0], []
    assert last is not None and session.recorder.prompt_ids(last.leaf, last.node, held)
    assert held == _template(messages)
    nodes = session.recorder.trace.nodes
    nodes[last.leaf] = nodes[last.leaf].model_copy()  # what a rollback and a new node leave there
    assert not session.recorder.prompt_ids(last.leaf, last.node, [])
    real_ids = Recorder.prompt_ids
    asked: list[bool] = []
    monkeypatch.setattr(Recorder, "prompt_ids",
                        lambda self, leaf, node, into: asked.append(real_ids(self, leaf, node, into)) or asked[-1])
    messages += [{"role": "assistant", "content": "three"}, {"role": "user", "content": "four"}]
    turn(messages, "five")
    assert reads == [False, True] and asked == [False]  # the prior was asked, and had nothing
    assert session.recorder.trace.branches[0].token_ids == _template(messages) + _words("five")


# --------------------------------------------------------------------------------------
# The graph: known nodes and known ids give what the walk gives

def _render(messages: list, variant: int) -> list[int]:
    """A template with the prefix property; ``variant`` renders the first message otherwise
    (a retokenised history: the ids part from the stored ones at the start)."""
    out: list[int] = []
    for j, m in enumerate(messages):
        out += [ROLES[m.role], *_words(m.text()), *([555_000 + variant] if j == 0 and variant else [])]
    return out + [ROLES["assistant"]]


# Found by the search once each: the fork's prompt ends at a stored message with new ids, so
# its last node is stored again, after an equal sibling stored with ``[]`` that the walk takes
# first; the next prompt's known path runs through the second one. The objects its message
# was stored with, or an equal parse of it.
_RESTORED = [("on", 0, False, 0, False, False), ("on", 1, False, 1, False, False), ("on", 0, False, 0, False, False),
             ("fork", 0, False, 1, False, False), ("on", 0, False, 0, False, False)]


@settings(max_examples=300, deadline=None)
@example(_RESTORED)
@example([*_RESTORED[:-1], ("on", 0, False, 0, False, True)])
@given(st.lists(st.tuples(st.sampled_from(["on", "on", "on", "fork", "again", "rename"]), st.integers(0, 1), st.booleans(),
                          st.integers(0, 1), st.booleans(), st.booleans()), min_size=1, max_size=14))
def test_known_nodes_and_known_ids_give_the_graph_the_walk_gives(steps):
    """Two graphs fed the same turns (going on, forking from an earlier turn, the same prompt
    again, a retokenised first message, a message the template does not render changed, a
    reasoning reply restated without its reasoning): one
    walks every prompt from the root; the other is
    handed the nodes of the leading messages it knows (the last turn's path and reply, as the
    recorder's remembered lists do, or the first stored path of equal messages, which may be
    another branch) and, when the ids begin with the last prompt's, a ``KnownIds`` saying
    so, as the reader makes it. Node for node, turn for turn, the same."""
    from interceptor.trace import Message, Reasoning
    from interceptor.trace.graph import Graph
    from interceptor.trace.model import Trace

    walked, handed = Graph(Trace(id="walk")), Graph(Trace(id="known"))
    fitting = handed._fitting

    def fitted_as_from_scratch(known, ids, prompt):
        """What the last fitting path (``Graph._fit``) lets the graph skip must not change
        what it finds: the same as with no memo, every time."""
        memo, handed._fit = handed._fit, None
        fresh = fitting(known, ids, prompt)
        handed._fit = memo
        got = fitting(known, ids, prompt)
        assert got == fresh
        return got

    handed._fitting = fitted_as_from_scratch
    history = [Message(role="system", content="be brief")]
    turns: list[tuple[list, list[int], list[int]]] = []  # each turn's messages, prompt ids, prompt path + reply
    for k, (step, variant, first_path, said, thought, parsed) in enumerate(steps):
        if step == "fork" and turns:
            history = list(turns[k % len(turns)][0])
        elif step == "again" and turns:
            history = list(turns[-1][0])
        elif step == "rename" and turns:  # the last user message named: the same ids, another message
            history = list(turns[-1][0])
            j = max(i for i, m in enumerate(history) if m.role == "user")
            history[j] = history[j].model_copy(update={"name": None if history[j].name else "someone"})
        # Few words, so branches can say the same (a known path on another branch).
        history = [*history, Message(role="user", content=f"ask {said} now")]
        # A reasoning model's reply, which a Chat harness restates without its reasoning.
        reply = Message(role="assistant", content=f"reply {said}", reasoning=[Reasoning(text="hmm")] if thought else [])
        restated = Message(role="assistant", content=f"reply {said}")
        ids = _render(history, variant)
        known: list[int] = []
        given_ids: list[int] = ids
        if turns:
            _, last_ids, chain = turns[-1]
            last_path = chain[:-1]
            nodes = handed.trace.nodes
            if first_path:  # the message-only walk: the first stored node of each equal message
                parent = None
                for m in history:
                    parent = handed._match(parent, m, None, 0)
                    if parent is None:
                        break
                    known.append(parent)
            else:
                for m, i in zip(history, chain):
                    held = nodes[i].message
                    if held != m and held.model_copy(update={"reasoning": []}) != m:
                        break
                    known.append(i)
            if ids[:len(last_ids)] == last_ids and len(ids) > len(last_ids):
                given_ids = KnownIds(last_path[-1], nodes[last_path[-1]])
                assert handed_fill(handed, last_path[-1], given_ids)
                given_ids.count = len(given_ids)
                given_ids += ids[len(given_ids):]
        # As parsed from a body: equal messages, not the stored objects (the recorder hands
        # the stored ones back where it can; a fresh parse cannot).
        prompt = [m.model_copy(deep=True) for m in history] if parsed else history
        a = walked.add_turn(prompt, reply, prompt_token_ids=list(ids), token_ids=_words(reply.text()))
        b = handed.add_turn(prompt, reply, prompt_token_ids=given_ids, token_ids=_words(reply.text()), known=known)
        assert (a.sampled, a.added, a.prompt_path) == (b.sampled, b.added, b.prompt_path)
        turns.append((history + [restated], ids, [*b.prompt_path, b.sampled]))
        history = history + [restated]
    strip = lambda g: [(n.parent, n.message, n.token_ids) for n in g.trace.nodes]  # noqa: E731
    assert strip(walked) == strip(handed)


def handed_fill(graph, leaf: int, into: list[int]) -> bool:
    """What ``Recorder.prompt_ids`` does, on a bare graph."""
    for i in graph.lineage(leaf):
        into += graph.trace.nodes[i].token_ids
    return True


def test_known_ids_from_a_path_whose_messages_differ_are_not_taken():
    """The last prompt named its user message (a field the template does not render): the
    next prompt's ids begin with that prompt's, but its message is the unnamed one, stored on
    the first branch, whose ids (another rendering) do not fit. The walk's nodes: a new
    branch whose ids are the prompt's, not the first branch's nodes with the named one's count."""
    from interceptor.trace import Message
    from interceptor.trace.graph import Graph
    from interceptor.trace.model import Trace

    system, ask = Message(role="system", content="be brief"), Message(role="user", content="ask 0")
    reply = Message(role="assistant", content="reply 0")
    named = [system, ask.model_copy(update={"name": "someone"})]
    prompt = [system, ask, reply, Message(role="user", content="ask 1")]
    turns = []
    for graph in (Graph(Trace(id="walked")), Graph(Trace(id="handed"))):
        first = graph.add_turn([system, ask], reply, prompt_token_ids=_render([system, ask], 1),
                               token_ids=_words("reply 0"))
        second = graph.add_turn(named, reply, prompt_token_ids=_render(named, 0), token_ids=_words("reply 0"))
        ids = _render(prompt, 0)
        known: list[int] = []
        if graph.trace.id == "handed":
            ids = KnownIds(second.prompt_path[-1], graph.trace.nodes[second.prompt_path[-1]])
            assert handed_fill(graph, second.prompt_path[-1], ids)
            ids.count = len(ids)
            ids += _render(prompt, 0)[len(ids):]
            known = [*first.prompt_path, first.sampled]  # the messages' nodes: the first branch
        turn = graph.add_turn(prompt, Message(role="assistant", content="reply 1"), prompt_token_ids=ids,
                              token_ids=_words("reply 1"), known=known)
        path_ids = [t for i in turn.prompt_path for t in graph.trace.nodes[i].token_ids]
        assert path_ids == _render(prompt, 0)
        turns.append(turn)
    assert turns[0] == turns[1]


def test_a_stream_whose_prior_ids_left_the_record_before_its_end_reads_them_whole(world, monkeypatch):
    """A stream's first chunk is read past the last prompt's ids, which are joined to the
    record's only when the stream is assembled (``Pending``). If the record no longer holds
    them by then (a rollback let the node go), the ids come from the array's own bytes."""
    session = world.session(collect_tokens=True)
    headers = {"authorization": f"Bearer {session.model_secret}"}
    committed = _spy_commits(monkeypatch)
    messages = [{"role": "user", "content": "one two"}]
    flow = world.send(flow_for("POST", CHAT_URL, {"model": "gpt-4o", "messages": messages}, headers))
    world.answer(flow, body=_answer(_template(messages), "three", True)[0])
    messages += [{"role": "assistant", "content": "three"}, {"role": "user", "content": "four five"}]
    flow = world.send(flow_for("POST", CHAT_URL, {"model": "gpt-4o", "messages": messages, "stream": True}, headers))
    _, events = _answer(_template(messages), "six", True)
    flow.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
    world.tee.responseheaders(flow)
    flow.response.stream(events[0])  # the ids: read past the last prompt's, not joined yet
    assert type(exchange_of(flow).own[TEE_KEY].assembler.prompt_token_ids) is Pending
    nodes = session.recorder.trace.nodes
    leaf = session.last_prompts[0].leaf
    nodes[leaf] = nodes[leaf].model_copy()  # what a rollback and a new node leave there
    for chunk in [*events[1:], b""]:
        flow.response.stream(chunk)
    world.tee.response(flow)
    assert committed[-1] == _template(messages) and type(committed[-1]) is list  # read whole, checked


@pytest.mark.parametrize("branches", [2, PROMPTS_KEPT, PROMPTS_KEPT + 1])
def test_branches_that_take_turns_each_read_past_their_own_last_ids(world, monkeypatch, branches):
    """A harness and its sub-agents take turns on one session: each branch's next answer is
    read past that branch's last ids, as long as the session remembers it (the last
    ``PROMPTS_KEPT`` branches); one more, taking turns in a circle, is read whole every time."""
    reads = _spy_reads(monkeypatch)
    session = world.session(collect_tokens=True)
    headers = {"authorization": f"Bearer {session.model_secret}"}
    histories = [[{"role": "system", "content": f"agent {b}"}] for b in range(branches)]
    last: list[list[int]] = [[] for _ in range(branches)]
    for k in range(3):
        for b, messages in enumerate(histories):
            messages.append({"role": "user", "content": f"step {k} of {b}"})
            flow = world.send(flow_for("POST", CHAT_URL, {"model": "gpt-4o", "messages": messages, "stream": k == 1},
                                       headers))
            body, events = _answer(_template(messages), f"done {k} {b}", True)
            if k == 1:
                world.answer(flow, chunks=events, ctype="text/event-stream")
            else:
                world.answer(flow, body=body)
            last[b] = _template(messages) + _words(f"done {k} {b}")
            messages.append({"role": "assistant", "content": f"done {k} {b}"})
    remembered = branches <= PROMPTS_KEPT
    assert reads == [False] * branches + [remembered] * 2 * branches
    assert sorted(b.token_ids for b in session.recorder.trace.branches) == sorted(last)
    assert len(session.last_prompts) == min(branches, PROMPTS_KEPT)

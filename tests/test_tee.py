"""The Tee's shortcut for the usual streamed event (issue 16), in process: a Chat text chunk
or a Messages delta read from its bytes (``NativeAssembler.quick``, ``dialects/common.py``'s
``Shape``) must put on the record exactly what the full path (cut into lines, parsed, folded)
puts there, whatever the chunks hold: escapes, non-ASCII text, OpenAI's obfuscation padding,
a head that changes midway, several choices or blocks, vLLM's token fields, events split
anywhere."""

from __future__ import annotations

import json
import random

import pytest

from interceptor.addons import tee as tee_module
from interceptor.dialects import ANTHROPIC, CHAT
from interceptor.dialects.common import NativeAssembler
from interceptor.dialects.sse import SSEDecoder
from provider import Reply, ToolCall, anthropic_messages, openai_chat
from provider.turn import Turn
from test_addons import CHAT_URL, MESSAGES_URL, flow_for, world  # noqa: F401 - the fixture

TEXTS = ["Hel", "lo", ", \"wor", "ld\"", "\\", " ünïcödé ", "😀", "\n", "tab\there", "", "</s>", "\u2028", " end"]


def chat_chunks(texts: list[str], **request) -> list[bytes]:
    """The simulator's Chat stream (one event per chunk, as providers flush them)."""
    body = {"model": "gpt-4o", "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "go"}], **request}
    return openai_chat.stream_events(Turn(body, Reply(text=texts), default_model="gpt-4o"))


def messages_chunks(texts: list[str]) -> list[bytes]:
    """The simulator's Messages stream: thinking, text and a tool call's input, each a block."""
    body = {"model": "claude-x", "max_tokens": 999, "stream": True, "messages": [{"role": "user", "content": "go"}]}
    reply = Reply(reasoning=texts, text=texts, tool_calls=[ToolCall(name="write", arguments=['{"a": "'] + texts[:4] + ['"}'])])
    return anthropic_messages.stream_events(Turn(body, reply, default_model="claude-x"))


def rewritten(chunks: list[bytes], change) -> list[bytes]:
    """Each JSON chunk changed by ``change(k, obj)`` and written back compactly, as OpenAI does."""
    out = []
    for k, chunk in enumerate(chunks):
        data = chunk.decode()[len("data: "):-2]
        if not data.startswith("{"):
            out.append(chunk)
            continue
        obj = json.loads(data)
        change(k, obj)
        out.append(b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n")
    return out


def obfuscated(k: int, obj: dict) -> None:
    if obj.get("choices"):
        obj["obfuscation"] = "x" * (1 + k % 7)


def full_path(chunks: list[bytes], dialect=CHAT):
    """What the record holds when every event is cut into lines and parsed (no shortcut)."""
    sse, asm = SSEDecoder(), dialect.assembler()
    for event in sse.feed(b"".join(chunks)) + sse.flush():
        asm.feed(event)
    return asm.result()


def through_tee(world, monkeypatch, chunks: list[bytes]):  # noqa: F811
    """The chunks through the real pipeline (Tee, Retry's capture); the committed response,
    the bytes the harness got, the events timed, the chunks the shortcut read."""
    committed, quick = [], []
    real_commit, real_quick = tee_module.commit, NativeAssembler.quick

    def spy_commit(ex, flow, response, error=None, **kw):
        committed.append((response, error))
        return real_commit(ex, flow, response, error, **kw)

    def spy_quick(self, chunk):
        took = real_quick(self, chunk)
        quick.append(took)
        return took

    monkeypatch.setattr(tee_module, "commit", spy_commit)
    monkeypatch.setattr(NativeAssembler, "quick", spy_quick)
    s = world.session()
    body = {"model": "gpt-4o", "stream": True, "max_tokens": 999, "messages": [{"role": "user", "content": "go"}]}
    if chunks[0].startswith(b"event:"):
        flow = flow_for("POST", MESSAGES_URL, body, {"x-api-key": s.model_secret})
    else:
        flow = flow_for("POST", CHAT_URL, body, {"authorization": f"Bearer {s.model_secret}"})
    world.send(flow)
    received = world.answer(flow, ctype="text/event-stream", chunks=chunks)
    assert len(committed) == 1
    response, error = committed[0]
    assert error is None
    times = len(flow.metadata["interceptor"].clock.times)
    return response, received, times, sum(quick)


CASES = {
    "plain": chat_chunks(TEXTS * 5),
    "obfuscated": rewritten(chat_chunks(TEXTS * 5), obfuscated),
    "head changes midway": rewritten(chat_chunks(TEXTS * 5), lambda k, o: o.update(created=o["created"] + (k > 30))),
    "escaped unicode": [c.replace(b'"content":"lo"', b'"content":"\\u006co\\ud83d\\ude00"') for c in chat_chunks(TEXTS * 5)],
    "two choices": chat_chunks(TEXTS * 5, n=2),
    "vllm token fields": chat_chunks(TEXTS * 5, return_token_ids=True, logprobs=True),
    "messages blocks": messages_chunks(TEXTS * 5),
}
DIALECT = {"messages blocks": ANTHROPIC}
SHORTCUT = ("plain", "obfuscated", "head changes midway", "escaped unicode", "messages blocks")


@pytest.mark.parametrize("case", list(CASES))
def test_the_shortcut_records_what_the_full_path_records(world, monkeypatch, case):  # noqa: F811
    chunks = CASES[case]
    expected = full_path(chunks, DIALECT.get(case, CHAT))
    assert expected.error is None and expected.message.text()
    response, received, times, quick = through_tee(world, monkeypatch, chunks)
    assert received == b"".join(chunks)  # the harness gets the bytes as sent
    assert response.model_dump() == expected.model_dump()
    assert times == len(chunks)  # one arrival time per event, the shortcut's too
    if case in SHORTCUT:
        assert quick > len(chunks) // 2  # the shortcut did the bulk of the work
    if case == "vllm token fields":
        assert quick == 0 and response.token_ids and response.logprobs


@pytest.mark.parametrize("case", ["obfuscated", "messages blocks"])
def test_the_shortcut_is_exact_for_any_split(world, monkeypatch, case):  # noqa: F811
    """Events cut anywhere among whole ones (an event split in two, two events in one chunk):
    the shortcut reads only a whole event between events; the record is the full path's."""
    events = CASES[case]
    rng = random.Random(16)
    for _ in range(5):
        chunks, pending = [], b""
        for event in events:
            roll = rng.random()
            if roll < 0.3:  # split in two, the first half joined to what came before
                cut = rng.randrange(1, len(event))
                chunks += [pending + event[:cut]]
                pending = event[cut:]
            elif roll < 0.45:  # joined to the next one
                pending += event
            else:
                chunks += [pending, event] if pending else [event]
                pending = b""
        chunks += [pending] if pending else []
        response, received, _, quick = through_tee(world, monkeypatch, chunks)
        assert received == b"".join(events) and quick
        assert response.model_dump() == full_path(events, DIALECT.get(case, CHAT)).model_dump()


@pytest.mark.parametrize("case", [*SHORTCUT, "vllm token fields"])
def test_a_chunk_of_many_whole_events_is_read_by_the_shortcut(world, monkeypatch, case):  # noqa: F811
    """The relay sends what reached it in one read as one chunk (``addons/relay.py``): runs
    of 1 to 40 whole events. Each event of the learned shape is read by the shortcut, each
    gets its arrival time, and the record is the full path's (vLLM's: no shortcut at all)."""
    events = CASES[case]
    rng = random.Random(40)
    chunks, k = [], 0
    while k < len(events):
        n = rng.randint(1, 40)
        chunks.append(b"".join(events[k:k + n]))
        k += n
    assert len(chunks) < len(events) // 4
    response, received, times, quick = through_tee(world, monkeypatch, chunks)
    assert received == b"".join(events)
    assert response.model_dump() == full_path(events, DIALECT.get(case, CHAT)).model_dump()
    assert times == len(events)
    if case in SHORTCUT:
        assert quick > len(events) // 2
    else:
        assert quick == 0 and response.token_ids and response.logprobs


def test_a_chunk_that_only_looks_like_the_shape_takes_the_full_path():
    """What is not one JSON string in the hole (a quote, a raw newline, a second event, a
    key after the hole) is no match, so the full path reads it."""
    chunks = chat_chunks(["a", "b", "c"])
    asm, sse = CHAT.assembler(), SSEDecoder()
    for chunk in chunks[:2]:
        for event in sse.feed(chunk):
            asm.feed(event)
    assert asm.quick(chunks[2])  # learned from the first text chunk
    good = chunks[2]
    assert b'"content":"b"' in good
    for bad in (good.replace(b'"b"', b'"b"x"'), good.replace(b'"b"', b'"b\nd"'), good + good,
                good.replace(b'"b"', b'"b","refusal":"no"'), good[:-1], good.replace(b'"b"', b'"\\x"'),
                good.replace(b'"b"', b'"\xff"'), good.replace(b'"b"', b'"b\x01"')):
        assert not asm.quick(bad), bad
    assert asm.result().message.content == "ab"  # none of them was folded

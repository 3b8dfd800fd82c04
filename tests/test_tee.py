"""The Tee's shortcut for the usual streamed event (issue 16), in process: a Chat text chunk
read from its bytes (``ChatAssembler.quick``, ``dialects/common.py``'s ``Shape``) must put on
the record exactly what the full path (cut into lines, parsed, folded) puts there, whatever
the chunks hold: escapes, non-ASCII text, OpenAI's obfuscation padding, a head that changes
midway, several choices, vLLM's token fields, events split anywhere."""

from __future__ import annotations

import json
import random

import pytest

from interceptor.addons import tee as tee_module
from interceptor.dialects import CHAT
from interceptor.dialects.chat import ChatAssembler
from interceptor.dialects.sse import SSEDecoder
from provider import Reply, openai_chat
from provider.turn import Turn
from test_addons import CHAT_URL, flow_for, world  # noqa: F401 - the fixture

TEXTS = ["Hel", "lo", ", \"wor", "ld\"", "\\", " ünïcödé ", "😀", "\n", "tab\there", "", "</s>", "\u2028", " end"]


def chat_chunks(texts: list[str], **request) -> list[bytes]:
    """The simulator's Chat stream (one event per chunk, as providers flush them)."""
    body = {"model": "gpt-4o", "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "go"}], **request}
    return openai_chat.stream_events(Turn(body, Reply(text=texts), default_model="gpt-4o"))


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


def full_path(chunks: list[bytes]):
    """What the record holds when every event is cut into lines and parsed (no shortcut)."""
    sse, asm = SSEDecoder(), CHAT.assembler()
    for event in sse.feed(b"".join(chunks)) + sse.flush():
        asm.feed(event)
    return asm.result()


def through_tee(world, monkeypatch, chunks: list[bytes]):
    """The chunks through the real pipeline (Tee, Retry's capture); the committed response,
    the bytes the harness got, the events timed, the chunks the shortcut read."""
    committed, quick = [], []
    real_commit, real_quick = tee_module.commit, ChatAssembler.quick

    def spy_commit(ex, flow, response, error=None, **kw):
        committed.append((response, error))
        return real_commit(ex, flow, response, error, **kw)

    def spy_quick(self, chunk):
        took = real_quick(self, chunk)
        quick.append(took)
        return took

    monkeypatch.setattr(tee_module, "commit", spy_commit)
    monkeypatch.setattr(ChatAssembler, "quick", spy_quick)
    s = world.session()
    flow = world.send(flow_for("POST", CHAT_URL, {"model": "gpt-4o", "stream": True,
                                                  "messages": [{"role": "user", "content": "go"}]},
                               {"authorization": f"Bearer {s.model_secret}"}))
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
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_shortcut_records_what_the_full_path_records(world, monkeypatch, case):  # noqa: F811
    chunks = CASES[case]
    expected = full_path(chunks)
    assert expected.error is None and expected.message.text()
    response, received, times, quick = through_tee(world, monkeypatch, chunks)
    assert received == b"".join(chunks)  # the harness gets the bytes as sent
    assert response.model_dump() == expected.model_dump()
    assert times == len(chunks)  # one arrival time per event, the shortcut's too
    if case in ("plain", "obfuscated", "head changes midway", "escaped unicode"):
        assert quick > len(chunks) // 2  # the shortcut did the bulk of the work
    if case == "vllm token fields":
        assert quick == 0 and response.token_ids and response.logprobs


def test_the_shortcut_is_exact_for_any_split(world, monkeypatch):  # noqa: F811
    """Events cut anywhere, whole ones among them: the shortcut reads only whole events
    between events; the record is the full path's."""
    body = b"".join(CASES["obfuscated"])
    rng = random.Random(16)
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(body)), 60))
        chunks = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)])]
        # Whole events too: after every cut, the rest of its event, then events one by one.
        response, received, _, _ = through_tee(world, monkeypatch, chunks)
        assert received == body
        assert response.model_dump() == full_path(chunks).model_dump()


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

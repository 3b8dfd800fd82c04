"""The Collect addon's stream rewrite at unit level: vLLM's chunks lose exactly what the proxy
asked for, whatever the chunking, and everything else passes byte for byte."""

from __future__ import annotations

import gzip
import json
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from interceptor.addons.gateway.answer.collect import StripStream
from interceptor.dialects import tokens as tokens_module
from interceptor.dialects.tokens import EventStrip, with_true_keys
from interceptor.dialects.vllm import ChatTokens, cut_prompt_ids
from interceptor.dialects import CHAT
from interceptor.dialects.sse import SSEDecoder
from test_addons import CHAT_URL, flow_for, world  # noqa: F401 - the fixture


def event(obj, ending=b"\n") -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + ending + ending


def chunk(delta, *, token_ids=None, logprobs=None, finish=None, **top):
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m", "choices": [choice], **top}


LP = {"content": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}], "refusal": None}
VLLM = [
    chunk({"role": "assistant", "content": ""}, token_ids=[], prompt_token_ids=[1, 2, 3]),
    chunk({"content": "Hi"}, token_ids=[7], logprobs=LP),
    chunk({}, token_ids=[8], logprobs=LP),  # a token the tool parser held back
    chunk({}, token_ids=[], finish="stop"),
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m", "choices": [],
     "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}},
]


def stream(ending=b"\n") -> bytes:
    return b": keep-alive" + ending + b"".join(event(o, ending) for o in VLLM) + b"data: [DONE]" + ending + ending


def stripped(plan: ChatTokens, data: bytes, cuts=()) -> bytes:
    strip = EventStrip(plan)
    out, last = [], 0
    for cut in sorted(cuts) + [len(data)]:
        out.append(strip.feed(data[last:cut]))
        last = cut
    return b"".join(out) + strip.flush()


def events_of(data: bytes) -> list:
    return [json.loads(line[6:]) if line != b"data: [DONE]" else "[DONE]"
            for line in data.splitlines() if line.startswith(b"data: ")]


def test_removes_what_the_proxy_asked_for_and_drops_token_only_chunks():
    plan = ChatTokens(token_ids=True, logprobs=True)
    out = stripped(plan, stream())
    assert b"token_ids" not in out and b'"content":[' not in out
    got = events_of(out)
    assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "prompt_token_ids" not in got[0]
    assert got[1]["choices"][0] == {"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}
    assert got[2]["choices"][0]["finish_reason"] == "stop"  # the held-back token's chunk is gone
    assert got[3]["usage"]["total_tokens"] == 5 and got[4] == "[DONE]"
    assert out.startswith(b": keep-alive\n")
    assert out.endswith(event(VLLM[-1]) + b"data: [DONE]\n\n")  # untouched events, same bytes
    assert (plan.events, plan.dropped) == (3, 1)
    assert plan.removed == {"prompt_token_ids", "choices[].token_ids", "choices[].logprobs"}


def test_logprobs_the_harness_asked_for_stay():
    out = stripped(ChatTokens(token_ids=True, logprobs=False), stream())
    got = events_of(out)
    assert [e["choices"][0]["logprobs"] for e in got[1:3]] == [LP, LP]  # the held-back token too
    assert b"token_ids" not in out


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([b"\n", b"\r\n", b"\r"]), st.lists(st.integers(0, 2000), max_size=12))
def test_any_chunking_and_line_ending_gives_the_same_events(ending, cuts):
    data = stream(ending)
    whole = stripped(ChatTokens(token_ids=True, logprobs=True), data)
    assert stripped(ChatTokens(token_ids=True, logprobs=True), data, [c % (len(data) + 1) for c in cuts]) == whole
    assert len(events_of(whole.replace(b"\r\n", b"\n").replace(b"\r", b"\n"))) == 5


def test_every_single_byte_split():
    data = stream(b"\r\n")
    whole = stripped(ChatTokens(token_ids=True, logprobs=True), data)
    for cut in range(len(data) + 1):
        assert stripped(ChatTokens(token_ids=True, logprobs=True), data, [cut]) == whole


@pytest.mark.parametrize("ending", [b"\n", b"\r\n"])
def test_a_chunk_of_one_byte_anywhere(ending):
    """A read of one byte (the first of an event's ``data:`` line, say) is no whole event:
    the next chunk's rest of the line must still be read as a data line and stripped. (It
    was taken for an event of its own, as ``find`` of a blank line that is not there gave
    -1, which is the length of one byte less two; the harness got the next event's token
    fields.)"""
    data = stream(ending)
    whole = stripped(ChatTokens(token_ids=True, logprobs=True), data)
    for cut in range(len(data)):
        assert stripped(ChatTokens(token_ids=True, logprobs=True), data, [cut, cut + 1]) == whole, cut


def test_a_compressed_stream_reaches_the_harness_decoded():
    seen = []

    def tee(chunk: bytes) -> bytes:
        seen.append(chunk)
        return chunk

    body = gzip.compress(stream())
    wrapper = StripStream(tee, SimpleNamespace(committed=False), ChatTokens(token_ids=True, logprobs=True), "gzip")
    calls = [wrapper(body[i:i + 50]) for i in range(0, len(body), 50)] + [wrapper(b"")]
    assert all(isinstance(c, list) and b"" not in c for c in calls)  # b"" would end the body
    out = b"".join(b"".join(c) for c in calls)
    assert b"".join(seen) == body  # the tee got the upstream's bytes
    assert out == stripped(ChatTokens(token_ids=True, logprobs=True), stream())


def test_keys_are_spliced_into_the_body_bytes():
    keys = ["return_token_ids", "logprobs"]
    body = b'{"model": "m", "messages": [{"role": "user", "content": "}"}]}\n'
    assert json.loads(with_true_keys(body, keys)) == {**json.loads(body), "return_token_ids": True, "logprobs": True}
    assert json.loads(with_true_keys(b" { } ", keys)) == {"return_token_ids": True, "logprobs": True}
    assert with_true_keys(b"[1]", keys) is None


def test_prompt_ids_are_cut_from_the_bytes_wherever_they_stand():
    for obj in ({"prompt_token_ids": [1, 2], "id": "x"}, {"id": "x", "prompt_token_ids": [1, 2]},
                {"id": "x", "prompt_token_ids": [], "choices": []}, {"prompt_token_ids": [3]}):
        for sep in ((",", ":"), (", ", ": ")):
            raw = json.dumps(obj, separators=sep).encode()
            out, cut = cut_prompt_ids(raw)
            assert cut and json.loads(out) == {k: v for k, v in obj.items() if k != "prompt_token_ids"}
    text = {"choices": [{"delta": {"content": 'say "prompt_token_ids": [1]'}}]}
    raw = json.dumps(text).encode()
    assert cut_prompt_ids(raw) == (raw, False)  # quoted inside a string: escaped, never matched
    assert cut_prompt_ids(b'{"prompt_token_ids":null}') == (b'{"prompt_token_ids":null}', False)


# What the byte path must keep equal to the JSON path: text that looks like the keys it looks
# for (quotes are escaped in a string, so it never matches), any Unicode, several choices.
_TRICKY = st.lists(st.sampled_from(['a', ' ', '"', '\\', '{', '}', '[', ']', ',', ':', 'é', '😀', '\n',
                                    '"token_ids":[1]', '"logprobs":{', '"delta":{"', 'null']), max_size=8).map("".join)
_LOGPROBS = st.one_of(st.none(), st.fixed_dictionaries({"content": st.lists(st.fixed_dictionaries({
    "token": _TRICKY, "logprob": st.floats(-20, 0), "bytes": st.lists(st.integers(0, 255), max_size=3),
    "top_logprobs": st.lists(st.fixed_dictionaries({"token": _TRICKY, "logprob": st.floats(-20, 0)}), max_size=2),
}), max_size=2)}))
_CHOICE = st.fixed_dictionaries({
    "index": st.integers(0, 3),
    "delta": st.one_of(st.just({}), st.fixed_dictionaries({"content": _TRICKY}),
                       st.fixed_dictionaries({"role": st.just("assistant"), "reasoning_content": _TRICKY})),
    "logprobs": _LOGPROBS,
    "finish_reason": st.one_of(st.none(), st.just("stop")),
}, optional={"token_ids": st.one_of(st.lists(st.integers(0, 200_000), max_size=3), st.none(),
                                    st.lists(st.lists(st.integers(0, 9), max_size=2), min_size=1, max_size=2)),
             "stop_reason": st.none()})


@settings(max_examples=400, deadline=None)
@given(st.lists(_CHOICE, min_size=1, max_size=3), st.booleans(), st.booleans(), st.booleans(),
       st.sampled_from([(",", ":"), (", ", ": ")]), st.booleans())
def test_the_byte_path_strips_what_the_json_path_strips(choices, token_ids, logprobs, prompt, separators, usage):
    """A chunk cut from its bytes (``ChatTokens.cut``) reads as the JSON path's (parse, strip,
    write), and says it removed the same; a compact chunk it leaves to the JSON path is one
    that may carry only token ids (no choice with a non-empty delta) or a value no flat array."""
    obj = {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": choices}
    if prompt:
        obj["prompt_token_ids"] = [5, 6, 7]
    if usage:
        obj["usage"] = {"prompt_tokens": 3}
    payload = json.dumps(obj, separators=separators, ensure_ascii=False).encode()
    fast, slow = ChatTokens(token_ids=token_ids, logprobs=logprobs), ChatTokens(token_ids=token_ids, logprobs=logprobs)
    cut = fast.cut(payload)
    expected = slow.stripped(payload)
    if cut is None:  # the usual chunk, as vLLM writes it (compact), takes the byte path
        assert (separators != (",", ":") or not any(c["delta"] for c in choices)
                or (token_ids and any("token_ids" in c and not (isinstance(c["token_ids"], list)
                                                                and all(type(t) is int for t in c["token_ids"]))
                                      for c in choices)))
        return
    if cut is payload:
        assert expected is None and not fast.removed
        return
    assert json.loads(cut) == expected and fast.removed == slow.removed


def test_the_byte_path_keeps_the_upstreams_bytes_around_what_it_cuts():
    payload = (b'{"id":"c", "choices":[{"index":0, "delta":{"content":"say \\"token_ids\\":[1]"},'
               b' "logprobs":{"content":[{"token":"}","logprob":-1}]}, "finish_reason":null, "token_ids":[9]}]}')
    plan = ChatTokens(token_ids=True, logprobs=True)
    assert plan.cut(payload) == (b'{"id":"c", "choices":[{"index":0, "delta":{"content":"say \\"token_ids\\":[1]"},'
                                 b' "logprobs":null, "finish_reason":null}]}')
    assert plan.removed == {"choices[].token_ids", "choices[].logprobs"}


# The strip of an event the Tee read by a learned shape (``_Cut``), in process through the
# real pipeline: a collect_tokens session's stream, the Tee, the strip, Retry's capture.

def _collect_stream(texts: list[str], change=None) -> list[bytes]:
    """The simulator's vLLM stream (token ids and logprobs on every chunk), each JSON chunk
    changed by ``change(k, obj)`` and written back compactly, as vLLM writes them."""
    from test_tee import chat_chunks, rewritten
    chunks = chat_chunks(texts, return_token_ids=True, logprobs=True)
    return rewritten(chunks, change) if change else chunks


def _runs(events: list[bytes], seed: int) -> list[bytes]:
    """The events as the relay sends them: runs of whole events, some split anywhere."""
    rng, chunks, pending = random.Random(seed), [], b""
    for event in events:
        roll = rng.random()
        if roll < 0.2:
            cut = rng.randrange(1, len(event))
            chunks.append(pending + event[:cut])
            pending = event[cut:]
        elif roll < 0.5:
            pending += event
        else:
            chunks.append(pending + event)
            pending = b""
    return chunks + ([pending] if pending else [])


def _escaped(k: int, obj: dict) -> None:
    for ch in obj.get("choices") or ():
        if ch["delta"].get("content"):
            ch["delta"]["content"] += ' "q\\ \u00e9\U0001f600\n'
            ch["logprobs"]["content"][0]["token"] = ch["delta"]["content"]


def _entry_with_ids(chunks: list[bytes]) -> list[bytes]:
    """Every fifth text chunk's logprobs entry with a ``token_ids`` of its own (null), the
    chunk written with ASCII escapes: the cut leaves such a chunk to the JSON path, which
    writes it anew (``é`` unescaped), so a template would give other bytes."""
    out = []
    for k, chunk in enumerate(chunks):
        if k % 5 == 3 and b'"token":' in chunk:
            obj = json.loads(chunk[6:])
            obj["choices"][0]["delta"]["content"] += "é"
            obj["choices"][0]["logprobs"]["content"][0]["token_ids"] = None
            chunk = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
        out.append(chunk)
    return out


STRIP_CASES = {
    "one event a chunk": (_collect_stream([f"w{k} " for k in range(60)]), None),
    "runs and splits": (_collect_stream([f"w{k} " for k in range(60)]), 7),
    "escapes and emoji": (_collect_stream([f"w{k} " for k in range(60)], _escaped), 11),
    "an entry with ids of its own": (_entry_with_ids(_collect_stream([f"w{k} " for k in range(60)])), None),
    "ids varied": (_collect_stream([f"w{k} " for k in range(60)],
                                   lambda k, o: [c.update(token_ids=c["token_ids"] * (k % 3)) for c in o.get("choices") or ()
                                                 if c.get("token_ids")]), 3),
    # A shape learned for the new head shares the old one's pattern (``Shape.first`` is left
    # out of it): the old head's template must not strip the new head's events.
    "a head that changes midway": (_collect_stream([f"w{k} " for k in range(60)],
                                                   lambda k, o: o.update(id="chatcmpl-x" * (1 + (k > 54)))), 5),
}


@pytest.mark.parametrize("case", list(STRIP_CASES))
def test_the_strip_by_a_shape_gives_the_harness_what_the_cut_gives(world, monkeypatch, case):  # noqa: F811
    """Each event the Tee read by its learned shape is stripped by that shape's template:
    the harness gets exactly the bytes the strip gives without the Tee's help, the rewrite
    record counts the same events and names the same fields, and the template did the bulk."""
    events, seed = STRIP_CASES[case]
    chunks = _runs(events, seed) if seed is not None else events
    fills = []
    real_fill = tokens_module._Cut.fill
    monkeypatch.setattr(tokens_module._Cut, "fill", lambda self, m: fills.append(1) or real_fill(self, m))
    session = world.session(collect_tokens=True)
    flow = world.send(flow_for("POST", CHAT_URL, {"model": "gpt-4o", "stream": True,
                                                  "messages": [{"role": "user", "content": "go"}]},
                               {"authorization": f"Bearer {session.model_secret}"}))
    sent = json.loads(flow.request.content)
    assert sent["return_token_ids"] is True and sent["logprobs"] is True
    received = world.answer(flow, chunks=chunks, ctype="text/event-stream")
    plan = ChatTokens(token_ids=True, logprobs=True)
    expected = stripped(plan, b"".join(events))
    assert received == expected
    assert b"token_ids" not in received and b'"logprobs":{' not in received
    [rewrite] = session.recorder.trace.response_rewrites
    assert rewrite.events == plan.events and set(rewrite.removed) == plan.removed
    assert len(fills) > len(events) // 2
    reply = session.recorder.trace.calls[-1]
    assert reply.error is None


_TRICKY = st.lists(st.sampled_from(["a", " ", '"', "\\", "{", "}", "[", "]", ":", ",", "é", "😀", "\n",
                                     '"token_ids":[1]', '"logprobs":{', '"delta":{"', "null"]), max_size=6).map("".join)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_TRICKY, st.lists(st.integers(0, 2**31), min_size=1, max_size=2),
                          st.floats(allow_nan=False, allow_infinity=False, max_value=0.0), st.booleans()),
                min_size=2, max_size=10))
def test_the_strip_by_a_template_equals_the_cut_for_any_text(tokens):
    """The template's claim: the cut of an event of a learned shape depends on the shape's
    fixed text alone, whatever its holes hold (text that looks like the keys, quotes,
    backslashes, any ids and logprobs, escaped or not). The Tee's reading is the assembler's
    shortcut on each chunk, as ``StreamTee`` hands it to the strip."""
    from test_tee import chat_chunks
    chunks = chat_chunks(["x"] * len(tokens), return_token_ids=True, logprobs=True)
    for k, (text, ids, logprob, ascii_only) in enumerate(tokens, start=1):
        obj = json.loads(chunks[k][6:])
        choice = obj["choices"][0]
        choice["delta"]["content"], choice["token_ids"] = text, ids
        choice["logprobs"]["content"][0].update(token=text, logprob=logprob, bytes=list(text.encode()))
        chunks[k] = b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=ascii_only).encode() + b"\n\n"
    reference = ChatTokens(token_ids=True, logprobs=True)
    expected = stripped(reference, b"".join(chunks))
    assembler, frames, matches, fills = CHAT.assembler(), SSEDecoder(), [], []
    plan = ChatTokens(token_ids=True, logprobs=True)
    strip = EventStrip(plan, matches)
    out = []
    real_fill = tokens_module._Cut.fill
    tokens_module._Cut.fill = lambda self, m: fills.append(1) or real_fill(self, m)
    try:
        for chunk in chunks:
            strip.begin()
            if frames.idle and assembler.quick(chunk):
                matches.append((chunk, assembler.matched))
            else:
                for event in frames.feed(chunk):
                    assembler.feed(event)
            out.append(strip.feed(chunk))
        out.append(strip.flush())
    finally:
        tokens_module._Cut.fill = real_fill
    assert b"".join(out) == expected
    assert (plan.events, plan.removed) == (reference.events, reference.removed)
    assert len(fills) >= len(tokens) - 2  # learned from the first text chunk, cut by template from the third

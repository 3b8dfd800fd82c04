"""The Tee's shortcut for the usual streamed event, in process: a Chat text chunk
or a Messages delta read from its bytes (``NativeAssembler.quick``, ``dialects/common.py``'s
``Shape``) must put on the record exactly what the full path (cut into lines, parsed, folded)
puts there, whatever the chunks hold: escapes, non-ASCII text, OpenAI's obfuscation padding,
a head that changes midway, several choices or blocks, vLLM's token fields, events split
anywhere."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from interceptor.addons.gateway.answer import tee as tee_module
from interceptor.dialects import ANTHROPIC, CHAT, RESPONSES
from interceptor.dialects.common import NativeAssembler, shape_of
from interceptor.dialects.sse import SSEDecoder
from provider import Reply, ToolCall, anthropic_messages, openai_chat, openai_responses
from provider.turn import Turn
from test_addons import CHAT_URL, MESSAGES_URL, flow_for, world  # noqa: F401 - the fixture

RESPONSES_URL = "https://api.openai.com/v1/responses"

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


def responses_chunks(texts: list[str], **request) -> list[bytes]:
    """The simulator's Responses stream: reasoning, text and a call's arguments, each an
    item, every delta numbered and padded (``obfuscation``), as OpenAI sends them."""
    body = {"model": "gpt-5", "stream": True, "input": "go", **request}
    reply = Reply(reasoning=texts, text=texts, tool_calls=[ToolCall(name="write", arguments=['{"a": "'] + texts[:4] + ['"}'])])
    return openai_responses.stream_events(Turn(body, reply, default_model="gpt-5"))


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


def varied_tokens(k: int, obj: dict) -> None:
    """vLLM's token fields as they vary: logprobs in every JSON spelling Python writes (an
    exponent, an int, minus zero, vLLM's floor -9999.0), two ids in one chunk; and, once each,
    a chunk of another shape: -Infinity (which only the full path reads), a token with no
    bytes, alternatives, two tokens in one chunk."""
    for ch in obj.get("choices") or ():
        entries = (ch.get("logprobs") or {}).get("content") or []
        for e in entries:
            e["logprob"] = [-0.5, 0, -1e-05, -12345.0, -9999.0, -0.0, 3, -2.5e-300][k % 8]
            e["logprob"] = float("-inf") if k == 20 else e["logprob"]
            e["bytes"] = None if k == 30 else e["bytes"]
            e["top_logprobs"] = [{"token": "x", "logprob": -1.0, "bytes": [120]}] if k == 40 else e["top_logprobs"]
        if entries and k == 50:
            entries.append(dict(entries[0]))
        if k % 9 == 4 and ch.get("token_ids"):
            ch["token_ids"] = ch["token_ids"] * 2


def full_path(chunks: list[bytes], dialect=CHAT):
    """What the record holds when every event is cut into lines and parsed (no shortcut)."""
    sse, asm = SSEDecoder(), dialect.assembler()
    for event in sse.feed(b"".join(chunks)) + sse.flush():
        asm.feed(event)
    return asm.result()


def by_shortcut(chunks: list[bytes], dialect=CHAT):
    """What the record holds when each chunk is offered to the shortcut first, as the Tee
    does with a chunk of one whole event; and how many it took."""
    asm, sse, quick = dialect.assembler(), SSEDecoder(), 0
    for chunk in chunks:
        if sse.idle and asm.quick(chunk):
            quick += 1
        else:
            for event in sse.feed(chunk):
                asm.feed(event)
    return asm.result(), quick


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
    if chunks[0].startswith(b"event: response."):
        flow = flow_for("POST", RESPONSES_URL, {"model": "gpt-5", "stream": True, "input": "go"},
                        {"authorization": f"Bearer {s.model_secret}"})
    elif chunks[0].startswith(b"event:"):
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
    "vllm token fields varied": rewritten(chat_chunks(TEXTS * 5, return_token_ids=True, logprobs=True), varied_tokens),
    "vllm ids only": chat_chunks(TEXTS * 5, return_token_ids=True),
    "logprobs only, obfuscated": rewritten(chat_chunks(TEXTS * 5, logprobs=True), obfuscated),
    "messages blocks": messages_chunks(TEXTS * 5),
    "responses items": responses_chunks(TEXTS * 5),
    "responses with logprobs": responses_chunks(TEXTS * 5, include=["message.output_text.logprobs"]),
}
DIALECT = {"messages blocks": ANTHROPIC, "responses items": RESPONSES, "responses with logprobs": RESPONSES}
SHORTCUT = tuple(c for c in CASES if c not in ("two choices", "responses with logprobs"))
TOKENS = ("vllm token fields", "vllm token fields varied", "vllm ids only", "logprobs only, obfuscated")


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
    if case in TOKENS:
        assert response.token_ids or response.logprobs


@pytest.mark.parametrize("case", ["obfuscated", "messages blocks", "vllm token fields varied", "responses items"])
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


@pytest.mark.parametrize("case", SHORTCUT)
def test_a_chunk_of_many_whole_events_is_read_by_the_shortcut(world, monkeypatch, case):  # noqa: F811
    """The relay sends what reached it in one read as one chunk (``addons/gateway/transport/relay.py``): runs
    of 1 to 40 whole events. Each event of the learned shape is read by the shortcut, each
    gets its arrival time, and the record is the full path's."""
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
    assert quick > len(events) // 2


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


def test_a_token_chunk_reads_its_numbers_and_ids_as_json_does():
    """vLLM's shape reads a chunk's logprobs entries as the JSON module reads them, whatever
    JSON allows in them (json.loads takes NaN and Infinity too, and so does the full path),
    and its ids as a compact list of ints; anything else (a leading zero or plus, a bare
    point, a list with a space or a float, a trailing comma) is no match, so the full path
    reads it."""
    chunks = chat_chunks(["a", "b", "c"], return_token_ids=True, logprobs=True)
    asm, sse = CHAT.assembler(), SSEDecoder()
    for chunk in chunks[:2]:
        for event in sse.feed(chunk):
            asm.feed(event)
    good = chunks[2]
    logprob = json.loads(good[6:])["choices"][0]["logprobs"]["content"][0]["logprob"]
    assert b'"token_ids":[' in good and b'"logprob":%s,' % repr(logprob).encode() in good
    folded = 1  # "a"

    def variant(number: bytes = b"", ids: bytes = b"") -> bytes:
        out = good.replace(b'"logprob":%s,' % repr(logprob).encode(), b'"logprob":' + number + b",") if number else good
        return out.replace(b'"token_ids":' + good.split(b'"token_ids":')[1].split(b"]")[0] + b"]", b'"token_ids":' + ids) if ids else out

    for number in (b"1e-05", b"-0", b"0.0", b"-1E+2", b"12345678901234567890", b"-9999.0", b"2.5e-300",
                   b"NaN", b"-Infinity", b"true", b'"1"'):
        assert asm.quick(variant(number=number)), number
        folded += 1
        got, want = asm.choices[0].logprobs[-1]["logprob"], json.loads(number)
        assert repr(got) == repr(want) and type(got) is type(want)
    for ids in (b"[]", b"[0,-1,123456789012]"):
        known = len(asm.choices[0].token_ids)
        assert asm.quick(variant(ids=ids)), ids
        folded += 1
        assert asm.choices[0].token_ids[known:] == json.loads(ids)
    before = (list(asm.choices[0].content), list(asm.choices[0].token_ids), len(asm.choices[0].logprobs))
    for number in (b"01", b"+1", b"1.", b".5", b"1e", b"--1", b"0x1", b"-", b"nan"):
        assert not asm.quick(variant(number=number)), number
    for ids in (b"[1, 2]", b"[1,]", b"[01]", b"[1.0]", b"[true]", b'["1"]', b"[[1]]", b"null", b"[ ]"):
        assert not asm.quick(variant(ids=ids)), ids
    assert (asm.choices[0].content, asm.choices[0].token_ids, len(asm.choices[0].logprobs)) == before  # none folded
    assert len(asm.choices[0].logprobs) == folded


def test_a_chunk_of_several_tokens_and_alternatives_is_read_by_the_shortcut():
    """vLLM sends several tokens in one chunk (``--stream-interval``, speculative decoding)
    and alternatives when asked (``top_logprobs``): one shape reads them all, however many,
    and the record is the full path's."""
    chunks = chat_chunks([f"w{k} " for k in range(40)], return_token_ids=True, logprobs=True, top_logprobs=2)

    def widened(k: int, obj: dict) -> None:
        for ch in obj.get("choices") or ():
            entries = (ch.get("logprobs") or {}).get("content")
            if entries and ch.get("token_ids"):
                n = 1 + k % 3
                entries[:] = [dict(entries[0], token=f"{entries[0]['token']}{j}") for j in range(n)]
                ch["token_ids"] = ch["token_ids"] * n
                ch["delta"]["content"] = "".join(e["token"] for e in entries)
    chunks = rewritten(chunks, widened)
    assert b'"top_logprobs":[{' in chunks[3]
    response, quick = by_shortcut(chunks)
    assert response.model_dump() == full_path(chunks).model_dump()
    assert quick >= 38  # all but the first text chunk


_TOKEN = st.fixed_dictionaries({
    "text": st.text(max_size=6),
    "logprob": st.one_of(st.floats(allow_nan=False, max_value=0.0), st.integers(-10**20, 0)),
    "bytes": st.one_of(st.lists(st.integers(0, 255), max_size=4), st.none()),
    "ids": st.lists(st.integers(-2**63, 2**63), max_size=3),
    "ascii": st.booleans(),
})


@settings(max_examples=300, deadline=None)
@given(st.lists(_TOKEN, min_size=1, max_size=12))
def test_any_token_chunks_are_recorded_as_the_full_path_records(tokens):
    """Text of any characters (escaped or not), any finite or infinite logprob, a token with
    or without bytes, any ids: the shortcut's record is the full path's, chunk for chunk, and
    every chunk after the first is read by it."""
    chunks = chat_chunks(["x"] * len(tokens), return_token_ids=True, logprobs=True)
    body = []
    for k, chunk in enumerate(chunks):
        obj = json.loads(chunk[6:]) if chunk.startswith(b"data: {") else None
        token = tokens[k - 1] if 1 <= k <= len(tokens) else None
        if obj is None or token is None:
            body.append(chunk)
            continue
        ch = obj["choices"][0]
        ch["delta"]["content"] = token["text"]
        ch["logprobs"]["content"][0].update(token=token["text"], logprob=token["logprob"], bytes=token["bytes"])
        ch["token_ids"] = token["ids"]
        body.append(b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=token["ascii"]).encode() + b"\n\n")
    response, quick = by_shortcut(body)
    assert response.model_dump() == full_path(body).model_dump()
    assert quick == len(tokens) - 1  # learned from the first, every other one by the shortcut


def test_a_responses_delta_checks_its_sequence_number_as_json_does():
    """Responses' deltas are read with their ``sequence_number`` only checked (it changes
    every event; the record does not keep it): any number JSON allows matches, anything else
    is no match, so the full path reads it."""
    chunks = responses_chunks(["a", "b", "c", "d"])
    asm, sse = RESPONSES.assembler(), SSEDecoder()
    first = next(k for k, c in enumerate(chunks) if b"output_text.delta" in c)
    for chunk in chunks[:first + 1]:
        for event in sse.feed(chunk):
            asm.feed(event)
    good = chunks[first + 1]
    number = good.split(b'"sequence_number":')[1].split(b",")[0]
    assert b"output_text.delta" in good and asm.quick(good)
    for spelled in (b"7", b"0", b"-3", b"1e3", b"2.5"):
        assert asm.quick(good.replace(b'"sequence_number":' + number, b'"sequence_number":' + spelled)), spelled
    for bad in (b"07", b"+7", b"7.", b"NaN", b'"7"', b"null", b"[7]", b"\xd9\xa7"):
        assert not asm.quick(good.replace(b'"sequence_number":' + number, b'"sequence_number":' + bad)), bad
    assert "".join(asm.items[max(asm.items)].texts[0]) == "a" + "b" * 6  # none of the bad ones folded


def test_a_list_hole_is_one_json_list_or_no_match():
    """A hole for any list is matched up to the first ``]`` the fixed text follows, and its
    text must then scan as exactly one list: an event that is no JSON (two lists where one
    was) is no match, as the full path would find it malformed."""
    obj = {"a": [{"x": 1}], "b": 2}
    data = json.dumps(obj, separators=(",", ":"))
    shape = shape_of("data: ", data, obj, [(obj, "a"), (obj, "b")], every=True)
    assert shape is not None and shape.match('data: {"a":[{"x":3},{"y":[4]}],"b":5}\n\n') == [[{"x": 3}, {"y": [4]}], 5]
    for bad in ('data: {"a":[1],[2],"b":5}\n\n', 'data: {"a":[1],"b":2],"b":5}\n\n', 'data: {"a":[1,"b":5}\n\n'):
        assert shape.match(bad) is None, bad


def test_streams_of_one_shape_share_its_pattern_and_each_keeps_its_head():
    """Every stream's head differs (its completion ``id``, ``created``), the rest of its token
    chunks does not: the pattern a shape matches after its head is compiled once for all of
    them (a pattern per stream cost ~0.4 ms of the event loop a turn in the real process),
    and each shape still reads only its own stream's events."""
    learned = []
    for k in range(2):
        chunks = rewritten(chat_chunks(["a", "b", "c"], return_token_ids=True, logprobs=True),
                           lambda _, o, k=k: o.update(id=f"chatcmpl-{k}" * (k + 1)))
        asm, sse = CHAT.assembler(), SSEDecoder()
        for event in sse.feed(b"".join(chunks[:2])):
            asm.feed(event)
        assert asm.quick(chunks[2])
        learned.append((asm._shape, chunks[2]))
    (one, one_chunk), (two, two_chunk) = learned
    assert one is not two and one.pattern is two.pattern
    assert one.match(one_chunk.decode()) is not None and two.match(two_chunk.decode()) is not None
    assert one.match(two_chunk.decode()) is None and two.match(one_chunk.decode()) is None


def test_an_event_cut_by_a_read_costs_no_try_to_learn():
    """A token chunk a read cut in two takes the full path though the learned shape reads it:
    it teaches nothing and must not use up the stream's tries, or a head that changes after a
    few such chunks is never learned and the rest of the stream takes the full path."""
    chunks = rewritten(chat_chunks([f"w{k} " for k in range(20)], return_token_ids=True, logprobs=True),
                       lambda k, o: o.update(created=o["created"] + (k > 8)))
    asm, sse, quick = CHAT.assembler(), SSEDecoder(), []
    for k, chunk in enumerate(chunks):
        if 2 <= k <= 6:  # cut by the reads: the shortcut never sees them whole
            for half in (chunk[:40], chunk[40:]):
                for event in sse.feed(half):
                    asm.feed(event)
        elif sse.idle and asm.quick(chunk):
            quick.append(k)
        else:
            for event in sse.feed(chunk):
                asm.feed(event)
    assert quick == [7, 8, *range(10, 21)]  # 9 has the new head, and teaches it
    assert asm.result().model_dump() == full_path(chunks).model_dump()


CAPTURES = Path(__file__).resolve().parent / "fixtures"


def _capture_events(path: Path) -> list[bytes]:
    """A real provider's stream as it was captured, one event per chunk (as providers flush)."""
    raw = path.read_bytes().replace(b"\r\n", b"\n")
    return [event + b"\n\n" for event in raw.split(b"\n\n") if event.strip()]


@pytest.mark.parametrize("path", sorted(CAPTURES.glob("openai-chat-sse/*.sse")) + sorted(CAPTURES.glob("anthropic-messages-sse/*.sse")),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_real_providers_stream_is_recorded_by_the_shortcut_as_by_the_full_path(path):
    """The captured streams of the real APIs (tests/fixtures, ground truth): whatever their
    events hold (OpenAI's refusals, tool calls, usage; Anthropic's padding, thinking and
    tool input), the record by the shortcut is the full path's, and the shortcut reads the
    usual delta of every stream that has a few of them."""
    dialect = ANTHROPIC if "anthropic" in path.parent.name else CHAT
    events = _capture_events(path)
    response, quick = by_shortcut(events, dialect)
    assert response.model_dump() == full_path(events, dialect).model_dump()
    deltas = sum(b'"content":"' in e or b'_delta"' in e for e in events)
    if deltas >= 4:
        assert quick, f"{deltas} deltas, none by the shortcut"

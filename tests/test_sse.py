"""The SSE decoder: framing edge cases, and any chunking equals no chunking."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from interceptor.dialects import sse
from interceptor.dialects.sse import SSEDecoder, SSEEvent, blank, lf_split, lines_kept


def decode(*chunks: bytes) -> list[SSEEvent]:
    d = SSEDecoder()
    out = []
    for c in chunks:
        out += d.feed(c)
    return out + d.flush()


def pairs(events: list[SSEEvent]) -> list[tuple[str | None, str]]:
    return [(e.event, e.data) for e in events]


def test_basic_event_and_data():
    assert pairs(decode(b"event: ping\ndata: {}\n\ndata: x\n\n")) == [("ping", "{}"), (None, "x")]


def test_crlf_split_between_cr_and_lf():
    body = b"data: a\r\n\r\ndata: b\r\n\r\n"
    for i in range(len(body) + 1):
        assert pairs(decode(body[:i], body[i:])) == [(None, "a"), (None, "b")], i


def test_cr_only_line_endings_and_empty_chunks():
    assert pairs(decode(b"data: a\r", b"", b"\rdata: b\r\r")) == [(None, "a"), (None, "b")]
    # An empty chunk between CR and LF must not turn the LF into a second blank line.
    assert pairs(decode(b"data: a\r", b"", b"\ndata: b\n\n")) == [(None, "a\nb")]


def test_comments_are_ignored():
    assert pairs(decode(b": keep-alive\n\n:another\ndata: x\n: mid\n\n")) == [(None, "x")]


def test_multi_line_data_is_joined_with_newlines():
    assert pairs(decode(b"data: line1\ndata:line2\ndata:  indented\n\n")) == [(None, "line1\nline2\n indented")]


def test_no_trailing_blank_line_is_flushed():
    assert pairs(decode(b"event: message_stop\ndata: {}")) == [("message_stop", "{}")]
    assert pairs(decode(b"data: [DONE]\n")) == [(None, "[DONE]")]


def test_invalid_utf8_split_across_chunks():
    good = "data: é€\n\n".encode()
    for i in range(len(good) + 1):
        events = decode(good[:i], good[i:])
        assert pairs(events) == [(None, "é€")] and not events[0].malformed
    bad = b"data: \xe2\x82\n\ndata: ok\n\n"  # a truncated 3-byte sequence
    for i in range(len(bad) + 1):
        events = decode(bad[:i], bad[i:])
        assert [e.malformed for e in events] == [True, False]
        assert events[0].data == "\ufffd" and events[1].data == "ok"


def test_byte_order_mark_and_fields():
    events = decode(b"\xef\xbb\xbfid: 7\nretry: 100\nevent: e\ndata: d\n\n")
    assert pairs(events) == [("e", "d")] and events[0].id == "7" and events[0].retry == 100
    assert decode(b"data\n\n")[0].data == ""  # a field with no colon has an empty value


def test_events_without_data_are_dropped():
    assert decode(b"\n\n\nid: 1\n\nevent: named-but-empty\n\n") == []


def test_encode_round_trips():
    events = [SSEEvent("message_start", '{"a": 1}'), SSEEvent(None, "two\nlines")]
    assert pairs(decode(b"".join(e.encode() for e in events))) == pairs(events)


def test_bytes_seen_counts_everything():
    d = SSEDecoder()
    d.feed(b"data: 1\n")
    d.feed(b"\n")
    assert d.bytes_seen == 9


STREAM = (
    b"event: a\r\ndata: one\r\n\r\n: comment\n"
    b"data: x\rdata: y\r\r"
    b"data: \xc3\xa9t\xc3\xa9\n\n"
    b"event: last\ndata: {\"k\": \"\xe2\x82\xac\"}"
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(STREAM)), max_size=20))
def test_any_chunking_gives_the_same_events(cuts):
    points = sorted({0, len(STREAM), *cuts})
    chunks = [STREAM[a:b] for a, b in zip(points, points[1:])]
    assert pairs(decode(*chunks)) == [("a", "one"), (None, "x\ny"), (None, "été"), ("last", '{"k": "€"}')]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(STREAM)), max_size=20))
def test_idle_says_exactly_when_the_decoder_is_between_events(cuts):
    """``idle`` (the Tee then lets a dialect read a whole event from its bytes) is kept by
    ``feed``: true exactly when nothing is pending, whatever the chunking; and then a chunk
    that is one whole event dispatches it and leaves the decoder idle."""
    points = sorted({0, len(STREAM), *cuts})
    d = SSEDecoder()
    for a, b in zip(points, points[1:]):
        d.feed(STREAM[a:b])
        between = (d._started and not d._line and not d._pending_cr and not d._has_data and d._event is None
                   and d._retry is None and not d._malformed)
        assert d.idle == between
        if d.idle:
            assert [ev.data for ev in d.feed(b'data: {"a":1}\n\n')] == ['{"a":1}'] and d.idle


_PIECES = st.lists(st.sampled_from([b"\n", b"\n\n", b"\r", b"\r\n", b"data: ", b"x", b"1,2,3,"]), max_size=30)


@settings(max_examples=400, deadline=None)
@given(_PIECES, st.integers(0, 2), st.integers(0, 40))
def test_the_memchr_scans_equal_the_bytes_methods(pieces, long, pos):
    """``blank``, ``lf_split`` and ``lines_kept`` are ``find(b"\\n\\n")``, ``split(b"\\n")`` and
    ``splitlines(keepends=True)``, for short chunks (the C methods) and long ones (a memchr
    per line: vLLM's first chunk of a long conversation), whatever line endings they hold."""
    data = b"".join(pieces)
    if long:  # past the length where the scans go line by line, the lines at either end
        filler = b"4," * (sse._LONG // 2)
        data = filler + data if long == 1 else data + filler
    assert blank(data, pos) == data.find(b"\n\n", pos)
    assert lf_split(data) == data.split(b"\n")
    assert lines_kept(data) == data.splitlines(keepends=True)

"""The relay passes an upstream's answer on as it arrives (addons/gateway/transport/framing.py).

The relay does not decode and re-encode an answer's chunks one by one: it tracks
where the body ends itself and passes each read's body bytes on, a chunked body as one chunk
per read. What must hold whatever the framing:
the harness gets the whole answer, the turn is recorded whole, a kept-alive upstream connection
is reused (a close-delimited one is not), an answer the harness abandons is still read to its
end and recorded from the tracked body, and a malformed body breaks the exchange instead of
reaching the harness as a whole answer. The tracker's own edge cases are checked in process
over every split of the bytes (a read can end anywhere).
"""

from __future__ import annotations

import json

import h11
import httpx2 as httpx
import pytest
from hypothesis import given, settings, strategies as st

from clients import session_clients
from interceptor.addons.gateway.transport.framing import CHUNKED, CLOSE, LENGTH, Body, FramingError, read_head
from interceptor.addons.gateway.transport.relay import DOWN_READ
from interceptor.trace import read_trace
from provider import Reply
from waiting import wait_until

MESSAGES = [{"role": "user", "content": "count"}]
FRAMINGS = [None, "extensions", "split", "close"]
PIECES = ["one ", "two ", "three ", "four"]


# -- the tracker, in process ---------------------------------------------------------------

CHUNKED_BODY = (b"4\r\nWiki\r\n5;name=value;q=\"a b\"\r\npedia\r\nE\r\n in\r\n\r\nchunks.\r\n"
                b"0;end\r\nx-trailer: 1\r\nx-other: two\r\n\r\n")


def fed(frame: Body, wire: bytes, cuts: list[int], passed: bytearray | None = None) -> tuple[bytes, int]:
    """Feed ``wire`` cut at ``cuts``: the body tracked, and the bytes that belonged to the
    answer; what is passed on appended to ``passed``."""
    body, used, start = bytearray(), 0, 0
    for end in [*cuts, len(wire)]:
        n = frame.feed(wire[start:end], body)
        if passed is not None:
            passed += frame.passed(wire[start:end], n)
        used += n
        start = end
    return bytes(body), used


@pytest.mark.parametrize("tail", [b"", b"HTTP/1.1 200 OK\r\n"])
def test_every_split_of_a_chunked_body_tracks_the_same_body_and_end(tail):
    """Extensions, trailers, a chunk that contains CRLF; the answer's end found at every
    split into two or three reads, nothing after it taken (a pipelined next answer), and what
    is passed on the wire as sent but for the trailers (mitmproxy cannot read them)."""
    wire = CHUNKED_BODY + tail
    n = len(wire)
    splits = [[i] for i in range(n + 1)] + [[i, j] for i in range(0, n, 3) for j in range(i, n + 1, 5)]
    for cuts in splits:
        frame, passed = Body(CHUNKED), bytearray()
        body, used = fed(frame, wire, cuts, passed)
        assert frame.done, cuts
        assert (body, used) == (b"Wikipedia in\r\n\r\nchunks.", len(CHUNKED_BODY)), cuts
        assert bytes(passed) == CHUNKED_BODY[:CHUNKED_BODY.index(b"x-trailer")] + b"\r\n", cuts
    plain = CHUNKED_BODY[:CHUNKED_BODY.index(b"x-trailer")] + b"\r\n"
    for cut in range(len(plain) + 1):
        passed = bytearray()
        fed(Body(CHUNKED), plain, [cut], passed)
        assert bytes(passed) == plain, cut


def test_one_byte_at_a_time():
    frame, body = Body(CHUNKED), bytearray()
    for i in range(len(CHUNKED_BODY)):
        assert not frame.done
        assert frame.feed(CHUNKED_BODY[i:i + 1], body) == 1
    assert frame.done and bytes(body) == b"Wikipedia in\r\n\r\nchunks."
    assert frame.passed(b"\n", 1) == b"\r\n"  # the blank line that ends it, in the trailers' place


def test_a_read_of_many_whole_chunks_is_the_same_as_a_byte_at_a_time():
    """A stream's usual read (many whole chunks, one event each, an extension, a chunk with
    CRLF in it, the last chunk) takes the tracker's shortcut: the same body, end and bytes
    passed on as when every byte is a read of its own (the general steps)."""
    events = [b'data: {"delta":"w%d "}\n\n' % k for k in range(40)] + [b"a\r\n\r\nb", b"data: [DONE]\n\n"]
    wire = b"".join(b"%x%s\r\n%s\r\n" % (len(e), b";x=1" if k == 7 else b"", e) for k, e in enumerate(events))
    wire += b"0\r\n\r\n"
    whole, passed = Body(CHUNKED), bytearray()
    body, used = fed(whole, wire, [], passed)
    assert whole.done and (body, used) == (b"".join(events), len(wire)) and bytes(passed) == wire
    assert fed(Body(CHUNKED), wire, list(range(1, len(wire)))) == (body, used)
    # a read that ends inside a chunk, or right after its data (before its CRLF)
    for cut in (5, len(wire) // 2, wire.index(b"\r\n", 30) - 1, wire.index(b"\r\n", 30)):
        assert fed(Body(CHUNKED), wire, [cut]) == (body, used), cut


def test_whole_counts_a_read_of_whole_chunks_only():
    """``whole``: the chunks of a read that was whole chunks from a chunk's start to a chunk's
    end (the relay passes a read of one such chunk on as it came, a paced stream's usual read,
    instead of framing its body again); 0 for a read that cuts a chunk, starts inside one,
    holds the last chunk, or follows a read that ended inside one."""
    one, two = b"5\r\nhello\r\n", b"3;x=1\r\nabc\r\n"
    frame, body = Body(CHUNKED), bytearray()
    seen = []
    for read in (one, one + two, one[:4], one[4:], two, two[:-1], b"\n", one + b"0\r\n\r\n"):
        frame.feed(read, body)
        seen.append(frame.whole)
    assert seen == [1, 2, 0, 0, 1, 0, 0, 0] and frame.done
    assert bytes(body) == b"hello" * 2 + b"abc" + b"hello" + b"abc" * 2 + b"hello"


@pytest.mark.parametrize("wire", [
    b"4x\r\nWiki\r\n0\r\n\r\n",  # not hex
    b"\r\nWiki\r\n0\r\n\r\n",  # no size
    b"4 \r\nWiki\r\n0\r\n\r\n",  # whitespace h11 refuses
    b"4\r\nWikiXY0\r\n\r\n",  # the chunk does not end with CRLF
    b"4\nWiki\r\n0\r\n\r\n",  # a bare LF
    b"4\r\nWiki\r\n0\r\nnot a header\r\n\r\n",  # a trailer without a colon
    b"123456789012345678901\r\n",  # more than 20 hex digits
])
def test_a_malformed_chunked_body_is_a_framing_error(wire):
    for cut in range(len(wire) + 1):
        with pytest.raises(FramingError):
            fed(Body(CHUNKED), wire, [cut])


def test_an_endless_chunk_header_is_refused():
    frame = Body(CHUNKED)
    with pytest.raises(FramingError):
        for _ in range(100):
            frame.feed(b"a" * 1000, bytearray())


def test_content_length_stops_at_its_length_and_a_cut_is_an_error():
    frame = Body(LENGTH, 10)
    assert fed(frame, b"0123456789HTTP/1.1", [3, 7]) == (b"0123456789", 10) and frame.done
    short = Body(LENGTH, 10)
    fed(short, b"01234", [2])
    with pytest.raises(FramingError):
        short.eof()
    cut = Body(CHUNKED)
    fed(cut, CHUNKED_BODY[:-3], [])
    with pytest.raises(FramingError):
        cut.eof()


def test_a_close_delimited_body_ends_with_the_connection():
    frame = Body(CLOSE)
    assert fed(frame, b"all of it", [3]) == (b"all of it", 9) and not frame.done
    frame.eof()
    assert frame.done


@pytest.mark.parametrize(("method", "status", "headers", "kind", "length"), [
    (b"POST", 200, [(b"transfer-encoding", b"chunked"), (b"content-length", b"5")], CHUNKED, 0),
    (b"POST", 200, [(b"content-length", b"5")], LENGTH, 5),
    (b"POST", 200, [(b"content-type", b"text/event-stream")], CLOSE, 0),
    (b"POST", 204, [(b"content-length", b"5")], LENGTH, 0),
    (b"POST", 304, [(b"transfer-encoding", b"chunked")], LENGTH, 0),
    (b"HEAD", 200, [(b"content-length", b"5")], LENGTH, 0),
])
def test_the_framing_is_h11s(method, status, headers, kind, length):
    frame = Body.of(method, status, headers)
    assert (frame.kind, frame.left) == (kind, length)
    assert frame.done == (kind == LENGTH and length == 0)


# -- the head, against h11 -------------------------------------------------------------------

def h11_head(data: bytes, limit: int):
    """What h11 reads from ``data`` as a client's answer: ("head", version, status, reason,
    lower-case headers, raw headers, the bytes after it), "incomplete", or "error"."""
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=limit)
    conn.send(h11.Request(method=b"POST", target=b"/", headers=[(b"host", b"relay")]))
    if data:  # b"" would tell it the connection closed
        conn.receive_data(data)
    try:
        event = conn.next_event()
    except h11.ProtocolError:
        return "error"
    if event is h11.NEED_DATA:
        return "incomplete"
    return ("head", event.http_version, event.status_code, event.reason, list(event.headers),
            list(event.headers.raw_items()), conn.trailing_data[0])


def our_head(data: bytes, limit: int):
    try:
        got = read_head(data, limit)
    except FramingError:
        return "error"
    if got is None:
        return "incomplete"
    head, used = got
    return ("head", head.http_version, head.status_code, head.reason, head.headers, head.fields, data[used:])


NAMES = [b"Content-Length", b"content-length", b"Transfer-Encoding", b"Content-Type", b"X-Req", b"x y", b"",
         b"a\x00", b"Connection", b"x-\xc3\xa9"]
VALUES = [b"5", b"5, 5", b"5,6", b" 7 ", b"-1", b"", b"chunked", b"Chunked", b"gzip, chunked", b"a  b",
          b"text/event-stream", b"x\x00y", b"\xc3\xa9t\xc3\xa9", b"close", b"1" * 21, b"a\tb", b"a\rb"]
STATUS = [b"HTTP/1.1 200 OK", b"HTTP/1.0 200 OK", b"HTTP/1.1 204", b"HTTP/1.1 200 ", b"HTTP/2.0 200 OK",
          b"HTTP/1.1 99 X", b"HTTP/1.1 100 Continue", b"HTTP/1.1 101 Switching", b"HTTP/1.1 999 Odd",
          b"HTTP/1.1 20 OK", b"HTTP/1.1  200 OK", b"http/1.1 200 OK", b"HTTP/1.1 200 r\xc3\xa9ason\tx",
          b" HTTP/1.1 200 OK", b"HTTP/1.1 200 OK\x00", b"ICY 200 OK"]
line_st = st.one_of(
    st.builds(lambda n, sep, v: n + sep + v, st.sampled_from(NAMES), st.sampled_from([b": ", b":", b" : ", b":\t"]),
              st.sampled_from(VALUES)),
    st.sampled_from([b" folded", b"\tfolded too", b"no colon"]),
)


@settings(max_examples=400, deadline=None)
@given(status=st.sampled_from(STATUS), lines=st.lists(line_st, max_size=6),
       eol=st.sampled_from([b"\r\n", b"\n"]), lead=st.sampled_from([b"", b"\r\n"]),
       tail=st.sampled_from([b"", b"body", b"HTTP/1.1 200 OK\r\n\r\n"]), cut=st.integers(0, 400))
def test_the_head_is_read_as_h11_reads_it(status, lines, eol, lead, tail, cut):
    """Generated heads, valid and broken (bad names, values, folding, conflicting lengths,
    transfer codings, status lines, bare LF endings), whole or cut short: read_head and
    h11 agree on every field, on what follows the head, on "incomplete" and on "error"."""
    data = lead + status + eol + b"".join(line + eol for line in lines) + eol + tail
    for piece in (data, data[:cut]):
        assert our_head(piece, 1 << 20) == h11_head(piece, 1 << 20), piece


@pytest.mark.parametrize("fields", [
    [b"Content-Length: 5"], [b"Content-Length: -1"], [b"Content-Length: 5, 5"], [b"Content-Length: 5, 6"],
    [b"Content-Length: 5", b"content-length: 5"], [b"Content-Length: 5", b"Content-Length: 6"],
    [b"Content-Length: " + b"1" * 21], [b"Content-Length: 0x5"], [b"Content-Length:"],
    [b"Transfer-Encoding: chunked"], [b"Transfer-Encoding: Chunked"], [b"Transfer-Encoding: gzip, chunked"],
    [b"Transfer-Encoding: chunked", b"Transfer-Encoding: chunked"], [b"Transfer-Encoding: chunked", b"Content-Length: 5"],
    [b" folded first"], [b"X-A: one", b" two", b"\tthree"], [b"X-A : one"], [b"X-A: o\x00ne"], [b"X A: one"],
    [b"X-A:   spaced   "], [b"X-A: r\xc3\xa9sum\xc3\xa9"], [b"X-A: a\x0bb"], [b":no-name"],
])
@pytest.mark.parametrize("status", [b"HTTP/1.1 200 OK", b"HTTP/1.1 101 Switching Protocols", b"HTTP/1.1 099 X",
                                    b"HTTP/1.1 100 Continue", b"HTTP/1.0 304"])
def test_each_check_of_the_head_is_h11s(status, fields):
    """Each rule spelt out once (the generated heads above rarely combine a valid head with
    exactly one broken field): read_head and h11 give the same head or both refuse."""
    for eol in (b"\r\n", b"\n"):
        data = status + eol + b"".join(f + eol for f in fields) + eol + b"rest"
        assert our_head(data, 1 << 20) == h11_head(data, 1 << 20), data


def test_a_head_over_the_limit_is_refused_while_incomplete():
    head = b"HTTP/1.1 200 OK\r\n" + b"x-pad: " + b"a" * 5000 + b"\r\n"
    assert our_head(head, 4096) == h11_head(head, 4096) == "error"
    assert our_head(head, 1 << 20) == h11_head(head, 1 << 20) == "incomplete"


# -- through a real mitmdump -----------------------------------------------------------------

def turns(proxy, session):
    proxy.api("DELETE", f"sessions/{session['id']}")
    return read_trace(session["trace_path"])


def chat(client: httpx.Client, session: dict, stream: bool) -> str:
    """One chat turn read to the end of its body (an SDK stops reading at ``[DONE]``, which
    with the terminal chunk written apart would make it a client that left), its text."""
    r = client.post("https://api.openai.com/v1/chat/completions",
                    json={"model": "gpt-4.1", "messages": MESSAGES, "stream": stream},
                    headers={"authorization": f"Bearer {session['model_secret']}"})
    assert r.status_code == 200, r.text[:300]
    if not stream:
        return r.json()["choices"][0]["message"]["content"]
    return sse_text(r.text)


def sse_text(body: str) -> str:
    """The text a Chat Completions stream's events carry."""
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    return "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])


@pytest.mark.parametrize("framing", FRAMINGS)
def test_every_framing_reaches_the_harness_whole_and_is_recorded(framing, sim, proxy, new_session):
    """JSON and SSE answers, twice each, in every framing, on one client connection; after the
    first turn, no new upstream connection (the pooled one is reused), except when the answer
    is close-delimited (a connection per turn)."""
    sim.script(*[Reply(text=PIECES, framing=framing) for _ in range(4)])
    session = new_session()
    opened = lambda: sim.connections()["accepted"] - sim.connections()["probes"]  # noqa: E731
    with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=30) as client:
        assert chat(client, session, False) == "".join(PIECES)
        before = opened()  # (and Reach's first look at the upstream)
        assert chat(client, session, True) == "".join(PIECES)
        assert chat(client, session, False) == "".join(PIECES)
        assert chat(client, session, True) == "".join(PIECES)
    assert opened() - before == (3 if framing == "close" else 0)
    trace = turns(proxy, session)
    assert trace.num_turns == 4, trace.calls
    assert all(c.error is None and c.delivered is not False for c in trace.calls), trace.calls
    assert [trace.nodes[c.node].message.text() for c in trace.calls] == ["".join(PIECES)] * 4


@pytest.mark.parametrize("framing", FRAMINGS)
def test_an_abandoned_answer_in_any_framing_is_read_to_its_end_and_recorded(framing, sim, proxy, new_session, harness_env):
    """The client stops after the first event; the rest comes 0.3 s apart: the Drain finishes
    the answer from the body it tracked, and the SDK's retry is answered from the record."""
    sim.script(Reply(text=PIECES, delay=0.3, framing=framing))
    session = new_session()
    harness_env(session["env"])
    oai, _ = session_clients(session)
    stream = oai.chat.completions.create(model="gpt-4.1", messages=MESSAGES, stream=True)
    next(iter(stream))
    stream.close()
    wait_until(lambda: read_trace(session["trace_path"]).calls, 15, "the abandoned answer on the record")
    flag = {"x-stainless-retry-count": "1"}
    with oai.chat.completions.stream(model="gpt-4.1", messages=MESSAGES, extra_headers=flag) as s:
        assert s.get_final_completion().choices[0].message.content == "".join(PIECES)
    assert len(sim.model_requests()) == 1
    trace = turns(proxy, session)
    call = next(c for c in trace.calls if c.node is not None)
    assert trace.num_turns == 1 and call.delivered is False and call.error is None
    assert trace.nodes[call.node].message.text() == "".join(PIECES)


def test_events_that_reach_the_relay_together_go_on_as_one_chunk(sim, proxy, new_session):
    """80 events written at once (``framing="burst"``): the harness reads the same events in a
    few chunks, not 80 (mitmproxy's work per chunk is then per read, ``addons/gateway/transport/relay.py``), and
    the turn is recorded whole. An event that arrives alone still goes at once: the paced
    answer is read as one chunk per event."""
    pieces = [f"w{k} " for k in range(80)]
    sim.script(Reply(text=pieces, framing="burst"), Reply(text=pieces[:6], delay=0.05))
    session = new_session()
    payload = {"model": "gpt-4.1", "messages": MESSAGES, "stream": True}
    got = []
    with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=30) as client:
        for _ in range(2):
            with client.stream("POST", "https://api.openai.com/v1/chat/completions", json=payload,
                               headers={"authorization": f"Bearer {session['model_secret']}"}) as r:
                assert r.status_code == 200
                got.append(list(r.iter_raw()))
    body = b"".join(got[0])
    assert sse_text(body.decode()) == "".join(pieces) and body.endswith(b"data: [DONE]\n\n")
    assert len(got[0]) <= 4, [len(c) for c in got[0]]
    assert len(got[1]) >= 6, [len(c) for c in got[1]]  # paced: nothing waits for company
    trace = turns(proxy, session)
    assert [trace.nodes[c.node].message.text() for c in trace.calls] == ["".join(pieces), "".join(pieces[:6])]


def test_a_malformed_chunk_breaks_the_answer_and_is_never_a_whole_one(sim, proxy, new_session):
    """An upstream whose chunk header is not hex: the harness sees the body cut (as mitmproxy
    would show a broken upstream), the record an error, and nothing is sent again."""
    bad = b'{"x": 1}'
    sim.script(Reply(raw=b"zz\r\n" + bad, content_type="application/json", chunked=False,
                     headers={"transfer-encoding": "chunked"}))
    session = new_session()
    with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=30) as client:
        r = client.post("https://api.openai.com/v1/chat/completions", json={"model": "gpt-4.1", "messages": MESSAGES},
                        headers={"authorization": f"Bearer {session['model_secret']}"})
    assert r.status_code >= 500 and bad not in r.content, (r.status_code, r.content[:200])
    assert len(sim.model_requests()) == 1
    trace = turns(proxy, session)
    assert trace.num_turns == 0 and [c.error is not None for c in trace.calls] == [True]


def test_the_request_leaves_the_relay_without_its_ticket_and_framed_by_its_length(sim, proxy, new_session):
    """The relay writes the upstream request itself: mitmproxy's request as it came, the
    ticket (the relay's own header) never sent, one Host, one Content-Length that is the body's."""
    sim.script(Reply(text="ok"))
    session = new_session()
    with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=30) as client:
        assert chat(client, session, False) == "ok"
    [seen] = sim.model_requests()
    names = [k.lower() for k, _ in seen.headers.items()]
    assert "x-interceptor-relay" not in names
    assert names.count("host") == 1 and names.count("content-length") == 1 and "transfer-encoding" not in names
    assert int(seen.headers["content-length"]) == len(seen.body) and seen.json["messages"] == MESSAGES


def test_a_body_larger_than_the_relays_reads_reaches_the_upstream_byte_for_byte(sim, proxy, new_session):
    """A request body the relay reads from mitmproxy in several reads (3 MB of non-ASCII
    history, past ``DOWN_READ``) and writes after its head without joining them: the upstream
    gets exactly the harness's bytes under one Content-Length, and the next turn on the same
    connections goes through too (the relay's connection to mitmproxy kept in step)."""
    sim.script(Reply(text="ok"), Reply(text="again"))
    session = new_session()
    history = [{"role": "user" if k % 2 == 0 else "assistant", "content": f"{k} ünïcødé → " + "x" * 3000}
               for k in range(1000)]
    bodies = [json.dumps({"model": "gpt-4.1", "messages": history + [{"role": "user", "content": q}]},
                         ensure_ascii=False, indent=1).encode() for q in ("one", "two")]
    assert len(bodies[0]) > 2 * DOWN_READ
    with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=60) as client:
        for body, text in zip(bodies, ("ok", "again")):
            r = client.post("https://api.openai.com/v1/chat/completions", content=body,
                            headers={"authorization": f"Bearer {session['model_secret']}",
                                     "content-type": "application/json"})
            assert r.status_code == 200, r.text[:300]
            assert r.json()["choices"][0]["message"]["content"] == text
    seen = sim.model_requests()
    assert [s.body for s in seen] == bodies
    assert all(int(s.headers["content-length"]) == len(b) for s, b in zip(seen, bodies))
    assert turns(proxy, session).num_turns == 2

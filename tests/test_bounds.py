"""What an upstream answer may cost the proxy is bounded by options, whatever it sends: a
compression bomb (1 MB of gzip, br or zstd inflating to 1 GB), JSON or SSE, and an SSE event
of 100 MB without a newline. The proxy's peak memory (VmHWM of the real mitmdump) stays far
below the answer's decoded size, the call is on the record with what was cut, the harness
gets the upstream's bytes as they came, and another session's stream at the same time ends
whole. The decoders' and the SSE parser's own bounds are tested in-process first."""

from __future__ import annotations

import gzip
import hashlib
import json
import ssl
import threading
import zlib
from types import SimpleNamespace

import brotli
import httpx
import openai
import pytest
import zstandard
from hypothesis import given, settings, strategies as st

from interceptor.addons.gateway.answer.collect import StripStream
from interceptor.dialects.vllm import ChatTokens
from interceptor.dialects.encoding import PIECE, Decoder, TooLarge
from interceptor.dialects.sse import EventTooLarge, SSEDecoder
from interceptor.trace import read_trace
from provider import Reply

MB = 1 << 20
GB = 1 << 30
BLOCK = b"a" * MB

JSON_HEAD = (b'{"id":"chatcmpl-bomb","object":"chat.completion","created":1,"model":"m","choices":'
             b'[{"index":0,"finish_reason":"stop","message":{"role":"assistant","content":"')
SSE_EVENT = (b'data: {"id":"chatcmpl-bomb","object":"chat.completion.chunk","created":1,"model":"m",'
             b'"choices":[{"index":0,"delta":{"content":"' + b"a" * 4000 + b'"},"finish_reason":null}]}\n\n')


def _compress(name: str, head: bytes, block: bytes, count: int) -> bytes:
    """``head`` then ``block`` ``count`` times, compressed as it goes (the bomb is never whole here)."""
    if name == "gzip":
        z = zlib.compressobj(6, wbits=31)
        out = [z.compress(head)] + [z.compress(block) for _ in range(count)] + [z.flush()]
    elif name == "br":
        c = brotli.Compressor(quality=5)
        out = [c.process(head)] + [c.process(block) for _ in range(count)] + [c.finish()]
    else:
        c = zstandard.ZstdCompressor(level=3).compressobj()
        out = [c.compress(head)] + [c.compress(block) for _ in range(count)] + [c.flush()]
    return b"".join(out)


_BOMBS: dict[tuple[str, str], bytes] = {}


def bomb(name: str, kind: str) -> bytes:
    """A 1 GB answer (JSON: one huge string; SSE: 1 GB of ordinary events) compressed with ``name``."""
    if (name, kind) not in _BOMBS:
        if kind == "json":
            _BOMBS[name, kind] = _compress(name, JSON_HEAD, BLOCK, GB // MB)
        else:
            events = SSE_EVENT * (MB // len(SSE_EVENT) + 1)
            _BOMBS[name, kind] = _compress(name, b"", events, GB // len(events) + 1)
    return _BOMBS[name, kind]


# -- in-process: the decoders and the SSE parser -------------------------------------------

@pytest.mark.parametrize("name", ["gzip", "br", "zstd", "deflate"])
def test_a_bomb_decodes_a_piece_at_a_time_and_stops_at_its_limit(name):
    data = (zlib.compress(JSON_HEAD + BLOCK * 1024, 6) if name == "deflate" else bomb(name, "json"))
    assert len(data) < 2 * MB
    decoder = Decoder.for_encoding(name, 16 * MB)
    seen = 0
    with pytest.raises(TooLarge, match="passed 16777216 bytes"):
        for i in range(0, len(data), 4096):  # as the network gives it
            for piece in decoder.pieces(data[i:i + 4096]):
                assert len(piece) <= 2 * PIECE  # brotli stops growing its buffer once past the limit
                seen += len(piece)
    assert 16 * MB - 2 * PIECE <= seen <= 16 * MB  # the piece that passed it is never handed on
    # Without a limit the pieces are as small, and the bytes the same as decoding at once.
    small = _compress(name, b"", b"xyz" * 100_000, 3) if name != "deflate" else zlib.compress(b"xyz" * 300_000)
    pieces = list(Decoder.for_encoding(name).pieces(small))
    assert max(map(len, pieces)) <= 2 * PIECE and b"".join(pieces) == b"xyz" * 300_000


def test_a_chain_of_codings_is_bounded_in_each():
    inner = bomb("gzip", "json")
    outer = brotli.compress(inner, quality=1)
    decoder = Decoder.for_encoding("gzip, br", 8 * MB)
    with pytest.raises(TooLarge):
        decoder.decode(outer)


def test_an_sse_line_or_event_past_max_event_raises_and_smaller_ones_pass():
    ok = SSEDecoder(max_event=1000)
    assert [e.data for e in ok.feed(b"data: " + b"x" * 900 + b"\n\n")] == ["x" * 900]
    endless = SSEDecoder(max_event=1000)
    endless.feed(b"data: " + b"x" * 600)
    with pytest.raises(EventTooLarge, match="a line"):
        endless.feed(b"x" * 600)  # no newline in sight
    many = SSEDecoder(max_event=1000)
    with pytest.raises(EventTooLarge, match="an event"):
        for _ in range(20):
            many.feed(b"data: " + b"y" * 90 + b"\n")  # lines, but never the blank one
    # The size is per event: many small events never add up.
    stream = SSEDecoder(max_event=1000)
    for _ in range(100):
        assert len(stream.feed(b"data: " + b"z" * 500 + b"\n\n")) == 1


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=3000), st.sampled_from(["gzip", "br", "zstd", "deflate", "identity"]),
       st.integers(0, 4000), st.lists(st.integers(0, 3000), max_size=6), st.integers(-2, 2), st.booleans())
def test_any_split_decodes_the_same_bytes_up_to_the_limit(data, name, limit, cuts, slack, near):
    """Whatever the network's chunks: the pieces are the body's bytes in order, and the
    decoder raises exactly when the body passes the limit (0: never)."""
    if near:  # the limit at the body's size, or a byte or two either side
        limit = max(0, len(data) + slack)
    encoded = {"gzip": gzip.compress,
               "br": brotli.compress, "zstd": zstandard.ZstdCompressor().compress,
               "deflate": zlib.compress, "identity": lambda d: d}[name](data)
    decoder = Decoder.for_encoding(name, limit)
    got = bytearray()
    bounds = sorted({0, len(encoded), *(c for c in cuts if c < len(encoded))})
    try:
        for start, end in zip(bounds, bounds[1:]):
            for piece in decoder.pieces(encoded[start:end]):
                got += piece
        got += decoder.flush()
    except TooLarge:
        assert limit and len(data) > limit and data.startswith(bytes(got))
        return
    assert bytes(got) == data and (not limit or len(data) <= limit)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 300), min_size=1, max_size=4), min_size=1, max_size=6),
       st.integers(1, 1500), st.lists(st.integers(0, 5000), max_size=6))
def test_an_sse_event_bound_holds_for_any_split(events, bound, cuts):
    """Wherever the chunks split the stream: what the parser holds between chunks never
    passes ``max_event`` (an event finished within one chunk is that chunk's), it raises only
    for an event past it, and below it the events are the same as without a bound."""
    stream = b"".join(b"".join(b"data: " + b"x" * n + b"\n" for n in lines) + b"\n" for lines in events)
    largest = max(sum(6 + n for n in lines) for lines in events)
    decoder, got = SSEDecoder(max_event=bound), []
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    try:
        for start, end in zip(bounds, bounds[1:]):
            got += decoder.feed(stream[start:end])
            assert len(decoder._line) <= bound and decoder._size <= bound
    except EventTooLarge:
        assert largest > bound
        return
    assert [e.data for e in got] == ["\n".join("x" * n for n in lines) for lines in events]


class _Tee:
    """Stands for the Tee inside Collect's strip: its bounds, the chunk passed on."""

    def __init__(self, limit: int, max_event: int) -> None:
        self.decoder = SimpleNamespace(limit=limit)
        self.sse = SimpleNamespace(max_event=max_event)

    def __call__(self, chunk: bytes) -> bytes:
        return chunk


@pytest.mark.parametrize("case", ["bomb", "event"])
def test_collects_strip_holds_no_more_than_the_tee_and_ends_the_stream_there(case):
    """Token fields cannot be stripped past a bound: the harness's stream ends there (the
    Tee's record says so), never a decoded bomb in memory, never an exception to mitmproxy."""
    ex = SimpleNamespace(committed=False, session=SimpleNamespace(id="s"))
    if case == "bomb":
        data, encoding, strip = bomb("gzip", "sse"), "gzip", StripStream(_Tee(8 * MB, 0), ex, ChatTokens(True, True), "gzip")
    else:
        data, encoding = SSE_EVENT * 3 + b"data: " + b"x" * 5000, None
        strip = StripStream(_Tee(0, 4096), ex, ChatTokens(True, True), None)
    out = [strip(data[i:i + 65536]) for i in range(0, min(len(data), 4 * MB), 65536)] + [strip(b"")]
    sent = sum(len(p) for c in out for p in c)
    assert strip.cut and out[-1] == [] and sent <= 8 * MB
    if case == "event":
        assert sent == 3 * len(SSE_EVENT)  # the whole events before it went on


# -- through the real proxy ----------------------------------------------------------------

def _calm(proxy, session, key: str, events: int = 40) -> tuple[threading.Thread, dict]:
    """Another session's paced stream, in a thread: what it read, once it ends."""
    got: dict = {}

    def run():
        client = openai.OpenAI(api_key=session["model_secret"], max_retries=0, timeout=120,
                               default_headers={"x-sim-key": key},
                               http_client=httpx.Client(proxy=proxy.url, verify=ssl.create_default_context(
                                                                  cafile=str(proxy.ca_bundle))))
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
        got["text"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, got


def _raw(proxy, session, key: str, stream: bool) -> tuple[int, int, str, dict]:
    """POST a chat request and read the answer's bytes as they came (never decoded here)."""
    context = ssl.create_default_context(cafile=str(proxy.ca_bundle))
    body = {"model": "m", "messages": [{"role": "user", "content": "bomb"}], "stream": stream}
    digest, size = hashlib.sha256(), 0
    with httpx.Client(proxy=proxy.url, verify=context, timeout=300) as client:
        with client.stream("POST", "https://api.openai.com/v1/chat/completions", json=body,
                           headers={"authorization": f"Bearer {session['model_secret']}", "x-sim-key": key,
                                    "accept-encoding": "gzip, br, zstd"}) as resp:
            for data in resp.iter_raw():
                digest.update(data)
                size += len(data)
            return resp.status_code, size, digest.hexdigest(), dict(resp.headers)


def _cut_call(proxy, session):
    proxy.api("DELETE", f"sessions/{session['id']}")
    trace = read_trace(session["trace_path"])
    (call,) = [c for c in trace.calls if c.error is not None]
    assert call.error.type == "answer_too_large", call.error
    return trace, call


def _through_the_proxy(proxy, new_session, sim, reply: Reply, sent: bytes, stream: bool, option: str):
    bombed, calm = new_session(model="m"), new_session(model="m")
    sim.script(reply, key="bomb")
    sim.script(Reply(text=[f"w{i} " for i in range(40)], delay=0.02), key="calm")
    before = proxy.memory()
    thread, got = _calm(proxy, calm, "calm")
    status, size, digest, headers = _raw(proxy, bombed, "bomb", stream)
    thread.join(120)
    after = proxy.memory()
    # The harness got the upstream's bytes as they came.
    assert status == 200 and size == len(sent) and digest == hashlib.sha256(sent).hexdigest()
    # The proxy's peak grew by far less than the answer's decoded size.
    assert after["VmHWM"] - before["VmHWM"] < 300 * MB, (before, after)
    # Another session's stream at the same time ended whole.
    assert got.get("text") == "".join(f"w{i} " for i in range(40)), got
    trace, call = _cut_call(proxy, bombed)
    assert option in call.error.message and "unchanged" in call.error.message
    assert trace.num_turns == 0
    return headers


@pytest.mark.parametrize("name", ["gzip", "br", "zstd"])
def test_a_json_bomb_costs_bounded_memory_and_is_on_the_record(proxy, new_session, sim, name):
    data = bomb(name, "json")
    reply = Reply(raw=data, content_type="application/json", content_encoding=name, encoded=True)
    headers = _through_the_proxy(proxy, new_session, sim, reply, data, False, "intercept_max_answer")
    assert headers.get("content-encoding") == name


@pytest.mark.parametrize("name", ["gzip", "br", "zstd"])
def test_an_sse_bomb_costs_bounded_memory_and_is_on_the_record(proxy, new_session, sim, name):
    data = bomb(name, "sse")
    reply = Reply(raw=data, content_type="text/event-stream", content_encoding=name, encoded=True)
    _through_the_proxy(proxy, new_session, sim, reply, data, True, "intercept_max_answer")


def test_a_100mb_sse_event_without_newline_costs_bounded_memory(proxy, new_session, sim):
    data = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"a" * (100 * MB)
    reply = Reply(raw=data, content_type="text/event-stream", encoded=True)
    _through_the_proxy(proxy, new_session, sim, reply, data, True, "intercept_max_event")


def test_a_json_error_bomb_is_not_passed_on(proxy, new_session, sim):
    """An error answer is read by the proxy (its message goes on the record and the status
    line): past the bound it is replaced by a 502 in the dialect's shape."""
    session = new_session(model="m")
    data = bomb("gzip", "json")
    sim.script(Reply(raw=data, status=500, content_type="application/json", content_encoding="gzip", encoded=True),
               key="bomb")
    before = proxy.memory()
    status, size, _, headers = _raw(proxy, session, "bomb", False)
    after = proxy.memory()
    assert status == 502 and size < 10_000 and "content-encoding" not in headers
    assert after["VmHWM"] - before["VmHWM"] < 300 * MB, (before, after)
    _, call = _cut_call(proxy, session)
    assert "502 instead" in call.error.message and call.status in (500, 502)


# -- a request body without Content-Length ---------------------------------------------------

def _tunnel(proxy) -> ssl.SSLSocket:
    """A TLS connection to api.openai.com through the proxy, as a harness opens one."""
    import socket

    raw = socket.create_connection(("127.0.0.1", proxy.port), timeout=60)
    raw.sendall(b"CONNECT api.openai.com:443 HTTP/1.1\r\nHost: api.openai.com:443\r\n\r\n")
    assert raw.recv(4096).startswith(b"HTTP/1.1 200")
    context = ssl.create_default_context(cafile=str(proxy.ca_bundle))
    return context.wrap_socket(raw, server_hostname="api.openai.com")


def test_a_chunked_body_past_the_cap_is_refused_while_it_is_still_sent(start_proxy, sim):
    """The body is never finished (no last chunk): the 413 can only come as the bytes arrive."""
    small = start_proxy({"intercept_max_body": "4m"})
    status, created = small.api("POST", "sessions", {"model": "m", "upstream": {"base_url": sim.url("/v1")}})
    conn = _tunnel(small)
    conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: api.openai.com\r\n"
                 b"authorization: Bearer " + created["model_secret"].encode() + b"\r\n"
                 b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
    piece = b"a" * MB
    for _ in range(12):  # three times the cap, and never the last chunk
        conn.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
    answer = b""
    while b"\r\n\r\n" not in answer:
        data = conn.recv(65536)  # the socket's timeout fails the test if nothing comes
        assert data, answer
        answer += data
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(rest) < length:
        rest += conn.recv(65536)
    error = json.loads(rest[:length])["error"]
    assert error["type"] == "invalid_request_error" and "intercept_max_body" in error["message"]
    assert created["model_secret"] not in rest.decode()
    conn.close()
    assert sim.requests == []
    status, summary = small.api("GET", f"sessions/{created['id']}")
    assert summary["oversized_requests"] == 1 and summary["calls"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_chunked_body_within_the_cap_goes_through_rewritten_and_recorded(start_proxy, sim, stream):
    small = start_proxy({"intercept_max_body": "4m"})
    status, created = small.api("POST", "sessions", {"model": "imposed", "upstream": {"base_url": sim.url("/v1")}})
    sim.script(Reply(text=["read ", "it"]))
    body = json.dumps({"model": "x", "stream": stream,
                       "messages": [{"role": "user", "content": "c" * (3 * MB)}]}).encode()

    def chunks():
        for i in range(0, len(body), 100_000):
            yield body[i:i + 100_000]

    context = ssl.create_default_context(cafile=str(small.ca_bundle))
    with httpx.Client(proxy=small.url, verify=context, timeout=60) as client:
        resp = client.post("https://api.openai.com/v1/chat/completions", content=chunks(),
                           headers={"authorization": f"Bearer {created['model_secret']}",
                                    "content-type": "application/json"})
    assert resp.status_code == 200, resp.text
    if stream:
        chunks = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "read it"
    else:
        assert resp.json()["choices"][0]["message"]["content"] == "read it"
    (req,) = sim.model_requests()
    assert req.json["model"] == "imposed" and len(req.json["messages"][0]["content"]) == 3 * MB
    assert "bearer " + created["model_secret"] not in str(req.headers).lower()
    small.api("DELETE", f"sessions/{created['id']}")
    trace = read_trace(created["trace_path"])
    assert trace.num_turns == 1 and trace.calls[0].error is None


def test_a_json_answer_read_whole_stops_at_the_bound(start_proxy, sim):
    """Fetch reads a JSON answer whole before mitmproxy gets it: past intercept_max_answer it
    reads no further, the harness gets a 502 it should not retry, and the call says why."""
    small = start_proxy({"intercept_max_answer": "16m"})
    status, created = small.api("POST", "sessions", {"model": "m", "upstream": {"base_url": sim.url("/v1")}})
    sim.script(Reply(raw=JSON_HEAD + b"a" * (200 * MB) + b'"}}]}', content_type="application/json"), key="big")
    before = small.memory()
    status, size, _, headers = _raw(small, created, "big", False)
    after = small.memory()
    assert status == 502 and size < 10_000 and headers["x-should-retry"] == "false"
    assert after["VmHWM"] - before["VmHWM"] < 100 * MB, (before, after)
    small.api("DELETE", f"sessions/{created['id']}")
    (call,) = read_trace(created["trace_path"]).calls
    assert "intercept_max_answer" in call.error.message and call.status == 502

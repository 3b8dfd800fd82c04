"""A streamed answer the relay reads is handed to mitmproxy as a read of its server connection,
not written down the loopback (``addons/handover.py``, issue 16).

What must hold: through a real mitmdump the answer reaches the harness whole and paced as it
came, is recorded, and never crosses mitmproxy's socket to the relay (the kernel's byte count
of that socket, ``tests/loopback.py``), and with ``intercept_relay_handover false`` it does;
mitmproxy's internals the handover relies on are the installed mitmproxy's (the same test:
``Handover.of`` finding none would send it down the loopback). In process: a piece that cannot
be handed over at once (mitmproxy's event lock taken) goes to the connection's reader, and so
does every piece after it while the reader holds bytes, so one answer's bytes keep their
order; a connection mitmproxy stopped reading takes nothing; the harness's unsent bytes are
the backpressure. The client-goes-away cases (tests/test_early_close.py, tests/test_fetch.py,
tests/test_retry.py) run through the handover, the default.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from pathlib import Path

import httpx2 as httpx
import pytest
from mitmproxy.connection import ConnectionState, Server
from mitmproxy.proxy import events
from mitmproxy.proxy.server import ConnectionIO

from interceptor.addons.handover import Handover
from interceptor.trace import read_trace
from provider import Reply

LOOPBACK = Path(__file__).with_name("loopback.py")
MESSAGES = [{"role": "user", "content": "count"}]
PIECES = [f"w{k} " for k in range(30)]


def read_stream(client: httpx.Client, url: str, secret: str, body: dict, http2: bool) -> tuple[str, list[float]]:
    """A streamed answer read to the end of its body (not closed at its last event, as the
    SDKs do, which races the chunked body's end and makes mitmproxy end the flow with an
    error): the text its deltas carry, and the gaps between the reads that brought them."""
    text, times = [], []
    headers = {"authorization": f"Bearer {secret}", "x-api-key": secret, "anthropic-version": "2023-06-01"}
    with client.stream("POST", url, json={**body, "stream": True}, headers=headers) as r:
        assert r.status_code == 200 and r.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
        rest = b""
        for raw in r.iter_raw():
            times.append(time.monotonic())
            *lines, rest = (rest + raw).split(b"\n")
            for line in lines:
                if line.startswith(b"data: {"):
                    event = json.loads(line[6:])
                    if "choices" in event:
                        text += [c["delta"].get("content") or "" for c in event["choices"]]
                    elif event.get("type") == "content_block_delta":
                        text.append(event["delta"].get("text", ""))
    return "".join(text), [b - a for a, b in zip(times, times[1:])]


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "http2"])
@pytest.mark.parametrize("handover", [True, False], ids=["handed-over", "loopback"])
def test_a_paced_stream_reaches_the_harness_whole_and_crosses_no_loopback(handover, http2, sim, start_proxy):
    """HTTP/2 too (Rust and Go SDKs): mitmproxy opens a connection to the relay per flow then."""
    proxy = start_proxy({"intercept_relay_handover": str(handover).lower()}, extra_scripts=[LOOPBACK])
    session = proxy.create_session(upstream={"base_url": sim.url("/v1")}, model="imposed")
    sim.script(*[Reply(text=PIECES, delay=0.01) for _ in range(4)])
    with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=30, http2=http2) as client:
        for _ in range(2):
            for url, body in (("https://api.openai.com/v1/chat/completions", {"model": "m", "messages": MESSAGES}),
                              ("https://api.anthropic.com/v1/messages",
                               {"model": "c", "max_tokens": 64, "messages": MESSAGES})):
                text, gaps = read_stream(client, url, session["model_secret"], body, http2)
                assert text == "".join(PIECES)
                assert len(gaps) >= len(PIECES) - 1 and sorted(gaps)[len(gaps) // 2] > 0.005  # paced, not at the end
    deadline = time.monotonic() + 10  # the last answer's hook may run just after the harness has it all
    while len(received := [int(n) for n in re.findall(r"DOWNLINK received=(\d+)", proxy.log())]) < 4:
        assert time.monotonic() < deadline, received
        time.sleep(0.05)
    assert len(received) == 4
    if handover:
        assert received == [0] * 4
    elif http2:  # each answer's bytes, on a connection of its own
        assert min(received) > 1000
    else:  # each answer's bytes; the count is per connection to the relay (one per host's tunnel)
        chat, messages = received[0::2], received[1::2]
        assert min(received) > 1000 and chat[1] > chat[0] and messages[1] > messages[0]
    status, _ = proxy.api("DELETE", f"sessions/{session['id']}")
    assert status == 200
    trace = read_trace(session["trace_path"])
    assert [c.status for c in trace.calls] == [200] * 4 and all(c.delivered for c in trace.calls)
    assert [trace.nodes[c.node].message.text() for c in trace.calls] == ["".join(PIECES)] * 4
    assert all(len(c.event_gaps_ms or []) >= len(PIECES) for c in trace.calls)


def test_a_failure_handing_the_answer_over_ends_it_as_an_error_on_the_record(sim, start_proxy, tmp_path):
    """A bug in the handover (tests/faults.py ``handover_fails``) mid-answer: the harness's
    stream is cut, the exchange is one error call on the record at once (not after
    ``intercept_drain_timeout``, with no one reading the upstream on), and the next turn is
    served."""
    faults = Path(__file__).with_name("faults.py")
    spec = tmp_path / "faults.json"
    spec.write_text(json.dumps({"handover_fails": 3}))  # the head and two pieces go down
    proxy = start_proxy({"faults_file": str(spec)}, extra_scripts=[faults])
    session = proxy.create_session(upstream={"base_url": sim.url("/v1")})
    sim.script(Reply(text=PIECES, delay=0.01), Reply(text=["after"]))
    url, body = "https://api.openai.com/v1/chat/completions", {"model": "m", "messages": MESSAGES}
    with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=30) as client:
        with pytest.raises(httpx.HTTPError):  # the body cut before its end
            read_stream(client, url, session["model_secret"], body, False)
        deadline = time.monotonic() + 10
        while not read_trace(session["trace_path"]).calls:
            assert time.monotonic() < deadline, "the failed exchange was never recorded"
            time.sleep(0.1)
        spec.write_text("{}")
        text, _ = read_stream(client, url, session["model_secret"], {**body, "messages": MESSAGES * 2}, False)
        assert text == "after"
    assert "passing the answer on failed" in proxy.log()
    status, _ = proxy.api("DELETE", f"sessions/{session['id']}")
    assert status == 200
    trace = read_trace(session["trace_path"])
    assert [c.error is not None for c in trace.calls] == [True, False] and trace.num_turns == 1


class Handler:
    """What ``Handover`` asks of mitmproxy's connection handler, with ``server_event``
    recording the events it is given, as mitmproxy's would run them."""

    def __init__(self, reader: asyncio.StreamReader, client) -> None:
        self.conn = Server(address=("127.0.0.1", 1))
        self.conn.state = ConnectionState.OPEN
        self.client = object()
        self.reading = asyncio.ensure_future(asyncio.Event().wait())  # mitmproxy's read loop of the connection
        self.transports = {self.conn: ConnectionIO(handler=self.reading, reader=reader),
                           self.client: ConnectionIO(writer=client)}
        self._server_event_lock = asyncio.Lock()
        self.got: list[bytes] = []

    async def server_event(self, event) -> None:
        async with self._server_event_lock:
            assert isinstance(event, events.DataReceived) and event.connection is self.conn
            self.got.append(event.data)


@contextlib.asynccontextmanager
async def handed():
    """A Handover to a fake handler whose client writer goes to a socket the harness (the
    reader yielded) reads only when the test does: (handover, handler, writer, harness)."""
    accepted = asyncio.Future()
    server = await asyncio.start_server(lambda r, w: accepted.set_result((r, w)), "127.0.0.1", 0)
    _, writer = await asyncio.open_connection(*server.sockets[0].getsockname())
    harness, far = await accepted
    reader = asyncio.StreamReader()
    handler = Handler(reader, writer)
    try:
        yield Handover(handler, handler.conn, handler.transports[handler.conn], writer), handler, writer, harness
    finally:
        handler.reading.cancel()
        writer.close()
        far.close()
        server.close()


def test_a_piece_that_cannot_be_handed_over_at_once_goes_to_the_reader_and_the_order_holds():
    async def main():
        async with handed() as (down, handler, _, _):
            reader = down.reader
            assert down.write(b"one") and handler.got == [b"one"]  # at once, in the caller's step
            await handler._server_event_lock.acquire()  # an event being handled (an eager task factory's)
            assert down.write(b"two") and handler.got == [b"one"]
            handler._server_event_lock.release()
            assert down.write(b"three") and handler.got == [b"one"]  # behind "two", in the reader
            assert down.fed == 2
            assert await reader.read(100) == b"twothree"  # mitmproxy's own read: in order
            assert down.write(b"four") and handler.got == [b"one", b"four"]
            handler.conn.state = ConnectionState.CAN_WRITE  # mitmproxy stopped reading it
            assert not down.write(b"five") and handler.got == [b"one", b"four"] and not reader._buffer
            handler.conn.state = ConnectionState.CAN_READ  # closed for writing only: still read
            assert down.write(b"six") and handler.got == [b"one", b"four", b"six"]
            handler.reading.cancel()  # its read loop ended (it forgot the connection)
            await asyncio.sleep(0)
            assert not down.write(b"seven") and handler.got == [b"one", b"four", b"six"] and not reader._buffer

    asyncio.run(main())


def test_an_event_that_waits_before_it_runs_is_taken_back_and_goes_to_the_reader():
    """The lock looked free but the call waited anyway (before anything of the event ran):
    the call is closed and the piece fed to the reader, neither lost nor handled twice."""
    async def main():
        async with handed() as (down, handler, _, _):
            handled = handler.server_event

            async def late(event) -> None:
                await asyncio.sleep(0)  # as a contended lock's acquire would
                await handled(event)
            handler.server_event = late
            assert down.write(b"one") and handler.got == [] and down.fed == 1
            handler.server_event = handled
            assert down.write(b"two") and handler.got == [] and down.fed == 2  # behind "one"
            await asyncio.sleep(0.01)
            assert handler.got == [] and await down.reader.read(100) == b"onetwo"

    asyncio.run(main())


def test_the_harness_s_unsent_bytes_hold_the_upstream_back():
    async def main():
        async with handed() as (down, _, writer, harness):
            assert not down.full()
            block = b"x" * (1 << 20)
            while writer.transport.get_write_buffer_size() < (16 << 20):  # past the kernel's buffers and
                writer.write(block)  # asyncio's high-water mark: the harness reads nothing
            assert down.full()
            drained = asyncio.ensure_future(down.drain())
            await asyncio.sleep(0.05)
            assert not drained.done()
            while not drained.done() or writer.transport.get_write_buffer_size():  # the harness reads
                await asyncio.wait_for(harness.read(1 << 20), 5)
            assert not down.full()

    asyncio.run(main())

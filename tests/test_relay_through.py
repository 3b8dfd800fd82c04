"""The relay's pass-through of a streamed answer (``addons/gateway/transport/relay.py``'s ``_Through``), in process
on real loopback sockets: what only its transport-callback phase can get wrong.

Once the StreamReader holds nothing more, ``_Through`` is the upstream transport's protocol
until the answer ends (a paced stream's reads then cost no task wake-up). So: the
bytes reach the loopback in order and whole whatever the phase they came in; a loopback that
does not take what is written pauses the upstream's reading, and reading resumes once it
drains; the StreamReader's protocol is back afterwards, so the pooled connection carries its
next exchange; an upstream that closes mid-answer is a break, passed on to the StreamReader
(at EOF, its writer closing), never a whole answer. The end-to-end behaviour (framings, reuse
in the pool, an abandoned answer read to its end) is tests/test_relay_framing.py's.
"""

from __future__ import annotations

import asyncio
import socket
import ssl

import pytest

from interceptor.addons.gateway.transport.framing import CLOSE, LENGTH, Body
from interceptor.addons.gateway.transport.relay import BROKE, READ, Upstream, _Loopback, _Through
from provider.tls import TestCA


class Down:
    """What ``_Through`` asks of its Drain: the body kept, nothing taken over."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.base = 0
        self.taken = False
        self.down_alive = True

    def _pass_down(self, down: _Loopback, data: bytes) -> None:
        down.write(data)

    def _guarded(self, step) -> None:
        step()

    def _feed(self) -> None:
        raise AssertionError("nothing is taken over here")


@pytest.fixture(scope="module")
def ca():
    with TestCA() as made:
        yield made


@pytest.fixture(params=["tcp", "tls"])
def tls(request, ca):
    """Plain TCP, and TLS (every real provider): asyncio's TLS transport takes a protocol of
    its own differently (``sslproto``), so both are run."""
    if request.param == "tcp":
        return None
    client = ssl.create_default_context(cafile=str(ca.path))
    return ca.server("127.0.0.1").context(), client


async def pair(upstream_bytes, tls=None, *, small_down: bool = False):
    """An upstream connection (``tls``: the server's and the client's contexts) whose server
    writes what ``upstream_bytes(writer)`` writes, and a loopback connection whose far end the
    test reads itself (``small_down``: 64 KiB socket buffers, so a few hundred KB fill them)."""
    served = asyncio.get_running_loop().create_future()

    async def handle(reader, writer):
        served.set_result(writer)
        await upstream_bytes(writer)

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=tls[0] if tls else None)
    port = server.sockets[0].getsockname()[1]
    ur, uw = await asyncio.open_connection("127.0.0.1", port, ssl=tls[1] if tls else None)
    up = Upstream(ur, uw, reusable=True)
    listener = socket.create_server(("127.0.0.1", 0))
    far = socket.create_connection(listener.getsockname())
    near, _ = listener.accept()
    listener.close()
    if small_down:
        far.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        near.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
    near.setblocking(False)
    _, down = await asyncio.open_connection(sock=near)
    far.setblocking(False)
    return server, up, down, far, await served


def shut(server: asyncio.Server, *conns) -> None:
    for c in conns:
        c.close()
    server.close()


async def closed(up: Upstream) -> None:
    """The StreamReader hears of the close: a loop pass after it over TCP, after TLS's
    close_notify exchange over TLS."""
    for _ in range(200):
        if up.reader.at_eof():
            break
        await asyncio.sleep(0.005)
    assert up.reader.at_eof() and up.writer.is_closing()


async def read_all(far: socket.socket, n: int) -> bytes:
    loop = asyncio.get_running_loop()
    got = bytearray()
    while len(got) < n:
        data = await loop.sock_recv(far, 1 << 16)
        assert data, f"the loopback closed after {len(got)} of {n} bytes"
        got += data
    return bytes(got)


def test_a_loopback_that_does_not_read_pauses_the_upstream_and_the_answer_arrives_whole(tls):
    body = bytes(range(256)) * 32 * 256  # 2 MiB, well over both sockets' buffers and asyncio's
    release = asyncio.Event()

    async def upstream(writer):
        # A first piece, then (the reader phase over) the rest in pieces, paced a little so
        # they come through the transport's callbacks.
        writer.write(body[:1000])
        await writer.drain()
        await asyncio.sleep(0.05)
        for k in range(1000, len(body), 8192):
            writer.write(body[k:k + 8192])
            await writer.drain()
            await asyncio.sleep(0)
        await release.wait()

    async def main():
        server, up, down, far, served = await pair(upstream, tls, small_down=True)
        transport = up.writer.transport
        original = transport.get_protocol()
        through = _Through(Down(), up, Body(LENGTH, len(body)), _Loopback(down))
        run = asyncio.ensure_future(through.run(b""))
        paused = False
        for _ in range(400):  # nobody reads the loopback yet: its buffers fill
            await asyncio.sleep(0.005)
            if transport.get_protocol() is through and not transport.is_reading():
                paused = True
                break
        assert paused, "the upstream kept being read while the loopback took nothing"
        assert not run.done()
        got = await read_all(far, len(body))
        await asyncio.wait_for(run, 10)
        assert got == body  # in order, whole, nothing twice
        assert transport.get_protocol() is original and transport.is_reading()
        release.set()
        shut(server, served, up, down, far)

    asyncio.run(main())


def test_the_pooled_connection_carries_its_next_answer_after_a_paced_one(tls):
    first = [b"event %d\n" % k for k in range(20)]
    second = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nagain"
    go = asyncio.Event()

    async def upstream(writer):
        for piece in first:  # one read each: the callbacks' phase
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.01)
        await go.wait()
        writer.write(second)
        await writer.drain()

    async def main():
        server, up, down, far, served = await pair(upstream, tls)
        original = up.writer.transport.get_protocol()
        size = sum(map(len, first))
        through = _Through(Down(), up, Body(LENGTH, size), _Loopback(down))
        await asyncio.wait_for(through.run(b""), 10)
        assert await read_all(far, size) == b"".join(first)
        assert up.writer.transport.get_protocol() is original and up.reusable
        assert not up.writer.is_closing() and not up.reader.at_eof()
        go.set()
        got = b""
        while len(got) < len(second):  # the StreamReader reads the next exchange again
            got += await asyncio.wait_for(up.reader.read(READ), 5)
        assert got == second
        shut(server, served, up, down, far)

    asyncio.run(main())


def test_an_upstream_that_closes_mid_answer_breaks_it_and_the_reader_sees_the_end(tls):
    async def upstream(writer):
        writer.write(b"a" * 100)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"b" * 100)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()  # 200 of the 1000 bytes it announced

    async def main():
        server, up, down, far, served = await pair(upstream, tls)
        drain = Down()
        through = _Through(drain, up, Body(LENGTH, 1000), _Loopback(down))
        with pytest.raises(BROKE):  # FramingError: 200 of the 1000 bytes announced
            await asyncio.wait_for(through.run(b""), 10)
        assert bytes(drain.buf) == b"a" * 100 + b"b" * 100
        await closed(up)
        shut(server, up, down, far)

    asyncio.run(main())


def test_a_connection_closed_by_the_relay_mid_answer_breaks_it_and_the_reader_sees_the_end(tls):
    """``intercept_drain_timeout`` running out closes the upstream from the relay's side
    (``Drain._expire``) while this is its protocol: the answer breaks, and the StreamReader
    hears of the close too."""
    async def upstream(writer):
        writer.write(b"a" * 100)
        await writer.drain()
        await asyncio.sleep(30)

    async def main():
        server, up, down, far, served = await pair(upstream, tls)
        through = _Through(Down(), up, Body(LENGTH, 1000), _Loopback(down))
        run = asyncio.ensure_future(through.run(b""))
        for _ in range(200):
            await asyncio.sleep(0.005)
            if up.writer.transport.get_protocol() is through:
                break
        assert up.writer.transport.get_protocol() is through
        up.close()
        with pytest.raises(BROKE):
            await asyncio.wait_for(run, 10)
        await closed(up)
        shut(server, served, down, far)

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["cut", "close-delimited"])
def test_an_answer_whose_end_was_buffered_before_the_pass_through_began_ends(tls, kind):
    """Every byte of the answer, and the upstream's close, reached the StreamReader before
    ``run`` began (Fetch read the head in the request hook; the relay reads on only once
    mitmproxy has brought the flow over): an answer cut short breaks, and one that ends with
    its connection ends, at once. Handing the transport to ``_Through`` after the short read
    hung both until the client gave up (its retries coalesced on it and hung too): the
    transport had told the StreamReader of the close already and would not tell again."""
    async def upstream(writer):
        writer.write(b"a" * 200)
        await writer.drain()
        writer.close()

    async def main():
        server, up, down, far, served = await pair(upstream, tls)
        for _ in range(200):  # the bytes and the end are in the StreamReader, not yet read
            if up.reader._eof:  # (asyncio's own flag: at_eof() also wants the buffer empty)
                break
            await asyncio.sleep(0.005)
        assert up.reader._eof and not up.reader.at_eof()
        drain = Down()
        through = _Through(drain, up, Body(LENGTH, 1000) if kind == "cut" else Body(CLOSE), _Loopback(down))
        try:
            await asyncio.wait_for(through.run(b""), 5)
        except TimeoutError:  # an OSError, as BROKE's are: told apart first
            pytest.fail("the pass-through waited for an end the transport had already told")
        except BROKE:
            assert kind == "cut"
        else:
            assert kind == "close-delimited"
            assert await read_all(far, 200) == b"a" * 200
        assert bytes(drain.buf) == b"a" * 200
        shut(server, up, down, far)

    asyncio.run(main())

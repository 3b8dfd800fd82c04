"""Relay: the proxy reads a model's answer to its end on a connection of its own, so an answer
the harness stopped reading is still recorded, and the harness's retry is answered from it.

Why not mitmproxy's own upstream connection: when the client closes mid-answer, mitmproxy 12
closes the upstream connection and cancels the client's server connections before any hook
runs (``HttpStream.handle_protocol_error``, ``ConnectionHandler.handle_client``), so what the
model was still generating would be lost and each SDK retry would make it generate again. No
hook can keep that connection, and patching mitmproxy's layers would tie the proxy to their
private internals.

So for a model POST the proxy sends the request with its own upstream client
(``addons/gateway/transport/client.py``: aiohttp, pooled per address and shared by every
session, TLS verified as mitmproxy would), and mitmproxy stays what it is: it runs the answer's
hooks (``addons/gateway/answer/pipeline.py``) and observers see the real upstream. An answer
that is not a stream is read whole in the request hook and becomes the flow's answer
(``Fetch``); a stream comes back through a loopback hop, a plain HTTP/1.1 server (h11) in the
proxy's own event loop that mitmproxy reads as its upstream (``Drain``). The upstream is read
only in tasks of the proxy's own (mitmproxy's hook tasks, the loopback server's, ``_read_on``),
never in one mitmproxy cancels when the client goes: a read cancelled mid-answer loses its
connection and the answer with it. A client that goes away is seen, and the answer is read on
through the same pipeline (at most ``intercept_drain_timeout`` seconds) and committed as
undelivered. An upstream that cannot be reached or closes without answering gets a 502 in the
dialect's shape (mitmproxy's own is an HTML page no SDK reads as a provider error), retryable.

The harness reads the upstream's answer as sent: its status, reason and headers in order, its
body in its content encoding, framed as the upstream framed it, except that a chunked body
goes down as one chunk per read (what arrived since the last read; chunk boundaries carry no
meaning in HTTP). mitmproxy's per-chunk work is paid once per chunk it reads, so events that
arrived together travel together, and an event that arrives alone still goes at once.
``intercept_drain_timeout=0`` turns the relay off (an answer the client abandons is lost);
upstream-proxy modes and client certificates are left to mitmproxy (the relay would bypass
them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import h11
from mitmproxy import ctx, exceptions, http
from mitmproxy import flow as mflow
from mitmproxy.connection import ConnectionState

from interceptor.addons.gateway.answer import hold
from interceptor.addons.gateway.answer.held import Held
from interceptor.addons.gateway.answers import error_response
from interceptor.addons.gateway.exchange import KEY, Exchange, exchange_of
from interceptor.addons.gateway.record import commit, mark_undelivered
from interceptor.addons.gateway.transport.client import BROKE as CLIENT_BROKE
from interceptor.addons.gateway.transport.client import (Client, Target, Unsendable, answer_head, chunked,
                                                         close_delimited, keeps, reason, unreached, upstream_tls)
from interceptor.addons.gateway.transport.modes import regular_mode
from interceptor.dialects.base import drop, header
from interceptor.trace.messages import ResponseError


class Stages(Protocol):
    """What the relay feeds an answer through: the answer's pipeline
    (``addons/gateway/answer/pipeline.py``), named by what the relay calls, so the relay does
    not import the stages it carries."""

    bounds: Any

    def responseheaders(self, flow: http.HTTPFlow, collect: bool = False) -> None: ...

    def response(self, flow: http.HTTPFlow, collect: bool = False) -> None: ...

    def error(self, flow: http.HTTPFlow) -> None: ...

    def client_gone(self, flow: http.HTTPFlow) -> None: ...


log = logging.getLogger(__name__)

TICKET = "x-interceptor-relay"
# The request from mitmproxy (on loopback, already whole in mitmproxy's memory) is read in
# reads this large, and the relay's side of that connection buffers as much before it stops
# reading: a long history's body in one or two reads, each a pass of the event loop and of h11.
DOWN_READ = 1 << 20
TRIM = 1 << 16  # consumed bytes kept before the buffer is cut
MAX_HEAD = 1 << 20  # request head size accepted from mitmproxy (above h11's smaller default)
WATCH = 0.25  # seconds between looks at the client's connection while an answer is fetched


class AnswerTooLarge(Exception):
    """An answer read whole (Fetch's, an abandoned one) passed ``intercept_max_answer``: it is
    read no further, and its connection is closed (``Drain._read_rest``)."""


@dataclass(eq=False, slots=True)
class Sent:
    """The request went out and its answer's head came back (``Drain._send``)."""

    resp: aiohttp.ClientResponse
    keep: bool  # the loopback may carry another request after this answer (its framing, both sides' wish)

    def close(self) -> None:
        """The answer is read no further: its connection is closed, never pooled."""
        self.resp.close()

    def release(self) -> None:
        """The answer was read to its end: its connection goes back to the pool (aiohttp closes
        one that either side said close, or whose body ended with it)."""
        self.resp.release()


@dataclass(frozen=True, slots=True)
class Refusal:
    """The request could not go out, or got no answer: the 502 (or the expiry) to give."""

    message: str
    retry: bool = True
    expired: bool = False  # intercept_drain_timeout ran out after the client left


async def _next(conn: h11.Connection, reader: asyncio.StreamReader, size: int = DOWN_READ):
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await reader.read(size))


# What ends an exchange with the upstream early: its connection or framing, or its size.
BROKE = (*CLIENT_BROKE, AnswerTooLarge)


def _version(version: bytes) -> tuple[int, int]:
    major, _, minor = version.partition(b".")
    return int(major), int(minor or 0)


def _cancelling() -> bool:
    """The running task itself is being cancelled (not only a task it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _piece(data: bytes, rechunk: bool) -> bytes:
    """One read of the answer's body as it goes down the loopback: a chunk of a chunked body."""
    return b"%x\r\n%b\r\n" % (len(data), data) if rechunk else data


def _too_large(limit: int) -> str:
    return f"the upstream's answer passed {limit} bytes (option intercept_max_answer); nothing of it was passed on"


def _seen(task: asyncio.Future) -> None:
    """A pump's failure is raised where it is awaited; one no one awaits any more is not logged."""
    if not task.cancelled():
        task.exception()


def _closes(headers) -> bool:
    """A ``Connection: close`` among these (name, value) pairs (h11's, or mitmproxy's fields)."""
    return any(k.lower() == b"connection" and b"close" in v.lower() for k, v in headers)


def _response(status: int, reason: bytes, fields: Any, *, version: bytes = b"HTTP/1.1",
              started: float, ended: float | None = None) -> http.Response:
    """The upstream's answer as mitmproxy's ``Response``, its body to be set by the caller.

    Made by mitmproxy's public constructor, so whatever mitmproxy's ``Response`` becomes in a
    release, the flow holds one it made itself, its fields checked by mitmproxy's own rules."""
    return http.Response(http_version=version, status_code=status, reason=reason, headers=http.Headers(fields),
                         content=None, trailers=None, timestamp_start=started, timestamp_end=ended)


class _Loopback:
    """The answer down the loopback: the relay's side of mitmproxy's server connection, which
    mitmproxy reads as the flow's upstream."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer

    def write(self, data: bytes) -> bool:
        if self.writer.is_closing():
            return False
        self.writer.write(data)
        return True

    def full(self) -> bool:
        return bool(self.writer.transport.get_write_buffer_size())

    async def drain(self) -> None:
        await self.writer.drain()


class _Meter:
    """The pipeline's outermost stream callable: counts what mitmproxy passed through it."""

    def __init__(self, inner: Any, drain: Drain) -> None:
        self.inner = inner
        self.drain = drain

    def __call__(self, chunk: bytes):
        self.drain.consumed(len(chunk))
        return self.inner(chunk) if callable(self.inner) else chunk


class Drain:
    """One model exchange through the relay; ``Exchange.drain``.

    ``request`` (the last request step before the Gate) points the flow at the relay with a
    one-use ticket header (random, removed before anything leaves); the relay sends the
    request upstream and passes the answer back as it arrives. A stream's head read by
    ``Fetch``, the flow goes on through the hop with the request's head only (the body went
    upstream already; ``_lighten``, put back for observers at the answer's headers), so the
    request is never sent twice.

    The Drain keeps the body bytes mitmproxy has not yet passed through the pipeline: the
    pipeline's outermost callable meters what it consumed, so for a stream this is what sits
    in socket buffers, not the answer. When mitmproxy reports the flow's ``error`` and the
    upstream did not break, the client went away and the Drain takes over: it feeds the bytes
    mitmproxy never consumed and the rest of the answer through the same pipeline itself
    (building it from the answer's headers if they came after the client left), then runs its
    ``response`` stage: the turn commits (or the error is recorded), the call says
    ``delivered: false``, and Retry settles it as undelivered, so the SDK's retry, which
    coalesces on the exchange in flight meanwhile, gets the recorded answer."""

    cut: str | None = None  # why the answer read whole was read no further (``_read_rest``)

    def __init__(self, relay: Relay, flow: http.HTTPFlow, ex: Exchange, target: Target) -> None:
        self.relay = relay
        self.flow = flow
        self.ex = ex
        self.target = target
        self.ticket = secrets.token_hex(16)
        self.started = False  # the relay has the request
        self.head: tuple[int, bytes, list[tuple[bytes, bytes]]] | None = None
        self.buf = bytearray()  # body bytes from offset `base` on
        self.base = 0
        self.fed = 0  # body bytes mitmproxy (or the takeover) passed through the pipeline
        self.upstream_done = False
        self.broken = False
        self.taken = False  # the client went away; this drain finishes the answer
        self.finished = False
        self.expired = False  # intercept_drain_timeout ran out after the client left
        self.down_alive = True
        self.resp: aiohttp.ClientResponse | None = None  # the upstream's answer, once its head came
        self._sending: asyncio.Future | None = None  # the request on its way, until its head came
        self.pumping: asyncio.Future | None = None  # a stream's reader (``_pump``)
        self.down: _Loopback | None = None  # the loopback the answer goes down, once mitmproxy asked for it
        self.sent: Sent | None = None  # Fetch sent the request and left the answer to the relay
        self.fetching = False  # Fetch has the exchange in mitmproxy's request hook
        self.fetched = False  # Fetch read the answer whole and gave it to mitmproxy
        self.closed_out = False  # Fetch ended the exchange itself, the client gone, and killed the flow
        self.kept: tuple[bytes, str] | None = None  # the body and length the loopback does not carry (``_lighten``)
        self._timer: asyncio.TimerHandle | None = None
        self._watching: asyncio.TimerHandle | None = None
        self._reading: asyncio.Future | None = None  # ``_read_on``

    # -- the flow's side --------------------------------------------------------------------

    def restore(self, flow: http.HTTPFlow) -> None:
        """Observers (mitmweb, flow files, the log) see the upstream, not the relay, and the
        request as it was sent there."""
        t = self.target
        flow.request.data.host, flow.request.data.port, flow.request.scheme = t.host, t.port, t.scheme
        drop(flow.request.headers, (TICKET,))  # used (or never used): never sent anywhere again
        self._unlighten(flow)

    def _lighten(self) -> None:
        """The request went upstream from Fetch and its answer is the relay's to pass down
        (``sent``): the relay never reads the body mitmproxy sends it, so mitmproxy sends only
        the head: a history-sized body would otherwise cross the loopback twice a streamed
        turn (mitmproxy's write, the relay's read). Put back by ``restore`` at the answer's
        headers (or the flow's error), before anything observes the flow again. A body framed
        otherwise than by its length (chunked) is left as it is."""
        req = self.flow.request
        length = req.headers.get("content-length")
        if self.kept is not None or length is None or "transfer-encoding" in req.headers or not req.raw_content:
            return
        self.kept = (req.raw_content, length)
        req.data.content = b""
        req.headers["content-length"] = "0"

    def _unlighten(self, flow: http.HTTPFlow) -> None:
        if self.kept is not None:
            flow.request.data.content, flow.request.headers["content-length"] = self.kept
            self.kept = None

    def meter(self, stream: Any) -> Any:
        return _Meter(stream, self) if stream else stream

    def consumed(self, n: int) -> None:
        self.fed += n
        cut = self.fed - self.base
        if cut >= TRIM and cut <= len(self.buf):
            del self.buf[:cut]
            self.base = self.fed

    def ended(self, flow: http.HTTPFlow) -> None:
        """The flow's answer is complete (or was given by the proxy: the relay never saw it)."""
        self.relay.forget(self)
        self.restore(flow)

    def take_over(self, flow: http.HTTPFlow) -> bool:
        """mitmproxy ended the flow with an error. True if this drain finishes the answer (the
        client went away while the upstream answered, or after it had answered in full).
        Whichever: observers see the flow as it went upstream (``restore``, idempotent), not
        the relay's address or the body ``_lighten`` kept back."""
        self.relay.forget(self)
        self.restore(flow)
        if self.fetched and not self.taken and flow.response is not None and not self.ex.committed:
            # Fetched whole, and the client went away before mitmproxy ran the answer's hooks
            # (it looks for that when the request hook returns): finished as a takeover's.
            self.buf = bytearray(flow.response.raw_content or b"")
            flow.response = None
        if not self.started or self.broken or self.taken or self.finished:
            return False
        if self.ex.hold is not None and self.ex.hold.phase == "deliver":
            return False  # decided and on the record: the stages after the hold see the error
        self._left()
        if self.sent is not None:  # Fetch left a stream to the relay, which the flow never reached
            sent, self.sent = self.sent, None
            self._reading = asyncio.ensure_future(self._read_on(sent))  # held: the loop keeps only weak refs
            return True
        if self.upstream_done and self.ex.hold is None:
            asyncio.get_running_loop().call_soon(self._guarded, self._finish)
        return True  # a held answer: ``_held`` goes on and hands the decision to the pipeline

    def _left(self) -> None:
        """The client went away before the answer's end: it is read on for at most
        ``intercept_drain_timeout`` seconds, and recorded as undelivered."""
        self.taken = True
        if not self.ex.handed:  # an answer whose end the client was handed is delivered
            if self.ex.committed:
                mark_undelivered(self.ex)  # committed at its terminal event, before the rest was sent
            self.ex.delivered = False
        self._timer = asyncio.get_running_loop().call_later(self.relay.timeout, self._expire)
        log.info(f"interceptor: session {self.ex.session.id!r}: the client left before the answer's end; "
                 f"reading it from the upstream to record it")

    # -- the relay's side -------------------------------------------------------------------

    async def _send(self, method: bytes, path: bytes, headers, body: bytes, keep: bool) -> Sent | Refusal:
        """Send the request to the upstream and read its answer's head; what went wrong
        otherwise, in words for the harness and the record."""
        # Never sent twice: a model POST sent again may be sampled again. A pooled connection
        # the upstream closed meanwhile is not used (``client.Client.send``); one that fails
        # anyway (the close was in flight as the request left: the upstream may have read it)
        # is the retryable 502 below, which the harness's SDK retries itself (aiohttp retries
        # it only for idempotent methods).
        self.started = True
        # A task of the relay's own, so ``_expire`` can end the wait for a head that never comes.
        self._sending = sending = asyncio.ensure_future(self.relay.client.send(
            self.target, method, path, headers, body, {TICKET.encode()}, self.relay.tls(self.target)))
        try:
            resp = await sending
        except asyncio.CancelledError:
            if not (self.expired and sending.cancelled()) or _cancelling():
                raise
            return Refusal(self._expiry(), expired=True)
        except BROKE as e:
            said = unreached(self.target.where(), e)
            if said is not None:
                return Refusal(*said)
            return Refusal(f"the session's upstream {self.target.where()} closed the connection without "
                           f"answering ({type(e).__name__})", expired=self.expired)
        except Unsendable as e:
            return Refusal(str(e), retry=False)
        except Exception as e:  # noqa: BLE001 - fail closed, in the dialect's shape; it may have gone out
            log.exception(f"interceptor: session {self.ex.session.id!r}: sending the request failed")
            return Refusal(f"the interceptor failed while sending this exchange ({type(e).__name__}); "
                           "it was not sent again", retry=False)
        finally:
            self._sending = None
        self.resp = resp
        return Sent(resp, keep and keeps(resp.version, resp.raw_headers) and not close_delimited(method, resp))

    async def run(self, down: h11.Connection, writer: asyncio.StreamWriter, request: h11.Request, body: bytes) -> bool:
        """Serve the request mitmproxy sent to the relay; True if the connection to mitmproxy
        may carry another request."""
        sent, self.sent = self.sent, None  # sent already: Fetch read the head, then left it to the relay
        if sent is None:
            if self.started:  # Fetch sent it and failed: never sent twice
                return await self._refuse(down, writer, "the interceptor failed while sending this exchange; "
                                                        "it was not sent again", retry=False)
            sent = await self._send(request.method, request.target, request.headers.raw_items(), body,
                                    keeps(_version(request.http_version), request.headers))
        if isinstance(sent, Refusal):
            if sent.expired:
                self._give_up(self._expiry())
                return False
            return await self._refuse(down, writer, sent.message, retry=sent.retry)
        self._answered(sent)
        if self.ex.hold is not None:
            return await self._held(down, writer, sent)
        # The answer goes down as the upstream framed it, a chunked body one chunk per read.
        loop = _Loopback(writer)
        rechunk = chunked(sent.resp)
        pump = self.pumping or self._pump(sent)
        if self.taken:
            self._guarded(self._headers)
        else:
            self._pass_down(loop, answer_head(sent.resp))
        try:
            if self.buf and not self.taken:  # what the pump read before the loopback was there, as one piece
                self._pass_down(loop, _piece(bytes(self.buf), rechunk))
            self.down = loop  # from here on the pump passes each piece down itself
            await pump
            if rechunk and not self.taken:
                self._pass_down(loop, b"0\r\n\r\n")
        except BROKE as e:
            sent.close()
            self.broken = True
            self._give_up(self._expiry() if self.expired else f"the upstream connection broke ({type(e).__name__})")
            return False  # not taken over: mitmproxy sees the body cut, as it would have from the upstream
        except Exception as e:  # noqa: BLE001 - the relay's own failure passing it on (not the upstream's)
            # Ended as a broken answer, on the record: left to ``_serve``'s catch-all, no one
            # would read the upstream on, and a drain that took over would wait its whole
            # ``intercept_drain_timeout`` without ever recording the exchange (its retries with it).
            log.exception(f"interceptor: session {self.ex.session.id!r}: passing the answer on failed")
            sent.close()
            self.broken = True
            self._give_up(f"passing it on failed ({type(e).__name__})")
            return False
        self.upstream_done = True
        sent.release()
        if self.taken:
            self._guarded(self._finish)
            return False
        # A close-delimited answer ends with the connection; so does one that says so.
        return self.down_alive and sent.keep

    def _pump(self, sent: Sent) -> asyncio.Future:
        """Read a streamed answer's body from its head on, in a task of the relay's own
        (``_through``): what arrives is taken out of the client's buffer at once, because
        aiohttp drops what it buffered unread when the connection breaks, and the harness must
        get every byte the upstream sent before a cut (Fetch reads the head, and the loopback
        comes a round trip later). Awaited by ``run`` or ``_read_rest``; its failure is theirs."""
        self.pumping = pump = asyncio.ensure_future(self._through(sent))
        pump.add_done_callback(_seen)
        return pump

    async def _through(self, sent: Sent) -> None:
        """The answer as it arrives, what arrived since the last read as one piece: kept in
        ``buf`` (for the loopback once there, and a takeover), passed down the loopback (a
        chunked body: one chunk per piece), or fed to the pipeline once the Drain took over.
        A loopback that does not take what is written (mitmproxy reads no faster than its
        harness) is drained before reading on, so the upstream's reading pauses (aiohttp's
        buffer fills) rather than the proxy's memory growing. An answer the harness left before
        the loopback was there is read whole, bounded by ``intercept_max_answer``."""
        rechunk = chunked(sent.resp)
        limit = getattr(self.relay.pipeline.bounds, "answer", 0)
        async for piece in sent.resp.content.iter_any():
            self.buf += piece
            down = self.down
            if self.taken:
                if down is None and limit and len(self.buf) > limit:
                    raise AnswerTooLarge(_too_large(limit))
                self._guarded(self._feed)
            elif down is not None and self.down_alive:
                self._pass_down(down, _piece(piece, rechunk))
                if self.down_alive and down.full():
                    try:
                        await down.drain()
                    except OSError:
                        self.down_alive = False

    # -- the fetch: an answer read whole in mitmproxy's request hook ------------------------

    async def fetch(self) -> None:
        """Send the request and read the answer whole in mitmproxy's request hook (``Fetch``),
        and give it to mitmproxy as the flow's answer: the loopback hop's second HTTP exchange
        is not made. An answer that is a stream (asked for, or not) is left to the relay once
        its head is read: the flow goes on to it without its body (``_lighten``), and ``run``
        passes that answer down as it comes, never sending the request again. See ``Fetch``."""
        flow, req = self.flow, self.flow.request
        self.fetching = True
        self._watching = asyncio.get_running_loop().call_later(WATCH, self._watch)
        waiting = self.relay.fetching.setdefault(flow.client_conn.id, set())
        waiting.add(self)
        try:
            sent = await self._send(req.data.method, req.data.path, req.headers.fields, req.raw_content or b"",
                                    not _closes(req.headers.fields))
            if isinstance(sent, Refusal):
                self.broken = True
                self._refused(self._expiry() if sent.expired else sent.message, sent.retry)
                return
            resp = sent.resp
            if self.ex.wire.frames(resp.status, resp.headers.get("content-type", ""), self.ex.stream) is not None \
                    and not self.gone():
                self.sent = sent  # a stream: the relay passes it down (``run``)
                self._pump(sent)
                self._lighten()
                return
            self._answered(sent)
            started = time.time()
            broke = await self._read_rest(sent)
            if broke is not None:
                self._refused(self._expiry() if self.expired else self.cut or
                              f"the session's upstream {self.target.where()} broke the connection before the "
                              f"answer's end ({broke})", self.cut is None)
                return
            if self.gone():  # ``_finish`` builds the answer from ``buf`` and runs the pipeline, as a takeover's
                self._close_out(self._finish)
                return
            self.fetched = True
            response = _response(resp.status, reason(resp), resp.raw_headers,
                                 version=b"HTTP/%d.%d" % (resp.version.major, resp.version.minor),
                                 started=started, ended=time.time())
            response.raw_content = bytes(self.buf)
            self.buf = bytearray()
            self._answer(response)
        finally:
            self.fetching = False
            waiting.discard(self)
            if not waiting:
                self.relay.fetching.pop(flow.client_conn.id, None)
            self._watching.cancel()

    async def _read_on(self, sent: Sent) -> None:
        """The answer's head came to Fetch, which left the stream to the relay, and the client
        went away before mitmproxy brought the flow there: the rest is read here, to its end
        (or ``intercept_drain_timeout``), and the answer finished as a takeover's."""
        try:
            self._answered(sent)
            broke = await self._read_rest(sent)
        except Exception as e:  # noqa: BLE001 - a task of its own: no one else would see it, and Retry must settle
            log.exception(f"interceptor: session {self.ex.session.id!r}: reading the abandoned answer failed")
            sent.close()
            self._give_up(f"reading it failed ({type(e).__name__})")
            return
        if broke is not None:
            self._give_up(self._expiry() if self.expired else self.cut or f"the upstream connection broke ({broke})")
            return
        self._guarded(self._finish)

    def _answered(self, sent: Sent) -> None:
        """The upstream answered: its head kept for the pipeline, its connection's fate known."""
        resp = sent.resp
        self.head = (resp.status, reason(resp), list(resp.raw_headers))
        if self.relay.reached is not None:
            self.relay.reached(self.target.host, self.target.port)

    async def _read_rest(self, sent: Sent) -> str | None:
        """The answer's body to its end into ``buf`` (nothing goes down: Fetch and the Drain
        read it whole), its connection back to the pool; the exception's name if it broke.
        Bounded by ``intercept_max_answer`` (the pipeline's): past it, ``cut`` says so."""
        limit = getattr(self.relay.pipeline.bounds, "answer", 0)
        try:
            if self.pumping is not None:  # a stream Fetch left to the relay: its reader has the rest
                await self.pumping
            else:
                async for piece in sent.resp.content.iter_any():
                    self.buf += piece
                    if limit and len(self.buf) > limit:
                        raise AnswerTooLarge(_too_large(limit))
        except BROKE as e:
            sent.close()
            self.broken = True
            if isinstance(e, AnswerTooLarge):
                self.cut, self.buf = str(e), bytearray()
            return type(e).__name__
        self.upstream_done = True
        sent.release()
        return None

    def _answer(self, response: http.Response) -> None:
        """The fetched answer (or the 502) is the flow's: mitmproxy runs the answer's hooks on
        it (``responseheaders``, then ``response``) and sends it; the relay never sees it."""
        self.relay.forget(self)
        self.restore(self.flow)
        self.flow.response = response

    def failed(self, e: Exception) -> None:
        """Fetch raised: a 500 that is not retried (the request may have gone out), and nothing
        left for the relay or a takeover to finish."""
        self.sent = None
        self.broken = True
        if self.resp is not None:
            self.resp.close()  # nothing will read it on
        self._answer(error_response(self.ex.wire, 500, f"the interceptor failed while fetching this answer "
                                                       f"({type(e).__name__}); it was not sent again", retry=False))

    def _refused(self, message: str, retry: bool) -> None:
        """No answer: the 502 in the upstream's dialect, or, the client gone, the record's error."""
        if self.gone():
            self._close_out(lambda: self._give_up(message))
        else:
            self._answer(error_response(self.ex.wire, 502, message, retry=retry))

    def gone(self) -> bool:
        """Has the client gone away (seen now, by ``_watch``, or told by ``Fetch``)? If so the
        answer is from now on this drain's to end (``_left``, and the pipeline told)."""
        if not self.taken and not self.flow.client_conn.state & ConnectionState.CAN_READ:
            self._left()
            self.relay.pipeline.client_gone(self.flow)
        return self.taken

    def _close_out(self, step: Callable[[], None]) -> None:
        """End the exchange here, the client gone (``_finish``: the pipeline on the answer read
        whole, committed as undelivered; ``_give_up``: the error on the record), then kill the
        flow: mitmproxy, seeing it killed when the request hook returns, sends nothing and runs
        only its ``error`` hook, which the pipeline passes over (``closed_out``)."""
        self.relay.forget(self)
        self._guarded(step)
        self.closed_out = True
        if self.flow.killable:
            self.flow.kill()

    def _watch(self) -> None:
        """While the answer is fetched: has the client gone (its connection at EOF)? mitmproxy
        holds that event from the flow until the request hook returns, so it is looked for
        here, at once when mitmproxy reports the client's disconnection (``Fetch``) and every
        ``WATCH`` seconds besides (a half-closed connection is not reported): from then on the
        answer is read for at most ``intercept_drain_timeout``, and a retry of it coalesces on
        it (Retry), even one that carries no retry header."""
        if self.fetching and not self.gone():
            self._watching = asyncio.get_running_loop().call_later(WATCH, self._watch)

    async def _held(self, down: h11.Connection, writer: asyncio.StreamWriter, sent: Sent) -> bool:
        """A held answer (``addons/gateway/answer/hold.py``): collected through the pipeline up to the hold,
        decided, then sent to mitmproxy (or, the harness gone, handed to the stages after it)."""
        held = self.ex.hold
        flow = self.flow
        with self._exchange():
            self._headers(collect=True)
        stream = flow.response.stream
        ticker = None
        if (held.keepalive > 0 and held.sse and flow.response.status_code == 200 and not self.taken
                and header(flow.response.headers, "content-encoding", "identity").lower() == "identity"):
            held.head_sent = True
            self._down(writer, down.send(h11.Response(status_code=200, headers=_framed(flow.response.headers.fields))))
            ticker = asyncio.ensure_future(self._keepalive(down, writer, held.keepalive))
        try:
            try:
                async for piece in sent.resp.content.iter_any():
                    with self._exchange():
                        if callable(stream):
                            stream(piece)
                        else:
                            self.buf += piece
            except BROKE as e:
                sent.close()
                self.broken = True
                why = self._expiry() if self.expired else f"the upstream connection broke ({type(e).__name__})"
                with self._exchange():
                    delivery = hold.broken(self.ex, flow, why)
            else:
                self.upstream_done = True
                sent.release()
                with self._exchange():
                    if callable(stream):
                        stream(b"")
                    else:
                        flow.response.raw_content = bytes(self.buf)
                        self.buf.clear()
                    flow.response.timestamp_end = time.time()
                    self.relay.pipeline.response(flow, collect=True)
                    delivery = await hold.settle(self.ex, flow)
        except Exception as e:  # noqa: BLE001 - the proxy's own failure: fail closed, on the record
            log.exception(f"interceptor: session {self.ex.session.id!r}: holding the answer failed")
            if not self.upstream_done:
                sent.close()
                self.broken = True
            with self._exchange():
                delivery = hold.failed(self.ex, flow, f"holding the answer failed ({type(e).__name__})")
        finally:
            if ticker is not None:
                ticker.cancel()
        if self.taken:
            with self._exchange():
                self._end()
                response = flow.response
                response.stream = False
                response.status_code = delivery.status
                if delivery.headers:
                    response.headers = http.Headers(delivery.headers)
                response.raw_content = delivery.joined()
                self.relay.pipeline.response(flow)
            return False
        if not held.head_sent:
            self._down(writer, down.send(h11.Response(status_code=delivery.status, headers=delivery.headers)))
        for data in delivery.parts():
            self._down(writer, down.send(h11.Data(data=data)))
            try:
                await writer.drain()
            except OSError:
                self.down_alive = False
        self._end()
        if self.broken and held.head_sent:
            return False  # the error event went out; the stream is cut, as the upstream's was
        self._down(writer, down.send(h11.EndOfMessage()))
        return self.down_alive and not self.broken and down.our_state is h11.DONE

    async def _keepalive(self, down: h11.Connection, writer: asyncio.StreamWriter, every: float) -> None:
        while self.down_alive:
            await asyncio.sleep(every)
            if not self.taken:
                self._down(writer, down.send(h11.Data(data=hold.KEEPALIVE)))

    def _expiry(self) -> str:
        return f"the upstream did not finish within intercept_drain_timeout ({self.relay.timeout:g} s)"

    def _expire(self) -> None:
        if self.finished:
            return
        self.expired = True
        if self.resp is not None:
            self.resp.close()  # the read in flight ends, and run() (or fetch()) gives up
        elif self._sending is not None:
            self._sending.cancel()  # the connect, or the wait for the head, ends: ``_send`` gives up
        elif not self.fetching:
            self._give_up(self._expiry())

    def _down(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        """Down the loopback (a held answer, its keep-alives): ``_pass_down``'s rule."""
        self._pass_down(_Loopback(writer), data)

    def _pass_down(self, down: _Loopback, data: bytes) -> None:
        if not (self.down_alive and down.write(data)):
            self.down_alive = False

    async def _refuse(self, down: h11.Connection, writer: asyncio.StreamWriter, message: str,
                      retry: bool = True) -> bool:
        self.broken = True  # nothing to drain: the error reaches the harness and the record as any 502
        if self.taken:
            self._give_up(message)
            return False
        # In the upstream's dialect: a translated session's answer is re-shaped by the pipeline.
        response = error_response(self.ex.wire, 502, message, retry=retry)
        writer.write(down.send(h11.Response(status_code=502, headers=list(response.headers.fields)))
                     + down.send(h11.Data(data=response.raw_content or b"")) + down.send(h11.EndOfMessage()))
        try:
            await writer.drain()
        except OSError:
            return False
        return True

    # -- the takeover (the client went away) ------------------------------------------------

    def _guarded(self, step: Callable[[], None]) -> None:
        with self._exchange():
            try:
                step()
            except Exception as e:  # noqa: BLE001 - the record must still end, and Retry settle
                log.exception(f"interceptor: session {self.ex.session.id!r}: finishing the abandoned answer failed")
                self._give_up(f"finishing it failed ({type(e).__name__})")

    @contextlib.contextmanager
    def _exchange(self):
        """The flow's typed state, for the pipeline's stages, while the Drain works on it.
        Redact made the flow's metadata plain at mitmproxy's ``error`` (a saved or displayed
        flow must not hold the session): it is made plain again after."""
        before = self.flow.metadata.get(KEY)
        self.flow.metadata[KEY] = self.ex
        try:
            yield
        finally:
            if before is not self.ex:
                self.flow.metadata[KEY] = before

    def _headers(self, collect: bool = False) -> None:
        """The answer's headers came after the client left (or the answer is held,
        ``collect``): the pipeline is built here."""
        flow = self.flow
        if flow.response is None or collect:
            status, reason, headers = self.head
            flow.response = _response(status, reason, headers, started=time.time())
            self.relay.pipeline.responseheaders(flow, collect)

    def _feed(self) -> None:
        stream = self.flow.response.stream if self.flow.response is not None else None
        if callable(stream):
            start = self.fed - self.base
            if start < len(self.buf):
                stream(bytes(self.buf[start:]))

    def _finish(self) -> None:
        if self.finished:
            return
        self._headers()
        flow = self.flow
        stream = flow.response.stream
        if callable(stream):
            self._feed()
            stream(b"")
        else:  # read whole: mitmproxy consumed nothing, so the buffer is the body
            flow.response.raw_content = bytes(self.buf)
        flow.response.timestamp_end = time.time()
        self._end()
        self.relay.pipeline.response(flow)

    def _give_up(self, reason: str) -> None:
        """Taken over, and the answer cannot be finished: the flow's error, on the record."""
        if not self.taken or self.finished:
            return
        self._end()
        self.flow.error = mflow.Error(f"the client went away and {reason}")
        with self._exchange():
            self.relay.pipeline.error(self.flow)

    def _end(self) -> None:
        self.finished = True
        if self._timer is not None:
            self._timer.cancel()


def _framed(fields) -> list[tuple[bytes, bytes]]:
    """An answer's headers with the framing left to h11 (chunked: its length is not known yet)."""
    return [(k, v) for k, v in fields if k.lower() not in (b"content-length", b"transfer-encoding")]


class Relay:
    """The addon: options, the relay server, the tickets, the upstream connection pool."""

    def __init__(self, pipeline: Stages, reached: Callable[[str, int], None] | None = None) -> None:
        self.pipeline = pipeline
        self.reached = reached  # Reach's: the upstream answered on a connection of ours
        self.timeout = 300.0
        self.keepalive = 0.0
        self.spill = 4 << 20
        self._mitmproxy_only = False  # an upstream-proxy mode or client certificates (``configure``)
        self.server: asyncio.Server | None = None
        self.port = 0
        self._tickets: dict[str, Drain] = {}
        self.fetching: dict[str, set[Drain]] = {}  # client connection id -> the drains Fetch is reading
        self.client = Client()  # the upstream connections, pooled per address and shared by every session
        self._tls: ssl.SSLContext | None = None

    def load(self, loader) -> None:
        loader.add_option(
            "intercept_drain_timeout", int, 300,
            "Seconds the proxy keeps reading a model's answer after the harness went away, to "
            "record it (the retry is answered from the record); 0: no relay, such an answer is lost.",
        )
        loader.add_option(
            "intercept_hold_keepalive", str, "0",
            "For sessions with response hooks: seconds between SSE comments sent while an answer is "
            "held (its 200 and headers go out at once); 0: off, nothing reaches the harness before "
            "the hooks decide.",
        )
        loader.add_option(
            "intercept_hold_spill", int, 4 << 20,
            "Bytes of a held SSE answer kept in memory; beyond, it is spilled to a temporary file.",
        )

    def configure(self, updated: set[str]) -> None:
        if "intercept_drain_timeout" in updated:
            if ctx.options.intercept_drain_timeout < 0:
                raise exceptions.OptionsError("intercept_drain_timeout: seconds, 0 or more")
            self.timeout = float(ctx.options.intercept_drain_timeout)
        if "intercept_hold_keepalive" in updated:  # a string: mitmproxy options have no float type
            try:
                every = float(ctx.options.intercept_hold_keepalive)
            except ValueError:
                every = -1.0
            if not 0 <= every < float("inf"):
                raise exceptions.OptionsError("intercept_hold_keepalive: seconds, 0 (off) or more")
            self.keepalive = every
        if "intercept_hold_spill" in updated:
            if ctx.options.intercept_hold_spill < 0:
                raise exceptions.OptionsError("intercept_hold_spill: bytes, 0 or more")
            self.spill = ctx.options.intercept_hold_spill
        if updated & {"ssl_insecure", "ssl_verify_upstream_trusted_ca", "ssl_verify_upstream_trusted_confdir"}:
            self._tls = None  # made again at the next https connection
        if updated & {"mode", "client_certs"}:  # read when they change (``regular_mode``)
            self._mitmproxy_only = not regular_mode() or bool(ctx.options.client_certs)

    async def running(self) -> None:
        if self.server is None:
            self.client.start()
            self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=DOWN_READ)
            self.port = self.server.sockets[0].getsockname()[1]

    async def done(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        await self.client.close()

    # -- request: point the flow at the relay -----------------------------------------------

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        ex = exchange_of(flow)
        if ex is None or ex.route.kind != "model" or flow.request.method != "POST" or ex.drain is not None:
            return
        held = hold.holds(ex)
        if (not self.port or self.timeout <= 0 or self._mitmproxy_only
                or flow.request.scheme not in ("http", "https")):
            if held:  # fail closed: an answer the hooks must see is never streamed unheld
                message = ("the session's response hooks need the proxy's relay to hold answers "
                           "(intercept_drain_timeout > 0, regular mode, no client certificates); nothing was forwarded")
                flow.response = error_response(ex.dialect, 500, message, type="hold_unavailable")
                commit(ex, flow, None, ResponseError(type="hold_unavailable", message=message, status=500))
            return
        if held:
            ex.hold = Held(spill_bytes=self.spill, keepalive=self.keepalive)
        drain = Drain(self, flow, ex, Target(flow.request.scheme, flow.request.host, flow.request.port))
        self._tickets[drain.ticket] = drain
        ex.drain = drain
        flow.request.headers[TICKET] = drain.ticket
        flow.request.scheme = "http"
        flow.request.data.host = "127.0.0.1"
        flow.request.data.port = self.port

    def forget(self, drain: Drain) -> None:
        self._tickets.pop(drain.ticket, None)

    def holds(self, drain: Drain) -> bool:
        """The flow is pointed at the relay with this drain's ticket."""
        return self._tickets.get(drain.ticket) is drain

    # -- the relay server -------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        leftover = b""
        try:
            while True:
                # An h11 connection per request: an answer passed on as the upstream framed it
                # is not sent through h11, so its state could not go on to the next cycle.
                down = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
                if leftover:
                    down.receive_data(leftover)
                request = await _next(down, reader, DOWN_READ)
                if not isinstance(request, h11.Request):
                    return
                parts: list[bytes] = []  # joined once (a large body comes in a few reads)
                while not isinstance(event := await _next(down, reader, DOWN_READ), h11.EndOfMessage):
                    if not isinstance(event, h11.Data):
                        return
                    parts.append(event.data)
                ticket = next((v.decode() for k, v in request.headers if k == TICKET.encode()), None)
                drain = self._tickets.pop(ticket, None) if ticket else None
                if drain is None:  # not a flow of ours: nothing is forwarded
                    writer.write(down.send(h11.Response(status_code=404, headers=[(b"content-length", b"0")]))
                                 + down.send(h11.EndOfMessage()))
                    return
                body = parts[0] if len(parts) == 1 else b"".join(parts)
                if not await drain.run(down, writer, request, body):
                    return
                if down.their_state is not h11.DONE:  # the request said close
                    return
                leftover, closed = down.trailing_data
                if closed:
                    return
        except (OSError, h11.ProtocolError, asyncio.IncompleteReadError):
            return
        except Exception:  # noqa: BLE001 - one exchange's bug must not end the proxy's loop
            log.exception("interceptor: relay connection failed")
        finally:
            writer.close()

    # -- upstream connections ---------------------------------------------------------------

    def tls(self, target: Target) -> ssl.SSLContext | None:
        """The TLS context for an https upstream (``upstream_tls``), made again once the options
        it reads changed."""
        if target.scheme != "https":
            return None
        if self._tls is None:
            self._tls = upstream_tls(ctx.options)
        return self._tls


class Fetch:
    """The last request step, after the Gate and the observers of its decision: a model
    exchange that does not ask for a stream is sent on the relay's own upstream connection and
    its answer read whole here, in mitmproxy's request hook, then given to mitmproxy as the
    flow's answer (``Drain.fetch``).

    Why: through the relay every exchange is two HTTP exchanges, mitmproxy's with the relay
    on loopback and the relay's with the upstream; a JSON answer is read whole before anything
    goes down anyway, so the first one only costs (CPU and latency every turn, more as the
    history grows: bench/relay.py). What stays as it was:
    mitmproxy runs the answer's hooks on it (``responseheaders``, ``response``: the pipeline,
    the commit, Retry's capture), observers see the real upstream, the upstream connections
    are the relay's pool. A client that goes away meanwhile is seen by ``Drain._watch``: the
    answer is read on (``intercept_drain_timeout``), committed as undelivered, and a retry
    coalesces on it, as a takeover does. A stream is sent from here too: once its head is
    read, the flow goes to the relay carrying no body (``Drain._lighten``) and the relay
    passes the stream down. Held answers and requests with trailers go through the relay as
    before. An error in here answers a 500 in the dialect's shape: the
    request may have gone out, so it is never sent again.
    """

    def __init__(self, relay: Relay) -> None:
        self.relay = relay

    def client_disconnected(self, client) -> None:
        """The client went away: each answer still fetched for it is now the drain's to end."""
        for drain in list(self.relay.fetching.get(client.id, ())):
            drain.gone()

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        ex = exchange_of(flow)
        drain = ex.drain if ex is not None else None
        if (drain is None or drain.started or ex.hold is not None or flow.request.trailers
                or not self.relay.holds(drain)):
            return
        try:
            await drain.fetch()
        except Exception as e:  # noqa: BLE001 - fail closed; the request may have gone out
            log.exception(f"interceptor: session {ex.session.id!r}: fetching the answer failed")
            drain.failed(e)

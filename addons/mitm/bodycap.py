"""BodyCap: a claimed request larger than ``intercept_max_body`` is answered 413 in the
dialect's shape as its bytes arrive, never read whole, and goes nowhere.

Buffering, parsing and forwarding such a body would cost memory in proportion to it and stall
every other session. No model API takes a body that size, so the proxy refuses it, records
nothing (the session summary counts it), and keeps its memory.

mitmproxy reads a request body whole before its ``request`` hook unless the body is
streamed (``flow.request.stream``, set in ``requestheaders``), and a streamed body goes to
the flow's server as it arrives, with the ``request`` hook after its end and no answer of
the hook's own. So a claimed request with a body goes, while its body arrives, to a sink this
addon runs on the loopback (never to the provider, with every credential removed first):

- ``Content-Length`` over the cap: streamed to the sink, which answers the 413 at once and
  reads the body into nothing.
- no ``Content-Length`` (chunked): the stream's callable (``Gauge``) keeps the body, up to
  the cap, and passes nothing on. Past the cap it lets go of what it kept and the sink
  answers the 413 then, while the client is still sending; the rest is counted and dropped.
  A body that ends within the cap is put back on the flow, with the flow's own destination
  and headers, as it ends (before any ``request`` hook): the steps see the request as if
  mitmproxy had read it whole. What they decide reaches the sink when the body's end does
  (mitmproxy sends that after the hook): their answer, written as it is, or the request
  passed on to where they pointed it (the Relay's loopback server) and its answer back.
  Without the Relay (``intercept_drain_timeout=0``) such a request gets a 502 in the
  dialect's shape: the sink does not reach upstreams itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from dataclasses import dataclass, field

from mitmproxy import http

from interceptor.addons.gateway.answers import error_response
from interceptor.addons.gateway.exchange import KEY, Exchange, exchange_of
from interceptor.addons.mitm.settings import Settings
from interceptor.dialects import DIALECTS
from interceptor.dialects.base import header

log = logging.getLogger(__name__)

SINK_HEADER = "x-interceptor-sink"  # the dialect whose error shape the sink answers in
LIMIT_HEADER = "x-interceptor-limit"
GAUGE_HEADER = "x-interceptor-gauge"  # the ticket of a body the Gauge measures
DISCARD = 1 << 20
# Hop-by-hop and framing fields: the sink frames what it writes itself.
_FRAMING = {"transfer-encoding", "content-length", "connection", "keep-alive"}


def too_large(limit: int, size: int | None) -> str:
    got = f"{size} bytes" if size is not None else "more"
    return (f"request body too large: {got}, this proxy accepts at most {limit} bytes "
            f"(option intercept_max_body); nothing was forwarded")


@dataclass(eq=False)
class Gauge:
    """``flow.request.stream`` for a body without ``Content-Length``: kept up to ``limit``
    bytes, nothing passed on; past it, refused (see the module docstring)."""

    flow: http.HTTPFlow
    ex: Exchange
    limit: int
    ticket: str = field(default_factory=lambda: secrets.token_hex(16))
    body: bytearray = field(default_factory=bytearray)
    size: int = 0
    over: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    # The flow's own request, put back when the body ends within the limit.
    target: tuple = ()
    headers: http.Headers | None = None

    def __call__(self, chunk: bytes) -> list[bytes]:
        if self.over.done():
            return []
        if not chunk:  # the body's end, within the limit: mitmproxy runs the request hook next
            self.restore()
            return []
        self.size += len(chunk)
        if self.size <= self.limit:
            self.body += chunk
            return []
        self.body = bytearray()
        self.ex.session.oversized += 1
        log.warning(f"interceptor: session {self.ex.session.id!r}: refused a request body past "
                    f"{self.limit} bytes as it arrived (intercept_max_body)")
        self.flow.metadata.pop(KEY, None)  # nothing to record, nothing for the Gate to check
        self.over.set_result(None)
        return []

    def restore(self) -> None:
        """The body ended within the limit: the flow's request as the client sent it."""
        req = self.flow.request
        req.headers = self.headers
        req.scheme, req.host, req.port, req.path, req.authority = self.target
        req.raw_content = bytes(self.body)
        self.body, self.headers = bytearray(), None


class BodyCap:
    """Listed right after Claim: needs the session, acts before any step reads the body."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._sink: asyncio.Server | None = None
        self.sink_port = 0
        self._gauges: dict[str, Gauge] = {}

    async def running(self) -> None:
        self._sink = await asyncio.start_server(self._answer, "127.0.0.1", 0, limit=1 << 20)
        self.sink_port = self._sink.sockets[0].getsockname()[1]

    def done(self) -> None:
        if self._sink is not None:
            self._sink.close()

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        ex = exchange_of(flow)
        limit = self.settings.max_body
        if ex is None or not limit or not self.sink_port:
            return
        length = header(flow.request.headers, "content-length", "")
        if not length:
            if "transfer-encoding" in flow.request.headers or not flow.request.http_version.startswith("HTTP/1"):
                self._gauge(flow, ex, limit)
            return
        try:
            size = int(length)
        except ValueError:
            return  # mitmproxy refuses a malformed length itself
        if size <= limit:
            return
        ex.session.oversized += 1
        log.warning(f"interceptor: session {ex.session.id!r}: refused a {size}-byte request "
                    f"(intercept_max_body is {limit})")
        del flow.metadata[KEY]  # nothing to record, nothing for the Gate to check
        self._to_sink(flow, ex, {"content-length": str(size), LIMIT_HEADER: str(limit)})
        flow.request.stream = True

    def _gauge(self, flow: http.HTTPFlow, ex: Exchange, limit: int) -> None:
        req = flow.request
        gauge = Gauge(flow, ex, limit, target=(req.scheme, req.host, req.port, req.path, req.authority),
                      headers=req.headers.copy())
        self._gauges[gauge.ticket] = gauge
        self._to_sink(flow, ex, {"transfer-encoding": "chunked", LIMIT_HEADER: str(limit), GAUGE_HEADER: gauge.ticket})
        req.stream = gauge

    def _to_sink(self, flow: http.HTTPFlow, ex: Exchange, headers: dict[str, str]) -> None:
        """The flow's request goes to the sink, with none of its own headers (credentials)."""
        req = flow.request
        req.headers.clear()
        req.headers.update({**headers, SINK_HEADER: ex.dialect.name})
        req.scheme, req.host, req.port = "http", "127.0.0.1", self.sink_port
        req.path = "/"
        req.host_header = f"127.0.0.1:{self.sink_port}"

    def request(self, flow: http.HTTPFlow) -> None:
        gauge = flow.request.stream
        if isinstance(gauge, Gauge) and gauge.headers is not None and not gauge.over.done():
            gauge.restore()  # no body came after all (mitmproxy streams none): the flow's own request
        if flow.response or flow.error or not flow.live:
            return
        ex = exchange_of(flow)
        limit = self.settings.max_body
        if ex is None or not limit or len(flow.request.raw_content or b"") <= limit:
            return
        ex.session.oversized += 1
        size = len(flow.request.raw_content or b"")
        flow.response = error_response(ex.dialect, 413, too_large(limit, size))
        del flow.metadata[KEY]
        flow.request.content = b""  # let go of it now, not when the flow is collected

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The loopback sink: a 413 in the shape the header names, then the body read into
        nothing so the proxy can finish streaming it; or, for a body the Gauge measures, the
        413 once it passes the limit, else the flow's answer once the body ended."""
        gauge = None
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            headers = dict(
                (k.strip().lower(), v.strip())
                for k, _, v in (line.partition(":") for line in head.decode("latin-1").split("\r\n")[1:] if line)
            )
            limit = int(headers.get(LIMIT_HEADER, "0"))
            dialect = DIALECTS.get(headers.get(SINK_HEADER, ""))
            if dialect is None:  # not a flow this addon pointed here: nothing to answer it with
                return
            gauge = self._gauges.pop(headers.get(GAUGE_HEADER, ""), None)
            if gauge is None:
                size = int(headers.get("content-length", "0"))
                self._refuse(writer, dialect, limit, size)
                await writer.drain()
                while size > 0:
                    chunk = await reader.read(min(DISCARD, size))
                    if not chunk:
                        break
                    size -= len(chunk)
                return
            # The Gauge passes nothing on, so the only body bytes here are the last chunk,
            # which mitmproxy sends after the ``request`` hook ran.
            ended = asyncio.ensure_future(reader.readuntil(b"0\r\n\r\n"))
            await asyncio.wait({ended, gauge.over}, return_when=asyncio.FIRST_COMPLETED)
            if gauge.over.done():
                self._refuse(writer, dialect, limit, None)
                await writer.drain()
                await ended
                return
            await ended
            await self._settle(gauge.flow, dialect, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            if gauge is not None:
                self._gauges.pop(gauge.ticket, None)
                gauge.body = bytearray()
            writer.close()

    @staticmethod
    def _refuse(writer: asyncio.StreamWriter, dialect, limit: int, size: int | None) -> None:
        body = json.dumps(dialect.error_body(413, too_large(limit, size))).encode()
        writer.write(b"HTTP/1.1 413 Payload Too Large\r\ncontent-type: application/json\r\n"
                     b"x-should-retry: false\r\nconnection: close\r\n"
                     b"content-length: %d\r\n\r\n" % len(body) + body)

    async def _settle(self, flow: http.HTTPFlow, dialect, writer: asyncio.StreamWriter) -> None:
        """The body ended within the limit and every ``request`` hook ran: what they decided
        goes to mitmproxy as this server's answer (``connection: close``: one exchange)."""
        req = flow.request
        if flow.response is not None:
            writer.write(_head(b"HTTP/1.1 %d %s" % (flow.response.status_code, flow.response.reason.encode()),
                               flow.response.headers.fields, len(flow.response.raw_content or b""))
                         + (flow.response.raw_content or b""))
        elif req.scheme == "http" and req.host == "127.0.0.1" and req.port != self.sink_port:
            # Pointed at the Relay's loopback server: the request passed on, its answer back.
            reader, upstream = await asyncio.open_connection("127.0.0.1", req.port)
            try:
                body = req.raw_content or b""
                upstream.write(_head(b"%s %s HTTP/1.1" % (req.data.method, req.data.path), req.headers.fields,
                                     len(body)) + body)
                while data := await reader.read(1 << 16):
                    writer.write(data)
                    await writer.drain()
            finally:
                upstream.close()
        else:
            message = ("a request body without Content-Length needs the proxy's relay "
                       "(intercept_drain_timeout > 0); nothing was forwarded")
            body = json.dumps(dialect.error_body(502, message)).encode()
            writer.write(_head(b"HTTP/1.1 502 Bad Gateway", [(b"content-type", b"application/json")], len(body)) + body)
        await writer.drain()


def _head(first: bytes, fields, length: int) -> bytes:
    """An HTTP/1.1 head: the fields as given, their framing replaced by ``length`` and a close."""
    lines = [first]
    lines += [k + b": " + v for k, v in fields if k.decode("latin-1").lower() not in _FRAMING]
    lines += [b"content-length: %d" % length, b"connection: close", b"", b""]
    return b"\r\n".join(lines)

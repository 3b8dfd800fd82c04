"""BodyCap: a claimed request larger than ``intercept_max_body`` is answered 413 in the
dialect's shape before its body is read whole, and goes nowhere.

A 200 MB request used to be buffered (mitmdump peaked at 1.56 GB and stayed at 948 MB),
parsed, forwarded and recorded, stalling every other session. No model API takes a body that
size, so the proxy refuses it, records nothing (the session summary counts it), and keeps
its memory.

mitmproxy reads a request body whole before its ``request`` hook unless the body is
streamed, and an answer set in ``requestheaders`` is sent only after the body was read. So a
request whose ``Content-Length`` is over the cap is streamed, chunk by chunk, to a sink this
addon runs on the loopback (never to the provider, with every credential removed first): the
sink answers the 413 at once and reads the body into nothing. A body without
``Content-Length`` (chunked) is buffered by mitmproxy as always and refused in ``request``,
still before anything leaves.
"""

from __future__ import annotations

import asyncio
import json
import logging

from mitmproxy import http

from interceptor.addons.answers import error_response
from interceptor.addons.exchange import KEY, exchange_of
from interceptor.addons.settings import Settings
from interceptor.dialects import CHAT, DIALECTS
from interceptor.dialects.base import header

log = logging.getLogger(__name__)

SINK_HEADER = "x-interceptor-sink"  # the dialect whose error shape the sink answers in
DISCARD = 1 << 20


def too_large(limit: int, size: int | None) -> str:
    got = f"{size} bytes" if size is not None else "more"
    return (f"request body too large: {got}, this proxy accepts at most {limit} bytes "
            f"(option intercept_max_body); nothing was forwarded")


class BodyCap:
    """Listed right after Claim: needs the session, acts before any step reads the body."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._sink: asyncio.Server | None = None
        self.sink_port = 0

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
        if ex is None or not limit:
            return
        try:
            size = int(header(flow.request.headers, "content-length", ""))
        except ValueError:
            return  # chunked or none: measured in ``request``
        if size <= limit or not self.sink_port:
            return
        ex.session.oversized += 1
        log.warning(f"interceptor: session {ex.session.id!r}: refused a {size}-byte request "
                    f"(intercept_max_body is {limit})")
        del flow.metadata[KEY]  # nothing to record, nothing for the Gate to check
        flow.request.headers.clear()
        flow.request.headers.update({"content-length": str(size), SINK_HEADER: ex.dialect.name,
                                     "x-interceptor-limit": str(limit)})
        flow.request.scheme, flow.request.host, flow.request.port = "http", "127.0.0.1", self.sink_port
        flow.request.path = "/"
        flow.request.host_header = f"127.0.0.1:{self.sink_port}"
        flow.request.stream = True

    def request(self, flow: http.HTTPFlow) -> None:
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

    @staticmethod
    async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The loopback sink: a 413 in the shape the header names, then the body read into
        nothing so the proxy can finish streaming it."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            headers = dict(
                (k.strip().lower(), v.strip())
                for k, _, v in (line.partition(":") for line in head.decode("latin-1").split("\r\n")[1:] if line)
            )
            size = int(headers.get("content-length", "0"))
            limit = int(headers.get("x-interceptor-limit", "0"))
            dialect = DIALECTS.get(headers.get(SINK_HEADER, ""), CHAT)
            body = json.dumps(dialect.error_body(413, too_large(limit, size))).encode()
            writer.write(b"HTTP/1.1 413 Payload Too Large\r\ncontent-type: application/json\r\n"
                         b"x-should-retry: false\r\nconnection: close\r\n"
                         b"content-length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()
            while size > 0:
                chunk = await reader.read(min(DISCARD, size))
                if not chunk:
                    break
                size -= len(chunk)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()

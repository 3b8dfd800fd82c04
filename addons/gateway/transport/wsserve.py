"""WsServe: the proxy is the other end of Codex's Responses WebSocket when the session's
upstream serves none, and speaks HTTP to that upstream, so Codex never waits for a fallback.

Codex CLI opens ``GET /v1/responses`` with ``Upgrade: websocket`` and, if the upgrade fails,
retries it for a while before it falls back to ``POST /v1/responses``. For a session whose
upstream serves no such socket, the upgrade goes to this addon's own WebSocket server
(127.0.0.1, in the proxy's loop, one-use ticket header), so mitmproxy relays the socket like
any other (a 101 an addon made up would leave mitmproxy's WebSocket layer without a server
side, and it crashes when the client closes). Each ``response.create`` frame becomes the
``POST /v1/responses`` (``stream: true``) Codex would have fallen back to, sent to the proxy's
own port, so every addon handles it as that POST (claim, policy, hooks, translation, the
record, the retry rules); its SSE events go back one text frame each, an HTTP error as an
``error`` frame with its status, body and retry headers. What the Responses WebSocket server
keeps, this keeps per session: ``previous_response_id`` is resolved here (the POST carries the
whole chain, so the upstream needs no stored responses), a warm-up (``generate: false``) is
answered here with nothing sent or recorded, and a frame resent on a new socket after a drop
is flagged as a retry (``x-stainless-retry-count: 1``), so Retry coalesces or replays it. One
keep-alive connection per socket carries its POSTs, so "delivered" means what it does over
HTTP. A frame that is not a JSON object or chains on an unknown id gets an ``error`` frame in
the API's shape; nothing leaves.

Which sessions: an upstream of another dialect, a Responses upstream declared without the
transport (``"websocket": false``) or that refused the session's upgrade once (WsRelay
reports it), and sessions with response hooks (addons/gateway/answer/hold.py holds answers over HTTP only);
in mitmproxy's regular mode only. Listed after Claim and before Rewrite (which refuses a
translated session's upgrade): from here on the upgrade is unclaimed, so WsRelay, the Gate
and the Tee leave its frames alone.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import h11
from mitmproxy import http
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import AcceptConnection, CloseConnection, Ping, RejectConnection, TextMessage
from wsproto.events import Request as WsRequest
from wsproto.extensions import PerMessageDeflate
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from interceptor.addons.gateway.exchange import KEY, Exchange, exchange_of
from interceptor.addons.gateway.answer.hold import holds
from interceptor.addons.gateway.transport.relay import _next as next_event
from interceptor.addons.gateway.transport.modes import regular_mode
from interceptor.addons.gateway.transport.wsrelay import is_upgrade
from interceptor.dialects.sse import SSEDecoder
from interceptor.trace import Response

log = logging.getLogger(__name__)

SERVE_KEY = "interceptor_ws_served"  # flow.metadata: where the served upgrade was addressed
TICKET = "x-interceptor-ws"  # the upgrade's one-use ticket to this addon's server
REFUSED = "ws_upgrade_refused"  # Session.state: the upstream refused this session's upgrade
UNDELIVERED = "ws_undelivered"  # Session.state: the digest of a POST whose answer a socket lost
CHAINS = 8  # answer ids a session remembers for previous_response_id (Codex chains on its last)
MAX_HEAD = 1 << 20
READ = 1 << 16
REFUSALS = (400, 403, 404, 405, 426, 501)  # an upgrade answered so: no WebSocket there
RETRY_HEADERS = ("retry-after", "retry-after-ms", "x-should-retry")
# The upgrade's headers that describe the socket, not the request a frame stands for.
SOCKET_HEADERS = frozenset({
    "host", "connection", "upgrade", "content-length", "transfer-encoding", "keep-alive", "te", "trailer",
    "authorization", "proxy-authorization", "accept", "accept-encoding", "content-type", "content-encoding",
    "openai-beta",
})


def _items(value: Any) -> list[Any]:
    """A Responses ``input`` as a list of items (a bare string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    if value is not None and not isinstance(value, list):
        raise FrameError(400, f"input must be a string or a list of items, not {type(value).__name__}")
    return list(value or [])


@dataclass(eq=False)
class Chains:
    """A session's ``previous_response_id`` memory: answer id -> the request's other fields
    (instructions, tools: a chained frame restates none of them, and the model still has
    them) and every input and output item up to it. Bounded: a chain goes forward, and only
    its last ids are ever named again."""

    ids: OrderedDict[str, tuple[dict[str, Any], list[Any]]] = field(default_factory=OrderedDict)

    def get(self, rid: str) -> tuple[dict[str, Any], list[Any]] | None:
        return self.ids.get(rid)

    def put(self, rid: str, body: dict[str, Any], items: list[Any]) -> None:
        self.ids[rid] = ({k: v for k, v in body.items() if k != "input"}, items)
        self.ids.move_to_end(rid)
        while len(self.ids) > CHAINS:
            self.ids.popitem(last=False)


class FrameError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(eq=False)
class Served:
    """One socket the proxy serves: the upgrade's session and headers, its POST connection."""

    upgrade: Exchange
    url: str  # the absolute URL the POSTs name (the upgrade's own: Claim and Rewrite treat it so)
    host: str
    headers: list[tuple[bytes, bytes]]
    send: Callable[[str], None] | None = None  # one text frame to Codex
    task: asyncio.Task | None = None
    sending: str | None = None  # the digest of the POST whose answer is under way on this socket
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter, h11.Connection] | None = None
    closed: bool = False

    @property
    def chains(self) -> Chains:
        return self.upgrade.session.state.setdefault("ws_chains", Chains())

    def close(self) -> None:
        if self.sending is not None:
            # Its answer never reached Codex whole: the same frame from it again is a retry.
            self.upgrade.session.state[UNDELIVERED] = self.sending
        self.closed = True
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self.drop_conn()

    def drop_conn(self) -> None:
        if self.conn is not None:
            self.conn[1].close()
            self.conn = None


class WsServe:
    def __init__(self, bound_address: Callable[[], tuple[str, int] | None]) -> None:
        # Where the proxy listens (the mitmproxy side knows): each frame is posted back to it.
        self.bound_address = bound_address
        self.server: asyncio.Server | None = None
        self.port = 0
        self._tickets: dict[str, Served] = {}

    @staticmethod
    def serves(ex: Exchange) -> bool:
        up = ex.session.upstream
        if up is None or up.replay is not None or not regular_mode():
            return False
        if up.dialect is not None and up.dialect != ex.dialect.name:
            return True
        # A session with response hooks holds its answers in the relay (addons/gateway/answer/hold.py), which
        # carries HTTP only: served here, each frame is a POST the relay holds, and Codex keeps
        # its socket instead of falling back after its refused upgrades.
        return ex.dialect.name == "responses" and (not up.websocket or holds(ex) or bool(ex.session.state.get(REFUSED)))

    def upstream_refused(self, ex: Exchange, status: int | None) -> bool:
        """WsRelay saw the session's upstream refuse the upgrade: Codex's next one is served
        here (True), unless this proxy cannot serve it. Per session, not per upstream: an
        upstream may gain the transport, and a declaration (``"websocket": false``) spares
        even the first refusal."""
        if ex.dialect.name != "responses" or status not in REFUSALS:
            return False
        ex.session.state[REFUSED] = True
        if not self.port or not self.serves(ex):
            return False
        log.info(f"interceptor: session {ex.session.id!r}: the upstream answered the Responses WebSocket "
                 f"upgrade with {status}; the proxy serves the session's next upgrade itself (frames go "
                 "upstream as HTTP)")
        return True

    async def running(self) -> None:
        if self.server is None:
            self.server = await asyncio.start_server(self._socket, "127.0.0.1", 0, limit=MAX_HEAD)
            self.port = self.server.sockets[0].getsockname()[1]

    async def done(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    # -- the upgrade -----------------------------------------------------------------------

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        ex = exchange_of(flow)
        if (ex is None or flow.request.method != "GET" or not is_upgrade(flow.request) or not self.port
                or not self.serves(ex)):
            return
        req = flow.request
        default = (req.scheme, req.port) in (("https", 443), ("http", 80))
        host = req.host if default else f"{req.host}:{req.port}"
        headers = [(k.encode(), v.encode()) for k, v in req.headers.items(multi=True)
                   if k.lower() not in SOCKET_HEADERS and not k.lower().startswith("sec-websocket")]
        served = Served(ex, f"{req.scheme}://{host}{req.path.split('?', 1)[0]}", host, headers)
        ticket = secrets.token_hex(16)
        self._tickets[ticket] = served
        # The upgrade goes to this addon's own WebSocket server in the proxy's loop, so
        # mitmproxy relays the socket as any other (a 101 made up by an addon would leave its
        # WebSocket layer without a server side, which it cannot close). It is no model
        # call and leaves nothing: unclaimed from here on (no step waits for it), without
        # the harness's credential.
        flow.metadata.pop(KEY, None)
        for name in ("authorization", "proxy-authorization"):
            req.headers.pop(name, None)
        req.headers[TICKET] = ticket
        flow.metadata[SERVE_KEY] = (req.scheme, req.data.host, req.data.port)
        req.scheme, req.data.host, req.data.port = "http", "127.0.0.1", self.port
        why = "its response hooks hold answers" if holds(ex) else f"its upstream {ex.session.upstream.name!r} serves none"
        log.info(f"interceptor: session {ex.session.id!r}: the Responses WebSocket is served by the proxy "
                 f"({why}); frames go upstream as HTTP")

    def response(self, flow: http.HTTPFlow) -> None:
        target = flow.metadata.pop(SERVE_KEY, None)
        if isinstance(target, tuple):  # observers see the provider the harness addressed
            flow.request.scheme, flow.request.data.host, flow.request.data.port = target
            self._tickets.pop(flow.request.headers.pop(TICKET, ""), None)

    def error(self, flow: http.HTTPFlow) -> None:
        self.response(flow)

    # -- the socket ------------------------------------------------------------------------

    async def _socket(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ws = WSConnection(ConnectionType.SERVER)
        served: Served | None = None
        queue: asyncio.Queue[str] = asyncio.Queue()
        parts: list[str] = []

        def send(text: str) -> None:
            if not writer.is_closing():
                writer.write(ws.send(TextMessage(data=text)))

        try:
            while True:
                data = await reader.read(READ)
                ws.receive_data(data or None)
                for event in ws.events():
                    if isinstance(event, WsRequest):
                        ticket = next((v for k, v in event.extra_headers if k.lower() == TICKET.encode()), b"")
                        served = self._tickets.pop(ticket.decode("latin-1"), None)
                        if served is None:  # not an upgrade of ours: nothing is served
                            writer.write(ws.send(RejectConnection(status_code=404)))
                            return
                        writer.write(ws.send(AcceptConnection(extensions=[PerMessageDeflate()])))
                        served.send = send
                        served.task = asyncio.get_running_loop().create_task(self._frames(served, queue))
                    elif isinstance(event, TextMessage):
                        parts.append(event.data)
                        if event.message_finished:
                            text, parts = "".join(parts), []
                            queue.put_nowait(text)
                    elif isinstance(event, Ping):
                        writer.write(ws.send(event.response()))
                    elif isinstance(event, CloseConnection):
                        if ws.state is ConnectionState.REMOTE_CLOSING:
                            writer.write(ws.send(event.response()))
                        return
                if not data:
                    return
        except (OSError, LocalProtocolError, RemoteProtocolError):
            return
        finally:
            if served is not None:
                # An answer in flight keeps going on the proxy's side (the relay reads it to
                # its end and records it undelivered); its frames have nowhere to go.
                served.close()
            writer.close()

    async def _frames(self, served: Served, queue: asyncio.Queue[str]) -> None:
        """The socket's frames answered one at a time, in the order they came (Codex waits
        for each answer's terminal frame before its next)."""
        while True:
            text = await queue.get()
            try:
                frame = json.loads(text)
            except ValueError:
                self._error(served, 400, "the frame is not valid JSON")
                continue
            if not isinstance(frame, dict):
                self._error(served, 400, "a frame must be a JSON object")
            elif frame.get("type") == "response.create":
                await self._answer(served, frame)
            # response.processed and the like need no answer

    # -- a frame's answer ------------------------------------------------------------------

    async def _answer(self, served: Served, frame: dict[str, Any]) -> None:
        try:
            body = self._body(served, frame)
            if frame.get("generate") is False:
                self._warmup(served, body)
            else:
                await self._post(served, body)
        except FrameError as e:
            self._error(served, e.status, str(e), e.code)
        except asyncio.CancelledError:
            served.drop_conn()
            raise
        except Exception as e:  # noqa: BLE001 - the harness gets an error frame, never silence
            served.drop_conn()
            log.exception(f"interceptor: session {served.upgrade.session.id!r}: a WebSocket frame failed")
            self._error(served, 502, f"the proxy could not answer the frame ({type(e).__name__})")

    @staticmethod
    def _body(served: Served, frame: dict[str, Any]) -> dict[str, Any]:
        """The POST body a frame stands for: the chain resolved, the whole input as a list."""
        body = {k: v for k, v in frame.items() if k not in ("type", "generate", "previous_response_id")}
        previous = frame.get("previous_response_id")
        if previous is not None:
            earlier = served.chains.get(previous) if isinstance(previous, str) else None
            if earlier is None:
                # As the Responses API answers an id it does not have.
                raise FrameError(400, f"Previous response with id '{previous}' not found.",
                                 "previous_response_not_found")
            base, items = earlier
            body = {**base, **body, "input": items + _items(frame.get("input"))}
        body["stream"] = True
        return body

    def _warmup(self, served: Served, body: dict[str, Any]) -> None:
        """An empty completed answer with an id to chain on (what the API's warm-up sends)."""
        dialect = served.upgrade.dialect
        response = Response(id=f"resp_{uuid.uuid4().hex}", model=dialect.requested_model(body, ""),
                            finish_reason="stop")
        response.message.content = ""
        served.chains.put(response.id, body, _items(body.get("input")))
        for event in dialect.stream_events(response):
            self._send(served, event.data)

    async def _post(self, served: Served, body: dict[str, Any]) -> None:
        content = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        # What the frame asks, less what Codex sends anew with every attempt: its resend is the same.
        digest = hashlib.sha256(served.upgrade.dialect.identity(content)).hexdigest()
        state = served.upgrade.session.state
        # The frame a dropped socket left unanswered, resent: flagged as the SDKs flag a retry,
        # so Retry coalesces it on the answer the proxy is still reading, or replays it.
        retry = state.get(UNDELIVERED) == digest
        if retry:
            del state[UNDELIVERED]
        reader, writer, conn = await self._connection(served)
        served.sending = digest
        secret = served.upgrade.session.model_secret.encode()
        headers = [(b"host", served.host.encode()), (b"proxy-authorization", b"Bearer " + secret),
                   (b"authorization", b"Bearer " + secret), (b"content-type", b"application/json"),
                   (b"accept", b"text/event-stream"), (b"content-length", str(len(content)).encode()),
                   *served.headers]
        if retry:
            headers.append((b"x-stainless-retry-count", b"1"))
        writer.write(conn.send(h11.Request(method="POST", target=served.url, headers=headers))
                     + conn.send(h11.Data(data=content)) + conn.send(h11.EndOfMessage()))
        await writer.drain()
        event = await next_event(conn, reader)
        while isinstance(event, h11.InformationalResponse):
            event = await next_event(conn, reader)
        if not isinstance(event, h11.Response):
            raise ConnectionError(f"the proxy answered the frame's request with {type(event).__name__}")
        status = event.status_code
        head = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}
        ctype = head.get("content-type", "")
        sse = SSEDecoder() if status == 200 and ctype.startswith("text/event-stream") else None
        whole = bytearray()
        terminal = False
        while True:
            event = await next_event(conn, reader)
            if isinstance(event, h11.EndOfMessage):
                break
            if not isinstance(event, h11.Data):
                raise ConnectionError(f"the frame's answer broke ({type(event).__name__})")
            if sse is None:
                whole += event.data
                continue
            for ev in sse.feed(bytes(event.data)):
                terminal |= self._event(served, ev.data, body)
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        else:
            served.drop_conn()
        if sse is not None:
            for ev in sse.flush():
                terminal |= self._event(served, ev.data, body)
            served.sending = None
            if not terminal:
                self._error(served, 502, "the answer ended without its terminal event")
            return
        served.sending = None
        self._http_error(served, status, bytes(whole), head)

    def _event(self, served: Served, data: str, body: dict[str, Any]) -> bool:
        """One SSE event as one text frame; True at the answer's terminal event."""
        if not data or data == "[DONE]":
            return False
        self._send(served, data)
        try:
            obj = json.loads(data)
        except ValueError:
            return False
        kind = obj.get("type") if isinstance(obj, dict) else None
        if kind not in served.upgrade.dialect.terminal_events:
            return False
        served.sending = None  # Codex has the whole answer
        response = obj.get("response") if kind != "error" else None
        if isinstance(response, dict) and isinstance(response.get("id"), str):
            served.chains.put(response["id"], body, _items(body.get("input")) + list(response.get("output") or []))
        return True

    def _http_error(self, served: Served, status: int, content: bytes,
                    head: dict[str, str]) -> None:
        """An HTTP error answer as the API's error frame: its status, its body, its retry headers."""
        try:
            body = json.loads(content or b"null")
        except ValueError:
            body = None
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            frame = {"type": "error", "status": status, **body}
            kept = {k: head[k] for k in RETRY_HEADERS if k in head}
            if kept:
                frame["headers"] = kept
            self._send(served, json.dumps(frame, ensure_ascii=False))
            return
        self._error(served, status if status >= 400 else 502,
                    f"the upstream answered {status} without an error body")

    # -- the wire --------------------------------------------------------------------------

    def _error(self, served: Served, status: int, message: str, code: str | None = None) -> None:
        error = served.upgrade.dialect.socket_error(status, message)
        if code is not None and isinstance(error.get("error"), dict):
            error["error"]["code"] = code
        self._send(served, json.dumps(error, ensure_ascii=False))

    @staticmethod
    def _send(served: Served, text: str) -> None:
        if not served.closed and served.send is not None:
            served.send(text)

    async def _connection(self, served: Served):
        if served.conn is not None and not served.conn[1].is_closing() and not served.conn[0].at_eof():
            return served.conn
        served.drop_conn()
        bound = self.bound_address()
        if bound is None:
            raise ConnectionError("the proxy's own address is not known yet")
        host, port = bound
        if host in ("", "0.0.0.0", "::"):
            host = "127.0.0.1"
        reader, writer = await asyncio.open_connection(host, port, limit=MAX_HEAD)
        served.conn = (reader, writer, h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD))
        return served.conn

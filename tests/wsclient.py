"""A small blocking WebSocket client for tests: Codex's Responses transport without Codex.

It reaches the server the way Codex does: through an HTTP proxy with CONNECT, TLS checked
against a CA file, then the upgrade with the API key in `Authorization`. wsproto (a
mitmproxy dependency) does the framing, including `permessage-deflate` when the server
accepts it.
"""

from __future__ import annotations

import json
import socket
import ssl
from typing import Any
from urllib.parse import urlsplit

from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Message,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.extensions import PerMessageDeflate


class Rejected(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"upgrade refused with {status}: {body[:200]!r}")
        self.status = status
        self.body = body


class WSClient:
    def __init__(self, url: str, *, headers: dict[str, str] | None = None, proxy: str | None = None,
                 cafile: str | None = None, deflate: bool = True, timeout: float = 30.0) -> None:
        u = urlsplit(url)
        secure = u.scheme in ("https", "wss")
        host, port = u.hostname or "", u.port or (443 if secure else 80)
        if proxy:
            p = urlsplit(proxy)
            sock = socket.create_connection((p.hostname, p.port or 8080), timeout=timeout)
            sock.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
            reply = b""
            while b"\r\n\r\n" not in reply:
                chunk = sock.recv(4096)
                if not chunk:
                    raise ConnectionError("the proxy closed the connection during CONNECT")
                reply += chunk
            if b" 200" not in reply.split(b"\r\n", 1)[0]:
                raise ConnectionError(f"CONNECT refused: {reply.split(b'\r\n', 1)[0]!r}")
        else:
            sock = socket.create_connection((host, port), timeout=timeout)
        if secure:
            context = ssl.create_default_context(cafile=cafile)
            sock = context.wrap_socket(sock, server_hostname=host)
        self.sock = sock
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.pending: list[Any] = []
        self.parts: list[str] = []
        self.response_headers: dict[str, str] = {}
        target = u.path + (f"?{u.query}" if u.query else "")
        extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        self._send(Request(host=u.netloc, target=target or "/", extra_headers=extra,
                           extensions=[PerMessageDeflate()] if deflate else []))
        self._handshake()

    def _send(self, event: Any) -> None:
        self.sock.sendall(self.ws.send(event))

    def _events(self):
        while not self.pending:
            data = self.sock.recv(65536)
            self.ws.receive_data(data or None)
            self.pending.extend(self.ws.events())
            if not data and not self.pending:
                raise ConnectionError("the connection closed")
        return self.pending.pop(0)

    def _handshake(self) -> None:
        event = self._events()
        if isinstance(event, AcceptConnection):
            self.response_headers = {k.decode().lower(): v.decode() for k, v in event.extra_headers}
            return
        if isinstance(event, RejectConnection):
            status, body = event.status_code, b""
            if event.has_body:
                while True:
                    data = self._events()
                    if isinstance(data, RejectData):
                        body += data.data
                        if data.body_finished:
                            break
            raise Rejected(status, body)
        raise ConnectionError(f"unexpected handshake event {event!r}")

    def send_json(self, obj: Any) -> None:
        self._send(TextMessage(data=json.dumps(obj)))

    def recv_json(self) -> dict[str, Any]:
        """The next text message, parsed; raises ConnectionError when the server closes."""
        while True:
            event = self._events()
            if isinstance(event, Message):
                self.parts.append(event.data if isinstance(event.data, str) else event.data.decode())
                if event.message_finished:
                    text, self.parts = "".join(self.parts), []
                    return json.loads(text)
            elif isinstance(event, Ping):
                self._send(event.response())
            elif isinstance(event, CloseConnection):
                raise ConnectionError(f"closed by the server: {event.code} {event.reason}")

    def until(self, *types: str) -> list[dict[str, Any]]:
        """Every event up to and including the first whose type is one of `types`."""
        out = []
        while True:
            event = self.recv_json()
            out.append(event)
            if event.get("type") in types:
                return out

    def close(self) -> None:
        try:
            self._send(CloseConnection(code=1000))
        except Exception:
            pass
        self.sock.close()

    def __enter__(self) -> WSClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

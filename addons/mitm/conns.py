"""Client connections: what a client cannot hold of the proxy by how it keeps a connection.

``ClientTimeouts``: a client connection waits at most ``intercept_client_idle_timeout`` for
its next request's head (from its start, the end of its last answer, or its tunnel's TLS: an
idle keep-alive and a head that never ends alike), and at most
``intercept_client_body_timeout`` from a request's head to the end of its body; then the
proxy closes it. Never while an answer is produced or sent (a model can think for minutes
before its first byte or between events), nor once it carries a WebSocket (Codex keeps one
for a whole rollout) or a tunnel the proxy does not read. mitmproxy's own ``tcp_timeout``
counts any activity, so a client that sends a byte now and then holds its connection for
ever; and mitmproxy 12 has no way to close a client connection from outside a hook (a flow
killed in transit is not stopped, its ``Flow.kill`` says so, and
https://github.com/mitmproxy/mitmproxy/issues/8045). The hooks that mark each phase note when
it began; a sweep finds what is past its timeout, and the connection's own socket, found by the
addresses mitmproxy reports for it (``Client.sockname``/``peername``), is shut down: mitmproxy
reads its end as the client's close and tears the connection down its usual way.

``AcceptErrors``: out of file descriptors, asyncio's accept loop reports every failed
``accept()`` to the loop's exception handler (several hundred a second, each a traceback in
mitmproxy's log: tens of MB a minute, and the log's work starves the sessions still served).
The handler mitmproxy installed is wrapped, not replaced: that one condition is said once per
``LOG_EVERY`` seconds with the count, and its end (``QUIET`` seconds without a failure) once; every other report goes to mitmproxy's handler as before. Connections
that cannot be accepted wait in the kernel's listen queue meanwhile (asyncio retries every
second); the open ones are served.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import socket
import stat
import time
from dataclasses import dataclass, field
from typing import Any

from mitmproxy import connection, ctx, exceptions, http, tls

log = logging.getLogger(__name__)

LOG_EVERY = 30.0  # seconds between two lines about failing accepts
# Seconds without a failed accept that end the condition: asyncio retries a failed accept after
# one second (``asyncio.constants.ACCEPT_RETRY_DELAY``), and fails again while it lasts.
QUIET = 2.0
# What asyncio's accept loop reports as running out of a system resource (and retries).
OUT_OF = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


@dataclass(eq=False, slots=True)
class _Conn:
    client: connection.Client
    waiting: float | None = None  # since when it waits for a request's head (monotonic); None: not
    bodies: dict[str, float] = field(default_factory=dict)  # flow id -> when its head came, body not yet whole
    open: set[str] = field(default_factory=set)  # flows whose answer has not ended
    carried: bool = False  # a WebSocket or an unread tunnel: no request comes any more


def _where(address: Any) -> str:
    return f"{address[0]}:{address[1]}" if address else "?"


def _same(a: Any, b: Any) -> bool:
    """Two socket addresses alike (IPv6 ones carry flow info and scope after host and port)."""
    return a is not None and b is not None and tuple(a[:2]) == tuple(b[:2])


def _fds() -> list[int]:
    """This process's descriptors; out of them (listing /dev/fd takes one), every number below
    the limit, which costs a system call each but takes no descriptor."""
    try:
        return [int(name) for name in os.listdir("/dev/fd")]
    except OSError:
        return list(range(min(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 1 << 20)))


def shut_down(client: connection.Client) -> bool:
    """Shut the client connection's socket down (both ways); False if none is found. mitmproxy
    reads the end and closes the connection itself; the client reads the close."""
    for fd in _fds():
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=fd)  # the descriptor itself, not a copy: detached below
        except OSError:
            continue
        try:
            if _same(sock.getsockname(), client.sockname) and _same(sock.getpeername(), client.peername):
                sock.shutdown(socket.SHUT_RDWR)
                return True
        except OSError:
            continue
        finally:
            sock.detach()
    return False


class ClientTimeouts:
    """The addon (see the module docstring). A hook only notes when a phase began (a float per
    connection, no timer per request); one sweep every ``tick`` seconds closes what is past its
    timeout, so a timeout fires at most a tick late."""

    def __init__(self) -> None:
        self.idle = 600.0
        self.body = 300.0
        self.conns: dict[str, _Conn] = {}
        self.sweeping: asyncio.TimerHandle | None = None

    def load(self, loader) -> None:
        loader.add_option(
            "intercept_client_idle_timeout", int, 600,
            "Seconds a client connection may wait for its next request's head (from its start or "
            "its last answer's end: idle, or a head that never ends) before the proxy closes it. "
            "Never while an answer is produced or sent, nor a WebSocket. 0: never.",
        )
        loader.add_option(
            "intercept_client_body_timeout", int, 300,
            "Seconds a client may take from a request's head to its body's end before the proxy "
            "closes the connection. 0: never.",
        )

    def configure(self, updated: set[str]) -> None:
        for name in ("intercept_client_idle_timeout", "intercept_client_body_timeout"):
            if name in updated and getattr(ctx.options, name) < 0:
                raise exceptions.OptionsError(f"{name}: seconds, 0 (never) or more")
        if "intercept_client_idle_timeout" in updated:
            self.idle = float(ctx.options.intercept_client_idle_timeout)
        if "intercept_client_body_timeout" in updated:
            self.body = float(ctx.options.intercept_client_body_timeout)

    @property
    def tick(self) -> float:
        """A quarter of the shorter timeout, clamped to 0.05-5 seconds."""
        timeouts = [t for t in (self.idle, self.body) if t > 0]
        return min(max(min(timeouts) / 4, 0.05), 5.0) if timeouts else 5.0

    def running(self) -> None:
        if self.sweeping is None:
            self.sweeping = asyncio.get_running_loop().call_later(self.tick, self._sweep)

    def done(self) -> None:
        if self.sweeping is not None:
            self.sweeping.cancel()
            self.sweeping = None

    # -- the phases --------------------------------------------------------------------------

    def client_connected(self, client: connection.Client) -> None:
        self.conns[client.id] = _Conn(client, waiting=time.monotonic())

    def client_disconnected(self, client: connection.Client) -> None:
        self.conns.pop(client.id, None)

    def tls_established_client(self, data: tls.TlsData) -> None:
        """The tunnel's TLS is the proxy's: its first request is waited for as any."""
        self._requests_again(data.context.client.id)

    def http_connect(self, flow: http.HTTPFlow) -> None:
        conn = self.conns.get(flow.client_conn.id)
        if conn is not None:
            conn.waiting = None
            conn.carried = True  # until its TLS is the proxy's (``tls_established_client``)

    def http_connect_error(self, flow: http.HTTPFlow) -> None:
        self._requests_again(flow.client_conn.id)

    def _requests_again(self, client_id: str) -> None:
        """The connection carries requests again (not a tunnel): the next one is waited for."""
        conn = self.conns.get(client_id)
        if conn is not None:
            conn.carried = False
            if not conn.open:
                conn.waiting = time.monotonic()

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        conn = self.conns.get(flow.client_conn.id)
        if conn is not None:
            conn.waiting = None
            conn.open.add(flow.id)
            conn.bodies[flow.id] = time.monotonic()

    def request(self, flow: http.HTTPFlow) -> None:
        conn = self.conns.get(flow.client_conn.id)
        if conn is not None:
            conn.bodies.pop(flow.id, None)

    def response(self, flow: http.HTTPFlow) -> None:
        self._ended(flow, carried=flow.response is not None and flow.response.status_code == 101)

    def error(self, flow: http.HTTPFlow) -> None:
        self._ended(flow)

    def websocket_start(self, flow: http.HTTPFlow) -> None:
        conn = self.conns.get(flow.client_conn.id)
        if conn is not None:
            conn.carried = True
            conn.waiting = None

    def _ended(self, flow: http.HTTPFlow, carried: bool = False) -> None:
        """The flow's answer ended (the ``response`` hook of a stream comes at its end): with
        no other request open on the connection, it waits for the next one."""
        conn = self.conns.get(flow.client_conn.id)
        if conn is None:
            return
        conn.bodies.pop(flow.id, None)
        conn.open.discard(flow.id)
        conn.carried = conn.carried or carried
        if not conn.open and not conn.carried:
            conn.waiting = time.monotonic()

    # -- the sweep ---------------------------------------------------------------------------

    def _sweep(self) -> None:
        self.sweeping = asyncio.get_running_loop().call_later(self.tick, self._sweep)
        now, idle, body = time.monotonic(), self.idle, self.body
        for conn in list(self.conns.values()):
            if idle > 0 and conn.waiting is not None and now - conn.waiting >= idle:
                self._close(conn, f"no request within intercept_client_idle_timeout ({idle:g} s)")
            elif body > 0 and conn.bodies and now - min(conn.bodies.values()) >= body:
                self._close(conn, f"no whole request body within intercept_client_body_timeout ({body:g} s)")

    def _close(self, conn: _Conn, what: str) -> None:
        conn.waiting = None  # said once: the connection's end comes as its client_disconnected
        conn.bodies.clear()
        where = _where(conn.client.peername)
        if shut_down(conn.client):
            log.info(f"interceptor: closed the client connection {where}: {what}")
        else:
            log.warning(f"interceptor: the client connection {where} is past its timeout ({what}) "
                        f"and its socket was not found to close it")


class AcceptErrors:
    """The addon (see the module docstring): mitmproxy's loop exception handler, wrapped."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.inner: Any = None  # the handler wrapped (mitmproxy's); None: asyncio's default
        self.failed = 0  # accepts failed since the condition began
        self.unsaid = 0  # of them, since the last line
        self.said = float("-inf")
        self.last = 0.0  # the last failure's time
        self.watch: asyncio.TimerHandle | None = None

    def running(self) -> None:
        loop = asyncio.get_running_loop()
        current = loop.get_exception_handler()
        if isinstance(current, _Handler):  # a reloaded script: the first wrapper stays
            return
        self.loop, self.inner = loop, current
        loop.set_exception_handler(_Handler(self))

    def done(self) -> None:
        loop = self.loop
        if loop is not None and isinstance(h := loop.get_exception_handler(), _Handler) and h.errors is self:
            loop.set_exception_handler(self.inner)
        if self.watch is not None:
            self.watch.cancel()
        self.loop = None

    def handle(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        e = context.get("exception")
        if isinstance(e, OSError) and e.errno in OUT_OF and "socket" in context:
            self._out_of(loop, e, context["socket"])
        elif self.inner is not None:
            self.inner(loop, context)
        else:
            loop.default_exception_handler(context)

    def _out_of(self, loop: asyncio.AbstractEventLoop, e: OSError, sock: Any) -> None:
        self.failed += 1
        self.unsaid += 1
        self.last = now = time.monotonic()
        if self.watch is None:
            self.watch = loop.call_later(QUIET, self._quiet)
        if now - self.said < LOG_EVERY:
            return
        try:
            where = f" on {_where(sock.getsockname())}"
        except OSError:
            where = ""
        since = f" ({self.unsaid} failed accepts since the last line)" if self.said > float("-inf") else ""
        log.error(f"interceptor: out of file descriptors ({e.strerror}) accepting{where}: new connections wait "
                  f"in the listen queue while the open ones are served{since}. Raise the limit (ulimit -n) "
                  f"or run fewer sessions per proxy. Said at most once per {LOG_EVERY:g} s.")
        self.said = now
        self.unsaid = 0

    def _quiet(self) -> None:
        """No failed accept for ``QUIET`` seconds (asyncio retries each second while out): over."""
        loop = self.loop or asyncio.get_running_loop()
        waited = time.monotonic() - self.last
        if waited < QUIET:
            self.watch = loop.call_later(QUIET - waited, self._quiet)
            return
        self.watch = None
        log.warning(f"interceptor: accepting connections again ({self.failed} accepts had failed "
                    f"for lack of file descriptors)")
        self.failed = self.unsaid = 0
        self.said = float("-inf")


class _Handler:
    """The loop's exception handler: ``AcceptErrors.handle`` (a class of its own, so a second
    ``running`` knows it is installed already)."""

    def __init__(self, errors: AcceptErrors) -> None:
        self.errors = errors

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        self.errors.handle(loop, context)

"""The relay's answer handed to mitmproxy as if mitmproxy's own socket had read it.

The relay (``addons/relay.py``) passes a streamed answer down to mitmproxy over a loopback
connection that mitmproxy opened to it. At a provider's pace every event is a read of its
own, and that hop costs each one a second write, a second read and a second pass of the event
loop: the proxy spent +60..+140 µs of CPU per paced event over bare streaming mitmdump, most
of it the hop (issue 16, docs/benchmarks.md "Streamed events").

mitmproxy reads a server connection in ``ConnectionHandler.handle_connection``: each read of
its socket becomes ``server_event(DataReceived(connection, data))``, and ``server_event`` is
synchronous by design ("No `await` beyond this point"; its lock is there for eager task
factories, mitmproxy issue 7027). ``Handover.write`` makes that same call from the upstream
transport's callback, for the flow's server connection (the loopback one mitmproxy opened to
the relay): mitmproxy's layers, the answer's pipeline and the write to the client run as they
would have for that read, one pass of the loop earlier and with no socket between. The
loopback connection stays: the request still comes over it, and mitmproxy closing it is how
a client that went away shows.

What it relies on is mitmproxy 12's, not public (``tests/test_handover.py`` holds each to the
installed mitmproxy, and the relay's tests run through it): the ``proxyserver`` addon's
``connections`` (the client connection's handler by its id), the handler's ``transports``
(its server connection's reader and reading task, the client's writer), the read loop taking
CAN_READ from the connection's state as it stops (``alive``), and ``server_event`` ending in
one step while its lock is free. ``Handover.of`` returns None when any of that is not so (another
mitmproxy, a mode whose transports are not asyncio's, the server connection not the relay's
socket), and the exchange goes down the loopback as before; the choice is made once per
exchange, so the two ways never interleave one answer's bytes. Should the lock ever be taken
(an eager task factory), a piece is fed to the connection's reader instead, which mitmproxy's
own read takes in order, and so is every piece after it while that reader holds bytes.
``intercept_relay_handover false`` keeps every answer on the loopback.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from mitmproxy import ctx, http
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import events

log = logging.getLogger(__name__)

# What a connection mitmproxy reads is in: open, or closed for writing only (``ConnectionState``
# is an enum.Flag of CAN_READ and CAN_WRITE).
_OPEN, _CAN_READ = ConnectionState.OPEN, ConnectionState.CAN_READ

#: Fed bytes (the fallback) the connection's reader may hold before the upstream waits for
#: mitmproxy's own read to take them, as a full socket buffer would make it wait.
FED_MAX = 1 << 16


class Handover:
    """One exchange's way down to mitmproxy without the loopback (see the module docstring)."""

    def __init__(self, handler: Any, conn: Any, io: Any, client: asyncio.StreamWriter) -> None:
        self.handler = handler
        self.conn = conn  # the flow's server connection: mitmproxy's socket to the relay
        self.reader: asyncio.StreamReader = io.reader  # that connection's reader: the fallback, read by mitmproxy in order
        self.task: asyncio.Task = io.handler  # the task that reads it (it forgets the connection as it ends)
        self.client = client  # the writer to the harness: its buffer is the backpressure
        self.lock: asyncio.Lock = handler._server_event_lock
        self.fed = 0  # pieces that went to the reader (an eager task factory; tests count them)

    @classmethod
    def of(cls, flow: http.HTTPFlow, loopback: asyncio.StreamWriter) -> Handover | None:
        """The handover for the flow whose request came over ``loopback`` (the relay's side of
        mitmproxy's server connection), or None: the loopback it is."""
        try:
            handler = ctx.master.addons.get("proxyserver").connections.get(flow.client_conn.id)
            conn = flow.server_conn
            if handler is None or conn.sockname != loopback.get_extra_info("peername"):
                return None
            io, down = handler.transports.get(conn), handler.transports.get(handler.client)
            if (io is None or down is None or not isinstance(io.reader, asyncio.StreamReader)
                    or not isinstance(io.handler, asyncio.Task)
                    or not isinstance(down.writer, asyncio.StreamWriter)
                    or not isinstance(getattr(handler, "_server_event_lock", None), asyncio.Lock)):
                return None
            return cls(handler, conn, io, down.writer)
        except Exception:  # noqa: BLE001 - another mitmproxy's internals: the loopback, as before
            log.debug("interceptor: relay handover unavailable", exc_info=True)
            return None

    def alive(self) -> bool:
        """mitmproxy still reads this server connection (it closes it when the client goes away)."""
        # mitmproxy 12's read loop (``handle_connection``) takes CAN_READ from the state as it
        # stops, then forgets the connection (``transports``) and ends: the state and the task
        # say it without a lookup by the connection (whose ``__hash__`` is Python's). The state
        # by identity: ``state & CAN_READ`` is enum.Flag's Python-level ``__and__`` (~1.2 µs an
        # event, as much as the rest of this check).
        state = self.conn.state
        return (state is _OPEN or state is _CAN_READ) and not self.reader.at_eof() and not self.task.done()

    def write(self, data: bytes) -> bool:
        """Hand ``data`` to mitmproxy as a read of its server connection; False if mitmproxy no
        longer reads it (the bytes are the Drain's then, as a loopback write's would be)."""
        if not self.alive():
            return False
        lock = self.lock
        waiters = lock._waiters  # None or a deque; the generator only when there is one to look at
        if len(self.reader._buffer) or lock.locked() or (waiters and any(not w.cancelled() for w in waiters)):
            self._feed(data)
            return True
        step = self.handler.server_event(events.DataReceived(self.conn, data))
        try:
            step.send(None)
        except StopIteration:
            return True
        # It waited after all. With the lock free and no one waiting, mitmproxy 12's call can
        # only wait at the lock, before anything of the event ran: taken back, the reader's way.
        # (A mitmproxy that awaits inside the event would break its own comment's contract.)
        step.close()
        self._feed(data)
        return True

    def _feed(self, data: bytes) -> None:
        self.fed += 1
        self.reader.feed_data(data)

    def full(self) -> bool:
        """The harness's side holds bytes not yet sent (a slow reader): read the upstream no
        further until it drains, as mitmproxy's own ``drain_writers`` after each read."""
        transport = self.client.transport
        return bool(transport.get_write_buffer_size()) or len(self.reader._buffer) > FED_MAX

    async def drain(self) -> None:
        """Until the harness's side took what was written (OSError: it is gone)."""
        await self.client.drain()
        while len(self.reader._buffer) > FED_MAX and self.alive():
            await asyncio.sleep(0.001)  # mitmproxy's own read takes the fed bytes

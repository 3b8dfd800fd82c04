"""Reach: an unreachable upstream answers 502 in the dialect's own shape, and is recorded.

When mitmproxy cannot connect it answers with its own HTML page, which no SDK can read as a
provider error, and no hook can change that page. So before forwarding to an address that
has not accepted a connection recently, this addon tries one itself; a failure becomes a
retryable 502 in the dialect's shape and an exchange with an error on the record. An address
that answered within ``FRESH`` seconds (to mitmproxy or to the Relay's pooled connections) is not
probed again, and requests arriving during a probe share it: the steady state costs nothing.
If the upstream dies between the probe and the request, the Relay (``addons/gateway/transport/relay.py``)
answers the same 502 in the dialect's shape (with ``intercept_drain_timeout=0``, mitmproxy's
own HTML 502 reaches the harness and the Tee's ``error`` hook records the exchange).

Any connection mitmproxy fails to make, a passed-through one included, is logged with the
host and port it was for (``server_connect_error``).
"""

from __future__ import annotations

import asyncio
import logging
import time

from mitmproxy import http

from interceptor.addons.gateway.answers import error_response
from interceptor.addons.gateway.exchange import Step, exchange_of
from interceptor.addons.gateway.record import commit
from interceptor.addons.gateway.transport.modes import regular_mode
from interceptor.trace.messages import ResponseError

log = logging.getLogger(__name__)

FRESH = 30.0
PROBE_TIMEOUT = 5.0


def _peer(peername: tuple | None) -> str:
    return f"{peername[0]}:{peername[1]}" if peername else "?"


class Reach:
    def __init__(self) -> None:
        self._ok: dict[tuple[str, int], float] = {}
        # One probe per address at a time: the requests that arrive while it runs wait for it
        # (without this, every request in flight when FRESH ran out opened a connection of its own).
        self._probes: dict[tuple[str, int], asyncio.Future[None]] = {}
        self._regular = True  # mitmproxy's default mode (``regular_mode``, in ``configure``)

    def configure(self, updated: set[str]) -> None:
        if "mode" in updated:
            self._regular = regular_mode()

    def reached(self, host: str, port: int) -> None:
        """The address answered: mitmproxy's connection, or the Relay's own (addons/gateway/transport/relay.py),
        which mitmproxy never sees, so it says so here."""
        self._ok[(host, port)] = time.monotonic()

    def server_connected(self, data) -> None:
        if data.server.address:
            self.reached(data.server.address[0], data.server.address[1])

    def server_connect_error(self, data) -> None:
        """mitmproxy's own line for a failed connection names neither host nor port, and a
        passed-through TLS connection has no flow line that would: say which, at info (the
        default verbosity), with mitmproxy's reason."""
        address = data.server.address
        if not address:
            return
        host, port = address[0], address[1]
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        log.info(f"interceptor: cannot connect to {where} for client {_peer(data.client.peername)}: "
                 f"{data.server.error or 'connection failed'}")

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        ex = exchange_of(flow)
        if ex is None or not self._regular:
            return  # in upstream-proxy modes the address is not ours to probe
        if ex.session.upstream is not None and ex.session.upstream.local:
            return  # a replay source answers every request itself (addons/gateway/replay.py)
        if not ex.done & Step.REWRITTEN:
            return  # not routed yet: never probe the address the harness named (the Gate refuses it)
        addr = (flow.request.host, flow.request.port)
        if time.monotonic() - self._ok.get(addr, float("-inf")) < FRESH:
            return
        probe = self._probes.get(addr)
        if probe is None:
            probe = self._probes[addr] = asyncio.ensure_future(self._probe(addr))
            probe.add_done_callback(lambda _: self._probes.pop(addr, None))
        try:
            await asyncio.shield(probe)
        except (OSError, asyncio.TimeoutError) as e:
            where = f"{flow.request.scheme}://{flow.request.host}:{flow.request.port}"
            reason = type(e).__name__ if isinstance(e, asyncio.TimeoutError) else (e.strerror or str(e))
            message = f"the session's upstream {where} is unreachable ({reason})"
            flow.response = error_response(ex.dialect, 502, message, retry=True)
            if ex.route.kind == "model":  # side routes (token counts, model lists) are never recorded
                commit(ex, flow, None, ResponseError(type="upstream_unreachable", message=message, status=502))
            return

    async def _probe(self, addr: tuple[str, int]) -> None:
        _, writer = await asyncio.wait_for(asyncio.open_connection(*addr), PROBE_TIMEOUT)
        writer.close()
        self.reached(*addr)

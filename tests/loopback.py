"""Test-only mitmproxy script: says what mitmproxy is about to send the proxy's relay.

Loaded after the entry script (``MitmProcess(extra_scripts=[LOOPBACK])``), never by ``make
run``. Its ``request`` hook runs after the script's (Fetch included), as mitmproxy is about
to send the flow on: for a flow pointed at the relay (its ticket header), it logs
``LOOPBACK body=<bytes> length=<content-length>``; at the answer's headers and at the end,
``OBSERVED body=<bytes> length=<content-length> at=<host>:<port>``, what observers see then;
at the end also ``DOWNLINK received=<bytes>``: what mitmproxy's socket to the relay has received
so far (the kernel's count, ``TCP_INFO``), which a handed-over answer never crosses
(``addons/handover.py``).
"""

from __future__ import annotations

import logging
import socket
import struct

from mitmproxy import ctx, http

from interceptor.addons.relay import TICKET

log = logging.getLogger(__name__)

#: ``struct tcp_info``'s ``tcpi_bytes_received`` (linux/tcp.h, since Linux 4.1).
TCPI_BYTES_RECEIVED = 128


class Loopback:
    def request(self, flow: http.HTTPFlow) -> None:
        if TICKET in flow.request.headers:
            log.warning(f"LOOPBACK body={len(flow.request.raw_content or b'')} "
                        f"length={flow.request.headers.get('content-length')}")

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        self._observed(flow)

    def response(self, flow: http.HTTPFlow) -> None:
        self._observed(flow)
        handler = ctx.master.addons.get("proxyserver").connections.get(flow.client_conn.id)
        io = handler.transports.get(flow.server_conn) if handler is not None else None
        if io is not None and io.writer is not None:
            info = io.writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            log.warning(f"DOWNLINK received={struct.unpack_from('Q', info, TCPI_BYTES_RECEIVED)[0]}")

    def _observed(self, flow: http.HTTPFlow) -> None:
        if flow.request.path.endswith(("/completions", "/messages")):
            log.warning(f"OBSERVED body={len(flow.request.raw_content or b'')} "
                        f"length={flow.request.headers.get('content-length')} at={flow.request.host}:{flow.request.port}")


addons = [Loopback()]

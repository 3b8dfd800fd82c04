"""Test-only mitmproxy script: says what mitmproxy is about to send the proxy's relay.

Loaded after the entry script (``MitmProcess(extra_scripts=[LOOPBACK])``), never by ``make
run``. Its ``request`` hook runs after the script's (Fetch included), as mitmproxy is about
to send the flow on: for a flow pointed at the relay (its ticket header), it logs
``LOOPBACK body=<bytes> length=<content-length>``; at the answer's headers and at the end,
``OBSERVED body=<bytes> length=<content-length> at=<host>:<port>``, what observers see then.
"""

from __future__ import annotations

import logging

from mitmproxy import http

from interceptor.addons.gateway.transport.relay import TICKET

log = logging.getLogger(__name__)


class Loopback:
    def request(self, flow: http.HTTPFlow) -> None:
        if TICKET in flow.request.headers:
            log.warning(f"LOOPBACK body={len(flow.request.raw_content or b'')} "
                        f"length={flow.request.headers.get('content-length')}")

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        self._observed(flow)

    def response(self, flow: http.HTTPFlow) -> None:
        self._observed(flow)

    def _observed(self, flow: http.HTTPFlow) -> None:
        if flow.request.path.endswith(("/completions", "/messages")):
            log.warning(f"OBSERVED body={len(flow.request.raw_content or b'')} "
                        f"length={flow.request.headers.get('content-length')} at={flow.request.host}:{flow.request.port}")


addons = [Loopback()]

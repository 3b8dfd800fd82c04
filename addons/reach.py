"""Reach: an unreachable upstream answers 502 in the dialect's own shape, and is recorded.

When mitmproxy cannot connect it answers with its own HTML page, which no SDK can read as a
provider error, and no hook can change that page. So before forwarding to an address that
has not accepted a connection recently, this addon tries one itself; a failure becomes a
retryable 502 in the dialect's shape and an exchange with an error on the record. An address
that answered within ``FRESH`` seconds is not probed again: the steady state costs nothing.
If the upstream dies between the probe and the request, the Relay (``addons/relay.py``)
answers the same 502 in the dialect's shape (with ``intercept_drain_timeout=0``, mitmproxy's
own HTML 502 reaches the harness and the Tee's ``error`` hook records the exchange).
"""

from __future__ import annotations

import asyncio
import time

from mitmproxy import ctx, http
from mitmproxy.proxy import server_hooks

from interceptor.addons.answers import error_response
from interceptor.addons.exchange import Step, exchange_of
from interceptor.addons.record import commit
from interceptor.trace.messages import ResponseError

FRESH = 30.0
PROBE_TIMEOUT = 5.0


class Reach:
    def __init__(self) -> None:
        self._ok: dict[tuple[str, int], float] = {}

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        if data.server.address:
            self._ok[(data.server.address[0], data.server.address[1])] = time.monotonic()

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        ex = exchange_of(flow)
        if ex is None or list(ctx.options.mode) != ["regular"]:
            return  # in upstream-proxy modes the address is not ours to probe
        if ex.session.upstream is not None and ex.session.upstream.local:
            return  # a replay source answers every request itself (addons/replay.py)
        if not ex.done & Step.REWRITTEN:
            return  # not routed yet: never probe the address the harness named (the Gate refuses it)
        addr = (flow.request.host, flow.request.port)
        if time.monotonic() - self._ok.get(addr, float("-inf")) < FRESH:
            return
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(*addr), PROBE_TIMEOUT)
            writer.close()
        except (OSError, asyncio.TimeoutError) as e:
            where = f"{flow.request.scheme}://{flow.request.host}:{flow.request.port}"
            reason = type(e).__name__ if isinstance(e, asyncio.TimeoutError) else (e.strerror or str(e))
            message = f"the session's upstream {where} is unreachable ({reason})"
            flow.response = error_response(ex.dialect, 502, message, retry=True)
            if ex.route.kind == "model":  # side routes (token counts, model lists) are never recorded
                commit(ex, flow, None, ResponseError(type="upstream_unreachable", message=message, status=502))
            return
        self._ok[addr] = time.monotonic()

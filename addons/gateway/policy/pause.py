"""Pause: a model request waits here while its upstream is paused for a weight swap, and
leaves stamped with the weights version it is sent under.

The last request step before the relay, after Retry's decision and Stops: a replayed or
coalesced retry already has its answer from the record and never waits for a pause (nor is
a refused request held only to be refused). What waits here has been decided a fresh turn
(Retry counts it in flight, so the SDK's retry of a request held too long for its client
coalesces on it, and an unflagged one from a harness whose client left while it waited is a
retry, the undelivered rule), and nothing of it has left: held, the harness sees latency.
``addons/gateway/sessions/weights.py`` keeps the upstream's state; the waiting is here.

A request held longer than its limit (``intercept_pause_limit``, a session's ``pause_limit``)
is answered a retryable error in its dialect's shape with ``retry-after``, on the record as
an ``upstream_paused`` call: the SDK's retry is a fresh request that waits again, and only
the attempt that is finally sent is sampled. A session's ``min_version`` refuses a request
whose upstream is declared older before it is sent, and an answer the upstream says came
from an older one (``Upstream.version_header``) is replaced by the error before the harness
reads any of it: an error on the record, never a turn.
"""

from __future__ import annotations

import logging

from mitmproxy import ctx, exceptions, http

from interceptor.addons.gateway.answers import error_response
from interceptor.addons.gateway.exchange import Exchange, exchange_of
from interceptor.addons.gateway.record import answered_version, commit
from interceptor.addons.gateway.retry import mark_left
from interceptor.addons.gateway.sessions.weights import Fleet, HoldExpired
from interceptor.trace.messages import ResponseError

log = logging.getLogger(__name__)

PAUSED = "upstream_paused"
STALE = "stale_version"
STALE_STATUS = 409  # the upstream's state conflicts with what the session asked for; not retried (x-should-retry)
RETRY_AFTER = "1"  # seconds: the SDKs wait this long, then their retry waits here again
_STALE_KEY = "interceptor_stale"  # this step's own flow state: the error that replaces a stale answer


class Pause:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet  # every upstream's weights (the registry's)
        self.limit = 300.0

    def load(self, loader) -> None:
        loader.add_option(
            "intercept_pause_limit", float, 300.0,
            "Seconds a model request may wait for its paused upstream (a weight swap) before it is "
            "answered a retryable error with retry-after; a session's pause_limit overrides it. "
            "Keep it under the harness's own request timeout.",
        )

    def configure(self, updated: set[str]) -> None:
        if "intercept_pause_limit" in updated:
            limit = ctx.options.intercept_pause_limit
            if not limit > 0:
                raise exceptions.OptionsError(f"intercept_pause_limit must be a number of seconds above 0, got {limit}")
            self.limit = float(limit)

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        ex = exchange_of(flow)
        if ex is None or ex.route.kind != "model" or ex.committed or flow.request.method != "POST":
            return
        session, weights = ex.session, ex.session.weights
        if weights is None:
            return
        try:
            waited = await weights.hold(flow, session.config.pause_limit or self.limit)
        except HoldExpired:
            self._expired(flow, ex, session.config.pause_limit or self.limit)
            return
        if waited is not None:
            ex.held_ms = int(waited * 1000)
        refused = weights.refuses(weights.version, session.config.min_version, "serves") \
            if weights.version is not None else None
        if refused is not None:
            self._answer(flow, ex, STALE_STATUS, f"{refused}; nothing was sent", STALE, retry=False)
            return
        ex.policy_version = weights.version
        ex.weights = weights
        weights.sent(ex.call_id, session.id)

    def client_disconnected(self, client) -> None:
        """A harness that left while its request waited: the same body from it next is that
        request's retry (Retry's undelivered rule), to coalesce on it when it is sent."""
        for held in [h for w in self.fleet.all() for h in w.held]:
            ex = exchange_of(held.key)
            if held.key.client_conn.id == client.id and ex is not None and mark_left(held.key):
                log.info(f"interceptor: session {ex.session.id!r}: the harness left while its request waited for "
                         f"the paused upstream; the same request from it is that request's retry")

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        ex = exchange_of(flow)
        if ex is None or ex.committed or ex.weights is None or flow.response is None:
            return
        answered = answered_version(ex, flow)
        refused = ex.weights.refuses(answered if answered is not None else ex.policy_version,
                                     ex.session.config.min_version, "answered with")
        if refused is None:
            return
        message = f"{refused}; the answer is not a turn"
        commit(ex, flow, None, ResponseError(type=STALE, message=message, status=STALE_STATUS), status=STALE_STATUS)
        flow.metadata[_STALE_KEY] = message
        flow.response.stream = False  # read whole by mitmproxy, then replaced below: the harness gets none of it

    def response(self, flow: http.HTTPFlow) -> None:
        message = flow.metadata.pop(_STALE_KEY, None)
        ex = exchange_of(flow)
        if message is not None and ex is not None:
            flow.response = error_response(ex.dialect, STALE_STATUS, message, type=STALE)
            ex.answered_here = True

    # -- answers ----------------------------------------------------------------------------

    def _expired(self, flow: http.HTTPFlow, ex: Exchange, limit: float) -> None:
        message = (f"the upstream {ex.session.weights.name!r} is paused for a weight update; this request waited "
                   f"{limit:g} s; retry")
        ex.held_ms = int(limit * 1000)
        self._answer(flow, ex, 503, message, PAUSED, retry=True)
        flow.response.headers["retry-after"] = RETRY_AFTER
        log.info(f"interceptor: session {ex.session.id!r}: a request waited past the pause limit; answered 503")

    @staticmethod
    def _answer(flow: http.HTTPFlow, ex: Exchange, status: int, message: str, kind: str, *, retry: bool) -> None:
        """Answer here, in the harness's dialect, and put the call on the record: nothing was sent."""
        flow.response = error_response(ex.dialect, status, message, type=kind, retry=retry)
        ex.answered_here = True
        commit(ex, flow, None, ResponseError(type=kind, message=message, status=status))


"""Stops: once a rollout is stopped, its model requests are refused in the dialect's shape.

Listed after Retry, so the retry decision comes first: a replayed or coalesced retry already
has its answer and is never refused (the harness gets the turn it was owed). Then, in this
order: a session already stopped; its limits (which stop it). A refusal is a 400 the
SDKs do not retry (``x-should-retry: false``), typed ``interceptor_stopped``, with the
condition in ``x-interceptor-stop``; nothing goes upstream. Its call is on the record with
the request's new messages as prompt nodes (fresh tool results), so the trace ends where the
harness was. A WebSocket frame gets the same answer as an error frame (``WsRelay``).

An upstream answer meaning "context too long" is passed through as it came; it is on the
record as ``context_length`` (the dialects classify it) and stops the session only when
``limits.context_length_stops`` says so.
"""

from __future__ import annotations

import json
import logging

from mitmproxy import http

from interceptor.addons.gateway.policy import intercept
from interceptor.addons.gateway.answers import json_response
from interceptor.addons.gateway.exchange import Exchange, Step, exchange_of
from interceptor.addons.gateway.policy.hookrun import HookFailure, context, first_stop
from interceptor.addons.gateway.policy.limits import Stop, reached
from interceptor.addons.gateway.record import first_carried, make_call
from interceptor.dialects.base import CONTEXT_LENGTH
from interceptor.trace.ids import new_id
from interceptor.trace.messages import ResponseError

log = logging.getLogger(__name__)

STOPPED = "interceptor_stopped"
HOOK_ERROR = "hook_error"


def in_flight(admitted: list[Exchange]) -> int:
    """Admitted exchanges not yet on the record; the finished ones are let go here."""
    admitted[:] = [ex for ex in admitted if not ex.committed]
    return len(admitted)


def stop_message(stop: Stop) -> str:
    return f"rollout stopped: {stop.condition}"


def decide(ex: Exchange) -> Stop | None:
    """The stop that refuses this model request, or None after admitting it. Synchronous on
    purpose: the count and the admission are one step, so two parallel requests can never
    both take the last turn of the budget."""
    session = ex.session
    if not ex.call_id:  # a WebSocket frame's exchange: Retry never saw it
        ex.call_id = new_id()
    if session.stop is not None:
        return session.stop
    limits = session.config.limits
    if limits is None:
        return None
    condition = reached(limits, session.recorder.trace, in_flight(session.admitted), session.created_at)
    if condition is not None:
        return session.stop_with(condition, "limit", ex.call_id or None)
    session.admitted.append(ex)
    return None


def refusal_body(ex: Exchange, stop: Stop) -> dict:
    return ex.dialect.error_body(400, stop_message(stop), STOPPED)


def record_refusal(ex: Exchange, flow: http.HTTPFlow, stop: Stop, error: ResponseError | None = None) -> None:
    """The refused request on the record once: a call with the stop (or the hook's
    ``error``) as its error, and the request's new messages as prompt nodes."""
    if ex.committed:
        return
    ex.committed = True
    error = error or ResponseError(type=STOPPED, message=stop_message(stop), status=400)
    call = make_call(ex, flow, None, error, status=error.status)
    new = first_carried(ex, call)
    rewrites = [r.rewrite for r in new]
    try:
        if ex.request is not None:
            ex.session.recorder.commit_prompt(ex.request, call, rewrites)
        else:
            ex.session.recorder.record_call(call, rewrites)
        if new:
            ex.session.memory.settle(new, ex.session.recorder.trace)
    except Exception:
        log.exception(f"interceptor: session {ex.session.id!r}: could not record the refused call {call.id}")


async def hook_stop(ex: Exchange, endpoint: str, stops: bool = True) -> Stop | None:
    """The session's hooks for one request, in this order: between-turn stops,
    request hooks (``addons/gateway/policy/intercept.py``: they may rewrite the new messages), then request
    stops (which see the request as the upstream would get it, rewritten). ``stops`` False:
    the rewriting hooks only (a warm-up, which samples nothing). Metrics the hooks record go
    on the record either way. Raises HookFailure."""
    hooks = ex.session.hooks
    if hooks is None or not (hooks.between_stops or hooks.request_stops or hooks.request):
        return None
    ctx = context(ex, endpoint)
    try:
        name = await first_stop(hooks.between_stops, ctx) if stops else None
        if name is None and hooks.request:
            await intercept.rewrite(ex, ctx)
        if name is None and stops and hooks.request_stops:
            try:
                name = await first_stop(hooks.request_stops, ctx, intercept.for_stops(ex))
            finally:
                intercept.kept_for_stops(ex)
    finally:
        ex.session.record_metrics(ctx.metrics)
    return ex.session.stop_with(name, "hook", ex.call_id or None) if name is not None else None


def hook_failed(ex: Exchange, failure: HookFailure) -> Stop | None:
    """The session's ``on_hook_error``: ``pass`` carries on as if the hook had said nothing
    (None); ``stop`` stops the rollout with ``hook_error`` (the caller answers and records
    the call as a ``hook_error``)."""
    session = ex.session
    if session.config.on_hook_error == "pass":
        log.warning(f"interceptor: session {session.id!r}: {failure}; on_hook_error is pass, going on")
        return None
    log.warning(f"interceptor: session {session.id!r}: {failure}; the rollout stops")
    return session.stop_with(HOOK_ERROR, "hook", ex.call_id or None)


class Stops:
    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        ex = exchange_of(flow)
        if ex is None or ex.route.kind != "model" or ex.committed:
            return
        if flow.request.method != "POST":
            return  # a WebSocket's frames go through the same steps in WsRelay
        if intercept.has_request_hooks(ex):
            try:
                intercept.remembered(ex)  # before any refusal: a refused prompt holds what was delivered
            except intercept.Undeliverable as e:
                ex.request = None  # the call alone on the record: no message of it was delivered
                self._refuse(flow, ex, str(e))
                return
        stop = decide(ex)
        if stop is None and ex.session.hooks is not None:
            try:
                stop = await hook_stop(ex, flow.request.path.split("?", 1)[0])
            except HookFailure as e:
                if self._hook_failed(flow, ex, e):
                    return
        if stop is None:
            content = intercept.spliced(ex)
            if content is not None:
                flow.request.content = content
                ex.unwritten = False
            ex.done |= Step.ADMITTED
            return
        flow.response = json_response(400, refusal_body(ex, stop), headers={"x-interceptor-stop": stop.condition})
        ex.answered_here = True
        record_refusal(ex, flow, stop)
        log.info(f"interceptor: session {ex.session.id!r}: request refused, {stop_message(stop)}")

    @staticmethod
    def _hook_failed(flow: http.HTTPFlow, ex: Exchange, failure: HookFailure) -> bool:
        """``on_hook_error`` (``hook_failed``); with ``stop``, a 500 in the dialect's shape
        that no SDK retries (True)."""
        stop = hook_failed(ex, failure)
        if stop is None:
            return False
        Stops._refuse(flow, ex, str(failure), stop)
        return True

    @staticmethod
    def _refuse(flow: http.HTTPFlow, ex: Exchange, message: str, stop: Stop | None = None) -> None:
        """A 500 ``hook_error`` in the dialect's shape that no SDK retries; the rollout stops
        (``stop``, or now with ``hook_error``: what a policy decided cannot be carried out)."""
        if stop is None:
            log.warning(f"interceptor: session {ex.session.id!r}: {message}; the rollout stops")
            stop = ex.session.stop_with(HOOK_ERROR, "hook", ex.call_id or None)
        flow.response = json_response(500, ex.dialect.error_body(500, message, HOOK_ERROR),
                                      headers={"x-interceptor-stop": stop.condition})
        ex.answered_here = True
        record_refusal(ex, flow, stop, ResponseError(type=HOOK_ERROR, message=message, status=500))

    def response(self, flow: http.HTTPFlow) -> None:
        ex = exchange_of(flow)
        if ex is None or ex.route.kind != "model" or flow.response is None or flow.response.status_code < 400:
            return
        if not _context_length_stops(ex):
            return
        try:
            body = json.loads(flow.response.get_content(strict=False) or b"null")
        except ValueError:
            return
        upstream_error(ex, ex.dialect.response_error(flow.response.status_code, body))


def _context_length_stops(ex: Exchange) -> bool:
    limits = ex.session.config.limits
    return limits is not None and limits.context_length_stops and ex.session.stop is None


def upstream_error(ex: Exchange, error: ResponseError | None) -> None:
    """An upstream "context too long" stops the rollout if the session says so (HTTP
    answers here, WebSocket error frames from WsRelay)."""
    if error is not None and error.type == CONTEXT_LENGTH and _context_length_stops(ex):
        ex.session.stop_with(CONTEXT_LENGTH, "upstream", ex.call_id or None)

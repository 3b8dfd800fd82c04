"""Hold: a session with response hooks (or response stops) gets no byte of an answer until
its hooks have decided; every other session streams exactly as before (this stage is not in
its chain and costs it nothing).

mitmproxy cannot wait for an asynchronous decision inside a stream: its stream callable is
synchronous, and after the last chunk nothing but trailers can follow. So a held answer is
read by the proxy's own relay (``addons/gateway/transport/relay.py``), which owns the upstream connection:

1. **collect** (``Held.phase == "collect"``): the Drain builds the answer's pipeline itself
   (as it does for a harness that went away) and feeds it the upstream's body as it
   arrives. Assemble, strip and translate run as always, but the commit is deferred
   (``Held.sampled``) and this stage keeps what the harness would have received: an SSE
   answer's events in a spill file (memory up to ``intercept_hold_spill`` bytes, then disk),
   a JSON body whole.
2. **decide** (``settle``): the response hooks and stops run (``addons/gateway/policy/respond.py``); the turn
   is committed with the sampled reply and, when a hook replaced it, the delivered one as a
   non-sampled sibling; what the harness gets is the held bytes untouched, the replacement
   written by the harness's dialect (``Dialect.synthetic``), a refusal (a response stop), or
   a 500 ``hook_error``.
3. **deliver** (``"deliver"``): the relay sends that to mitmproxy as the upstream's answer, and
   only the stages after this one (Retry's capture) run on it, so a retry replays what the
   harness was given.

``intercept_hold_keepalive`` (seconds, 0: off): an SSE answer's 200 and headers go to the
harness at once and an SSE comment every that many seconds while the answer is held, so an
SDK's read timeout does not fire; a stop decided after the headers went out arrives as the
dialect's error event (``Dialect.stream_error``). A session whose answers are held needs the
relay: without it (``intercept_drain_timeout=0``, an upstream-proxy mode) its model requests
are refused in the dialect's shape rather than streamed unheld.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from mitmproxy import http

from interceptor.addons.gateway.policy import respond
from interceptor.addons.gateway.answers import json_response
from interceptor.addons.gateway.exchange import Exchange, exchange_of
from interceptor.addons.gateway.policy.hookrun import HookFailure
from interceptor.addons.gateway.policy.limits import Stop
from interceptor.addons.gateway.record import commit, endpoint
from interceptor.addons.gateway.policy.stops import HOOK_ERROR, STOPPED, hook_failed, stop_message
from interceptor.addons.gateway.answer.held import Held
from interceptor.trace.messages import Response, ResponseError

log = logging.getLogger(__name__)

KEEPALIVE = b": interceptor holds the answer for the session's response hooks\n\n"


def holds(ex: Exchange) -> bool:
    """Whether this exchange's answer is held back for the session's response hooks."""
    hooks = ex.session.hooks
    return hooks is not None and hooks.holds_responses and ex.route.kind == "model"


class HeldStream:
    """The stream callable of a held SSE answer: the chain inside it runs as always (the
    turn is assembled, token fields stripped, a translated answer translated), and what it
    would have sent the harness is kept instead."""

    def __init__(self, inner, held: Held) -> None:
        self.inner = inner
        self.held = held

    def __call__(self, chunk: bytes) -> list[bytes]:
        out = self.inner(chunk) if callable(self.inner) else chunk
        if not isinstance(out, bytes):
            out = b"".join(out)
        self.held.keep(out)
        return []


class Hold:
    """The pipeline's hold stage (``addons/gateway/answer/pipeline.py``); collect phase only."""

    def on_headers(self, flow: http.HTTPFlow, stream):
        held = _held(flow)
        if held is None or flow.response is None:
            return stream
        held.sse = flow.response.headers.get("content-type", "").startswith("text/event-stream")
        return HeldStream(stream, held) if stream else stream

    def on_response(self, flow: http.HTTPFlow) -> None:
        held = _held(flow)
        if held is None or flow.response is None or callable(flow.response.stream):
            return
        held.body = flow.response.raw_content or b""

    def on_error(self, flow: http.HTTPFlow) -> None:
        held = _held(flow)
        if held is not None:
            held.close()


def _held(flow: http.HTTPFlow) -> Held | None:
    ex = exchange_of(flow)
    held = ex.hold if ex is not None else None
    return held if held is not None and held.phase == "collect" else None


@dataclass(eq=False)
class Delivery:
    """What the relay sends mitmproxy once the hooks decided."""

    status: int
    headers: list[tuple[bytes, bytes]]  # empty when the headers went out already (keepalive)
    body: Iterator[bytes] | bytes = b""

    def parts(self) -> Iterator[bytes]:
        if isinstance(self.body, bytes):
            if self.body:
                yield self.body
        else:
            yield from self.body

    def joined(self) -> bytes:
        return b"".join(self.parts())


def broken(ex: Exchange, flow: http.HTTPFlow, reason: str) -> Delivery:
    """The upstream broke while its answer was held: one error call, and the harness gets
    the retryable 502 any unheld exchange gets (its headers sent: the dialect's error event
    and a cut stream). Nothing was sampled whole, so a retry samples nothing twice."""
    return _failed(ex, flow, 502, "connection_error", f"the session's upstream {reason}", retry=True)


def failed(ex: Exchange, flow: http.HTTPFlow, reason: str) -> Delivery:
    """The proxy itself failed while holding the answer: fail closed, a 500 nobody retries
    (the answer may have been sampled), the exchange on the record."""
    return _failed(ex, flow, 500, "hold_error", reason, retry=False)


def _failed(ex: Exchange, flow: http.HTTPFlow, status: int, type_: str, message: str, *, retry: bool) -> Delivery:
    held = ex.hold
    held.close()
    held.sampled = None
    held.phase = "deliver"
    commit(ex, flow, None, ResponseError(type=type_, message=message, status=status))
    if held.head_sent:
        return Delivery(200, [], ex.dialect.stream_error(status, message, None).encode())
    response = json_response(status, ex.dialect.error_body(status, message), retry=retry)
    return Delivery(status, list(response.headers.fields), response.raw_content or b"")


def _stopped(ex: Exchange, held: Held, stop: Stop, status: int, type_: str, message: str) -> Delivery:
    held.close()
    held.replaced = True
    if held.head_sent:
        return Delivery(200, [], ex.dialect.stream_error(status, message, type_).encode())
    response = json_response(status, ex.dialect.error_body(status, message, type_), headers={"x-interceptor-stop": stop.condition})
    return Delivery(status, list(response.headers.fields), response.raw_content or b"")


def _plain_headers(flow: http.HTTPFlow, length: int | None, *, replaced: bool) -> list[tuple[bytes, bytes]]:
    """The answer's headers for the bytes delivered: framing by the relay, and no content
    encoding on a body the proxy wrote itself."""
    drop = {b"content-length", b"transfer-encoding"}
    if replaced:
        drop.add(b"content-encoding")
    out = [(k, v) for k, v in flow.response.headers.fields if k.lower() not in drop]
    if length is not None:
        out.append((b"content-length", str(length).encode()))
    return out


async def settle(ex: Exchange, flow: http.HTTPFlow) -> Delivery:
    """Decide a held answer (the module docstring, step 2): commit it and say what the
    harness gets."""
    held = ex.hold
    sampled, held.sampled = held.sampled, None
    verdict = respond.Verdict()
    failure: HookFailure | None = None
    if sampled is not None:
        try:
            verdict = await respond.decide(ex, sampled, endpoint(flow))
        except HookFailure as e:
            failure = e
    held.phase = "deliver"
    if sampled is None:  # an error answer, or nothing assembled: it goes as it came
        return _as_held(flow, held)
    if failure is not None:
        stop = hook_failed(ex, failure)
        if stop is not None:
            commit(ex, flow, sampled, withheld=ResponseError(type=HOOK_ERROR, message=str(failure), status=500))
            return _stopped(ex, held, stop, 500, HOOK_ERROR, str(failure))
    if verdict.stop is not None:
        stop = ex.session.stop_with(verdict.stop, "hook", ex.call_id or None)
        commit(ex, flow, sampled, withheld=ResponseError(type=STOPPED, message=stop_message(stop), status=400))
        return _stopped(ex, held, stop, 400, STOPPED, stop_message(stop))
    if verdict.delivered is None:
        commit(ex, flow, sampled)
        return _as_held(flow, held)
    commit(ex, flow, sampled, delivered=verdict.delivered,
           rewrite=respond.rewrite_record(ex, sampled, verdict))
    held.close()
    held.replaced = True
    body = ex.dialect.synthetic(verdict.delivered, held.sse, _harness_body(ex))
    if held.head_sent:
        return Delivery(200, [], body)
    return Delivery(200, _plain_headers(flow, None if held.sse else len(body), replaced=True), body)


def _as_held(flow: http.HTTPFlow, held: Held) -> Delivery:
    response = flow.response
    if held.sse:
        return Delivery(response.status_code, [] if held.head_sent else _plain_headers(flow, None, replaced=False),
                        held.chunks())
    return Delivery(response.status_code, _plain_headers(flow, len(held.body), replaced=False), held.body)


def _harness_body(ex: Exchange) -> dict | None:
    """The request as the harness sent it (a dialect reads what it asked for, such as Chat's
    ``stream_options.include_usage``)."""
    try:
        body = json.loads(ex.raw_body or b"null")
    except ValueError:
        return None
    return body if isinstance(body, dict) else None

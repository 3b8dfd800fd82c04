"""Record: the one place an exchange goes on the record, for HTTP and WebSocket alike.

An exchange is recorded exactly once: as a turn (nodes and a call) when the model answered,
as one call with its error otherwise, or as a replay call when Retry answered it from an
earlier one. Every path that ends an exchange (the stream pipeline, Reach's 502, a
WebSocket frame, a replay) comes here, so what a call record holds is decided once.
"""

from __future__ import annotations

import logging
import time

from mitmproxy import http

from interceptor.addons.gateway.exchange import Exchange
from interceptor.addons.gateway.policy.memory import Remembered
from interceptor.addons.gateway.sessions.weights import parse_version
from interceptor.trace import ModelCall
from interceptor.trace.ids import new_id
from interceptor.trace.messages import Response, ResponseError, Sampling
from interceptor.trace.model import Rewrite
from interceptor.trace.prefix import identical, touches

log = logging.getLogger(__name__)


def effective_sampling(ex: Exchange) -> Sampling:
    """The settings the upstream actually received: the rewritten body, read back."""
    if ex.body is None:
        return Sampling()
    try:
        return ex.wire.sampling(ex.body)
    except Exception:  # the body was forwarded; a record without sampling beats no record
        return Sampling()


def endpoint(flow: http.HTTPFlow) -> str:
    return flow.request.path.split("?", 1)[0]


def answered_version(ex: Exchange, flow: http.HTTPFlow):
    """The weights version the upstream says answered, in the header its declaration names
    (``Upstream.version_header``); None when it names none or the answer has none."""
    upstream = ex.session.upstream
    name = upstream.version_header if upstream is not None else None
    value = flow.response.headers.get(name) if name is not None and flow.response is not None else None
    return parse_version(value) if value else None


def declared_version(ex: Exchange):
    """The version declared when the request was sent (Pause stamps it); for an exchange that
    never passed there (a WebSocket frame, a refusal), the upstream's current one."""
    if ex.weights is not None:
        return ex.policy_version
    return ex.session.weights.version if ex.session.weights is not None else None


def finished(ex: Exchange) -> None:
    """The exchange ended (a commit, a replay): it no longer keeps its paused upstream from
    being drained."""
    if ex.weights is not None and ex.call_id:
        ex.weights.finished(ex.call_id)


def make_call(ex: Exchange, flow: http.HTTPFlow, response: Response | None, error: ResponseError | None,
              status: int | None = None) -> ModelCall:
    declared, answered = declared_version(ex), answered_version(ex, flow)
    return ModelCall(
        id=ex.call_id or new_id(),
        dialect=ex.dialect.name,
        endpoint=endpoint(flow),
        model=(response.model if response and response.model else None) or ex.wire.requested_model(ex.body, flow.request.path),
        requested_model=ex.requested_model,
        stream=ex.stream,
        sampling=effective_sampling(ex),
        overrides=[o.as_dict() for o in ex.overrides],
        status=status if status is not None else (flow.response.status_code if flow.response else None),
        finish_reason=response.finish_reason if response else None,
        native_finish_reason=response.native_finish_reason if response else None,
        usage=response.usage if response else None,
        started_at=ex.started_at,
        first_byte_at=ex.first_byte_at,
        ended_at=time.time(),
        event_gaps_ms=ex.clock.gaps() if ex.clock is not None else None,
        error=error,
        previous_response_id=ex.previous_response_id,
        previous_response_unknown=ex.previous_response_unknown,
        upstream_dialect=ex.wire.name if ex.translation is not None else None,
        translated_digest=ex.translated_digest,
        replayed_from=ex.replayed_from,
        delivered=ex.delivered,
        rewrites=[r.rewrite.id for r in ex.carried if r.rewrite.id],
        policy_version=declared,
        answered_version=answered,
        version_mismatch=answered is not None and declared is not None and answered != declared,
        held_ms=ex.held_ms,
    )


def first_carried(ex: Exchange, call: ModelCall) -> list[Remembered]:
    """The rewrites this exchange is the first on the record to carry: their records are
    written with its call (and the memory re-keys them by node once the call has nodes)."""
    new = [r for r in ex.carried if not r.recorded]
    for r in new:
        r.recorded = True
        r.rewrite.call = call.id
    return new


def _held(ex: Exchange) -> int | None:
    """How many leading messages of the request ``intercept.remembered`` found to be nodes,
    if the graph has not changed since and the request still begins with those very
    messages (a hook's rewrite makes a new list, of the same objects up to its first new
    message); None when that is not known."""
    walked = ex.walked
    if walked is None or not walked.current(ex.session.recorder):
        return None
    messages = ex.request.messages
    return walked.on if messages is walked.messages or identical(walked.messages, messages) >= walked.on else None


def commit(ex: Exchange, flow: http.HTTPFlow, response: Response | None, error: ResponseError | None = None,
           *, status: int | None = None, delivered: Response | None = None, rewrite: Rewrite | None = None,
           withheld: ResponseError | None = None) -> None:
    """Put the exchange on the record exactly once: a turn when the model answered, a call
    with its error otherwise. ``status`` stands in for the flow's when the exchange is not
    the flow's own (a WebSocket frame's answer; the flow's is the upgrade's 101).

    A held answer (``addons/gateway/answer/hold.py``) is not committed while it is collected: the answer is
    kept for the response hooks, which commit it with what they decided: ``delivered`` (a
    replacement, the sampled reply's sibling, with its ``rewrite`` record) or ``withheld``
    (the harness got this error instead: a response stop, a hook error; the turn is on the
    record, the call carries the error and ``delivered: false``)."""
    if ex.committed:
        return
    hold = ex.hold
    if (hold is not None and hold.phase == "collect" and error is None and response is not None
            and response.error is None and ex.request is not None):
        hold.sampled = response
        return
    ex.committed = True
    finished(ex)
    if response is not None and response.error is not None and error is None:
        error = response.error
    call = make_call(ex, flow, response, error, status)
    if error is None and ex.session.weights is not None:
        # An answer from weights older than the session accepts is never a turn, however it
        # came (Pause replaces it for the harness where it can: addons/gateway/policy/pause.py).
        version = call.answered_version if call.answered_version is not None else call.policy_version
        refused = ex.session.weights.refuses(version, ex.session.config.min_version, "answered with")
        if refused is not None:
            error = call.error = ResponseError(type="stale_version", message=f"{refused}; the answer is not a turn",
                                               status=call.status)
    if withheld is not None:
        call.error, call.status, call.delivered = withheld, withheld.status, False
        ex.delivered = False
    recorder = ex.session.recorder
    new = first_carried(ex, call)
    rewrites = [r.rewrite for r in new]
    if rewrite is not None:
        rewrites.append(rewrite)
    try:
        if error is None and response is not None and ex.request is not None:
            listed = ex.listed
            if listed is not None and touches(ex.overrides, listed.key):
                recorder.prefixes.clear()  # changed after Rewrite: its elements are not as sent
                listed = None
            recorder.commit_turn(ex.request, response, call, listed, rewrites=rewrites,
                                 delivered=delivered.message if delivered is not None else None, held=_held(ex))
            ex.turn = call.id
            if ex.prompt_read is not None and call.node is not None and response.prompt_token_ids is not None:
                ex.session.remember_prompt(ex.prompt_read, call.node, response.prompt_token_ids)
        else:
            recorder.record_call(call, rewrites)
        if new:
            ex.session.memory.settle(new, recorder.trace)
    except Exception:
        log.exception(f"interceptor: session {ex.session.id!r}: could not record call {call.id}")


def commit_replay(ex: Exchange, flow: http.HTTPFlow, status: int, replay_of: str) -> None:
    """An exchange answered from the record of call ``replay_of``: one call saying so, no
    turn. Marks the exchange as a replay, which every later stage reads from ``ex.replay_of``."""
    ex.committed = True  # nothing more for the pipeline to record
    ex.replay_of = replay_of
    finished(ex)
    call = ModelCall(
        id=new_id(),
        dialect=ex.dialect.name,
        endpoint=endpoint(flow),
        requested_model=ex.requested_model,
        stream=ex.stream,
        status=status,
        started_at=ex.started_at,
        ended_at=time.time(),
        replay_of=replay_of,
    )
    try:
        ex.session.recorder.record_call(call)
    except Exception:
        log.exception(f"interceptor: session {ex.session.id!r}: could not record replay")


def mark_undelivered(ex: Exchange) -> None:
    """The exchange's call is on the record, and its answer did not reach the harness whole
    (the client went away after the terminal event was committed): one ``undelivered`` record
    amends it, so the trace says per call whether the harness received all of it. An answer
    whose end was handed to the client (``ex.handed``) was delivered: what the client does with
    its connection afterwards changes nothing."""
    call_id = ex.turn or ex.call_id
    if not ex.delivered or ex.handed or not call_id:
        return
    ex.delivered = False
    try:
        ex.session.recorder.record_undelivered(call_id)
    except Exception:
        log.exception(f"interceptor: session {ex.session.id!r}: could not mark call {call_id} undelivered")

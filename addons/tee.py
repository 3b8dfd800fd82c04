"""Tee: the provider's answer goes to the harness untouched while the record is assembled.

For SSE, ``flow.response.stream`` is a synchronous callable that returns each chunk at once
(nothing is buffered) and feeds the dialect's assembler on the way, O(chunk) per call. The
turn is committed *before* the chunk carrying the terminal event is returned, so a harness
that stops reading at ``message_stop`` / ``response.completed`` / ``[DONE]`` and sends its
next request at once never races the record. JSON answers are assembled in ``response``.

A failed exchange (an error status, an ``error`` event, a cut stream, an unreachable
upstream) commits no turn but is one call on the record, with its error.
"""

from __future__ import annotations

import json
import logging
import time
import uuid

from mitmproxy import http

from interceptor.addons.exchange import Exchange, exchange_of
from interceptor.dialects.encoding import Decoder
from interceptor.dialects.base import Frames
from interceptor.trace import ModelCall
from interceptor.trace.messages import Response, ResponseError, Sampling

log = logging.getLogger(__name__)


def effective_sampling(ex: Exchange) -> Sampling:
    """The settings the upstream actually received: the rewritten body, read back."""
    if ex.body is None:
        return Sampling()
    try:
        return ex.dialect.sampling(ex.body)
    except Exception:  # the body was forwarded; a record without sampling beats no record
        return Sampling()


def make_call(ex: Exchange, flow: http.HTTPFlow, response: Response | None, error: ResponseError | None,
              status: int | None = None) -> ModelCall:
    return ModelCall(
        id=ex.call_id or uuid.uuid4().hex[:16],
        dialect=ex.dialect.name,
        endpoint=flow.request.path.split("?", 1)[0],
        model=(response.model if response and response.model else None) or (ex.body or {}).get("model"),
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
        error=error,
    )


def commit(ex: Exchange, flow: http.HTTPFlow, response: Response | None, error: ResponseError | None = None,
           *, status: int | None = None) -> None:
    """Put the exchange on the record exactly once: a turn when the model answered, a call
    with its error otherwise. ``status`` stands in for the flow's when the exchange is not
    the flow's own (a WebSocket frame's answer; the flow's is the upgrade's 101)."""
    if ex.committed:
        return
    ex.committed = True
    if response is not None and response.error is not None and error is None:
        error = response.error
    call = make_call(ex, flow, response, error, status)
    recorder = ex.session.recorder
    try:
        if error is None and response is not None and ex.request is not None:
            recorder.commit_turn(ex.request, response, call)
            if call.node is not None:  # else the recorder kept it as an error call
                ex.extra["turn"] = call.id
        else:
            recorder.record_call(call)
    except Exception:
        log.exception(f"interceptor: session {ex.session.id!r}: could not record call {call.id}")


class StreamTee:
    """The callable set as ``flow.response.stream``; see the module docstring."""

    def __init__(self, ex: Exchange, flow: http.HTTPFlow, content_encoding: str, frames: Frames) -> None:
        self.ex = ex
        self.flow = flow
        self.decoder = Decoder.for_encoding(content_encoding)
        self.sse = frames
        self.assembler = ex.dialect.assembler()
        self.failed = False

    def __call__(self, chunk: bytes) -> bytes:
        if self.failed or self.ex.committed:
            return chunk
        try:
            if chunk:
                self._feed(self.sse.feed(self.decoder.decode(chunk)))
            else:  # end of body
                tail = self.decoder.flush()
                events = self.sse.feed(tail) if tail else []
                self._feed(events + self.sse.flush())
                self.finish()
        except Exception as e:
            # Never let the record break the harness's stream: forward, and say so.
            self.failed = True
            log.exception(f"interceptor: session {self.ex.session.id!r}: stream assembly failed")
            commit(self.ex, self.flow, None, ResponseError(type="assembler_error", message=f"{type(e).__name__}: {e}"))
        return chunk

    def _feed(self, events) -> None:
        for event in events:
            if self.assembler.feed(event):
                commit(self.ex, self.flow, self.assembler.result())
                return

    def finish(self, reason: str | None = None) -> None:
        """The stream ended (or broke) without its terminal event: an error on the record."""
        if self.ex.committed:
            return
        response = self.assembler.result()
        error = response.error or ResponseError(
            type="incomplete_stream",
            message=reason or "the stream ended without its terminal event",
            status=self.flow.response.status_code if self.flow.response else None,
        )
        commit(self.ex, self.flow, None, error)


class Tee:
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        ex = exchange_of(flow)
        if ex is None or ex.route.kind != "model" or flow.response is None or ex.committed:
            return
        ex.first_byte_at = time.time()
        ctype = flow.response.headers.get("content-type", "")
        frames = ex.dialect.frames(flow.response.status_code, ctype, ex.stream)
        if frames is not None:
            encoding = flow.response.headers.get("content-encoding", "identity")
            try:
                # Kept on the exchange too: later addons (Collect, Retry) wrap the callable.
                flow.response.stream = ex.extra["tee"] = StreamTee(ex, flow, encoding, frames)
            except ValueError as e:  # an encoding we cannot read: forward, record the gap
                flow.response.stream = True
                commit(ex, flow, None, ResponseError(type="unsupported_encoding", message=str(e), status=200))

    def response(self, flow: http.HTTPFlow) -> None:
        ex = exchange_of(flow)
        if ex is None or ex.route.kind != "model" or ex.committed or flow.response is None:
            return
        stream = ex.extra.get("tee")
        if isinstance(stream, StreamTee):
            stream.finish()
            return
        status = flow.response.status_code
        body = None
        try:
            body = json.loads(flow.response.get_content(strict=False) or b"null")
        except ValueError:
            pass
        if status != 200:
            commit(ex, flow, None, ex.dialect.response_error(status, body))
            return
        if not isinstance(body, dict):
            commit(ex, flow, None, ResponseError(type="invalid_response", message="a 200 answer that is not a JSON object", status=status))
            return
        try:
            response = ex.dialect.parse_response(body)
        except Exception as e:
            commit(ex, flow, None, ResponseError(type="invalid_response", message=f"{type(e).__name__}: {e}", status=status))
            return
        commit(ex, flow, response)

    def error(self, flow: http.HTTPFlow) -> None:
        ex = exchange_of(flow)
        if ex is None or ex.route.kind != "model" or ex.committed:
            return
        message = flow.error.msg if flow.error else "connection error"
        stream = ex.extra.get("tee")
        if isinstance(stream, StreamTee):
            stream.finish(f"the stream broke: {message}")
        else:
            commit(ex, flow, None, ResponseError(type="upstream_unreachable" if flow.response is None else "connection_error", message=message, status=None))

"""Tee: the provider's answer goes to the harness untouched while the record is assembled.

For SSE, ``flow.response.stream`` is a synchronous callable that returns each chunk at once
(nothing is buffered) and feeds the dialect's assembler on the way, O(chunk) per call. The
turn is committed *before* the chunk carrying the terminal event is returned, so a harness
that stops reading at ``message_stop`` / ``response.completed`` / ``[DONE]`` and sends its
next request at once never races the record. JSON answers are assembled in ``on_response``.
``Assemble`` is the first stage of the answer's pipeline; ``Tee`` is the addon that runs it.

Most of a stream is one kind of event (a text delta, with vLLM's token ids and logprobs in
a session that collects them); a chunk carries one or several (the relay sends what reached
it in one read as one chunk). Each whole such event in a chunk, between events, is read by
the dialect's shortcut (``NativeAssembler.quick``): the assembler learned the event's exact
shape from the first one it parsed, and reads only the values the record needs
(``dialects/common.py``'s ``Shape``). Anything else (another kind of event, a split one) is
cut into lines, parsed and folded, and the shortcut goes on after it (``StreamTee._events``).
The record is the same either way (``tests/test_tee.py``); the shortcut costs a fraction of
the CPU per event (``bench/pipeline.py``). The events read by a shape's pattern are handed to
collect.py's strip (``matches``), which then takes the token fields out of each by the
shape's template instead of searching its bytes.

A failed exchange (an error status, an ``error`` event, a cut stream, an unreachable
upstream) commits no turn but is one call on the record, with its error.
"""

from __future__ import annotations

import logging
import re
import time

from mitmproxy import http
from mitmproxy.connection import ConnectionState

from interceptor.addons.exchange import EventClock, Exchange, exchange_of
from interceptor.addons.hold import Hold
from interceptor.addons.pipeline import Pipeline, Stage
from interceptor.addons.record import commit
from interceptor.addons.translate import Translate
from interceptor.dialects.base import Frames, header
from interceptor.dialects.encoding import Decoder, Identity
from interceptor.dialects.sse import SSEDecoder, blank
from interceptor.trace.messages import ResponseError

log = logging.getLogger(__name__)


class StreamTee:
    """The callable set as ``flow.response.stream``; see the module docstring."""

    def __init__(self, ex: Exchange, flow: http.HTTPFlow, content_encoding: str, frames: Frames,
                 clock: EventClock | None = None) -> None:
        self.ex = ex
        self.clock = clock  # None: read whole, so the events' times say nothing
        self.flow = flow
        self.decoder = Decoder.for_encoding(content_encoding)
        self.identity = isinstance(self.decoder, Identity)  # no call per chunk to return it
        self.sse = frames
        # A translated answer is assembled from the upstream's events, recorded as the harness gets it.
        self.assembler = ex.translation.assembler() if ex.translation is not None else ex.dialect.assembler()
        self.assembler.expect(ex.session.last_prompts)  # vLLM's prompt ids: parsed past the last ones
        self.failed = False
        self.done = False  # the terminal event was assembled (a held answer commits later)
        # The dialect's shortcut for a chunk that is one usual event (a text delta), read from
        # its bytes between events instead of cut into lines and parsed (``NativeAssembler.quick``).
        self.quick = self.assembler.quick if getattr(self.assembler, "shapes", False) and isinstance(frames, SSEDecoder) else None
        #: Set to a list by a stage that reuses the shortcut's reading (collect.py's strip):
        #: each call's events read by a shape's pattern, as (the event's bytes, the match).
        self.matches: list[tuple[bytes, re.Match[str]]] | None = None

    def __call__(self, chunk: bytes) -> bytes:
        if self.failed or self.done or self.ex.committed:
            return chunk
        try:
            if chunk:
                data = chunk if self.identity else self.decoder.decode(chunk)
                if self.quick is not None:
                    self._events(data)
                else:
                    self._feed(self.sse.feed(data))
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

    def _events(self, data: bytes) -> None:
        """A chunk, piece by piece: each up to its first blank line (``\n\n``; a JSON string
        cannot hold a raw LF). A piece that is one whole event of the learned shape, between
        events, is read by the shortcut; any other (the rest of an event the last chunk cut,
        another kind of event, which may teach a new shape, a comment, CRLF lines) is fed the
        full way, as is what follows the last blank line. Piece by piece, not the rest of the
        chunk at once: a shape is learned from one event, as when chunks were one event each.
        The decoder sees the same bytes in the same order either way."""
        sse, quick, clock, matches, pos, end = self.sse, self.quick, self.clock, self.matches, 0, len(data)
        while pos < end and not self.done:
            cut = blank(data, pos) + 2
            if cut < 2:
                break
            piece = data if not pos and cut == end else data[pos:cut]
            if sse.idle and quick(piece):
                sse.bytes_seen += len(piece)
                if matches is not None and self.assembler.matched is not None:
                    matches.append((piece, self.assembler.matched))
                if clock is not None:
                    clock.times.append(time.monotonic())
            else:
                self._feed(sse.feed(piece))
            pos = cut
        if pos < end and not self.done:
            self._feed(sse.feed(data[pos:] if pos else data))

    def _feed(self, events) -> None:
        # The chunk's arrival, once per event (before the feed: the terminal event commits).
        stamp = self.clock.times.append if self.clock is not None and events else None
        now = time.monotonic() if stamp is not None else 0.0
        for event in events:
            if stamp is not None:
                stamp(now)
            if self.assembler.feed(event):
                self.done = True
                self.ex.prompt_read = self.assembler.prompt_read
                response = self.assembler.result()
                # Let go of what assembled it: a finished flow is cyclic garbage until the
                # collector's next pass, and a young collection walks all it holds till then
                # (vLLM's prompt ids: ~70,000 items at turn 300; 17 ms pauses every ~12 turns).
                self.assembler = self.quick = None
                commit(self.ex, self.flow, response)
                return

    def finish(self, reason: str | None = None) -> None:
        """The stream ended (or broke) without its terminal event: an error on the record."""
        if self.ex.committed or self.done:
            return
        response = self.assembler.result()
        error = response.error or ResponseError(
            type="incomplete_stream",
            message=reason or "the stream ended without its terminal event",
            status=self.flow.response.status_code if self.flow.response else None,
        )
        commit(self.ex, self.flow, None, error)


class Assemble:
    """The pipeline's first stage (``addons/pipeline.py``): decode, frame, assemble, commit."""

    def on_headers(self, flow: http.HTTPFlow, stream):
        ex = exchange_of(flow)
        if ex is None or ex.route.kind != "model" or flow.response is None or ex.committed:
            return stream
        ex.first_byte_at = time.time()
        ctype = header(flow.response.headers, "content-type", "")
        frames = ex.wire.frames(flow.response.status_code, ctype, ex.stream)
        if frames is not None:
            encoding = header(flow.response.headers, "content-encoding", "identity")
            try:
                ex.clock = EventClock()
                ex.tee = StreamTee(ex, flow, encoding, frames, ex.clock)
                return ex.tee
            except ValueError as e:  # an encoding we cannot read: forward, record the gap
                commit(ex, flow, None, ResponseError(type="unsupported_encoding", message=str(e), status=200))
                return True
        return stream

    def on_response(self, flow: http.HTTPFlow) -> None:
        ex = exchange_of(flow)
        if ex is None or ex.route.kind != "model" or ex.committed or flow.response is None:
            return
        if ex.tee is not None:
            ex.tee.finish()
            return
        status = flow.response.status_code
        frames = ex.dialect.frames(status, header(flow.response.headers, "content-type", ""), ex.stream)
        if frames is not None:
            # A stream read whole (Feedback's second attempt): assembled as if it had streamed.
            try:
                tee = StreamTee(ex, flow, header(flow.response.headers, "content-encoding", "identity"), frames)
            except ValueError as e:
                commit(ex, flow, None, ResponseError(type="unsupported_encoding", message=str(e), status=status))
                return
            tee(flow.response.raw_content or b"")
            tee(b"")
            return
        body = None
        try:
            # vLLM's prompt ids are parsed past the ones the session's last answer carried.
            body, ex.prompt_read = ex.wire.load_response(flow.response.get_content(strict=False) or b"null",
                                                         ex.session.last_prompts)
        except ValueError:
            pass
        if status != 200:
            commit(ex, flow, None, ex.wire.response_error(status, body))
            return
        if not isinstance(body, dict):
            commit(ex, flow, None, ResponseError(type="invalid_response", message="a 200 answer that is not a JSON object", status=status))
            return
        try:
            response = ex.wire.parse_response(body)
            if ex.translation is not None and response.error is None:
                response = ex.translation.recorded(body, response)
        except Exception as e:
            commit(ex, flow, None, ResponseError(type="invalid_response", message=f"{type(e).__name__}: {e}", status=status))
            return
        commit(ex, flow, response)

    def on_error(self, flow: http.HTTPFlow) -> None:
        ex = exchange_of(flow)
        if ex is None or ex.route.kind != "model" or ex.committed:
            return
        message = flow.error.msg if flow.error else "connection error"
        if ex.tee is not None:
            ex.tee.finish(f"the stream broke: {message}")
        else:
            commit(ex, flow, None, ResponseError(type=_failed_side(flow), message=message, status=None))


def _failed_side(flow: http.HTTPFlow) -> str:
    """Whose end broke a flow that has no answer on the record: the client's when its request
    never came whole (a body cut or timed out) or its connection stopped sending (closed, or
    half-closed, which mitmproxy 12 ends while the answer is awaited); else the upstream's."""
    if flow.request.timestamp_end is None or not flow.client_conn.state & ConnectionState.CAN_READ:
        return "client_disconnected"
    return "upstream_unreachable" if flow.response is None else "connection_error"


class Tee:
    """The addon that carries an answer back to the harness: the stream pipeline
    (``addons/pipeline.py``), this module's ``Assemble`` first, then the stages given (in the
    script: Collect's strip, Retry's capture) around the answer's translation (``Translate``,
    which has no request hooks: Rewrite translates the request) and the hold for response
    hooks (``Hold``, whose answers the Relay collects and delivers)."""

    def __init__(self, strip: Stage | None = None, capture: Stage | None = None) -> None:
        self.pipeline = Pipeline(Assemble(), strip=strip, translate=Translate(), hold=Hold(), capture=capture)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        self.pipeline.responseheaders(flow)

    def response(self, flow: http.HTTPFlow) -> None:
        self.pipeline.response(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self.pipeline.error(flow)

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

What an upstream sends is bounded for the record (``Bounds``: ``intercept_max_answer`` for an
answer's decoded bytes, ``intercept_max_event`` for one SSE event or line): decoding goes a
piece at a time and stops where a bound is passed, so a compression bomb or an event without
end costs the proxy the bound, not the answer. The call is then on the record with an
``answer_too_large`` error that says what was cut, and the harness gets the upstream's bytes
as they came (compressed ones untouched) where nothing in the proxy must rewrite them; where
something must (a JSON error the proxy reads, a translated or token-collecting session, a
held answer), a JSON answer over the bound is replaced by a 502 in the dialect's shape.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

from mitmproxy import ctx, http
from mitmproxy.connection import ConnectionState

from interceptor.addons.gateway.answers import error_response
from interceptor.addons.gateway.exchange import EventClock, Exchange, exchange_of
from interceptor.addons.gateway.answer.hold import Hold
from interceptor.addons.gateway.answer.pipeline import Pipeline, Stage
from interceptor.addons.gateway.record import commit
from interceptor.addons.gateway.sizes import size_option
from interceptor.addons.gateway.answer.translate import Translate
from interceptor.dialects.base import Frames, header
from interceptor.dialects.encoding import Decoder, Identity, TooLarge
from interceptor.dialects.sse import EventTooLarge, SSEDecoder, blank
from interceptor.trace.messages import ResponseError

log = logging.getLogger(__name__)

# The Tee's own state on an exchange (``Exchange.own``): the streamed answer's assembler.
TEE_KEY = "tee"

MAX_ANSWER, MAX_EVENT = "64m", "16m"  # the options' defaults
# Deflate's largest ratio, 1032:1 (zlib's technical details, https://zlib.net/zlib_tech.html);
# brotli's and zstd's have no such small bound.
DEFLATE_RATIO = 1032
_DEFLATED = ("gzip", "x-gzip", "deflate")


@dataclass(slots=True)
class Bounds:
    """What one answer may cost the proxy to read for the record, bytes (0: no bound)."""

    answer: int = 64 << 20  # decoded bytes of one answer (intercept_max_answer)
    event: int = 16 << 20  # one SSE event, or one line of it (intercept_max_event)


PASSED_ON = "the harness got the upstream's bytes unchanged"
REPLACED = "the harness got a 502 instead (the proxy must read this answer to pass it on)"
ENDED = "the harness's stream ends there (the proxy must read this answer to pass it on)"
WENT_ON = "the stream went on to the harness through the session's translation or response hooks"


def too_large(e: TooLarge, got: str, status: int | None = None) -> ResponseError:
    """The record's error for an answer cut at a bound: which bound, and what the harness got."""
    option = "intercept_max_event" if isinstance(e, EventTooLarge) else "intercept_max_answer"
    return ResponseError(type="answer_too_large", status=status,
                         message=f"{e} (option {option}): the record stops there; {got}")


class StreamTee:
    """The callable set as ``flow.response.stream``; see the module docstring."""

    def __init__(self, ex: Exchange, flow: http.HTTPFlow, content_encoding: str, frames: Frames,
                 clock: EventClock | None = None, bounds: Bounds | None = None) -> None:
        self.ex = ex
        self.clock = clock  # None: read whole, so the events' times say nothing
        self.flow = flow
        bounds = bounds or Bounds()
        self.decoder = Decoder.for_encoding(content_encoding, bounds.answer)
        self.identity = isinstance(self.decoder, Identity)  # no call per chunk to return it
        if isinstance(frames, SSEDecoder):
            frames.max_event = bounds.event
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
                if self.identity:
                    self.decoder.count(len(chunk))
                    self._read(chunk)
                else:  # a piece at a time: a chunk may inflate a thousandfold
                    for piece in self.decoder.pieces(chunk):
                        self._read(piece)
                        if self.done:
                            break
            else:  # end of body
                tail = self.decoder.flush()
                events = self.sse.feed(tail) if tail else []
                self._feed(events + self.sse.flush())
                self.finish()
        except TooLarge as e:  # the record stops at the bound; the harness's bytes go on
            self._drop()
            log.warning(f"interceptor: session {self.ex.session.id!r}: {e}; the record stops there")
            ex = self.ex
            got = ENDED if ex.collect is not None else WENT_ON if ex.translation or ex.hold else PASSED_ON
            commit(ex, self.flow, None, too_large(e, got))
        except Exception as e:
            # Never let the record break the harness's stream: forward, and say so.
            self._drop()
            log.exception(f"interceptor: session {self.ex.session.id!r}: stream assembly failed")
            commit(self.ex, self.flow, None, ResponseError(type="assembler_error", message=f"{type(e).__name__}: {e}"))
        return chunk

    def _read(self, data: bytes) -> None:
        if self.quick is not None:
            self._events(data)
        else:
            self._feed(self.sse.feed(data))

    def _drop(self) -> None:
        """Reading for the record stopped: what it held goes now, not with the flow."""
        self.failed = True
        self.assembler = self.quick = self.sse = self.decoder = None

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
                # (vLLM's prompt ids: a whole conversation's tokens, late in a rollout).
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
    """The pipeline's first stage (``addons/gateway/answer/pipeline.py``): decode, frame, assemble, commit."""

    def __init__(self, bounds: Bounds | None = None) -> None:
        self.bounds = bounds or Bounds()

    def on_headers(self, flow: http.HTTPFlow, stream):
        ex = exchange_of(flow)
        if ex is None or ex.route.kind != "model" or flow.response is None or ex.committed:
            return stream
        ex.first_byte_at = time.time()
        ctype = header(flow.response.headers, "content-type", "")
        frames = ex.wire.frames(flow.response.status_code, ctype, ex.stream)
        encoding = header(flow.response.headers, "content-encoding", "identity")
        if frames is not None:
            try:
                ex.clock = EventClock()
                tee = ex.own[TEE_KEY] = StreamTee(ex, flow, encoding, frames, ex.clock, self.bounds)
                return tee
            except ValueError as e:  # an encoding we cannot read: forward, record the gap
                commit(ex, flow, None, ResponseError(type="unsupported_encoding", message=str(e), status=200))
                return True
        if flow.response.raw_content and not stream:
            self._measure(ex, flow, encoding)
        return stream

    def _measure(self, ex: Exchange, flow: http.HTTPFlow, encoding: str) -> None:
        """A JSON answer read whole (the Relay's Fetch) over ``intercept_max_answer`` once
        decoded, found before any addon's ``response`` hook decodes it whole (mitmproxy's
        ``get_content`` would): it goes on as the upstream sent it where nothing must read
        it (a 200 in a plain session); elsewhere it becomes a 502 in the dialect's shape.
        Either way the call is on the record with what was cut."""
        limit, size = self.bounds.answer, len(flow.response.raw_content)
        if not limit or (encoding.strip().lower() in _DEFLATED and size * DEFLATE_RATIO <= limit):
            return  # no bound, or it cannot inflate past it: not decoded twice to find that out
        try:
            decoder = Decoder.for_encoding(encoding, limit)
            if isinstance(decoder, Identity):
                decoder.count(size)
            else:
                for _ in decoder.pieces(flow.response.raw_content):
                    pass  # counted and let go: only the size is wanted here
                decoder.flush()
        except TooLarge as e:
            response = flow.response
            safe = (response.status_code == 200 and ex.translation is None and ex.collect is None
                    and ex.hold is None)
            log.warning(f"interceptor: session {ex.session.id!r}: {e}; the record stops there")
            error = too_large(e, PASSED_ON if safe else REPLACED, status=response.status_code)
            if not safe:  # in the upstream's dialect: a translated session's is re-shaped by the pipeline
                flow.response = error_response(ex.wire, 502, error.message, type="answer_too_large")
            commit(ex, flow, None, error)
        except ValueError:
            pass  # a broken encoding: ``on_response`` records it as it reads the body

    def on_response(self, flow: http.HTTPFlow) -> None:
        ex = exchange_of(flow)
        if ex is None or ex.route.kind != "model" or ex.committed or flow.response is None:
            return
        tee = ex.own.get(TEE_KEY)
        if isinstance(tee, StreamTee):
            tee.finish()
            return
        status = flow.response.status_code
        frames = ex.dialect.frames(status, header(flow.response.headers, "content-type", ""), ex.stream)
        if frames is not None:
            # A stream read whole (Feedback's second attempt): assembled as if it had streamed.
            try:
                tee = StreamTee(ex, flow, header(flow.response.headers, "content-encoding", "identity"), frames,
                            bounds=self.bounds)
            except ValueError as e:
                commit(ex, flow, None, ResponseError(type="unsupported_encoding", message=str(e), status=status))
                return
            tee(flow.response.raw_content or b"")
            tee(b"")
            return
        body = None
        try:
            # vLLM's prompt ids are parsed past the ones the session's last answer carried.
            body, ex.prompt_read = ex.wire.load_response(self._content(flow.response) or b"null",
                                                         ex.session.last_prompts)
        except TooLarge as e:  # read whole by mitmproxy itself (no relay): the record stops here
            commit(ex, flow, None, too_large(e, PASSED_ON))
            return
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

    def _content(self, response: http.Response) -> bytes:
        """The body decoded within ``intercept_max_answer`` (``TooLarge`` past it); a body
        that does not decode is read as it came, as mitmproxy's ``get_content(strict=False)``."""
        raw = response.raw_content or b""
        try:
            decoder = Decoder.for_encoding(header(response.headers, "content-encoding", "identity"),
                                           self.bounds.answer)
            if isinstance(decoder, Identity):
                decoder.count(len(raw))
                return raw
            return decoder.decode(raw) + decoder.flush()
        except TooLarge:
            raise
        except ValueError:
            return raw

    def on_error(self, flow: http.HTTPFlow) -> None:
        ex = exchange_of(flow)
        if ex is None or ex.route.kind != "model" or ex.committed:
            return
        message = flow.error.msg if flow.error else "connection error"
        tee = ex.own.get(TEE_KEY)
        if isinstance(tee, StreamTee):
            tee.finish(f"the stream broke: {message}")
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
    (``addons/gateway/answer/pipeline.py``), this module's ``Assemble`` first, then the stages given (in the
    script: Collect's strip, Retry's capture) around the answer's translation (``Translate``,
    which has no request hooks: Rewrite translates the request) and the hold for response
    hooks (``Hold``, whose answers the Relay collects and delivers)."""

    def __init__(self, strip: Stage | None = None, capture: Stage | None = None) -> None:
        self.bounds = Bounds()
        self.pipeline = Pipeline(Assemble(self.bounds), strip=strip, translate=Translate(), hold=Hold(),
                                 capture=capture)

    def load(self, loader) -> None:
        loader.add_option("intercept_max_answer", str, MAX_ANSWER,
                          "Largest decoded answer the proxy reads for the record (k/m/g suffixes, 0: no "
                          "limit); past it the record stops and says so, and the harness still gets the "
                          "upstream's bytes where the proxy need not rewrite them.")
        loader.add_option("intercept_max_event", str, MAX_EVENT,
                          "Largest single SSE event or line the proxy reads for the record (k/m/g "
                          "suffixes, 0: no limit); past it, as for intercept_max_answer.")

    def configure(self, updated: set[str]) -> None:
        for name, field in (("intercept_max_answer", "answer"), ("intercept_max_event", "event")):
            if name in updated:
                setattr(self.bounds, field, size_option(name, getattr(ctx.options, name)))

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        self.pipeline.responseheaders(flow)

    def response(self, flow: http.HTTPFlow) -> None:
        self.pipeline.response(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self.pipeline.error(flow)

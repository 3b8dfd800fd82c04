"""Translate: an upstream's answer in the harness's own dialect, when the two differ.

Rewrite sent the harness's request translated (``ex.translation``); this is the answer's
half, a stage of the answer's pipeline (``addons/gateway/answer/pipeline.py``) after the assembler (which
records the upstream's events, token ids included) and Collect's strip, and before Retry's
capture (so a replay repeats what the harness received, in its own dialect):

- a stream is cut into events as the bytes arrive and each event is translated at once
  (``Translation.events``): nothing is held beyond the event in flight, and the terminal
  event the harness gets is produced in the same call in which the assembler below has
  committed the turn;
- a JSON answer is translated whole in ``on_response``; an error answer is re-shaped into
  the harness's error (the status and every header, ``retry-after`` and ``x-should-retry``
  included, stay the upstream's).

A translation that raises must not hand the harness half an answer in the wrong dialect:
the stream ends with an error event in the harness's shape, a JSON answer becomes a 502.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from mitmproxy import http

from interceptor.addons.gateway.exchange import Exchange, exchange_of
from interceptor.dialects.encoding import Decoder
from interceptor.dialects.sse import SSEDecoder
from interceptor.dialects.translate import EventTranslator

log = logging.getLogger(__name__)


class TranslateStream:
    """The ``flow.response.stream`` callable around the inner ones: they see the upstream's
    bytes, the harness gets the translated events."""

    def __init__(self, inner: Any, ex: Exchange, events: EventTranslator, content_encoding: str | None) -> None:
        self.inner = inner
        self.ex = ex
        self.events = events
        self.sse = SSEDecoder()
        self.decoder = Decoder.for_encoding(content_encoding) if content_encoding else None
        self.failed = False

    def __call__(self, chunk: bytes) -> list[bytes]:
        out = self.inner(chunk) if callable(self.inner) else chunk
        if not isinstance(out, bytes):  # an inner callable may return an iterable of chunks
            out = b"".join(out)
        if self.failed:
            return []
        try:
            if self.decoder is not None:
                out = (self.decoder.decode(out) if out else b"") + (b"" if chunk else self.decoder.flush())
            events = self.sse.feed(out) if out else []
            if not chunk:
                events += self.sse.flush()
            sent = b"".join(e.encode() for ev in events for e in self.events.feed(ev))
        except Exception as e:  # noqa: BLE001 - the harness gets an error in its shape, not garbage
            self.failed = True
            log.exception(f"interceptor: session {self.ex.session.id!r}: the answer could not be translated")
            sent = self.ex.translation.stream_error(f"the proxy could not translate the answer: {type(e).__name__}")
        return [sent] if sent else []


class Translate:
    """The pipeline's translate stage; see the module docstring."""

    def on_headers(self, flow: http.HTTPFlow, stream):
        ex = exchange_of(flow)
        response = flow.response
        if ex is None or ex.translation is None or response is None or ex.replayed or ex.answered_here:
            return stream
        if response.status_code != 200 or not response.headers.get("content-type", "").startswith("text/event-stream"):
            return stream  # read whole, translated in on_response
        encoding = response.headers.get("content-encoding", "").strip()
        if encoding.lower() in ("", "identity"):
            encoding = ""
        translated = TranslateStream(stream, ex, ex.translation.events(), encoding or None)
        if encoding:
            del response.headers["content-encoding"]
        return translated

    def on_response(self, flow: http.HTTPFlow) -> None:
        ex = exchange_of(flow)
        response = flow.response
        if ex is None or ex.translation is None or response is None or ex.replayed or ex.answered_here:
            return
        if isinstance(response.stream, TranslateStream) or callable(response.stream):
            return
        tr = ex.translation
        status = response.status_code
        try:
            body = json.loads(response.get_content(strict=False) or b"null")
        except ValueError:
            body = None
        try:
            if status == 200 and isinstance(body, dict) and not body.get("error"):
                out = tr.response(body)
            else:
                if status == 200:  # a 200 that is no answer: the harness must not take it for one
                    response.status_code = 502
                    status = 502
                out = tr.error(status, body)
        except Exception as e:  # noqa: BLE001 - see the module docstring
            log.exception(f"interceptor: session {ex.session.id!r}: the answer could not be translated")
            response.status_code = 502
            out = ex.dialect.error_body(502, f"the proxy could not translate the answer: {type(e).__name__}")
        response.headers.pop("content-encoding", None)
        response.headers["content-type"] = "application/json"
        response.content = json.dumps(out, ensure_ascii=False, separators=(",", ":")).encode()

    def on_error(self, flow: http.HTTPFlow) -> None:
        pass

"""Collect: token ids and logprobs for training, from an upstream that returns them.

A session with ``collect_tokens`` asks the upstream, on every model request whose wire dialect
has token fields (``Dialect.tokens``: vLLM's and SGLang's on Chat Completions and Responses,
``dialects/vllm.py``), for the tokens the model saw and sampled: what the trace needs to train
on exactly those. The harness never asked for them, so they are taken out of what it receives.
Which keys ask, where the answer carries the fields and how they come out are the dialect's
(``dialects/tokens.py``); this decides which exchanges ask and runs the stages:

- ``request`` (after Rewrite): adds the keys to the body Rewrite left in ``ex.body`` and to
  the bytes it left in ``flow.request.content`` (spliced in, not re-serialised), and lists
  them among the call's overrides (reason ``collect_tokens``). A key the body already asks
  for (the harness's own ``logprobs``) is left alone and, below, never stripped.
- ``on_headers`` (the pipeline's strip stage): wraps the Tee's stream callable, so the Tee
  assembles the upstream's bytes, token fields included, and the harness gets each event
  without them (``tokens.EventStrip``).
- ``on_response`` (after the Tee, which has parsed and recorded the full JSON body): strips the
  body. Either way one ``rewrite`` record (direction ``response``) says what was removed,
  written right after the turn and before the harness has the answer.

``addons/gateway/answer/pipeline.py`` runs the answer-side stages after the Tee's and before Retry's capture,
so the capture (and any replay) holds the bytes the harness actually received.
"""

from __future__ import annotations

import logging
from typing import Any

from mitmproxy import http

from interceptor.addons.gateway.exchange import Exchange, exchange_of
from interceptor.dialects.base import Override
from interceptor.dialects.encoding import Decoder, TooLarge
from interceptor.dialects.sse import EventTooLarge
from interceptor.dialects.tokens import EventStrip, TokenFields, dumps, with_true_keys
from interceptor.trace.ids import new_id

log = logging.getLogger(__name__)

REASON = "collect_tokens"


def record(plan: TokenFields, ex: Exchange) -> None:
    """One ``rewrite`` record for the exchange, once, if anything was removed."""
    if not plan.removed or plan.recorded:
        return
    plan.recorded = True
    kind = "sse" if plan.streamed else "json"
    rewrite: dict[str, Any] = {"direction": "response", "by": REASON, "call": ex.call_id,
                               "body": kind, "removed": sorted(plan.removed)}
    if plan.streamed:
        rewrite["events"] = plan.events
        if plan.dropped:
            rewrite["dropped_events"] = plan.dropped
    try:
        ex.session.recorder.record_rewrite(rewrite)
    except Exception:
        log.exception(f"interceptor: session {ex.session.id!r}: could not record the response rewrite")


class StripStream:
    """The ``flow.response.stream`` callable around the Tee's: the inner callable sees (and
    records) the upstream's bytes, the harness gets them stripped. The rewrite record is
    written in the call where the Tee commits the turn, so it follows the turn on the record
    and precedes the terminal event the harness then receives.

    It holds what the Tee may hold (the Tee's bounds: ``intercept_max_answer`` decoded,
    ``intercept_max_event`` an event): past either, the rest cannot be stripped, so the
    harness's stream ends there (the token fields never reach it) and the Tee's record says
    what was cut."""

    def __init__(self, inner: Any, ex: Exchange, plan: TokenFields, content_encoding: str | None) -> None:
        self.inner = inner
        self.ex = ex
        self.plan = plan
        limit = getattr(getattr(inner, "decoder", None), "limit", 0)
        self.max_event = getattr(getattr(inner, "sse", None), "max_event", 0)
        self.cut = False
        # An upstream that compressed despite ``accept-encoding: identity`` is decoded here
        # and the header removed, so the harness gets plain events.
        self.decoder = Decoder.for_encoding(content_encoding, limit) if content_encoding else None
        # The Tee's readings by a shape, for the same bytes only (it decodes what it reads).
        matches = None
        if self.decoder is None and getattr(inner, "matches", False) is None and getattr(inner, "identity", False):
            matches = inner.matches = []
        self.events = EventStrip(plan, matches)

    def __call__(self, chunk: bytes) -> list[bytes]:
        """A list, never ``b""``: mitmproxy sends an empty bytes result as an empty chunk,
        which in a chunked HTTP/1.1 body is its end (a held partial event yields none)."""
        self.events.begin()
        out = self.inner(chunk) if callable(self.inner) else chunk
        if not isinstance(out, bytes):  # an inner callable may return an iterable of chunks
            out = b"".join(out)
        if self.cut:
            return []
        try:
            if self.decoder is not None:
                out = self.decoder.decode(out) if out else b""
                if not chunk:
                    out += self.decoder.flush()
            out = self.events.feed(out) if chunk else self.events.feed(out) + self.events.flush()
            if self.max_event and len(self.events.event) > self.max_event:
                self._cut(EventTooLarge(f"an event of the stream passed {self.max_event} bytes"))
        except TooLarge as e:
            self._cut(e)
            out = b""
        if self.ex.committed:
            record(self.plan, self.ex)
        return [out] if out else []

    def _cut(self, e: TooLarge) -> None:
        self.cut = True
        self.events = EventStrip(self.plan)  # what it held goes now
        self.decoder = None
        log.warning(f"interceptor: session {self.ex.session.id!r}: {e}; token fields cannot be "
                    "stripped past it, so the harness's stream ends there")


class Collect:
    def __init__(self) -> None:
        self._warned: set[str] = set()

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        ex = exchange_of(flow)
        if (ex is None or ex.route.kind != "model" or ex.wire.tokens is None or ex.body is None
                or not ex.session.config.collect_tokens):
            return
        body = ex.body
        plan = ex.wire.tokens.wanted(body)
        if plan is None:
            return  # the body asks for them already: nothing added, nothing to strip
        added = plan.asks
        present = any(key in body for key in added)  # e.g. "logprobs": false
        for key in added:
            ex.overrides.append(Override(key, body.get(key), True, REASON))
            body[key] = True
        if not ex.unwritten:  # else Stops writes the body, these keys with the rest (Exchange.unwritten)
            content = None if present else with_true_keys(flow.request.content or b"", added)
            flow.request.content = content if content is not None else dumps(body)
        # Plain bytes back, so events can be cut and rewritten as they pass.
        flow.request.headers["accept-encoding"] = "identity"
        ex.call_id = ex.call_id or new_id()  # the rewrite record names the call
        ex.collect = plan

    def on_headers(self, flow: http.HTTPFlow, stream):
        plan = self._plan(flow)
        response = flow.response
        if plan is None or response is None or not stream:
            return stream
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            return stream
        encoding = response.headers.get("content-encoding", "").strip()
        if encoding.lower() in ("", "identity"):
            encoding = ""
        try:
            stripped = StripStream(stream, exchange_of(flow), plan, encoding or None)
        except ValueError as e:  # an encoding nobody here can read: forward as is
            log.warning(f"interceptor: token fields left in a {encoding} stream: {e}")
            return stream
        plan.streamed = True
        if encoding:
            del response.headers["content-encoding"]
        if "content-length" in response.headers:
            # The harness gets fewer bytes than the upstream framed: a length kept would make it
            # wait for the rest. HTTP/1.1 then frames the stripped events in chunks (RFC 9112
            # section 6.1); HTTP/2 and 3 frame them themselves.
            del response.headers["content-length"]
            if flow.request.http_version.startswith("HTTP/1"):
                response.headers["transfer-encoding"] = "chunked"
        return stripped

    def on_response(self, flow: http.HTTPFlow) -> None:
        plan = self._plan(flow)
        response = flow.response
        if plan is None or response is None:
            return
        ex = exchange_of(flow)
        if plan.streamed:
            self._check(ex, plan)
            record(plan, ex)
            return
        if response.stream or not response.headers.get("content-type", "").startswith("application/json"):
            return
        body = plan.stripped(response.get_content(strict=False) or b"")
        if body is not None:
            response.content = dumps(body)
        if response.status_code == 200:
            self._check(ex, plan)
        record(plan, ex)

    def on_error(self, flow: http.HTTPFlow) -> None:
        """A stream that broke after events were stripped: the rewrite is still on record."""
        plan = self._plan(flow)
        if plan is not None and plan.streamed:
            record(plan, exchange_of(flow))

    def _check(self, ex: Exchange, plan: TokenFields) -> None:
        """Say once per session when the upstream ignores the request for token ids (the
        dialect's ``hint`` says which upstream returns them): the trace then has no tokens to
        train on."""
        if not plan.token_ids or plan.proof in plan.removed or ex.session.id in self._warned:
            return
        if ex.replayed:
            return
        self._warned.add(ex.session.id)
        log.warning(f"interceptor: session {ex.session.id!r} collects tokens, but the upstream "
                    f"returned no {plan.proof}: {plan.hint}")

    @staticmethod
    def _plan(flow: http.HTTPFlow) -> TokenFields | None:
        ex = exchange_of(flow)
        return ex.collect if ex is not None else None

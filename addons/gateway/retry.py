"""Retry: a retried request gets the answer already recorded for it, never a second sample.

RL training needs a graph that does not fork because an SDK sent a request twice, and a
rollout must not loop on a stale answer when a harness legitimately sends the same body
again (compaction regenerates byte-identical requests). The rules, per session, keyed by the
digest of the body exactly as the harness sent it (less what the dialect knows a harness sends
anew with every attempt: ``Dialect.identity``):

- **flagged**: ``x-stainless-retry-count`` > 0 (every OpenAI/Anthropic SDK attempt carries
  it, 0 first), or a header named in ``intercept_retry_headers`` repeating a value seen
  before in the session;
- **replay**: a flagged retry of the session's last recorded exchange gets its recorded
  status, headers and body bytes, JSON or SSE, verbatim; no upstream request, no node;
- **coalesce**: a flagged retry of an exchange still in flight waits for it, then replays it
  (or gets a retryable 503 if it failed);
- **fresh**: the same body without a flag is a new turn, and drops the recorded answer so its
  own retries coalesce on it;
- **undelivered** (harnesses that retry without a flag: Claude Code's own loop, Codex): an
  identical body that follows a committed answer the client left **before its end** is a
  retry. An answer whose end was handed to the client connection (a JSON body, a stream's
  terminal event: ``Exchange.handed``, set by the capture below) is delivered, whatever the
  client does with its connection afterwards: a best-of-n loop with a fresh client per call,
  an idle keep-alive dropped, curl, or a harness that re-asks after an answer failed its own
  check all ask again, and each must get a new sample.

Upstream errors are never replayed: the SDK's retry of a 429 must reach the provider.
Its request hook runs after Rewrite (which keeps the raw body); its capture is the stream
pipeline's last stage (``addons/gateway/answer/pipeline.py``), so it keeps the bytes the harness received
after every other stage had its say.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash
from mitmproxy import ctx, http

from interceptor.addons.gateway.answers import error_response
from interceptor.addons.gateway.exchange import Exchange, Step, exchange_of
from interceptor.addons.gateway.record import commit_replay
from interceptor.dialects.base import header
from interceptor.trace.ids import new_id

log = logging.getLogger(__name__)

# The body's digest is XXH3-128, not sha256: it is computed for every model request on the
# event loop, over the whole history the request restates, and XXH3 reads it many times
# faster than sha256 (``bench/retry.py``). It is only compared with this session's own
# earlier digests in memory (never stored, never a security boundary: a harness that forged a
# collision would only be answered its own session's earlier answer); 128 bits make an
# accidental collision between two bodies of one session as likely as sha256's would be, nil.
HASH_OFF_LOOP = 32 << 20  # bodies above this are hashed in a worker thread (only there is the hop worth it)
HOP_BY_HOP = {"transfer-encoding", "connection", "content-length", "keep-alive"}
# Retry's own state on an exchange (``Exchange.own``): what it keeps of the answer for a replay.
RECORDED_KEY = "retry"


@dataclass(eq=False)
class Recorded:
    """One exchange's answer as the harness received it, kept for replay."""

    digest: str
    call_id: str
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)
    committed: bool = False  # a turn is on the record
    completed: bool = False  # the answer ended (read whole, or finished by the Relay's Drain)
    left: bool = False  # the client went away before the answer's end was handed to it
    failed: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def replayable(self) -> bool:
        return self.committed and self.completed and not self.failed

    @property
    def delivered(self) -> bool:
        return self.completed and not self.left


@dataclass(eq=False)
class Book:
    """A session's retry state: the last recorded exchange and those in flight."""

    last: Recorded | None = None
    inflight: dict[str, Recorded] = field(default_factory=dict)
    seen_keys: set[tuple[str, str]] = field(default_factory=set)


class _Capture:
    """Outermost stream callable: keeps every byte the harness is sent, for replay, and marks
    the exchange ``handed`` once a chunk goes to the client after the turn was committed (the
    assembler commits at the terminal event, before that event's bytes go on): from then on
    the answer counts as delivered."""

    def __init__(self, inner, rec: Recorded, ex: Exchange) -> None:
        self.inner = inner
        self.rec = rec
        self.ex = ex
        self._call = inner if callable(inner) else None  # once, not per chunk

    def __call__(self, chunk: bytes) -> bytes | list[bytes]:
        out = self._call(chunk) if self._call is not None else chunk
        if out.__class__ is not bytes:  # an iterable of chunks
            out = b"".join(out)
        self.rec.body += out
        ex = self.ex
        if not ex.handed and ex.committed and ex.delivered:
            ex.handed = True  # the terminal event goes to a client that is still there
        return out or []  # never b"": mitmproxy would send it as a chunked body's last chunk


def _captured(stream) -> bool:
    """Whether the capture stage is in the chain (the Relay's meter wraps it)."""
    while stream is not None and not isinstance(stream, _Capture):
        stream = getattr(stream, "inner", None)
    return stream is not None


def retry_count(flow: http.HTTPFlow) -> int:
    try:
        return int(header(flow.request.headers, "x-stainless-retry-count", "0"))
    except ValueError:
        return 0


class Retry:
    def __init__(self) -> None:
        self.retry_headers: tuple[str, ...] = ()
        self.undelivered = True

    def load(self, loader) -> None:
        loader.add_option(
            "intercept_retry_headers", Sequence[str], [],
            "Headers whose repeated value flags a retry (an idempotency key), e.g. Idempotency-Key.",
        )
        loader.add_option(
            "intercept_retry_undelivered", bool, True,
            "Treat an identical body that follows a committed but undelivered answer as a retry.",
        )

    def configure(self, updated: set[str]) -> None:
        if "intercept_retry_headers" in updated:
            self.retry_headers = tuple(h.strip().lower() for h in ctx.options.intercept_retry_headers if h.strip())
        if "intercept_retry_undelivered" in updated:
            self.undelivered = ctx.options.intercept_retry_undelivered

    @staticmethod
    def book(ex: Exchange) -> Book:
        # Kept on the session, so it goes when the sealed session is released.
        return ex.session.state.setdefault("retry", Book())

    # -- request: decide ---------------------------------------------------------------------

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        ex = exchange_of(flow)
        if ex is None or ex.route.kind != "model" or flow.request.method != "POST":
            return
        raw = ex.dialect.identity(ex.raw_body)
        if len(raw) > HASH_OFF_LOOP:
            digest = await asyncio.to_thread(xxhash.xxh3_128_hexdigest, raw)
        else:
            digest = xxhash.xxh3_128_hexdigest(raw)
        book = self.book(ex)
        flagged = retry_count(flow) > 0
        new_key = False  # an idempotency key never seen before: certainly not a retry
        for name in self.retry_headers:
            value = header(flow.request.headers, name)
            if value is not None:
                key = (name, value)
                flagged = flagged or key in book.seen_keys
                new_key = new_key or key not in book.seen_keys
                book.seen_keys.add(key)
        last = book.last
        pending = book.inflight.get(digest)
        if not flagged and not new_key and self.undelivered and (
                (last and last.digest == digest and last.replayable and not last.delivered)
                or (pending is not None and pending.left and not pending.done.is_set())):
            # After an answer the harness cannot have read whole, or while the proxy still reads
            # one whose harness went away (addons/gateway/transport/relay.py): the same body is its retry.
            flagged = True
            ex.retry_reason = "undelivered"
        if flagged:
            if pending is not None and not pending.done.is_set():
                await pending.done.wait()
                if not flow.live:
                    return
                if pending.replayable:
                    self._replay(flow, ex, pending, coalesced=True)
                else:
                    flow.response = error_response(
                        ex.dialect, 503,
                        "the original attempt of this retried request failed; retry again", retry=True,
                    )
                    flow.metadata.pop("interceptor", None)
                return
            if last is not None and last.digest == digest and last.replayable:
                self._replay(flow, ex, last, coalesced=False)
                return
        elif last is not None and last.digest == digest:
            book.last = None  # a fresh turn: its retries must coalesce on it, not replay the old one
        rec = Recorded(digest=digest, call_id=new_id())
        ex.call_id = rec.call_id
        ex.own[RECORDED_KEY] = rec
        book.inflight[digest] = rec
        ex.done |= Step.DECIDED

    def _replay(self, flow: http.HTTPFlow, ex: Exchange, rec: Recorded, coalesced: bool) -> None:
        resp = http.Response.make(rec.status, b"", [])
        resp.headers = http.Headers([(k, v) for k, v in rec.headers if k.decode().lower() not in HOP_BY_HOP])
        resp.raw_content = bytes(rec.body)
        resp.headers["content-length"] = str(len(rec.body))
        resp.headers["x-interceptor-replay"] = rec.call_id
        flow.response = resp
        commit_replay(ex, flow, rec.status, rec.call_id)
        how = "coalesced retry" if coalesced else f"retry ({ex.retry_reason or 'flagged'})"
        log.info(f"interceptor: session {ex.session.id!r}: {how} answered from call {rec.call_id}")

    # -- answer: capture (the pipeline's last stage) ----------------------------------------

    def on_headers(self, flow: http.HTTPFlow, stream):
        ex = exchange_of(flow)
        rec = recorded_of(flow)
        if ex is None or rec is None or flow.response is None:
            return stream
        rec.status = flow.response.status_code
        rec.headers = list(flow.response.headers.fields)
        return _Capture(stream, rec, ex) if stream else stream

    def on_response(self, flow: http.HTTPFlow) -> None:
        rec = recorded_of(flow)
        if rec is None or flow.response is None:
            return
        ex = exchange_of(flow)
        try:
            if not _captured(flow.response.stream):
                rec.status = flow.response.status_code
                rec.headers = list(flow.response.headers.fields)
                rec.body = bytearray(flow.response.raw_content or b"")
            rec.committed = bool(ex and ex.turn)
            rec.completed = True
            if ex is not None:
                if ex.delivered:
                    ex.handed = True  # a JSON body goes to the client whole after this hook
                else:
                    rec.left = True  # the Relay read the rest after the harness went away
        except Exception:
            rec.failed = True  # never replayed; but settled, or its retries would wait forever
            raise
        finally:
            self._settle(flow, rec)

    def on_error(self, flow: http.HTTPFlow) -> None:
        rec = recorded_of(flow)
        if rec is None:
            return
        ex = exchange_of(flow)
        try:
            if ex is not None and ex.turn:
                # Committed, then the connection broke (no Relay to read the rest): the turn's
                # bytes up to and including its terminal event were captured when the Tee let
                # them through, so a retry gets them whole. Undelivered unless the terminal
                # event had been handed to the client before it went.
                rec.committed = rec.completed = True
                rec.left = not ex.handed
            else:
                rec.failed = True
        finally:
            self._settle(flow, rec)

    def on_client_gone(self, flow: http.HTTPFlow) -> None:
        """The harness went away and the Relay reads the answer on (see ``mark_left``)."""
        mark_left(flow)

    def _settle(self, flow: http.HTTPFlow, rec: Recorded) -> None:
        ex = exchange_of(flow)
        if ex is None:
            return
        book = self.book(ex)
        if book.inflight.get(rec.digest) is rec:
            del book.inflight[rec.digest]
        if rec.committed and not rec.failed:
            book.last = rec
        rec.done.set()


def recorded_of(flow: http.HTTPFlow) -> Recorded | None:
    """What Retry keeps of this flow's answer for a replay (its own state on the exchange):
    set when the request was decided a fresh turn."""
    ex = exchange_of(flow)
    rec = ex.own.get(RECORDED_KEY) if ex is not None else None
    return rec if isinstance(rec, Recorded) else None


def mark_left(flow: http.HTTPFlow) -> bool:
    """The harness went away before this exchange's answer reached it (the Relay reads it on,
    or a paused upstream still holds it): the same body from it next is this exchange's retry,
    to coalesce on it (the undelivered rule). An answer already handed over was delivered."""
    ex, rec = exchange_of(flow), recorded_of(flow)
    if ex is None or rec is None or ex.handed:
        return False
    rec.left = True
    return True

"""Per-flow state shared by the addons, kept in ``flow.metadata[KEY]``.

One object with typed fields instead of loose metadata keys, so each addon can see what the
earlier ones decided (session, route, parsed body, overrides, the retry decision, the token
collection plan, the stream's assembler) without re-deriving it, and a type checker sees
every reader and writer of each fact.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from interceptor.dialects import Route
from interceptor.dialects.base import Override
from interceptor.dialects.tokens import TokenFields
from interceptor.trace.messages import Message, Request
from interceptor.trace.model import ReplaySource
from interceptor.trace.prefix import Listed

if TYPE_CHECKING:
    from mitmproxy import http

    from interceptor.addons.gateway.answer.held import Held
    from interceptor.addons.gateway.transport.relay import Drain
    from interceptor.addons.gateway.policy.memory import Remembered
    from interceptor.dialects.body import Body, Edit
    from interceptor.dialects.prompt_ids import PromptRead
    from interceptor.addons.gateway.sessions.session import Session
    from interceptor.addons.gateway.sessions.weights import Weights
    from interceptor.dialects.translate import Translation

KEY = "interceptor"


class EventClock:
    """When each event of a streamed answer arrived, for ``ModelCall.event_gaps_ms`` (a paced
    replay sends each event at its time). On the stream's hot path, so the reader takes one
    monotonic reading per chunk and appends it once per event (the same float: no allocation);
    ``gaps`` turns them into milliseconds once, at the commit: the gap before each event, the
    first since the answer's headers (``first_byte_at``). Each gap is the difference of two
    offsets rounded down, so their sum is the last event's offset exactly (no drift over a long
    stream), and a gap under 128 milliseconds is one byte in msgpack."""

    __slots__ = ("start", "times")

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.times: list[float] = []

    def gaps(self) -> list[int]:
        out, last, start = [], 0, self.start
        for t in self.times:
            ms = int((t - start) * 1000)
            out.append(ms - last)
            last = ms
        return out


class Step(enum.Flag):
    """The steps a claimed flow must complete before it may leave (the Gate checks them);
    each step sets its flag as its last act, so a step that raised or returned early halfway
    never looks done."""

    REWRITTEN = enum.auto()  # model, sampling, credential and route imposed (Rewrite)
    DECIDED = enum.auto()  # a fresh turn, not a retry to answer from the record (Retry)
    ADMITTED = enum.auto()  # the rollout is not stopped and its limits let it through (Stops)


class Walked(NamedTuple):
    """What ``intercept.remembered`` found of a request's messages on the graph: how many
    leading ones are nodes (``on``) and the node of the last (``last``). The hooks' walk and
    the commit take it instead of a pass of their own while the graph is as it was then."""

    messages: list[Message]  # the list it was found for
    on: int
    last: int | None
    nodes: int  # the graph's node count then
    generation: int  # the recorder's prefixes generation then (a rollback or release bumps it)

    def current(self, recorder: Any) -> bool:
        """Whether the graph has not changed since: no node added, no rollback, no release."""
        return self.nodes == len(recorder.trace.nodes) and self.generation == recorder.prefixes.generation


@dataclass(eq=False)
class Exchange:
    session: Session
    route: Route
    started_at: float = field(default_factory=time.time)
    raw_body: bytes = b""  # exactly as the harness sent it (the retry digest is of this)
    body: dict[str, Any] | None = None  # parsed, after overrides
    request: Request | None = None  # canonical, as the harness sent it
    requested_model: str | None = None
    overrides: list[Override] = field(default_factory=list)
    stream: bool = False
    first_byte_at: float | None = None
    clock: EventClock | None = None  # a streamed answer's event times (Tee, WsRelay)
    done: Step = Step(0)  # the Gate forwards only when every required step is in here
    committed: bool = False  # a turn (or an error call) is on the record
    call_id: str = ""
    turn: str | None = None  # the committed turn's call id (Record)
    replay_of: str | None = None  # answered from the record of this call, not sampled (Retry)
    replayed_from: ReplaySource | None = None  # answered from a replay source's trace (Replay)
    retry_reason: str | None = None  # why an unflagged request counts as a retry (Retry)
    collect: TokenFields | None = None  # the token fields the proxy asked for, to strip (Collect)
    prompt_read: PromptRead | None = None  # how vLLM's prompt ids read (Tee), kept with the turn (Record)
    drain: Drain | None = None  # the proxy's own read of the upstream answer (Relay)
    delivered: bool = True  # False once the harness went away before the answer's end (Relay)
    # The answer's end (a JSON body, the terminal event of a stream) was handed to the client
    # connection (Retry's capture, the pipeline's last stage): delivered, whatever the client
    # does with its connection afterwards.
    handed: bool = False
    # Responses' previous_response_id, and whether this session had it (else a new root).
    previous_response_id: str | None = None
    previous_response_unknown: bool = False
    # The upstream speaks another dialect: the request went out translated (Rewrite), the
    # answer comes back translated (the pipeline's translate stage). ``translated_digest``
    # is the sha256 of the body actually sent.
    translation: Translation | None = None
    translated_digest: str | None = None
    resent: bool = False  # sent a second time after the provider refused a proxy change (Feedback)
    # The proxy answered the harness itself, in the harness's dialect (a refusal: Stops, the
    # Gate): no upstream answer to translate back.
    answered_here: bool = False
    # The message list as Rewrite scanned it: the history recognised from an earlier request,
    # handed to the recorder with the turn so it remembers this one (trace/prefix.py).
    listed: Listed | None = None
    prefix_len: int = 0  # messages of ``request`` from the record, not the body (a Responses chain)
    # For request hooks only (sessions that have them): the body as parsed, with its spans, so
    # a rewrite splices in only what it changes.
    parsed: Body | None = None
    carried: list[Remembered] = field(default_factory=list)  # the rewrites this request carries
    walked: Walked | None = None  # what ``intercept.remembered`` found of ``request.messages``
    edits: list[Edit] = field(default_factory=list)  # where they go in the body (``parsed``)
    # The body's overrides are not in ``flow.request.content`` yet: Stops writes them with the
    # hooks' edits, as one body (a hooked model request; writing it twice would copy the whole
    # history twice). Until then the content is the harness's bytes,
    # and only a flow Stops admitted (``Step.ADMITTED``) may leave.
    unwritten: bool = False
    # For sessions with response hooks only: the answer held back until they decide (Hold).
    hold: Held | None = None
    # Each stage's own state on this exchange, under that stage's key, read and written only
    # through the stage's own functions (Retry's ``recorded_of``, the Tee's assembler): the
    # exchange stays the one object every stage shares without naming any stage's types.
    # (Not ``flow.metadata``: Redact makes that plain at the flow's error, while the relay may
    # still finish the answer through the pipeline.)
    own: dict[str, Any] = field(default_factory=dict)
    # The upstream's weights version declared when the request was let go (Pause), how long
    # it waited for a paused upstream, and the upstream's Weights that count it in flight
    # until its commit (record.py), so a pause knows when every request sent has finished.
    policy_version: Any = None
    held_ms: int | None = None
    weights: Weights | None = None

    @property
    def dialect(self):
        """The harness's dialect: what it sent, and what it must get back."""
        return self.route.dialect

    @property
    def wire(self):
        """The dialect the upstream reads and answers in: ``body`` is in it."""
        return self.translation.target if self.translation is not None else self.route.dialect

    @property
    def replayed(self) -> bool:
        """Answered from the record (a retry); no upstream request, no turn."""
        return self.replay_of is not None


def exchange_of(flow: http.HTTPFlow) -> Exchange | None:
    ex = flow.metadata.get(KEY)
    return ex if isinstance(ex, Exchange) else None

"""Per-flow state shared by the addons, kept in ``flow.metadata[KEY]``.

One object instead of loose metadata keys, so each addon can see what the earlier ones
decided (session, route, parsed body, overrides) without re-deriving it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from interceptor.dialects import Route
from interceptor.dialects.base import Override
from interceptor.trace.messages import Request

if TYPE_CHECKING:
    from mitmproxy import http

    from interceptor.addons.session import Session

KEY = "interceptor"


class Step(enum.Flag):
    """The steps a claimed flow must complete before it may leave (the Gate checks them);
    each step sets its flag as its last act, so a step that raised or returned early halfway
    never looks done."""

    REWRITTEN = enum.auto()  # model, sampling, credential and route imposed (Rewrite)
    DECIDED = enum.auto()  # a fresh turn, not a retry to answer from the record (Retry)


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
    done: Step = Step(0)  # the Gate forwards only when every required step is in here
    committed: bool = False  # a turn (or an error call) is on the record
    call_id: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def dialect(self):
        return self.route.dialect


def exchange_of(flow: http.HTTPFlow) -> Exchange | None:
    ex = flow.metadata.get(KEY)
    return ex if isinstance(ex, Exchange) else None

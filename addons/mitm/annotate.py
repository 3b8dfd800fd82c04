"""Annotate: what the proxy did with each flow, on the flow itself, for mitmweb's list.

Someone watching ``mitmweb -s addons/interception.py`` sees hundreds of flows to the same
URL; without this, telling a turn from a replayed retry or a refusal means opening each one.
Each flow the proxy had a hand in gets mitmproxy's two annotation fields, ``flow.comment``
(one line: session, turn and call number, what was rewritten, replayed, refused and why) and
``flow.marked`` (a marker, shown as an emoji):

- 🟢 a turn the model answered; 🔴 a claimed exchange that ended in an error;
- 🔁 a retry answered from the record (no second sample);
- ⛔ a request the proxy refused (no session, bad input); 🤖 the proxy's own answers
  (its control API, the non-model paths of a provider host it answers locally).

Traffic the proxy passes through untouched (package indexes, git) is left alone.

``outcome`` is the one classification, shared with the Status line. It reads a small,
stable surface of the other addons on purpose, so that their internals can change: the
exchange's ``session``, ``started_at`` (the call's, found on the session's trace by it or by
``call_id``), ``overrides``; the replay header Retry puts on what it answers
(``x-interceptor-replay``); Control's and Claim's flow markers; and whether the proxy set a
response before the request's hooks were done (recorded here in ``request``, which runs
after every other addon's, this addon being listed last).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from mitmproxy import http

from interceptor.addons.gateway.exchange import exchange_of
from interceptor.dialects.base import header

log = logging.getLogger(__name__)

ANSWERED_HERE = "interceptor_answered_here"  # flow.metadata: the proxy set the response itself
REPLAY_HEADER = "x-interceptor-replay"
MARKERS = {"turn": ":green_circle:", "call": ":red_circle:", "replay": ":repeat:",
           "refused": ":no_entry:", "local": ":robot:"}


@dataclass
class Outcome:
    """What became of one flow. ``kind``: turn, call (an exchange on the record that is not
    a turn: an error), replay, refused, local (the proxy's own answer to a non-model path or
    its control API); None for traffic the proxy only passed through."""

    kind: str | None
    session: str | None = None
    call: str | None = None
    call_number: int | None = None  # 1-based, among the session's calls
    turn: int | None = None  # 1-based, among its committed turns
    replay_of: str | None = None
    status: int | None = None
    reason: str | None = None  # why it was refused, or the error
    rewritten: list[str] = field(default_factory=list)

    def comment(self) -> str:
        parts = []
        if self.session:
            parts.append(f"session {self.session}")
        if self.kind == "turn":
            parts.append(f"turn {self.turn}" if self.turn else "turn")
        if self.call_number:
            parts.append(f"call {self.call_number} ({self.call})")
        if self.kind == "replay":
            parts.append(f"replayed: the recorded answer of call {self.replay_of}, no second sample")
        if self.rewritten:
            parts.append("rewritten: " + ", ".join(self.rewritten))
        if self.kind == "refused":
            parts.append(f"refused {self.status}: {self.reason or 'no reason given'}; nothing forwarded")
        elif self.kind == "local":
            parts.append(f"answered by the proxy ({self.reason}); nothing forwarded")
        elif self.kind == "call":
            parts.append(f"error {self.status}: {self.reason}" if self.reason else f"status {self.status}")
        return "interceptor: " + " · ".join(parts)


def _error_message(flow: http.HTTPFlow) -> str | None:
    """The message of an error answer in any provider's shape (``{"error": {"message"}}``,
    Anthropic's ``{"type": "error", "error": {...}}``)."""
    try:
        body = json.loads(flow.response.get_content(strict=False) or b"{}")
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict):
            return str(error.get("message") or error.get("type") or "") or None
        if isinstance(error, str):
            return error
    except (ValueError, AttributeError):
        pass
    return None


def _find_call(ex, numbers: bool) -> tuple[int | None, int | None, object | None]:
    """(call number, turn number, the call) of the exchange on its session's trace. Scans
    from the end, where a just-finished exchange is; a released (sealed) trace has none.
    Only ``numbers`` asks for the turn number (``_turn_number``)."""
    calls = ex.session.recorder.trace.calls
    for k in range(len(calls) - 1, -1, -1):
        c = calls[k]
        if (ex.call_id and c.id == ex.call_id) or c.started_at == ex.started_at:
            turn = _turn_number(ex.session, calls, k) if numbers and c.node is not None else None
            return k + 1, turn, c
    return None, None, None


def _turn_number(session, calls: list, k: int) -> int:
    """How many of ``calls[:k + 1]`` committed a turn. Counted on from where the session's
    last count stopped (kept in its state, gone with it), so a rollout's annotations cost
    what its new calls cost, not a pass over all of them at every turn; a call
    before that point (answers finishing out of order) is counted from the start."""
    seen = session.state.setdefault("annotate_turns", [0, 0])  # [calls counted, turns among them]
    if k + 1 < seen[0] or seen[0] > len(calls):
        return sum(1 for x in calls[:k + 1] if x.node is not None)
    seen[1] += sum(1 for x in calls[seen[0]:k + 1] if x.node is not None)
    seen[0] = k + 1
    return seen[1]


def outcome(flow: http.HTTPFlow, *, numbers: bool = True) -> Outcome:
    if flow.metadata.get("interceptor_control"):
        return Outcome("local", status=flow.response.status_code if flow.response else None,
                       reason="control API")
    if flow.metadata.get("interceptor_local"):
        return Outcome("local", status=flow.response.status_code if flow.response else None,
                       reason="not a model route")
    ex = exchange_of(flow)
    status = flow.response.status_code if flow.response else None
    if ex is None:
        if flow.metadata.get(ANSWERED_HERE) and flow.response is not None:
            return Outcome("refused", status=status, reason=_error_message(flow))
        return Outcome(None)
    out = Outcome("call", session=ex.session.id, status=status,
                  rewritten=sorted({o.key for o in ex.overrides}))
    number, turn, call = _find_call(ex, numbers)
    out.call_number, out.turn = number, turn
    out.call = call.id if call is not None else (ex.call_id or None)
    replay = header(flow.response.headers, REPLAY_HEADER) if flow.response else None
    if replay or (call is not None and call.replay_of):
        out.kind, out.replay_of = "replay", replay or call.replay_of
        out.rewritten = []  # nothing was sent anywhere
    elif call is not None and call.node is not None:
        out.kind = "turn"
    else:
        err = getattr(call, "error", None)
        out.reason = (f"{err.type}: {err.message}" if err is not None else
                      flow.error.msg if flow.error else _error_message(flow) if status and status >= 400 else None)
        if flow.metadata.get(ANSWERED_HERE) and out.reason:
            out.reason = "answered by the proxy, " + out.reason
    return out


class Annotate:
    """Listed last: its hooks see what every other addon decided."""

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            flow.metadata[ANSWERED_HERE] = True

    def response(self, flow: http.HTTPFlow) -> None:
        self._annotate(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._annotate(flow)

    def _annotate(self, flow: http.HTTPFlow) -> None:
        try:
            out = outcome(flow)
            if out.kind is None:
                return
            flow.comment = out.comment()
            flow.marked = MARKERS[out.kind]
        except Exception:  # noqa: BLE001 - an annotation must never disturb a flow
            log.exception("interceptor: could not annotate a flow")

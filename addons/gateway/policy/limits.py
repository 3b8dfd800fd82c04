"""A rollout's budgets (session config ``limits``) and the stop that ends it.

A limit is checked before a request goes upstream, against the trace's own counts, so the
README's definitions and the footer's totals are the same numbers. ``max_turns`` and
``max_calls`` also count the requests already admitted and still in flight: parallel
sub-agent requests arrive together, and without that each would see the budget free and all
of them would go out. The check and the admission happen in one synchronous step on the event
loop, so two requests can never both take the last turn.

A ``Stop`` is final and the first one wins: every later model request of the session is
refused with the same condition (``addons/gateway/policy/stops.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt, model_validator

if TYPE_CHECKING:
    from interceptor.trace.model import Trace

StopBy = Literal["limit", "hook", "upstream", "tool", "control", "shutdown"]  # tool: a tool server's POST /stop


class Limits(BaseModel):
    """Each limit is reached when the trace's count is at it: ``max_turns=2`` admits two
    model requests and refuses the third."""

    model_config = ConfigDict(extra="forbid")

    max_turns: PositiveInt | None = None  # replies committed + admitted requests in flight
    max_calls: PositiveInt | None = None  # upstream exchanges (errors too, replays not) + in flight
    max_input_tokens: PositiveInt | None = None  # Trace.num_input_tokens (fed-in, counted once)
    max_output_tokens: PositiveInt | None = None  # Trace.num_output_tokens
    max_total_tokens: PositiveInt | None = None  # Trace.num_total_tokens
    max_wall_seconds: PositiveFloat | None = None  # since the session was created
    clamp_max_tokens: bool = False  # lower each request's max tokens to the output budget left
    context_length_stops: bool = False  # an upstream "context too long" also stops the rollout

    @model_validator(mode="after")
    def _clamp_needs_a_budget(self) -> Limits:
        if self.clamp_max_tokens and self.max_output_tokens is None and self.max_total_tokens is None:
            raise ValueError("clamp_max_tokens needs max_output_tokens or max_total_tokens to clamp to")
        return self


@dataclass(slots=True)
class Stop:
    """Why a rollout ended early: ``condition`` (``max_turns``, ``context_length``, a hook's
    name...), who decided (``by``), and the call that met it."""

    condition: str
    by: StopBy
    call: str | None = None
    at: float = 0.0

    @property
    def truncated(self) -> bool:
        """Cut short by a budget or the model's context, not finished by the agent."""
        return self.by == "limit" or self.condition == "context_length"

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"condition": self.condition, "by": self.by, "at": self.at}
        if self.call is not None:
            out["call"] = self.call
        return out


# Calls the proxy answered itself: they never reached the model, so no budget counts them.
PROXY_ANSWERED = frozenset({"interceptor_stopped", "hook_error"})


def upstream_calls(trace: Trace) -> int:
    return sum(1 for c in trace.calls
               if c.replay_of is None and not (c.error is not None and c.error.type in PROXY_ANSWERED))


def reached(limits: Limits, trace: Trace, flying: int, started_at: float, now: float | None = None) -> str | None:
    """The first limit the next request would break, or None. Cheap checks first; the token
    totals walk the calls, and only sessions with those limits pay for it."""
    if limits.max_turns is not None and trace.num_turns + flying >= limits.max_turns:
        return "max_turns"
    if limits.max_calls is not None and upstream_calls(trace) + flying >= limits.max_calls:
        return "max_calls"
    if limits.max_wall_seconds is not None and (now or time.time()) - started_at >= limits.max_wall_seconds:
        return "max_wall_seconds"
    if limits.max_output_tokens is not None and trace.num_output_tokens >= limits.max_output_tokens:
        return "max_output_tokens"
    if limits.max_input_tokens is not None and trace.num_input_tokens >= limits.max_input_tokens:
        return "max_input_tokens"
    if limits.max_total_tokens is not None and trace.num_total_tokens >= limits.max_total_tokens:
        return "max_total_tokens"
    return None


def output_cap(limits: Limits | None, trace: Trace) -> int | None:
    """The max tokens a request may ask for under ``clamp_max_tokens``, or None."""
    if limits is None or not limits.clamp_max_tokens:
        return None
    left = []
    if limits.max_output_tokens is not None:
        left.append(limits.max_output_tokens - trace.num_output_tokens)
    if limits.max_total_tokens is not None:
        left.append(limits.max_total_tokens - trace.num_total_tokens)
    return max(1, min(left))

"""Weights: per declared upstream, which version of the policy it serves, and whether new
requests to it wait for a weight swap.

An asynchronous RL loop trains while its rollouts run: the trainer swaps the inference
server's weights between two of a rollout's turns. A trainer must know which weights sampled
each token (to weight, mask or drop off-policy ones), and the swap must not fail the harnesses
that are mid-conversation. So the orchestrator declares each upstream's version (every call
sent after it is stamped with it, and every live session of that upstream gets a ``version``
record), and pauses the upstream for the swap: requests that arrive meanwhile wait here, in
arrival order, before anything is sent (the harness sees latency, not an error); those already
sent finish and are counted out at their commit (``record.py``), so ``drained`` knows when the
upstream is idle. ``resume`` releases the waiting requests in the order they came.

Versions are numbers or names. A number is older than a larger one; a name is ordered by when
the orchestrator first declared it, and a version never declared here is older than any that
was (a session's ``min_version`` fails closed on what the proxy cannot place).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from interceptor.trace.model import Version


def parse_version(text: str) -> Version:
    """A version as an upstream reports it (a header's text): a whole number as a number."""
    text = text.strip()
    return int(text) if text.isdigit() else text


class HoldExpired(Exception):
    """A request waited longer than its hold limit: it is answered a retryable error."""


@dataclass(eq=False)
class Held:
    """One request waiting for a paused upstream, in arrival order."""

    key: Any  # what the caller finds it by again (its flow)
    since: float = field(default_factory=time.monotonic)
    released: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Weights:
    """One upstream's version and pause (see the module docstring). Used on the event loop only."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.version: Version | None = None
        self.declared_at: float | None = None
        self._order: dict[Version, int] = {}  # a name's place: when it was first declared
        self.paused = False
        self.held: deque[Held] = deque()
        self.inflight: dict[str, tuple[str, float]] = {}  # call id -> (session id, sent at)
        self._idle: asyncio.Event | None = None  # set when ``inflight`` empties (a drain waits on it)

    # -- versions ------------------------------------------------------------------------

    def declare(self, version: Version) -> None:
        self.version = version
        self.declared_at = time.time()
        self._order.setdefault(version, len(self._order))

    def older(self, version: Version | None, than: Version) -> bool:
        """Whether ``version`` is older than ``than`` (None, or one never declared here and not
        a number beside a number, counts as older: it cannot be placed)."""
        if version is None:
            return True
        if type(version) is int and type(than) is int:
            return version < than
        if version not in self._order or than not in self._order:
            return version != than
        return self._order[version] < self._order[than]

    def refuses(self, version: Version | None, minimum: Version | None, what: str) -> str | None:
        """Why ``version`` is not one a session with ``minimum`` accepts (None: it is, or the
        session sets no minimum); ``what``: how the version is known, for the message."""
        if minimum is None or not self.older(version, minimum):
            return None
        return (f"the upstream {self.name!r} {what} weights version {version!r}, older than the session's "
                f"min_version {minimum!r}")

    # -- in flight -----------------------------------------------------------------------

    def sent(self, call_id: str, session_id: str) -> None:
        self.inflight[call_id] = (session_id, time.time())
        if self._idle is not None:
            self._idle.clear()

    def finished(self, call_id: str) -> None:
        if self.inflight.pop(call_id, None) is not None and not self.inflight and self._idle is not None:
            self._idle.set()

    # -- pause ---------------------------------------------------------------------------

    async def hold(self, key: Any, limit: float | None) -> float | None:
        """Wait while the upstream is paused; the seconds waited (None: it was not paused).
        Raises ``HoldExpired`` after ``limit`` seconds (None: no limit)."""
        if not self.paused:
            return None
        held = Held(key)
        self.held.append(held)
        try:
            await asyncio.wait_for(asyncio.shield(held.released), limit)
        except TimeoutError:
            raise HoldExpired() from None
        finally:
            if not held.released.done():  # expired or cancelled: its place goes
                held.released.cancel()
                try:
                    self.held.remove(held)
                except ValueError:
                    pass
        return time.monotonic() - held.since

    def pause(self) -> None:
        self.paused = True

    async def drained(self, timeout: float) -> list[dict[str, Any]]:
        """Wait until no request sent to this upstream is still running, or ``timeout``
        seconds; the ones still running then (none: drained)."""
        if self.inflight:
            self._idle = self._idle or asyncio.Event()
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except TimeoutError:
                pass
        now = time.time()
        return [{"call": call, "session": sid, "running_s": round(now - at, 3)}
                for call, (sid, at) in self.inflight.items()]

    def resume(self) -> int:
        """Release every waiting request, in arrival order (each continues in that order);
        how many."""
        self.paused = False
        released = 0
        while self.held:
            held = self.held.popleft()
            if not held.released.done():
                held.released.set_result(None)
                released += 1
        return released

    def public(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "declared_at": self.declared_at,
                "paused": self.paused, "held": len(self.held), "in_flight": len(self.inflight)}


class Fleet:
    """Every upstream's ``Weights``, made on first use (by name; the harness's own provider
    host, a session without a declared upstream, is the default upstream's)."""

    def __init__(self) -> None:
        self._by_name: dict[str, Weights] = {}

    def of(self, name: str) -> Weights:
        weights = self._by_name.get(name)
        if weights is None:
            weights = self._by_name[name] = Weights(name)
        return weights

    def get(self, name: str) -> Weights | None:
        return self._by_name.get(name)

    def all(self) -> list[Weights]:
        return list(self._by_name.values())

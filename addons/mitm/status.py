"""Status: one line in mitmdump's log every few seconds while traffic flows.

A night of rollouts should say how it is going without anyone reading flow logs: how many
sessions are live and sealed, turns and calls in the last minute, errors, replays and
refusals, what the trace writer has written and how much it still has queued. Quiet when
idle: a line is written only for an interval that saw a flow, plus one last line when the
traffic stops (so the final totals are on screen). ``--set intercept_status=0`` turns it off;
any other value is the interval in seconds.

Counting happens in the ``response``/``error`` hooks (listed after every other addon, so the
exchange is already on the record), with ``annotate.outcome``'s classification; the line
itself is built from counters and the registry, never by walking a trace.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from mitmproxy import ctx, exceptions, http

from interceptor.addons.mitm.annotate import outcome
from interceptor.addons.gateway.sessions.session import Registry

log = logging.getLogger(__name__)

WINDOW = 60.0  # seconds the per-minute rates look back


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} KB"


class Status:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.interval = 0
        self.totals: collections.Counter[str] = collections.Counter()
        self.recent: collections.deque[tuple[float, str]] = collections.deque()
        # What ``recent`` holds, by kind, kept as it changes: a line costs the entries that
        # left the window, not the minute's every flow again (at thousands of turns a minute,
        # recounting them was milliseconds on the loop every tick).
        self.minute: collections.Counter[str] = collections.Counter()
        self._seen = 0  # flows counted so far; a tick compares it with the last tick's
        self._ticked_at_seen = 0
        self._idle_said = True
        self._task: asyncio.Task | None = None

    def load(self, loader) -> None:
        loader.add_option(
            "intercept_status", int, 5,
            "Seconds between status lines in the log while flows pass (sessions, turns and "
            "calls per minute, errors, replays, bytes written); 0 turns them off.")

    def configure(self, updated: set[str]) -> None:
        if "intercept_status" not in updated:
            return
        value = ctx.options.intercept_status
        if value < 0:
            raise exceptions.OptionsError(
                f"intercept_status must be a number of seconds >= 0 (0 turns the status line off), not {value}")
        self.interval = value
        self._restart()

    def running(self) -> None:
        self._restart()

    def done(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def _restart(self) -> None:
        self.done()
        if self.interval <= 0:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # configured before the loop runs: ``running`` starts it
        self._task = loop.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the status line must never stop the proxy
                log.exception("interceptor: status line failed")

    # --- counting --------------------------------------------------------------------------

    def response(self, flow: http.HTTPFlow) -> None:
        self._count(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._count(flow)

    def _count(self, flow: http.HTTPFlow) -> None:
        if self.interval <= 0:
            return
        try:
            kind = outcome(flow, numbers=False).kind
        except Exception:  # noqa: BLE001
            log.exception("interceptor: status could not classify a flow")
            return
        if kind is None or (kind == "local" and flow.metadata.get("interceptor_control")):
            return  # pass-through traffic and the control API are not rollout traffic
        if kind == "turn":
            kinds = ("turn", "call")
        elif kind == "call":
            kinds = ("call", "error")
        else:
            kinds = (kind,)
        now = time.monotonic()
        for k in kinds:
            self.totals[k] += 1
            self.recent.append((now, k))
            self.minute[k] += 1
        self._seen += 1

    # --- the line --------------------------------------------------------------------------

    def line(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        while self.recent and self.recent[0][0] < now - WINDOW:
            self.minute[self.recent.popleft()[1]] -= 1
        minute = self.minute
        sessions = self.registry.all()
        sealed = sum(1 for s in sessions if s.sealed)
        store = self.registry.store
        t = self.totals
        return (f"interceptor status: sessions {len(sessions) - sealed} live, {sealed} sealed · "
                f"last minute {minute['turn']} turns, {minute['call']} calls · "
                f"totals {t['turn']} turns, {t['call']} calls, {t['error']} errors, "
                f"{t['replay']} replays, {t['refused']} refused · "
                f"trace {_mb(store.bytes_written)} written, {store.records_written} records, "
                f"{store.pending} queued" + (f", {len(store.errors)} files failing" if store.errors else ""))

    def tick(self) -> None:
        active = self._seen != self._ticked_at_seen
        self._ticked_at_seen = self._seen
        if active:
            self._idle_said = False
            log.info(self.line())
        elif not self._idle_said:
            self._idle_said = True
            log.info(self.line() + " · idle")

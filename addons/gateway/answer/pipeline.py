"""Pipeline: what happens to a provider's answer on its way back to the harness, in one place.

A streamed answer passes through one chain of callables set as ``flow.response.stream``,
built here and nowhere else, innermost first:

1. **assemble** (``tee.Assemble``): decode the content encoding, cut the body into events
   (the dialect's ``frames``), feed the dialect's assembler, and commit the turn before the
   bytes of its terminal event go on;
2. **strip** (``collect.Collect``): take the token ids and logprobs the proxy asked for out
   of what the harness receives (the assembler above has recorded them);
3. **translate** (``translate.Translate``): for a session whose upstream speaks another
   dialect, the answer in the harness's own, event by event (after strip, so the token
   fields the proxy asked for never reach the translation);
4. **hold** (``hold.Hold``: response hooks, for the sessions that have them), after strip
   and before capture, so a hook sees what the harness would and a replay repeats what the
   hook let through. A held answer passes the pipeline twice (``addons/gateway/answer/hold.py``): collected
   by the relay through the stages up to the hold, then delivered to the harness through
   the stages after it;
5. **capture** (``retry.Retry``): keep the bytes the harness is sent, for a replay.

A JSON answer takes the same stages in the same order in ``response``, a broken one in
``error``. The order is the ``Pipeline`` constructor's, not the order of the script's addon
list: the one addon that runs it is the Tee (``tee.Tee``); Collect and Retry are listed in
the script for their request hooks only, and their answer-side work is ``on_headers`` /
``on_response`` / ``on_error``, names mitmproxy never calls.

When the relay carries the exchange (``addons/gateway/transport/relay.py``), its meter is the outermost
callable, and an ``error`` that means the client went away is handed to the relay's Drain,
which finishes the answer through this same pipeline (``responseheaders`` if need be, the
chain, ``response``), so the stages see an abandoned answer whole, as if it had been read.
An answer whose turn was committed before the client went away is marked undelivered on
the record.

Each stage runs even when an earlier one raised (Retry must still settle what it has in
flight); the first exception is put on the flow as a ``Fault`` naming the stage, exactly as
a guarded hook of an addon would (``guard``), and the Gate answers it (``addons/mitm/gate.py``).
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from mitmproxy import http

from interceptor.addons.gateway.exchange import exchange_of
from interceptor.addons.gateway.faults import FAULT_KEY, Fault
from interceptor.addons.gateway.record import mark_undelivered

log = logging.getLogger(__name__)

#: ``flow.response.stream``: a chain of callables, or False/True (buffered / passed on as is).
Stream = Callable[[bytes], Any] | bool | None


class Stage(Protocol):
    def on_headers(self, flow: http.HTTPFlow, stream: Stream) -> Stream:
        """Given the chain built so far (False when the answer is read whole), return it
        wrapped, or unchanged."""

    def on_response(self, flow: http.HTTPFlow) -> None: ...

    def on_error(self, flow: http.HTTPFlow) -> None: ...


class Pipeline:
    def __init__(self, assemble: Stage, strip: Stage | None = None, translate: Stage | None = None,
                 hold: Stage | None = None, capture: Stage | None = None) -> None:
        self.bounds = getattr(assemble, "bounds", None)  # what reading one answer may cost (tee.Bounds)
        # The order of the chain is this line.
        self.stages: tuple[Stage, ...] = tuple(s for s in (assemble, strip, translate, hold, capture)
                                               if s is not None)
        # A held answer's two passes (addons/gateway/answer/hold.py): collected up to the hold, delivered after it.
        cut = self.stages.index(hold) + 1 if hold is not None else len(self.stages)
        self.collect, self.deliver = self.stages[:cut], self.stages[cut:]

    def _for(self, ex, collect: bool = False) -> tuple[Stage, ...]:
        """The stages a call runs: all of them, but for a held answer those up to the hold
        when the relay collects it (``collect``) and those after it when mitmproxy carries
        the decided answer to the harness."""
        if ex is None or ex.hold is None:
            return self.stages
        return self.collect if collect else self.deliver

    def responseheaders(self, flow: http.HTTPFlow, collect: bool = False) -> None:
        if flow.response is None:
            return
        ex = exchange_of(flow)
        drain = ex.drain if ex is not None else None
        if drain is not None:
            drain.restore(flow)
        stream: Stream = flow.response.stream
        stages = self._for(ex, collect)
        if stages is self.deliver and ex is not None and ex.hold is not None and flow.response.headers.get("content-type", "").startswith("text/event-stream"):
            stream = True  # a held SSE answer, decided: streamed on as the relay sends it
        for stage in stages:
            try:
                stream = stage.on_headers(flow, stream)
            except Exception as e:  # noqa: BLE001 - see the module docstring
                self._fault(flow, stage, "on_headers", e)
        if drain is not None:
            stream = drain.meter(stream)
        flow.response.stream = stream or False

    def response(self, flow: http.HTTPFlow, collect: bool = False) -> None:
        ex = exchange_of(flow)
        if ex is not None and ex.drain is not None and not collect:
            ex.drain.ended(flow)
        self._each(flow, "on_response", self._for(ex, collect))

    def error(self, flow: http.HTTPFlow) -> None:
        ex = exchange_of(flow)
        if ex is not None and ex.drain is not None:
            if ex.drain.closed_out:
                return  # the Drain finished it after the client went away; mitmproxy says so late
            if ex.drain.take_over(flow):
                self.client_gone(flow)
                return  # the Drain finishes the answer through this pipeline
        if ex is not None and ex.turn and not ex.replayed:
            # The turn was committed at its terminal event; the rest never reached the harness.
            mark_undelivered(ex)
        # A held answer that broke before its decision: every stage (the record, then the capture).
        held = ex.hold if ex is not None else None
        self._each(flow, "on_error", self.stages if held is None or held.phase == "collect" else self.deliver)

    def client_gone(self, flow: http.HTTPFlow) -> None:
        """The client went away and the Drain reads the answer on: the stages may note it."""
        for stage in self.stages:
            gone = getattr(stage, "on_client_gone", None)
            if gone is not None:
                try:
                    gone(flow)
                except Exception as e:  # noqa: BLE001 - see the module docstring
                    self._fault(flow, stage, "on_client_gone", e)

    def _each(self, flow: http.HTTPFlow, hook: str, stages: tuple[Stage, ...]) -> None:
        for stage in stages:
            try:
                getattr(stage, hook)(flow)
            except Exception as e:  # noqa: BLE001 - see the module docstring
                self._fault(flow, stage, hook, e)

    @staticmethod
    def _fault(flow: http.HTTPFlow, stage: Stage, hook: str, e: Exception) -> None:
        step = f"{type(stage).__name__}.{hook}"
        flow.metadata.setdefault(FAULT_KEY, Fault(step, f"raised {type(e).__name__}"))
        # The exception's text may quote the answer: frames only, as a guarded hook logs them.
        frames = "".join(traceback.format_tb(e.__traceback__))
        log.error(f"interceptor: {step} raised {type(e).__name__}; the Gate answers the flow\n{frames}")

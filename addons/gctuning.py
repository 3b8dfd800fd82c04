"""GcTuning: the garbage collector's pauses kept off the proxy's tail latency.

mitmproxy serves every session on one event loop, so a collection of the oldest generation,
which walks every object the collector tracks, stalls every stream at once: in a 300-turn
rollout each slow turn was one (46-86 ms, issue 16). Most of what it walked never dies:
mitmproxy's, the addons' and their libraries' own objects (modules, pydantic schemas, the
CA). Once start-up is done they are frozen (``gc.freeze``: moved where the collector never
looks), so a full collection walks only what the sessions hold. The youngest generation is
collected less often (``gc.set_threshold``): a request allocates thousands of short-lived
objects that reference counting frees anyway, and every young collection that finds them
alive promotes them towards the old generation, whose growth is what triggers full passes.

Only start-up is frozen, once per process: anything frozen is never freed by the collector,
so a flow in flight at a later freeze that died in a reference cycle would leak.

A dead flow is the collector's to free, never reference counting's: mitmproxy's per-request
objects point at each other (a layer keeps bound methods of itself as its state, and each
``RequestData``/``ResponseData`` made with a field ``None`` leaves a caught ``TypeError`` of
its type check whose traceback holds the stack that made it), and the flow holds its bodies
and, through its Exchange, the proxy's copies of them (the text, the spans). The threshold
counts objects, not bytes, and a turn of a long rollout leaves a few hundred objects and a
few history-sized blocks: in a 300-turn rollout a young collection came every ~50 turns and
the proxy held up to ~50 turns of dead ~360 KB bodies, its resident set grew 131 -> 186 MB
and each turn's new blocks were fresh pages (100-200 faults a turn), where bare mitmdump's
default threshold (700) frees them within a turn or two (docs/benchmarks.md). So the bodies
of the flows that ended are counted (request and answer as mitmproxy holds them), and past
``intercept_gc_collect_mib`` (2 by default) one collection of the young generation (of the middle one too, when Python's
own next pass would take it) runs ``GRACE`` seconds after the hook that saw the end: by then
mitmproxy has let the flow go, and the collection walks only what was allocated since the
last one.

``intercept_gc_tuning false`` keeps Python's defaults; ``intercept_gc_collect_mib 0`` keeps
the tuning without the collections this addon asks for, by bytes or by flows (the collector's
object count alone, as before).

The ended flows are counted too: every ``FLOWS`` of them, whatever their size, the same
collection. Python's own count of the young generation is allocations minus deallocations of
*any* generation's objects (CPython's ``PyObject_GC_Del`` lowers it for an old object too; on
3.13, 300 young lists allocated and then 5,000 old ones freed leave the count at 0), so when old
objects are freed as fast as flows are made it never reaches its threshold. That is
what a burst of seals does: each releases its session's graph (old objects freed by reference
counting) over one control-API flow (~200 young objects of cyclic garbage). 300 seals left
~67,000 objects in the young generation and 900 left ~240,000; the first collection after them
walked and freed them all at once, a 70-300 ms stall of every stream on the loop
(docs/benchmarks.md, "A burst of seals"). ``FLOWS`` flows is about the threshold's worth of
their garbage, so under plain load this comes about when Python's own pass would have.
"""

from __future__ import annotations

import asyncio
import gc
import logging

from mitmproxy import ctx, exceptions, http

log = logging.getLogger(__name__)

#: Allocations (net of frees) between young collections; Python's default is 700.
THRESHOLD0 = 10_000
#: MiB of ended flows' bodies after which the young generation is collected (measured in a
#: 300-turn rollout, collecting on the next pass of the loop: 2 MiB held the resident set to
#: +16 MB, 8 MiB to +38, none to +55; the CPU per turn unchanged within the run's noise).
COLLECT_MIB = 2
#: Seconds from the hook that saw a flow end to the collection: mitmproxy still holds the flow
#: while it writes the answer (a collection on the next pass of the loop found every flow of
#: tests/test_gctuning.py's rollout alive, and so moved it to the middle generation, whose
#: collection comes every tenth young one; three passes later each was free).
GRACE = 0.02
#: Ended flows after which the young generation is collected whatever their bodies' size: a
#: dead flow leaves ~200 objects in cycles, so this is about ``THRESHOLD0``'s worth.
FLOWS = 50

_done = False  # per process: a reloaded script must not freeze the flows in flight


class GcTuning:
    def __init__(self) -> None:
        self._ended = 0  # body bytes of the flows ended since the last collection this asked for
        self._flows = 0  # flows ended since then
        self._asked = False  # a collection is scheduled
        self._budget = COLLECT_MIB << 20  # intercept_gc_collect_mib, in bytes

    def load(self, loader) -> None:
        loader.add_option(
            "intercept_gc_tuning", bool, True,
            "After start-up, freeze the objects alive (gc.freeze) and collect the young generation "
            f"every {THRESHOLD0} allocations, so the collector's full passes stay short, and after every "
            "intercept_gc_collect_mib of ended flows' bodies, so dead flows do not hold them; false: "
            "Python's defaults.")
        loader.add_option(
            "intercept_gc_collect_mib", int, COLLECT_MIB,
            "With intercept_gc_tuning: MiB of ended flows' bodies (requests and answers) after which "
            f"(and after every {FLOWS} ended flows) the young generation is collected, since mitmproxy's "
            "flows are freed by the collector only and its object count comes seldom when turns are large "
            "or sessions are sealed; 0: by the object count alone.")

    def configure(self, updated) -> None:
        if "intercept_gc_collect_mib" in updated:
            mib = ctx.options.intercept_gc_collect_mib
            if mib < 0:
                raise exceptions.OptionsError(f"intercept_gc_collect_mib must be 0 (off) or more, got {mib}")
            self._budget = mib << 20

    def running(self) -> None:
        global _done
        if _done or not ctx.options.intercept_gc_tuning:
            return
        _done = True
        gc.collect()
        gc.freeze()
        t0, t1, t2 = gc.get_threshold()
        gc.set_threshold(max(t0, THRESHOLD0), t1, t2)
        log.info(f"interceptor: gc: {gc.get_freeze_count()} objects alive after start-up frozen; "
                 f"young generation collected every {max(t0, THRESHOLD0)} allocations")

    def response(self, flow: http.HTTPFlow) -> None:
        self._end(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._end(flow)

    def _end(self, flow: http.HTTPFlow) -> None:
        if not _done:  # Python's defaults (intercept_gc_tuning false): its threshold frees them
            return
        self._flows += 1
        self._ended += len(flow.request.raw_content or b"")
        if flow.response is not None:
            self._ended += len(flow.response.raw_content or b"")
        if self._asked or not self._budget or (self._ended < self._budget and self._flows < FLOWS):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a hook called outside an event loop (a test): now, then
            self._collect()
            return
        self._asked = True
        loop.call_later(GRACE, self._collect)

    def _collect(self) -> None:
        """The young generation, and the middle one when it is due (Python's own next pass
        would take it: it counts young collections, manual ones too, and the next automatic
        one is far off)."""
        self._asked = False
        self._ended = self._flows = 0
        gc.collect(1 if gc.get_count()[1] >= gc.get_threshold()[1] else 0)

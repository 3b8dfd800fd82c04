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
``intercept_gc_tuning false`` keeps Python's defaults.
"""

from __future__ import annotations

import gc
import logging

from mitmproxy import ctx

log = logging.getLogger(__name__)

#: Allocations (net of frees) between young collections; Python's default is 700.
THRESHOLD0 = 10_000

_done = False  # per process: a reloaded script must not freeze the flows in flight


class GcTuning:
    def load(self, loader) -> None:
        loader.add_option(
            "intercept_gc_tuning", bool, True,
            "After start-up, freeze the objects alive (gc.freeze) and collect the young generation "
            f"every {THRESHOLD0} allocations, so the collector's full passes stay short; false: "
            "Python's defaults.")

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

"""What mitmproxy's own dispatch of an event costs with this script's addons, in process, A/B.

    .venv/bin/python bench/dispatch.py [--rounds 30]

Three DumpMasters in one process (mitmdump's own addons, dumper included, output to
/dev/null): ``bare`` (no script), ``listed`` (addons/interception.py with its steps listed one
by one, as before the Chain) and ``chain`` (the script as it is: one ``Chain``, see
addons/chain.py). Each gets ``update`` (which no step implements: the cost of the walk alone)
and ``requestheaders``, ``request``, ``responseheaders`` and ``response`` (each followed by
``update``, as mitmproxy's ``handle_lifecycle`` does) on a finished flow, which every step
passes over after its first check: what is measured is the dispatch, not the steps' work.
Rounds of 200 events per master alternate, the order reversed every other round; the
thread's CPU per event (``time.thread_time_ns``), median (min-max) over rounds, in µs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mitmproxy import hooks, options
from mitmproxy.proxy.layers.http import (HttpRequestHeadersHook, HttpRequestHook, HttpResponseHeadersHook,
                                         HttpResponseHook)
from mitmproxy.test import tflow
from mitmproxy.tools.dump import DumpMaster

ROOT = Path(__file__).resolve().parent.parent
CHAINED = "addons = [Chain(steps)]"


async def master(work: Path, name: str, script: str | None) -> DumpMaster:
    m = DumpMaster(options.Options(confdir=str(work / name / "conf")), with_termlog=False, with_dumper=True)
    m.options.update(connection_strategy="lazy")
    if script is not None:
        path = work / f"interception_{name}.py"
        path.write_text(script)
        m.options.update(scripts=[str(path)])
        for _ in range(200):  # mitmproxy loads a script in a task once the loop runs
            await asyncio.sleep(0.05)
            if "intercept_trace_dir" in m.options:
                break
        else:
            raise SystemExit(f"{name}: the script did not load")
        m.options.update(intercept_trace_dir=str(work / name / "traces"))
    return m


async def run(rounds: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-dispatch-"))
    text = (ROOT / "addons" / "interception.py").read_text()
    if CHAINED not in text:
        raise SystemExit(f"addons/interception.py has no {CHAINED!r} line")
    masters = {"bare": await master(work, "bare", None),
               "listed": await master(work, "listed", text.replace(CHAINED, "addons = steps")),
               "chain": await master(work, "chain", text)}
    events = {"update": lambda f: hooks.UpdateHook([f])}
    for hook in (HttpRequestHeadersHook, HttpRequestHook, HttpResponseHeadersHook, HttpResponseHook):
        events[f"{hook.name} + update"] = hook
    cpu = {(n, e): [] for n in masters for e in events}
    for k in range(rounds):
        order = list(masters.items()) if k % 2 else list(masters.items())[::-1]
        for e, make in events.items():
            for n, m in order:
                f = tflow.tflow(resp=True)
                f.live = False
                event = make(f)
                t0 = time.thread_time_ns()
                for _ in range(200):
                    if e == "update":
                        await m.addons.trigger_event(event)
                    else:
                        await m.addons.handle_lifecycle(event)
                cpu[n, e].append((time.thread_time_ns() - t0) / 200 / 1e3)
    out = sys.__stdout__
    print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; {rounds} rounds of 200 events; "
          "thread CPU per event, µs: median (min-max)", file=out)
    print("", file=out)
    print("| event | " + " | ".join(masters) + " | listed - chain (medians) |", file=out)
    print("|---|" + "---|" * (len(masters) + 1), file=out)
    for e in events:
        cells = [f"{statistics.median(cpu[n, e]):.1f} ({min(cpu[n, e]):.1f}-{max(cpu[n, e]):.1f})" for n in masters]
        gain = statistics.median(cpu["listed", e]) - statistics.median(cpu["chain", e])
        print(f"| {e} | " + " | ".join(cells) + f" | {gain:+.1f} |", file=out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    sys.stdout = open(os.devnull, "w")  # the dumper's flow lines
    asyncio.run(run(args.rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

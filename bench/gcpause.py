"""How long a full garbage collection stalls the proxy's event loop, with and without
``RuntimeTuning``'s freeze of start-up (addons/mitm/tuning.py), in one process.

    .venv/bin/python bench/gcpause.py [--turns 300] [--sessions 4] [--repeats 7]

Imports what mitmdump with this project's script imports (mitmproxy's tools, every addon),
then records ``--sessions`` conversations of ``--turns`` Chat turns each through the
proxy's own code path (``prepare`` then ``commit_turn``, 570 characters a side per turn), so
the heap holds what a proxy with those live sessions holds. Then times ``gc.collect()`` (a
full collection, what the collector runs on its own from time to time): first as Python
leaves it, then after ``gc.freeze()`` of everything that was alive before the sessions
started (what RuntimeTuning does once mitmdump has started). Median and min-max over
``--repeats`` collections each, and the number of objects each walks.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import mitmproxy.tools.dump  # noqa: E402,F401  (what mitmdump imports)

import interceptor.addons.interception  # noqa: E402,F401  (every addon, as the script loads them)
from interceptor.addons.gateway.rewrite import prepare  # noqa: E402
from interceptor.addons.gateway.sessions.session import SessionConfig  # noqa: E402
from interceptor.dialects import CHAT  # noqa: E402
from interceptor.trace import Message, ModelCall, Recorder, Response, Store, Usage  # noqa: E402
from trace_turns import machine  # noqa: E402


def timed_collections(repeats: int) -> tuple[list[float], int]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - t0)
    return times, len(gc.get_objects())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=300)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    gc.collect()
    startup = len(gc.get_objects())
    gc.freeze()  # what RuntimeTuning does once mitmdump has started, before any session
    work = Path(tempfile.mkdtemp(prefix="bench-gc-"))
    store = Store()
    reply = ("The answer, at length. " * 25)[:570]
    for s in range(args.sessions):
        rec = Recorder(work / f"s{s}.msgpack", {"id": f"s{s}"}, store=store, fsync="never")
        messages = [{"role": "system", "content": "You are a patient assistant."}]
        for k in range(args.turns):
            messages.append({"role": "user", "content": (f"turn {k}: " + "please go on. " * 41)[:570]})
            raw = json.dumps({"model": "gpt-4o", "messages": messages}).encode()
            p = prepare(raw, CHAT, "model", SessionConfig(), "/v1/chat/completions", prefixes=rec.prefixes)
            call = ModelCall(id=uuid.uuid4().hex[:12], started_at=1.0, ended_at=2.0)
            response = Response(message=Message(role="assistant", content=reply), usage=Usage(input_tokens=1, output_tokens=1))
            rec.commit_turn(p.request, response, call, p.listed)
            messages.append({"role": "assistant", "content": reply})
    store.flush(timeout=60)
    tuned, walked_tuned = timed_collections(args.repeats)
    gc.unfreeze()  # Python's defaults: the collector walks start-up too
    plain, walked_plain = timed_collections(args.repeats)
    print(f"machine: {machine()}")
    print(f"{args.sessions} sessions x {args.turns} turns in memory; objects the collector tracks: "
          f"{startup:,} at start-up (mitmproxy, the addons, their libraries), {walked_tuned:,} more for the sessions")
    print()
    print("| full collection | objects walked | ms: median (min-max) |")
    print("|---|---|---|")
    for label, xs, walked in (("Python's defaults", plain, walked_plain),
                              ("start-up frozen (RuntimeTuning)", tuned, walked_tuned)):
        print(f"| {label} | {walked:,} | {statistics.median(xs) * 1e3:.2f} ({min(xs) * 1e3:.2f}-{max(xs) * 1e3:.2f}) |")
    store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

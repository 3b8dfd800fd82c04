"""What the relay costs (issue 9: an abandoned answer is read to its end and recorded),
side by side in one run.

    .venv/bin/python bench/relay.py [--requests 600] [--rounds 15]

Two mitmdump processes from this checkout against one simulator: "before" with
``intercept_drain_timeout=0`` (no relay: mitmproxy talks to the upstream itself), "after"
with the default (every model request goes out through addons/relay.py's loopback hop).
Sequential JSON and SSE chat turns, rounds interleaved; per-request latency as median and
p10-p90 per side and the ratio of the medians with its spread over rounds
(bench/failclosed.py's ``compare``).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from failclosed import compare  # noqa: E402
from mitm import MitmProcess  # noqa: E402
from overhead import KEY_ENV, start_simulator  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-relay-"))
    sim, sim_url = start_simulator(work)
    opts = {"intercept_upstream": f"{sim_url}/v1", "intercept_api_key_env": KEY_ENV}
    env = {KEY_ENV: "sk-bench-real-key"}
    procs = {"before": MitmProcess(workdir=work / "before", options={**opts, "intercept_drain_timeout": "0"}, env=env),
             "after": MitmProcess(workdir=work / "after", options=opts, env=env)}
    try:
        for p in procs.values():
            p.start()
        sessions = {k: p.create_session(upstream={"base_url": f"{sim_url}/v1"}) for k, p in procs.items()}
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
              f"{platform.platform()}; before = no relay (intercept_drain_timeout=0), after = relay")
        print(f"{args.requests} sequential requests per side and mode, {args.rounds} interleaved rounds; ms\n")
        compare(procs, sessions, args.requests, args.rounds)
    finally:
        for p in procs.values():
            p.cleanup()
        sim.terminate()
        sim.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

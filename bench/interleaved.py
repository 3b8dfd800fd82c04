"""CPU per request of several proxies under one load, interleaved request by request: the
16-client cell's cost with the machine's drift taken out.

    .venv/bin/python bench/interleaved.py [--paths bare,proxy] [--before REV] [--rounds 8] [--requests 40]
    .venv/bin/python bench/interleaved.py --before HEAD~3      # this proxy, as it was at HEAD~3, and bare

Paths, each a real mitmdump on one simulator: ``bare`` (bare mitmdump, ``map_remote``: what
mitmproxy itself costs for the same bytes), ``proxy`` (this proxy as ``make run`` starts it,
from the working tree), and with ``--before REV`` this proxy as it was at ``REV`` (``git
archive``). Each of 16 concurrent clients sends 20 KB independent JSON requests (bench/fsync.py's
body) and takes the paths in turn, request by request, each client starting at another path:
every path is loaded at the same moments of the same machine. Per round, each process's CPU
(every thread, user and system, and the main thread's alone: the event loop's, which saturates
first) divided by the requests it answered; reported as the median over rounds and paired with
the first path round by round.

Why: bench/fsync.py and bench/compare.py run the paths one after another, and on a shared
virtual machine whose speed drifts by tens of percent within minutes a path's round can land
in a slow minute: their paired throughput spread over 30 points (72-103% of bare's) while the
change measured was a few. Interleaved, the spread of the paired difference is a tenth of a
millisecond. What this does not give is throughput (the paths share the clients' time): it is
the CPU per request that bounds throughput when the event loop or the machine saturates.

Checks afterwards: each session's trace holds each of its requests as a turn and verifies; a
path that failed a request or a check makes the run exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai and anthropic SDKs use

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from mitm import MitmProcess  # noqa: E402
from overhead import KEY_ENV, start_simulator  # noqa: E402
from failclosed import checkout_proxy  # noqa: E402
from fsync import bare_process, conclude, fallbacks, session_problems  # noqa: E402
from trace_turns import cpu_ns  # noqa: E402

URL = "https://api.openai.com/v1/chat/completions"
CLIENTS = 16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", default="bare,proxy", help="comma-separated, of bare and proxy (default: %(default)s)")
    ap.add_argument("--before", metavar="REV", help="also this proxy as it was at REV (git archive)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--requests", type=int, default=40, help="per client, path and round")
    args = ap.parse_args()
    wanted = [p.strip() for p in args.paths.split(",") if p.strip()]
    if any(p not in ("bare", "proxy") for p in wanted) or not wanted:
        ap.error("--paths takes bare and proxy")
    work = Path(tempfile.mkdtemp(prefix="bench-interleaved-"))
    sim, sim_url = start_simulator(work)
    options = {"intercept_upstream": f"{sim_url}/v1", "intercept_api_key_env": KEY_ENV}
    env = {KEY_ENV: "sk-bench-real-key"}
    procs: dict[str, MitmProcess] = {}
    for name in wanted:
        procs[name] = (bare_process(work, sim_url) if name == "bare"
                       else MitmProcess(workdir=work / "proxy", env=env, options=options))
    if args.before:
        procs[f"at {args.before}"] = checkout_proxy(args.before, work, options, env)
    names = list(procs)
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    sessions: dict[str, list[dict]] = {name: [] for name in names}
    counter = itertools.count()
    filler = "x" * 19_800
    errors: list[str] = []

    async def run() -> None:
        made, clients = {}, {}
        for name, proc in procs.items():
            bare = name == "bare"
            verify = str(proc.confdir / "mitmproxy-ca-cert.pem") if bare else str(proc.ca_bundle)
            made[name] = [{"model_secret": "sk-client"} if bare else
                          proc.create_session(upstream={"base_url": f"{sim_url}/v1"}, model="gpt-4o-bench")
                          for _ in range(CLIENTS)]
            sessions[name] = [s for s in made[name] if not bare]
            clients[name] = [httpx.AsyncClient(proxy=proc.url, verify=verify, timeout=120) for _ in range(CLIENTS)]

        async def one(name: str, k: int) -> None:
            payload = json.dumps({"model": "gpt-4o", "messages": [
                {"role": "user", "content": f"{next(counter)} {filler}"}]}).encode()
            try:
                r = await clients[name][k].post(URL, content=payload, headers={
                    "authorization": f"Bearer {made[name][k]['model_secret']}", "content-type": "application/json"})
                r.raise_for_status()
            except Exception as e:  # noqa: BLE001 - counted and reported, never hidden
                errors.append(f"{name}: {type(e).__name__}: {e}"[:200])

        try:
            for name in names:  # connections and sessions warm
                await asyncio.gather(*(one(name, k) for k in range(CLIENTS)))

            async def client(k: int) -> None:
                for i in range(args.requests):
                    for j in range(len(names)):
                        await one(names[(i + j + k) % len(names)], k)

            for _ in range(args.rounds):
                before = {name: cpu_ns(procs[name].proc.pid) for name in names}
                await asyncio.gather(*(client(k) for k in range(CLIENTS)))
                n = CLIENTS * args.requests
                for name in names:
                    after, pid = cpu_ns(procs[name].proc.pid), str(procs[name].proc.pid)
                    total = sum(after.values()) - sum(before[name].values())
                    main_thread = after.get(pid, 0) - before[name].get(pid, 0)
                    rows[name].append((total / 1e6 / n, main_thread / 1e6 / n))
        finally:
            for cs in clients.values():
                for c in cs:
                    await c.aclose()

    bad: list[str] = []
    notes: list[str] = []
    try:
        for proc in procs.values():
            proc.start()
        started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        asyncio.run(run())
        bad = session_problems(procs, sessions, args.rounds * args.requests + 1)
        notes = fallbacks(procs)
    finally:
        for proc in procs.values():
            proc.cleanup()
        sim.terminate()
        sim.wait(10)

    base = names[0]

    def spread(xs: list[float]) -> str:
        return f"{statistics.median(xs):+.3f} ({min(xs):+.3f}..{max(xs):+.3f})"

    print(f"# bench/interleaved.py\n\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}; {started}; {CLIENTS} clients, each taking the {len(names)} paths in "
          f"turn, {args.requests} requests per client, path and round (20 KB JSON), {args.rounds} rounds\n")
    print(f"| path | CPU per request, ms | main thread's, ms | CPU minus {base}'s, paired, ms "
          f"| main thread's minus {base}'s, paired, ms |")
    print("|---|---|---|---|---|")
    for name in names:
        cpu, main_cpu = [r[0] for r in rows[name]], [r[1] for r in rows[name]]
        paired = "- | -" if name == base else (
            f"{spread([r[0] - b[0] for r, b in zip(rows[name], rows[base])])} | "
            f"{spread([r[1] - b[1] for r, b in zip(rows[name], rows[base])])}")
        print(f"| {name} | {statistics.median(cpu):.3f} | {statistics.median(main_cpu):.3f} | {paired} |")
    return conclude(errors[:3] + bad[:5], work, sessions, "every request answered", notes)


if __name__ == "__main__":
    sys.exit(main())

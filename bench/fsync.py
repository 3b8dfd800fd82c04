"""The trace's fsync policy under load: CPU per request and throughput at 16
concurrent clients, each its own session, side by side in one run; with ``--before REV``, a
change's cost in the same cell (this proxy as it was at ``REV`` as one more path).

    .venv/bin/python bench/fsync.py [--clients 16] [--requests 60] [--rounds 6]
    .venv/bin/python bench/fsync.py --paths bare,grouped --before HEAD~1 --base bare --rounds 12

Paths, each a real mitmdump with ``addons/interception.py`` on the simulator, in rotating
order per round (reversed every other round): ``never`` (``intercept_fsync=never``, the
floor), ``per write`` (``turn`` with ``intercept_fsync_ms=0``: an fsync after every batch the
writer thread writes, as before the group commit), ``grouped`` (``turn`` as it ships: at most
one fsync per file per ``intercept_fsync_ms``), and ``bare`` (bare mitmdump, for scale). Each
client sends 20 KB independent JSON requests one after another, all clients at once (as
bench/compare.py's 16-client cell). Per path: the process's CPU (every thread, user and
system) per request and the throughput, medians over rounds, and paired with ``never`` round
by round (the machine's speed drifts within a run; a round's paths run back to back; ``--base``
names another path to pair with). Also the CPU of the process's main thread alone: the event
loop's, the one that saturates first at 16 clients (every hook and mitmproxy's own work run
there), so its time per request is what the throughput follows. Each path's traces are
checked afterwards: every request a turn, every file verifying.

Why it matters: an fsync costs its thread's kernel time and a GIL hand-over each way, and
under 16 clients there were hundreds a second, one per turn (py-spy ``--nonblocking`` put the
writer thread in ``os.fsync`` for a fifth of the proxy's samples).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import shutil
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
from trace_turns import cpu_between, cpu_ns  # noqa: E402

from interceptor.trace import read_trace  # noqa: E402
from interceptor.trace.verify import problems  # noqa: E402

URL = "https://api.openai.com/v1/chat/completions"
PATHS = {
    "never": {"intercept_fsync": "never"},
    "per write": {"intercept_fsync": "turn", "intercept_fsync_ms": 0},
    "grouped": {"intercept_fsync": "turn"},
}


def bare_process(work: Path, sim_url: str) -> MitmProcess:
    """Bare mitmdump with api.openai.com mapped to the simulator: mitmproxy's own cost."""
    return MitmProcess(script=False, workdir=work / "bare", options={
        "connection_strategy": "lazy", "map_remote": f"|https://api\\.openai\\.com/v1|{sim_url}/v1"})


def session_problems(procs: dict[str, MitmProcess], sessions: dict[str, list[dict]], sent: int) -> list[str]:
    """Each session sealed (DELETE) and its trace read back: ``sent`` turns, verifying."""
    bad: list[str] = []
    for name, made in sessions.items():
        for s in made:
            status, _ = procs[name].api("DELETE", f"sessions/{s['id']}")
            trace = read_trace(Path(s["trace_path"]))
            if status != 200 or trace.num_turns != sent or problems(trace):
                bad.append(f"{name}: session {s['id']}: DELETE {status}, {trace.num_turns} turns (sent {sent}), "
                           f"{problems(trace)[:2]}")
    return bad


def fallbacks(procs: dict[str, MitmProcess]) -> list[str]:
    """The proxies whose trace writes left the event loop during the run (health's
    ``trace_writes``, as bench/compare.py reads it): from then on their figures are the
    writer thread's. Asked while they run; bare mitmdump has no health to ask."""
    return [f"{name}: a trace write on its event loop was slow, and its writer thread wrote every later "
            "record (trace/store.py): its figures after that are the thread's"
            for name, proc in procs.items()
            if proc.script and proc.api("GET", "health", token=None)[1].get("trace_writes") == "thread"]


def conclude(bad: list[str], work: Path, sessions: dict[str, list[dict]], checked: str,
             notes: list[str] = ()) -> int:
    """The run's end: ``notes`` said, then a failed check printed with the work dir kept to
    look at (exit 1), or the work dir removed and what was checked said (exit 0)."""
    for note in notes:
        print(f"\nnote: {note}")
    if bad:
        print("\nFAILED: " + "; ".join(bad) + f"\n(the run's traces and logs: {work})")
        return 1
    shutil.rmtree(work, ignore_errors=True)
    print(f"\nchecks: {checked}; every session's trace holds each of its requests as a turn and verifies "
          f"({sum(len(v) for v in sessions.values())} sessions)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=60, help="per client and round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--paths", default="bare," + ",".join(PATHS), help="comma-separated (default: %(default)s)")
    ap.add_argument("--before", metavar="REV", help="also this proxy as it was at REV (git archive), as it ships")
    ap.add_argument("--base", default="never", help="the path the others are paired with")
    args = ap.parse_args()
    wanted = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = [p for p in wanted if p != "bare" and p not in PATHS]
    if unknown:
        ap.error(f"unknown path(s) {unknown}: the paths are bare, {', '.join(PATHS)}")
    if args.base not in wanted and not (args.before and args.base == "before"):
        ap.error(f"--base {args.base!r} is not among the paths run")
    work = Path(tempfile.mkdtemp(prefix="bench-fsync-"))
    sim, sim_url = start_simulator(work)
    procs: dict[str, MitmProcess] = {}
    if "bare" in wanted:
        procs["bare"] = bare_process(work, sim_url)
    proxy_options = {"intercept_upstream": f"{sim_url}/v1", "intercept_api_key_env": KEY_ENV}
    for name, options in PATHS.items():
        if name in wanted:
            procs[name] = MitmProcess(workdir=work / name.replace(" ", "-"), env={KEY_ENV: "sk-bench-real-key"},
                                      options={**proxy_options, **options})
    if args.before:
        procs["before"] = checkout_proxy(args.before, work, proxy_options, {KEY_ENV: "sk-bench-real-key"})
    counter = itertools.count()
    filler = "x" * 19_800
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in procs}
    sessions: dict[str, list[dict]] = {name: [] for name in procs}

    async def cell(name: str, proc: MitmProcess) -> None:
        bare = name == "bare"
        verify = str(proc.confdir / "mitmproxy-ca-cert.pem") if bare else str(proc.ca_bundle)
        made = [{"model_secret": "sk-client"} if bare else
                proc.create_session(upstream={"base_url": f"{sim_url}/v1"}, model="gpt-4o-bench")
                for _ in range(args.clients)]
        sessions[name] += [s for s in made if not bare]
        clients = [httpx.AsyncClient(proxy=proc.url, verify=verify, timeout=120) for _ in made]

        async def one(k: int) -> None:
            payload = json.dumps({"model": "gpt-4o", "messages": [
                {"role": "user", "content": f"{next(counter)} {filler}"}]}).encode()
            r = await clients[k].post(URL, content=payload, headers={
                "authorization": f"Bearer {made[k]['model_secret']}", "content-type": "application/json"})
            r.raise_for_status()

        await asyncio.gather(*(one(k) for k in range(len(made))))  # connections and sessions warm
        c0, t0 = cpu_ns(proc.proc.pid), time.perf_counter()

        async def client(k: int) -> None:
            for _ in range(args.requests):
                await one(k)

        await asyncio.gather(*(client(k) for k in range(len(made))))
        wall = time.perf_counter() - t0
        c1 = cpu_ns(proc.proc.pid)
        n = len(made) * args.requests
        main_thread = str(proc.proc.pid)  # the main thread's id is the process's
        results[name].append((cpu_between(c0, c1) / 1e6 / n, n / wall,
                              (c1.get(main_thread, 0) - c0.get(main_thread, 0)) / 1e6 / n))
        for c in clients:
            await c.aclose()

    bad: list[str] = []
    notes: list[str] = []
    try:
        for proc in procs.values():
            proc.start()
        started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        for r in range(args.rounds):
            order = list(procs) if r % 2 == 0 else list(procs)[::-1]
            for name in order[r % len(order):] + order[:r % len(order)]:
                asyncio.run(cell(name, procs[name]))
        bad = session_problems(procs, sessions, args.requests + 1)
        notes = fallbacks(procs)
    finally:
        for proc in procs.values():
            proc.cleanup()
        sim.terminate()
        sim.wait(10)

    print(f"# bench/fsync.py\n\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}; {started}; {args.clients} clients x {args.requests} requests "
          f"(20 KB JSON) per cell, {args.rounds} rounds\n")
    print(f"| path | CPU per request, ms | main thread's, ms | throughput/s | CPU minus {args.base}'s, paired, ms "
          f"| main thread's minus {args.base}'s, paired, ms | throughput, share of {args.base}'s, paired |")
    print("|---|---|---|---|---|---|---|")
    base = results[args.base]

    def spread(xs: list[float], f: str) -> str:
        return f"{statistics.median(xs):{f}} ({min(xs):{f}}-{max(xs):{f}})"

    for name, rows in results.items():
        cpu, thr, main = [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]
        d_cpu = [r[0] - o[0] for r, o in zip(rows, base)]
        d_main = [r[2] - o[2] for r, o in zip(rows, base)]
        share = [r[1] / o[1] * 100 for r, o in zip(rows, base)]
        paired = ("- | - | -" if name == args.base else
                  f"{spread(d_cpu, '+.2f')} | {spread(d_main, '+.2f')} | {spread(share, '.0f')}%")
        print(f"| {name} | {spread(cpu, '.2f')} | {spread(main, '.2f')} | {spread(thr, '.0f')} | {paired} |")
    return conclude(bad, work, sessions, "every cell's requests answered", notes)


if __name__ == "__main__":
    sys.exit(main())

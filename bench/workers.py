"""More than one core: the front with 2 workers against 1, and the proxy alone, side by side.

    .venv/bin/python bench/workers.py [--clients 16] [--requests 40] [--streams 16] [--tokens 500] [--reps 3]

Three paths live at once against one simulator process, every client a real session made
through each path's control API: this proxy alone (one mitmdump, no front), scripts/serve.py
with 1 worker, and with 2 workers (HAProxy in front; sessions alternate between the workers
by round robin). Two workloads, in rotating path order, ``--reps`` times each:

- JSON: ``--clients`` concurrent clients (one session each, one keep-alive connection each)
  send ``--requests`` non-streaming chat requests each; throughput (requests/s), added-free
  latency p50 and p99, proxy CPU per request (all worker processes' threads, from
  /proc/<pid>/task/*/schedstat, HAProxy's too, apart).
- streams: ``--streams`` concurrent streams of ``--tokens`` token events; events/s delivered
  and proxy CPU per event.

Every proxy process runs in its own session, as scripts/serve.py starts its workers: with the
kernel's autogroup scheduling a shared machine gives each session a share of the CPU, so the
proxies compete with the machine's other work as separate processes would on a node, and
the simulator and the clients (this process) keep one share between them.

Reported as each path's figures and the 2-worker/1-worker ratio per repetition (median and
spread), with the machine and its load average. Each path's traces are checked afterwards:
every session holds one call per request its client sent and no error.
Then ``--memory-sessions`` sessions of 5 turns each go to one worker: its RSS per live
session and per sealed (released) session, for sizing a node.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx2 as httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from mitm import MitmProcess  # noqa: E402
from overhead import KEY_ENV, start_simulator  # noqa: E402
from rollout import load, quantile  # noqa: E402
from trace_turns import cpu_between, cpu_ns, machine  # noqa: E402

from interceptor.client import Proxy  # noqa: E402
from interceptor.client.proxy import with_userinfo  # noqa: E402
from interceptor.scripts.serve import Deployment  # noqa: E402
from interceptor.trace import read_trace  # noqa: E402

URL = "https://api.openai.com/v1/chat/completions"
REAL_KEY = "sk-bench-real-key"


class _Skip(Exception):
    pass


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Path_:
    """One way through: its control API, its processes (for CPU), its sessions."""

    def __init__(self, name: str, url: str, token: str, pids, front_pid: int | None = None) -> None:
        self.name, self.url, self.pids, self.front_pid = name, url, pids, front_pid
        self.proxy = Proxy.attach(url, token)
        self.sessions = []
        self.turns: dict[str, int] = {}

    def cpu(self) -> dict:
        return {(p, t): ns for p in self.pids() for t, ns in cpu_ns(p).items()}

    def front_cpu(self) -> dict:
        return cpu_ns(self.front_pid) if self.front_pid else {}

    def session(self):
        s = self.proxy.session(upstream="sim")
        self.sessions.append(s)
        self.turns[s.id] = 0
        return s


def run_cell(path: Path_, sessions, payload: bytes, count: int, stream: bool) -> dict:
    """Each session's client sends ``count`` requests on its own connection, all at once."""
    lat: list[float] = []
    events = [0]
    lock = threading.Lock()
    errors: list[str] = []
    barrier = threading.Barrier(len(sessions) + 1)

    def client(s) -> None:
        with httpx.Client(proxy=s.proxy_url, verify=s.ssl_context(), timeout=300) as c:
            headers = {"authorization": f"Bearer {s.secret}", "content-type": "application/json"}
            barrier.wait()
            for _ in range(count):
                t0 = time.perf_counter()
                n = 0
                try:
                    if stream:
                        with c.stream("POST", URL, content=payload, headers=headers) as r:
                            r.raise_for_status()
                            for line in r.iter_lines():
                                n += line.startswith("data: {")
                    else:
                        r = c.post(URL, content=payload, headers=headers)
                        r.raise_for_status()
                except Exception as e:  # noqa: BLE001 - counted and reported, never hidden
                    errors.append(f"{type(e).__name__}: {e}"[:200])
                    continue
                with lock:
                    lat.append(time.perf_counter() - t0)
                    events[0] += n
                    path.turns[s.id] += 1

    threads = [threading.Thread(target=client, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    barrier.wait()
    c0, f0, t0 = path.cpu(), path.front_cpu(), time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    time.sleep(0.005)
    cpu, front = cpu_between(c0, path.cpu()), cpu_between(f0, path.front_cpu())
    if errors:
        raise RuntimeError(f"{path.name}: {len(errors)} failed requests, first: {errors[0]}")
    return {"wall": wall, "n": len(lat), "events": events[0], "cpu": cpu, "front": front,
            "p50": statistics.median(lat), "p99": quantile(lat, 0.99)}


def warm(path: Path_, sessions, payload: bytes) -> None:
    run_cell(path, sessions, payload, 1, stream=False)


def memory(dep: Deployment, sessions: int, turns: int) -> tuple[float, float]:
    """KB of one worker's RSS per live session (``turns`` growing turns each), and at most per
    sealed one. A first batch is made and measured live, then sealed; then a second batch. RSS
    never falls at a seal (Python keeps freed memory for reuse), but the second batch reuses
    what the sealed first one freed: it grows RSS only by what it could not reuse, so a sealed
    session keeps at most that growth per session."""
    proxy = Proxy.attach(dep.url, dep.admin_token)
    pid = dep.workers[0].proc.pid

    def batch() -> list:
        made = [proxy.session(upstream="sim") for _ in range(sessions)]
        for s in made:
            with httpx.Client(proxy=s.proxy_url, verify=s.ssl_context(), timeout=60) as c:
                messages = []
                for k in range(turns):
                    messages.append({"role": "user", "content": f"turn {k} " + "lorem ipsum " * 80})
                    r = c.post(URL, json={"model": "gpt-4o", "messages": messages},
                               headers={"authorization": f"Bearer {s.secret}"})
                    r.raise_for_status()
                    messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        time.sleep(1)
        return made

    rss0 = rss_kb(pid)
    first = batch()
    rss1 = rss_kb(pid)
    for s in first:
        s.close()
    second = batch()
    rss2 = rss_kb(pid)
    for s in second:
        s.close()
    return (rss1 - rss0) / sessions, max(0.0, (rss2 - rss1) / sessions)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=40, help="per client per repetition (JSON)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--stream-requests", type=int, default=2, help="streams per client per repetition")
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--memory-sessions", type=int, default=300, help="0: skip the memory figure")
    ap.add_argument("--reps-only", action="store_true", help="skip the memory figure")
    ap.add_argument("--memory-only", action="store_true", help="only the memory figure")
    args = ap.parse_args()
    if args.reps_only:
        args.memory_sessions = 0
    work = Path(tempfile.mkdtemp(prefix="bench-workers-"))
    script = work / "script.json"
    pieces = [f"w{k} " for k in range(args.tokens)]
    script.write_text(json.dumps({"default": {"text": pieces}}))
    sim, sim_url = start_simulator(work, [sys.executable, "-m", "provider", "--port", "0", "--script", str(script)])
    upstreams = json.dumps({"sim": {"base_url": f"{sim_url}/v1", "api_key_env": KEY_ENV}})
    env = {KEY_ENV: REAL_KEY}
    alone = MitmProcess(workdir=work / "alone", options={"intercept_upstreams": upstreams}, env=env, new_session=True)
    deps = {n: Deployment(n, listen_port=0, trace_dir=work / f"traces-{n}", confdir=work / f"conf-{n}",
                          options=[f"intercept_upstreams={upstreams}"], env=env, restart=False) for n in (1, 2)}
    json_body = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "x" * 20_000}]}).encode()
    sse_body = json.dumps({"model": "gpt-4o", "stream": True, "stream_options": {"include_usage": True},
                           "messages": [{"role": "user", "content": "count"}]}).encode()
    loads = [load()]
    results: dict[str, dict[str, list[dict]]] = {}
    try:
        if args.memory_only:
            raise _Skip
        alone.start()
        for d in deps.values():
            d.start()
        paths = [Path_("proxy alone", alone.url, alone.admin_token, lambda: [alone.proc.pid])]
        for n, d in deps.items():
            paths.append(Path_(f"front + {n} worker{'s' if n > 1 else ''}", d.url, d.admin_token,
                               (lambda d=d: [w.proc.pid for w in d.workers]), d.front.pid))
        clients = {p.name: [p.session() for _ in range(max(args.clients, args.streams))] for p in paths}
        for p in paths:
            warm(p, clients[p.name], json_body)
        for work_name, body, count, stream, n_clients in (
                ("JSON 20 KB", json_body, args.requests, False, args.clients),
                (f"streams of {args.tokens} events", sse_body, args.stream_requests, True, args.streams)):
            results[work_name] = {p.name: [] for p in paths}
            for k in range(args.reps):
                for p in paths[k % len(paths):] + paths[:k % len(paths)]:
                    results[work_name][p.name].append(run_cell(p, clients[p.name][:n_clients], body, count, stream))
                loads.append(load())
        # every session holds exactly its client's turns, and verifies
        for p in paths:
            for s in p.sessions:
                s.close()
                trace = read_trace(s.trace_path)
                assert len(trace.calls) == p.turns[s.id] and not trace.errors, (p.name, s.id, len(trace.calls), p.turns[s.id])
    except _Skip:
        pass
    finally:
        if alone.proc is not None:
            alone.cleanup()
        for d in deps.values():
            d.stop()
        sim.terminate()
        sim.wait(10)

    mem = None
    if args.memory_sessions:
        # a fresh worker: one that served the cells above reuses their freed memory
        sim, sim_url = start_simulator(work, [sys.executable, "-m", "provider", "--port", "0", "--script", str(script)])
        upstreams = json.dumps({"sim": {"base_url": f"{sim_url}/v1", "api_key_env": KEY_ENV}})
        fresh = Deployment(1, listen_port=0, trace_dir=work / "traces-mem", confdir=work / "conf-mem",
                           options=[f"intercept_upstreams={upstreams}"], env=env, restart=False)
        try:
            mem = memory(fresh.start(), args.memory_sessions, 5)
        finally:
            fresh.stop()
            sim.terminate()
            sim.wait(10)
    if not results:
        print(f"memory, one fresh worker, 2 x {args.memory_sessions} sessions of 5 turns: {mem[0]:.0f} KB RSS per "
              f"live session, at most {mem[1]:.0f} KB per sealed one")
        return 0
    print(f"machine: {machine()}; load average at the start and after each repetition: {' | '.join(loads)}")
    print(f"{args.reps} repetitions, paths in rotating order; one simulator process for all\n")
    for work_name, by_path in results.items():
        stream = "events" in work_name
        unit = "events/s" if stream else "requests/s"
        print(f"**{work_name}** ({args.streams if stream else args.clients} concurrent clients)\n")
        print(f"| path | {unit}: median (min-max) | p50 ms | p99 ms | worker CPU per "
              f"{'event, µs' if stream else 'request, ms'} | HAProxy CPU per {'event, µs' if stream else 'request, ms'} |")
        print("|---|---|---|---|---|---|")
        for name, cells in by_path.items():
            rate = [(c["events"] if stream else c["n"]) / c["wall"] for c in cells]
            div = (lambda c: c["events"] * 1e3) if stream else (lambda c: c["n"] * 1e6)
            cpu = [c["cpu"] / div(c) for c in cells]
            front = [c["front"] / div(c) for c in cells]
            print(f"| {name} | {statistics.median(rate):.0f} ({min(rate):.0f}-{max(rate):.0f}) | "
                  f"{statistics.median(c['p50'] for c in cells) * 1e3:.1f} | "
                  f"{statistics.median(c['p99'] for c in cells) * 1e3:.1f} | {statistics.median(cpu):.2f} | "
                  f"{statistics.median(front):.3f} |")
        two, one = by_path["front + 2 workers"], by_path["front + 1 worker"]
        key = "events" if stream else "n"
        ratios = [(a[key] / a["wall"]) / (b[key] / b["wall"]) for a, b in zip(two, one)]
        alone_r = [(b[key] / b["wall"]) / (a[key] / a["wall"]) for a, b in zip(by_path["proxy alone"], one)]
        print(f"\n2 workers / 1 worker, throughput per repetition: {', '.join(f'{r:.2f}' for r in ratios)} "
              f"(median {statistics.median(ratios):.2f}); front + 1 worker / proxy alone: "
              f"{', '.join(f'{r:.2f}' for r in alone_r)}\n")
    if mem:
        print(f"memory, one worker, 2 x {args.memory_sessions} sessions of 5 turns (~1 KB per user message): "
              f"{mem[0]:.0f} KB RSS per live session (~{1024 * 1024 / max(mem[0], 1):.0f} live sessions per GB); "
              f"a sealed session keeps at most {mem[1]:.0f} KB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Upstream connections: how many TCP connections and TLS handshakes the upstream
sees for N sessions x M turns, through bare mitmdump and through this proxy, side by side in
one run.

    .venv/bin/python bench/connections.py [--sessions 16] [--turns 10] [--rounds 3]

The upstream is the simulator over HTTPS (a CA made for the run, tests/provider/tls.py),
counting the connections it accepts and the handshakes it completes. Each session is a thread
with an HTTP client of its own, sending its turns one after another (JSON and SSE chat turns
alternating), all sessions at once, in two client shapes: ``keep-alive`` (one client per
session, as an SDK in a long-lived harness) and ``client per turn`` (a new connection to the
proxy every turn, as a harness process per step). Paths, in alternating order per round:

- ``bare``: bare mitmdump; mitmproxy opens a server connection per client connection;
- ``proxy``: this proxy as it runs (model POSTs through ``addons/gateway/transport/relay.py``'s pool, shared by
  every session of an upstream and kept alive);
- ``proxy, no relay``: ``intercept_drain_timeout=0``, mitmproxy's own upstream connections.

Also measured: what one handshake costs here (a fresh TLS connection and one request, against
a request on a kept-alive one), to weigh the counts. On loopback a handshake is cheap; to a
real provider it is TCP's and TLS 1.3's round trips (two RTTs before the request can leave).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import ssl
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai and anthropic SDKs use

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from mitm import MitmProcess  # noqa: E402
from overhead import KEY_ENV, body, one  # noqa: E402
from provider import ProviderSimulator, Reply, TestCA  # noqa: E402

SHAPES = ("keep-alive", "client per turn")


def run_sessions(proxy: MitmProcess, url: str, secrets: list[str], turns: int, shape: str) -> float:
    """Every session at once, each its turns in order; the wall time. Raises on any failure."""
    verify = ssl.create_default_context(cafile=str(proxy.ca_bundle if proxy.script else
                                                   proxy.confdir / "mitmproxy-ca-cert.pem"))
    errors: list[BaseException] = []

    def session(secret: str) -> None:
        client = None
        try:
            for turn in range(turns):
                if client is None or shape == "client per turn":
                    if client is not None:
                        client.close()
                    client = httpx.Client(proxy=proxy.url, verify=verify, timeout=60)
                one(client, url, body(2_000, turn % 2 == 1), turn % 2 == 1, secret)
        except BaseException as e:  # noqa: BLE001 - reported after the join
            errors.append(e)
        finally:
            if client is not None:
                client.close()

    threads = [threading.Thread(target=session, args=(s,)) for s in secrets]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} sessions failed; first: {errors[0]!r}")
    return time.perf_counter() - t0


def handshake_cost(sim: ProviderSimulator, ca: TestCA, n: int = 100) -> tuple[float, float]:
    """Median ms of one JSON turn straight to the simulator on a new TLS connection each time,
    and on one kept-alive connection."""
    verify = ssl.create_default_context(cafile=str(ca.path))
    url, payload = sim.url("/v1/chat/completions"), body(2_000, False)
    fresh, kept = [], []
    with httpx.Client(verify=verify, timeout=30) as client:
        one(client, url, payload, False, "k")
        for _ in range(n):
            kept.append(one(client, url, payload, False, "k")[0])
    for _ in range(n):
        with httpx.Client(verify=verify, timeout=30) as client:
            fresh.append(one(client, url, payload, False, "k")[0])
    return statistics.median(fresh) * 1e3, statistics.median(kept) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-connections-"))
    ca = TestCA()
    sim = ProviderSimulator(tls=ca.server("127.0.0.1"), default=Reply(text=["The ", "answer ", "is ", "42."])).start()
    tls = {"ssl_verify_upstream_trusted_ca": str(ca.path)}
    opts = {"intercept_upstream": sim.url("/v1"), "intercept_api_key_env": KEY_ENV, **tls}
    env = {KEY_ENV: "sk-bench-real-key"}
    procs = {
        "bare": MitmProcess(workdir=work / "bare", script=False, options=tls),
        "proxy": MitmProcess(workdir=work / "proxy", options=opts, env=env),
        "proxy, no relay": MitmProcess(workdir=work / "norelay", options={**opts, "intercept_drain_timeout": "0"},
                                       env=env),
    }
    try:
        for p in procs.values():
            p.start()
        load = os.getloadavg()
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
              f"{platform.platform()}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start")
        fresh, kept = handshake_cost(sim, ca)
        print(f"one JSON turn straight to the simulator, median of 100: new TLS connection {fresh:.2f} ms, "
              f"kept-alive {kept:.2f} ms (a handshake here: {fresh - kept:.2f} ms)\n")
        print(f"{args.sessions} sessions x {args.turns} turns at once (JSON and SSE alternating), "
              f"{args.rounds} rounds, paths in alternating order\n")
        counts: dict[tuple[str, str], list[dict]] = {}
        for r in range(args.rounds):
            for shape in SHAPES:
                order = list(procs) if r % 2 == 0 else list(reversed(procs))
                for name in order:
                    p = procs[name]
                    if p.script:
                        secrets = [p.create_session()["model_secret"] for _ in range(args.sessions)]
                        url = "https://api.openai.com/v1/chat/completions"
                    else:
                        secrets = ["sk-bench-real-key"] * args.sessions
                        url = sim.url("/v1/chat/completions")
                    before = sim.connections()
                    requests_before = len(sim.model_requests())
                    wall = run_sessions(p, url, secrets, args.turns, shape)
                    after = sim.connections()
                    seen = len(sim.model_requests()) - requests_before
                    assert seen == args.sessions * args.turns, (name, shape, seen)  # one request per turn
                    counts.setdefault((shape, name), []).append(
                        {k: after[k] - before[k] for k in after} | {"wall": wall, "turns": seen})
        print("| client shape | path | TCP connections, per round | of which probes | TLS handshakes, per round | "
              "handshakes per turn, whole run | wall s per round (median) |")
        print("|---|---|---|---|---|---|---|")
        per_turn: dict[tuple[str, str], float] = {}
        for (shape, name), rows in counts.items():
            hs = [r["handshakes"] for r in rows]
            per_turn[(shape, name)] = sum(hs) / sum(r["turns"] for r in rows)
            print(f"| {shape} | {name} | {', '.join(str(r['accepted']) for r in rows)} | "
                  f"{', '.join(str(r['probes']) for r in rows)} | {', '.join(map(str, hs))} | "
                  f"{per_turn[(shape, name)]:.3f} | {statistics.median(r['wall'] for r in rows):.2f} |")
        print("\nhandshakes per turn, bare mitmdump / this proxy (whole run):")
        for shape in SHAPES:
            bare, ours = per_turn[(shape, "bare")], per_turn[(shape, "proxy")]
            print(f"  {shape}: {bare:.3f} / {ours:.3f}" + (f" = {bare / ours:.1f}x" if ours else " (none)"))
        print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(json.dumps({f"{s} | {n}": rows for (s, n), rows in counts.items()}), file=sys.stderr)
    finally:
        for p in procs.values():
            p.cleanup()
        sim.stop()
        ca.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What the relay costs (an abandoned answer is read to its end and recorded; its loopback hop),
side by side in one run.

    .venv/bin/python bench/relay.py [--requests 200] [--tokens 500] [--before REV] [--bare]

mitmdump processes from this checkout against one simulator: "relay off" with
``intercept_drain_timeout=0`` (mitmproxy talks to the upstream itself), "relay" with the
default (every model request goes out through addons/gateway/transport/relay.py's loopback hop), and with
``--before REV`` the proxy at that revision (its relay on) as a third path. Sequential chat
turns with 20 KB request bodies, JSON and SSE (the SSE answer ``--tokens`` events, one token
each); ``--bare`` adds bare mitmdump streaming SSE (``bench/stream_sse.py``, ``map_remote`` to
the simulator, no addons), the baseline the speed goals are stated against. The paths in
rotating order request by request so the machine's load hits them alike.
Per request: its latency, and the CPU time of all of the mitmdump process's threads
(``/proc/<pid>/task/*/schedstat``) from before the request to 5 ms after its end; for SSE also
that CPU divided by the events the client received. Reported per path as median (p10-p90)
and each path's excess over "relay off" (medians). Each path's trace is checked afterwards:
one turn per request, every reply whole. The load average is printed: on a shared machine
the CPU figures are the ones to trust, latencies move with the load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx2 as httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from events import URL, chat_stream, check_traces  # noqa: E402
from failclosed import checkout_proxy  # noqa: E402
from mitm import MitmProcess  # noqa: E402
from overhead import KEY_ENV, body, start_simulator  # noqa: E402
from rollout import load, quantile  # noqa: E402
from trace_turns import cpu_between, cpu_ns, machine  # noqa: E402

def spread(xs: list[float], digits: int = 1) -> str:
    return f"{statistics.median(xs):.{digits}f} ({quantile(xs, 0.1):.{digits}f}-{quantile(xs, 0.9):.{digits}f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="per path and mode")
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--before", default="none", help="a git revision (its relay as a path), or 'none'")
    ap.add_argument("--bare", action="store_true", help="add bare streaming mitmdump as a path")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-relay-"))
    pieces = [f"w{k} " for k in range(args.tokens)]
    script = work / "script.json"
    script.write_text(json.dumps({"default": {"text": pieces}}))
    sim, sim_url = start_simulator(work, [sys.executable, "-m", "provider", "--port", "0", "--script", str(script)])
    opts = {"intercept_upstream": f"{sim_url}/v1", "intercept_api_key_env": KEY_ENV}
    env = {KEY_ENV: "sk-bench-real-key"}
    procs = {"relay off": MitmProcess(workdir=work / "off", options={**opts, "intercept_drain_timeout": "0"}, env=env)}
    if args.before != "none":
        procs[f"relay at {args.before}"] = checkout_proxy(args.before, work, opts, env)
    procs["relay"] = MitmProcess(workdir=work / "on", options=opts, env=env)
    if args.bare:
        procs["bare"] = MitmProcess(script=False, workdir=work / "bare", options={
            "connection_strategy": "lazy", "map_remote": f"|https://api\\.openai\\.com/v1|{sim_url}/v1",
            "scripts": str(ROOT / "bench" / "stream_sse.py")})
    names = list(procs)
    modes = ("JSON", "SSE")
    lat = {(m, n): [] for m in modes for n in names}
    cpu = {(m, n): [] for m in modes for n in names}
    per_event = {n: [] for n in names}
    loads = [load()]
    try:
        for p in procs.values():
            p.start()
        sessions = {n: p.create_session(upstream={"base_url": f"{sim_url}/v1"}) for n, p in procs.items()
                    if n != "bare"}
        secrets = {n: s["model_secret"] for n, s in sessions.items()} | {"bare": "sk-bench-client-key"}
        with ExitStack() as stack:
            clients = {n: stack.enter_context(httpx.Client(
                proxy=p.url, verify=str(p.ca_bundle if n != "bare" else p.confdir / "mitmproxy-ca-cert.pem"),
                timeout=120)) for n, p in procs.items()}

            def one(n: str, stream: bool) -> int:
                """One turn; the events received (SSE), 1 (JSON)."""
                headers = {"authorization": f"Bearer {secrets[n]}", "content-type": "application/json"}
                payload = body(20_000, stream)
                if not stream:
                    r = clients[n].post(URL, content=payload, headers=headers)
                    r.raise_for_status()
                    assert r.json()["choices"][0]["message"]["content"] == "".join(pieces), n
                    return 1
                events, text, _ = chat_stream(clients[n], payload, secrets[n])
                assert text == "".join(pieces), (n, text[:60])
                return events

            for n in names:
                one(n, False)  # connections, TLS, certificates
                one(n, True)
            for m in modes:
                for k in range(args.requests):
                    for n in names[k % len(names):] + names[:k % len(names)]:
                        pid = procs[n].proc.pid
                        t0, c0 = time.perf_counter(), cpu_ns(pid)
                        events = one(n, m == "SSE")
                        lat[m, n].append((time.perf_counter() - t0) * 1e3)
                        time.sleep(0.005)
                        used = cpu_between(c0, cpu_ns(pid)) / 1e3
                        cpu[m, n].append(used)
                        if m == "SSE":
                            per_event[n].append(used / events)
                    if k % 50 == 49:
                        loads.append(load())
        check_traces(procs, sessions, 2 * args.requests + 2, "".join(pieces))
    finally:
        for p in procs.values():
            p.cleanup()
        sim.terminate()
        sim.wait(10)
    print(f"machine: {machine()}; load average at the start and every 50 requests: {' | '.join(loads)}")
    print(f"{args.requests} sequential requests per path and mode (20 KB request bodies, SSE answers of "
          f"{args.tokens} token events), paths in rotating order" +
          (f"; relay at {args.before}: that revision's proxy" if args.before != "none" else ""))
    print()
    over_bare = " | CPU / bare's (medians)" if args.bare else ""
    print("| mode | path | latency, ms: median (p10-p90) | proxy CPU per request, µs: median (p10-p90) "
          f"| CPU over relay off, µs (medians) | CPU per event, µs | per event over relay off, µs{over_bare} |")
    print("|---|---|---|---|---|---|---|" + ("---|" if args.bare else ""))
    for m in modes:
        base = statistics.median(cpu[m, "relay off"])
        ebase = statistics.median(per_event["relay off"])
        for n in names:
            c = statistics.median(cpu[m, n])
            ev = (f"{spread(per_event[n], 2)} | {statistics.median(per_event[n]) - ebase:+.2f}" if m == "SSE"
                  else "- | -")
            ratio = f" {c / statistics.median(cpu[m, 'bare']):.2f}x |" if args.bare else ""
            print(f"| {m} | {n} | {spread(lat[m, n], 2)} | {spread(cpu[m, n], 0)} | {c - base:+.0f} | {ev} |{ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

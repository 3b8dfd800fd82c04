"""Proxy CPU per streamed event: bare streaming mitmdump against this proxy, side by side.

    .venv/bin/python bench/events.py [--streams 60] [--tokens 500] [--gap-ms 0] [--concurrent 1] [--before REV] [--relay-off]

Chat Completions streams of ``--tokens`` events each (one token per event, as providers
send them), one at a time or ``--concurrent`` at once (a round), through: bare mitmdump streaming SSE (``bench/stream_sse.py``, the
fair baseline: by default mitmproxy buffers whole bodies), this proxy at ``--before``
(omit with ``--before none``), and this checkout; with ``--relay-off`` each proxy also
with ``intercept_drain_timeout=0``, to tell the relay's cost per event from the pipeline's.
The paths alternate round by round (rotating order), so the machine's load hits them alike. Per round: the CPU time of all of
the mitmdump process's threads (``/proc/<pid>/task/*/schedstat``) from before the requests
to 5 ms after their end, divided by the events the clients received. Reported: µs per event,
median (p10-p90), each proxy's excess over bare (the medians' difference, and paired: each
round's figure minus bare's in the same round, whose quartiles are the figure to read on a
machine whose speed drifts), and how many times the process's threads were
put on a CPU per event (schedstat's run count: at a provider's pace a wake-up finds cold
caches, so one more per event would cost more than most code the event runs). Each proxy's trace is checked
afterwards: one turn per stream, every reply whole.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx2 as httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from failclosed import checkout_proxy  # noqa: E402
from mitm import MitmProcess  # noqa: E402
from overhead import KEY_ENV, start_simulator  # noqa: E402
from rollout import load, quantile  # noqa: E402
from trace_turns import cpu_between, cpu_ns, machine, runs  # noqa: E402

from interceptor.trace import read_trace  # noqa: E402

URL = "https://api.openai.com/v1/chat/completions"


def chat_stream(client: httpx.Client, payload: bytes, secret: str) -> tuple[int, str, int]:
    """One streamed Chat turn read to its end: the events received, the text they carry, and
    the HTTP chunks they came in (httpx hands over one per chunk)."""
    events, text, chunks, rest = 0, [], 0, b""
    with client.stream("POST", URL, content=payload, headers={
            "authorization": f"Bearer {secret}", "content-type": "application/json"}) as r:
        r.raise_for_status()
        for raw in r.iter_raw():
            chunks += 1
            *lines, rest = (rest + raw).split(b"\n")
            for line in lines:
                if line.startswith(b"data:"):
                    events += 1
                    if line.startswith(b"data: {"):
                        text += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
    return events, "".join(text), chunks


def check_traces(procs: dict[str, MitmProcess], sessions: dict[str, dict], turns: int, text: str) -> None:
    """Each path's session sealed and its trace checked: ``turns`` turns, every reply ``text``
    (a benchmark of a path that did not do the work is worthless)."""
    for n, s in sessions.items():
        procs[n].api("DELETE", f"sessions/{s['id']}")
    time.sleep(1)
    for n, s in sessions.items():
        trace = read_trace(s["trace_path"])
        assert trace.num_turns == turns, (n, trace.num_turns)
        assert all(node.message.content == text for node in trace.nodes if node.sampled), n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=60)
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--before", default="none", help="a git revision, or 'none'")
    ap.add_argument("--relay-off", action="store_true",
                    help="add this checkout (and --before) with intercept_drain_timeout=0 (no relay hop) as paths")
    ap.add_argument("--concurrent", type=int, default=1,
                    help="streams at once through a path in each round (each client its own connection); "
                         "the round's CPU is divided by all of their events")
    ap.add_argument("--gap-ms", type=float, default=0,
                    help="the simulator sleeps this long between events (a provider at token rate: each "
                         "event read alone); 0, the default: as fast as it can write them")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-events-"))
    pieces = [f"w{k} " for k in range(args.tokens)]
    script = work / "script.json"
    reply = {"text": pieces}
    if args.gap_ms:
        reply["delay"] = args.gap_ms / 1000
    script.write_text(json.dumps({"default": reply}))
    sim, sim_url = start_simulator(work, [sys.executable, "-m", "provider", "--port", "0", "--script", str(script)])
    opts = {"intercept_upstream": f"{sim_url}/v1", "intercept_api_key_env": KEY_ENV}
    env = {KEY_ENV: "sk-bench-real-key"}
    procs = {"bare + stream": MitmProcess(script=False, workdir=work / "bare", options={
        "connection_strategy": "lazy", "map_remote": f"|https://api\\.openai\\.com/v1|{sim_url}/v1",
        "scripts": str(ROOT / "bench" / "stream_sse.py")})}
    if args.before != "none":
        procs["before"] = checkout_proxy(args.before, work, opts, env)
        if args.relay_off:
            (work / "off").mkdir()
            procs["before, relay off"] = checkout_proxy(args.before, work / "off", {**opts, "intercept_drain_timeout": "0"}, env)
    if args.relay_off:
        procs["proxy, relay off"] = MitmProcess(workdir=work / "relay-off", env=env,
                                                options={**opts, "intercept_drain_timeout": "0"})
    procs["proxy"] = MitmProcess(workdir=work / "proxy", options=opts, env=env)
    per_event: dict[str, list[float]] = {n: [] for n in procs}
    chunks: dict[str, list[int]] = {n: [] for n in procs}
    woke: dict[str, list[float]] = {n: [] for n in procs}
    loads = [load()]
    try:
        for p in procs.values():
            p.start()
        sessions = {n: p.create_session(upstream={"base_url": f"{sim_url}/v1"}) for n, p in procs.items() if n != "bare + stream"}
        count = itertools.count()

        def payload() -> bytes:
            """A body of its own per request: the same body again right after a paced answer
            whose end the proxy has not seen yet is, by Retry's rules, the harness retrying an
            answer it cannot have read in full (``addons/gateway/retry.py``), answered from the record."""
            return json.dumps({"model": "gpt-4o", "stream": True, "stream_options": {"include_usage": True},
                               "messages": [{"role": "user", "content": f"count {next(count)}"}]}).encode()
        with ExitStack() as stack:
            clients: dict[str, list[httpx.Client]] = {}
            for n, p in procs.items():
                ca = p.ca_bundle if n in sessions else p.confdir / "mitmproxy-ca-cert.pem"
                clients[n] = [stack.enter_context(httpx.Client(proxy=p.url, verify=str(ca), timeout=120))
                              for _ in range(args.concurrent)]
            pool = stack.enter_context(ThreadPoolExecutor(args.concurrent))

            def stream(n: str) -> list[tuple[int, str, int]]:
                """``--concurrent`` streams through path ``n`` at once, one per client."""
                secret = sessions[n]["model_secret"] if n in sessions else "sk-unused"
                return list(pool.map(lambda c: chat_stream(c, payload(), secret), clients[n]))

            names = list(procs)
            for n in names:
                stream(n)  # connections, TLS, certificates
            for k in range(args.streams):
                for n in names[k % len(names):] + names[:k % len(names)]:
                    pid = procs[n].proc.pid
                    t0, r0 = cpu_ns(pid), runs(pid)
                    got = stream(n)
                    time.sleep(0.005)
                    events = sum(e for e, _, _ in got)
                    per_event[n].append(cpu_between(t0, cpu_ns(pid)) / events / 1e3)
                    woke[n].append(cpu_between(r0, runs(pid)) / events)
                    chunks[n] += [c for _, _, c in got]
                    assert all(text == "".join(pieces) for _, text, _ in got), (n, got[0][1][:60])
                if k % 20 == 19:
                    loads.append(load())
        check_traces(procs, sessions, (args.streams + 1) * args.concurrent, "".join(pieces))
    finally:
        for p in procs.values():
            p.cleanup()
        sim.terminate()
        sim.wait(10)
    shutil.rmtree(work, ignore_errors=True)  # kept when a check failed, to look at
    print(f"machine: {machine()}; load average at the start and every 20 rounds: {' | '.join(loads)}")
    print(f"{args.streams} rounds of {args.concurrent} stream(s) at once of {args.tokens} token events per path, paths in rotating order"
          + (f", {args.gap_ms:g} ms between events" if args.gap_ms else ", events as fast as the simulator writes them")
          + (f"; before = {args.before}" if args.before != "none" else ""))
    print()
    print("| path | CPU per event, µs: median (p10-p90) | over bare + stream, µs (medians) "
          "| over bare + stream, paired per round, µs: median (p25..p75) "
          "| HTTP chunks the client read per stream, median | times a thread was woken, per event, median |")
    print("|---|---|---|---|---|---|")
    base = per_event["bare + stream"]
    bare = statistics.median(base)
    for n, xs in per_event.items():
        m = statistics.median(xs)
        # The same round's streams ran within seconds of each other: the difference cancels
        # what the machine did meanwhile, which each path's own spread does not.
        d = [x - b for x, b in zip(xs, base)]
        print(f"| {n} | {m:.1f} ({quantile(xs, 0.1):.1f}-{quantile(xs, 0.9):.1f}) | {m - bare:+.1f} "
              f"| {statistics.median(d):+.1f} ({quantile(d, 0.25):+.1f}..{quantile(d, 0.75):+.1f}) "
              f"| {statistics.median(chunks[n]):.0f} | {statistics.median(woke[n]):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

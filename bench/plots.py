"""The plots of docs/benchmarks.md, where a table of numbers hides the shape.

    .venv/bin/pip install -e '.[bench]'          # matplotlib, for this script only
    .venv/bin/python bench/plots.py [--out docs/img] [--requests 60] [--turns 300]

Three figures, each measured side by side in one run with the other benches' own code:

- ``overhead-by-body-size.png``: request latency (median, p10-p90 band) by request body size,
  1 KB to 4 MB, JSON, one client: direct to the simulator, bare mitmdump (``map_remote``,
  same TLS and HTTP work), this proxy (bench/overhead.py's paths), one request to each path
  in turn so that the machine's load hits all three alike;
- ``per-turn-cost.png``: mitmdump's CPU per turn as a conversation grows to ``--turns``
  (bench/trace_turns.py's lockstep lanes: the proxy's JSON and SSE sessions and bare
  mitmdump for each), with ``Recorder.commit_turn`` in process and each turn's record size;
- ``events-per-second.png``: stream assembly throughput (events/s) by stream size, for each
  dialect's synthetic stream (bench/dialects.py's streams and assembler loop).

Prints the machine and where the files went.
"""

from __future__ import annotations

import argparse
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

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import dialects as dialect_bench  # noqa: E402  (bench/dialects.py)
import failclosed  # noqa: E402
import overhead  # noqa: E402
import trace_turns  # noqa: E402
from mitm import MitmProcess  # noqa: E402

KEY_ENV = overhead.KEY_ENV
SIZES = [1_000, 10_000, 50_000, 200_000, 1_000_000, 2_000_000, 4_000_000]


def quantiles(xs: list[float]) -> tuple[float, float, float]:
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=10) if len(xs) > 1 else [xs[0]] * 9
    return statistics.median(xs), q[0], q[-1]


def overhead_by_size(out: Path, requests: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-plots-"))
    sim, sim_url = overhead.start_simulator(work)
    remap = f"|https://api\\.openai\\.com/v1|{sim_url}/v1"
    bare = MitmProcess(script=False, workdir=work / "bare", options={"connection_strategy": "lazy", "map_remote": remap})
    addon = MitmProcess(workdir=work / "addon", options={"intercept_upstream": f"{sim_url}/v1", "intercept_api_key_env": KEY_ENV},
                        env={KEY_ENV: "sk-bench-real-key"})
    results: dict[str, list[tuple[float, float, float]]] = {}
    try:
        bare.start()
        addon.start()
        session = addon.create_session(upstream={"base_url": f"{sim_url}/v1"})
        paths = {
            "direct": (lambda: httpx.Client(timeout=120), f"{sim_url}/v1/chat/completions"),
            "bare mitmdump": (lambda: httpx.Client(proxy=bare.url, verify=str(bare.confdir / "mitmproxy-ca-cert.pem"), timeout=120),
                              "https://api.openai.com/v1/chat/completions"),
            "interceptor": (lambda: httpx.Client(proxy=addon.url, verify=str(addon.ca_bundle), timeout=120),
                            "https://api.openai.com/v1/chat/completions"),
        }
        with ExitStack() as stack:
            clients = {name: (stack.enter_context(make()), url) for name, (make, url) in paths.items()}
            secret = session["model_secret"]
            for size in SIZES:
                payload = overhead.body(size, False)
                n = requests if size < 500_000 else max(10, requests // 3)
                lat: dict[str, list[float]] = {name: [] for name in clients}
                for client, url in clients.values():  # warm each connection
                    overhead.one(client, url, payload, False, secret)
                # Interleaved, one request per path in turn: the machine's load hits all alike.
                for _ in range(n):
                    for name, (client, url) in clients.items():
                        lat[name].append(overhead.one(client, url, payload, False, secret)[0] * 1e3)
                for name, xs in lat.items():
                    results.setdefault(name, []).append(quantiles(xs))
    finally:
        addon.cleanup()
        bare.cleanup()
        sim.terminate()
        sim.wait(10)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    kb = [s / 1e3 for s in SIZES]
    for name, rows in results.items():
        med = [r[0] for r in rows]
        ax.plot(kb, med, marker="o", label=name)
        ax.fill_between(kb, [r[1] for r in rows], [r[2] for r in rows], alpha=0.18)
    ax.set(xscale="log", yscale="log", xlabel="request body, KB", ylabel="latency, ms (median; band p10-p90)",
           title="JSON chat completion, one client")
    ax.legend()
    for name in ("interceptor",):
        over = [a[0] - b[0] for a, b in zip(results[name], results["bare mitmdump"])]
        ax2.plot(kb, over, marker="o", color="C2", label="interceptor - bare mitmdump")
    ax2.axhline(0, color="grey", lw=0.8)
    ax2.set(xscale="log", xlabel="request body, KB", ylabel="added latency, ms (medians)",
            title="what the addons add over bare mitmdump")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def per_turn_cost(out: Path, turns: int, before: str | None = None) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-plots-turns-"))
    sim, sim_url = overhead.start_simulator(work, [sys.executable, trace_turns.__file__, "--serve"])
    bare = MitmProcess(script=False, workdir=work / "bare", options={
        "connection_strategy": "lazy", "map_remote": f"|https://api\\.openai\\.com/v1|{sim_url}/v1",
        "scripts": str(trace_turns.stream_sse_script(work))})
    options = {"intercept_upstream": f"{sim_url}/v1", "intercept_api_key_env": KEY_ENV}
    env = {KEY_ENV: "sk-bench-real-key"}
    addon = MitmProcess(workdir=work / "addon", options=options, env=env)
    old = failclosed.checkout_proxy(before, work, options, env) if before else None
    try:
        bare.start()
        addon.start()
        upstream = {"base_url": f"{sim_url}/v1"}
        sessions = {name: addon.create_session(upstream=upstream) for name in ("json", "sse")}
        if old is not None:
            old.start()
            old_session = old.create_session(upstream=upstream)
        with ExitStack() as stack:
            def client(proxy: MitmProcess, ca: Path) -> httpx.Client:
                return stack.enter_context(httpx.Client(proxy=proxy.url, verify=str(ca), timeout=120))

            lanes = {name: trace_turns.Lane(client(addon, addon.ca_bundle), addon.proc.pid, s["model_secret"],
                                            stream=name == "sse") for name, s in sessions.items()}
            bare_ca = bare.confdir / "mitmproxy-ca-cert.pem"
            lanes["bare json"] = trace_turns.Lane(client(bare, bare_ca), bare.proc.pid, "sk-unused")
            lanes["bare sse"] = trace_turns.Lane(client(bare, bare_ca), bare.proc.pid, "sk-unused", stream=True)
            if old is not None:
                lanes["before json"] = trace_turns.Lane(client(old, old.ca_bundle), old.proc.pid, old_session["model_secret"])
            trace_turns.lockstep(lanes, turns)
        for s in sessions.values():
            addon.api("DELETE", f"sessions/{s['id']}")
        time.sleep(1)
        sizes = trace_turns.turn_record_sizes(Path(sessions["json"]["trace_path"]))
        commits, _ = trace_turns.in_process_commits(work, turns)
    finally:
        addon.cleanup()
        if old is not None:
            old.cleanup()
        bare.cleanup()
        sim.terminate()
        sim.wait(10)
    x = list(range(1, turns + 1))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = {"json": "interceptor, JSON", "bare json": "bare mitmdump, JSON", "sse": "interceptor, SSE",
              "bare sse": "bare mitmdump, SSE", "before json": f"interceptor at {before}, JSON"}
    for name, style in (("json", "C0"), ("bare json", "C0--"), ("sse", "C1"), ("bare sse", "C1--"), ("before json", "C7")):
        if name in lanes:
            ax.plot(x, [ns / 1e6 for ns in lanes[name].cpu], style, lw=0.9, label=labels[name])
    ax.set(xlabel="turn (the request restates every earlier turn: ~7 KB more each)", ylabel="mitmdump CPU per turn, ms",
           title=f"proxy CPU per turn over {turns} turns")
    ax.legend()
    ax2.plot(x, [t * 1e3 for t in commits], "C2", lw=0.9, label="Recorder.commit_turn, ms")
    ax2.set(xlabel="turn", ylabel="commit_turn in process, ms", title="recording cost and record size per turn")
    ax3 = ax2.twinx()
    ax3.plot(x[:len(sizes)], [s / 1e3 for s in sizes], "C3", lw=0.9, label="record size, KB")
    ax3.set_ylabel("turn record on disk, KB")
    ax3.set_ylim(0, max(s / 1e3 for s in sizes) * 1.3)
    ax2.legend(loc="upper left")
    ax3.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def events_per_second(out: Path, repeats: int) -> None:
    sizes_mb = [0.1, 0.5, 1, 2, 5, 10]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in dialect_bench.WRITERS:
        dialect = dialect_bench.DIALECTS[name]
        rates = []
        for mb in sizes_mb:
            chunks = dialect_bench.events_of(dialect_bench.synthetic_of_size(name, int(mb * 1e6)))
            _, events = dialect_bench.assemble(dialect, chunks)
            times = dialect_bench.timed(lambda: dialect_bench.assemble(dialect, chunks), repeats)
            rates.append(events / statistics.median(times))
        ax.plot(sizes_mb, rates, marker="o", label=name)
    ax.set(xscale="log", xlabel="stream size, MB", ylabel="events assembled per second (median)",
           title="stream assembly throughput by dialect")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "img"))
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--turns", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", choices=["overhead", "turns", "events"])
    ap.add_argument("--before", default=None, help="per-turn figure: also this proxy at a git revision (JSON)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {trace_turns.machine()}")
    if args.only in (None, "events"):
        events_per_second(out / "events-per-second.png", args.repeats)
    if args.only in (None, "overhead"):
        overhead_by_size(out / "overhead-by-body-size.png", args.requests)
    if args.only in (None, "turns"):
        per_turn_cost(out / "per-turn-cost.png", args.turns, args.before)
    print(f"plots in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

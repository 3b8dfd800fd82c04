"""What failing closed costs, before and after, side by side in one run.

    .venv/bin/python bench/failclosed.py [--before REV] [--requests 300] [--rounds 5]

"before" is the proxy at ``REV`` (default: the last commit before the Gate, found by
message), exported with ``git archive`` into a temporary directory and imported from there; "after" is this
checkout. Both run as real mitmdump processes against one simulator, so the difference is
the guarded addons + Gate and the atomic commit (records packed on the event loop), nothing
else. Per-request latency of sequential JSON and SSE chat turns (20 KB bodies, each turn a
commit), rounds interleaved (before, after, before, ...) so drift hits both alike; reported
as median and p10-p90 per side and the ratio of the medians with its spread over rounds.

Then memory around one 200 MB request body: VmRSS before and after it and VmHWM (the
peak) of each mitmdump, read from /proc. "before" buffers, forwards and records it; "after"
answers 413 (intercept_max_body) without reading it whole.
"""

from __future__ import annotations

import argparse
import os
import platform
import ssl
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx2 as httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from mitm import MitmProcess  # noqa: E402
from overhead import KEY_ENV, body, one, start_simulator  # noqa: E402

MB = 1 << 20


def before_rev() -> str:
    out = subprocess.run(["git", "log", "--format=%H", "--grep=^Store never leaves a hole", "-n1"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    if not out:
        raise SystemExit("cannot find the commit before the Gate; pass --before REV")
    return out + "^"


def package_dir(tree: Path, into: Path) -> Path:
    """A directory that, on PYTHONPATH, makes ``interceptor`` the package in ``tree``: every
    subpackage of it (one left out is found in this checkout by the editable install, and
    an old tree would run with this checkout's ``interceptor.hooks``)."""
    pkg = into / "interceptor"
    pkg.mkdir(parents=True)
    for name in ("addons", "client", "dialects", "hooks", "scripts", "trace"):
        if (tree / name / "__init__.py").exists():
            (pkg / name).symlink_to(tree / name)
    return into


def checkout_proxy(rev: str, work: Path, options: dict, env: dict, **kwargs) -> MitmProcess:
    """This proxy as it was at ``rev`` (``git archive`` into ``work``), ready to start;
    ``kwargs`` go to ``MitmProcess``."""
    tree = work / "before-tree"
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    proc = MitmProcess(workdir=work / "before", options=options,
                       env={**env, "PYTHONPATH": str(package_dir(tree, work / "before-pkg"))}, **kwargs)
    proc.script_path = tree / "addons" / "interception.py"  # (and its own package, above)
    return proc


def fmt(xs: list[float]) -> str:
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=10)
    return f"{statistics.median(xs) * 1000:.2f} ({q[0] * 1000:.2f}-{q[-1] * 1000:.2f})"


def compare(procs: dict[str, MitmProcess], sessions: dict[str, dict], requests: int, rounds: int) -> None:
    """Sequential JSON and SSE chat turns (20 KB bodies) through two proxies, ``before`` and
    ``after``, in interleaved rounds so drift hits both alike; a markdown table of the
    latencies (ms) and the ratio of the medians with its spread over rounds."""
    print("| mode | before: median (p10-p90) | after: median (p10-p90) | after/before: median | p10 | per-round median ratios: median (min-max) |")
    print("|---|---|---|---|---|---|")
    for stream in (False, True):
        payload = body(20_000, stream)
        lat: dict[str, list[float]] = {k: [] for k in procs}
        ratios = []
        for _ in range(rounds):
            medians = {}
            for name, p in procs.items():
                ctx = ssl.create_default_context(cafile=str(p.ca_bundle))
                with httpx.Client(proxy=p.url, verify=ctx, timeout=60) as client:
                    url = "https://api.openai.com/v1/chat/completions"
                    one(client, url, payload, stream, sessions[name]["model_secret"])
                    xs = [one(client, url, payload, stream, sessions[name]["model_secret"])[0]
                          for _ in range(requests // rounds)]
                lat[name] += xs
                medians[name] = statistics.median(xs)
            ratios.append(medians["after"] / medians["before"])
        ratio = statistics.median(lat["after"]) / statistics.median(lat["before"])
        p10 = statistics.quantiles(lat["after"], n=10)[0] / statistics.quantiles(lat["before"], n=10)[0]
        print(f"| {'SSE' if stream else 'JSON'} | {fmt(lat['before'])} | {fmt(lat['after'])} | "
              f"{ratio:.3f} | {p10:.3f} | {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |",
              flush=True)


def intrinsic() -> None:
    """The two costs in isolation, in process (no network noise): one guarded hook call
    against the bare call, and packing a typical turn record, which the atomic commit moved
    from the writer thread onto the event loop."""
    import timeit

    from mitmproxy.test import tflow

    from interceptor.addons.mitm.gate import guard
    from interceptor.trace import store
    from test_trace import Rollout, tool_turns

    class Step:
        def request(self, flow):
            return None

    flow, bare = tflow.tflow(), Step()
    guarded = guard(Step())
    n = 200_000
    t_bare = min(timeit.repeat(lambda: bare.request(flow), number=n, repeat=5)) / n
    t_guard = min(timeit.repeat(lambda: guarded.request(flow), number=n, repeat=5)) / n
    work = Path(tempfile.mkdtemp(prefix="bench-pack-"))
    r = Rollout(work / "p.msgpack")
    for prompt, reply in tool_turns(10):
        r.send(prompt, reply)
    r.store.flush(timeout=10)
    from interceptor.trace import iter_records

    turn = [rec for _, rec in iter_records(r.path) if rec["kind"] == "turn"][-1]
    t_pack = min(timeit.repeat(lambda: store.pack(turn), number=20_000, repeat=5)) / 20_000
    print(f"\nin process: a hook call {t_bare * 1e6:.2f} us bare, {t_guard * 1e6:.2f} us guarded "
          f"(+{(t_guard - t_bare) * 1e6:.2f} us; {len(REQUEST_HOOK_CALLS)} guarded calls per exchange: "
          f"+{(t_guard - t_bare) * len(REQUEST_HOOK_CALLS) * 1e6:.1f} us); packing a {len(store.pack(turn))}-byte "
          f"turn record on the event loop: {t_pack * 1e6:.1f} us per turn")


# The guarded hook calls one plain JSON exchange makes (addons/interception.py's list).
REQUEST_HOOK_CALLS = ["Control.requestheaders", "Claim.requestheaders", "BodyCap.requestheaders",
                      "Control.request", "BodyCap.request", "Rewrite.request",
                      "Reach.request", "Collect.request", "Retry.request", "Relay.request", "Collect.responseheaders",
                      "Tee.responseheaders", "Retry.responseheaders", "WsRelay.response", "Tee.response",
                      "Collect.response", "Retry.response"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default=None)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    rev = args.before or before_rev()
    work = Path(tempfile.mkdtemp(prefix="bench-failclosed-"))
    sim, sim_url = start_simulator(work)
    opts = {"intercept_upstream": f"{sim_url}/v1", "intercept_api_key_env": KEY_ENV}
    env = {KEY_ENV: "sk-bench-real-key"}
    before = checkout_proxy(rev, work, opts, env)
    after = MitmProcess(workdir=work / "after", options=opts, env=env)
    procs = {"before": before, "after": after}
    try:
        for p in procs.values():
            p.start()
        sessions = {k: p.create_session(upstream={"base_url": f"{sim_url}/v1"}) for k, p in procs.items()}
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
              f"{platform.platform()}; before = {subprocess.run(['git', 'rev-parse', '--short', rev], cwd=ROOT, capture_output=True, text=True).stdout.strip()}")
        print(f"{args.requests} sequential requests per side and mode, {args.rounds} interleaved rounds; ms\n")
        compare(procs, sessions, args.requests, args.rounds)
        intrinsic()

        print("\n| 200 MB request | answer | VmRSS before | VmRSS after | VmHWM (peak) after |")
        print("|---|---|---|---|---|")
        big = b'{"model":"gpt-4o","max_tokens":8,"messages":[{"role":"user","content":"' + b"a" * (200 * MB) + b'"}]}'
        for name, p in procs.items():
            mem0 = p.memory()
            ctx = ssl.create_default_context(cafile=str(p.ca_bundle))
            with httpx.Client(proxy=p.url, verify=ctx, timeout=300) as client:
                r = client.post("https://api.openai.com/v1/chat/completions", content=big,
                                headers={"authorization": f"Bearer {sessions[name]['model_secret']}",
                                         "content-type": "application/json"})
            mem1 = p.memory()
            print(f"| {name} | {r.status_code} | {mem0['VmRSS'] / MB:.0f} MB | {mem1['VmRSS'] / MB:.0f} MB | "
                  f"{mem1['VmHWM'] / MB:.0f} MB |", flush=True)
    finally:
        for p in procs.values():
            p.cleanup()
        sim.terminate()
        sim.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

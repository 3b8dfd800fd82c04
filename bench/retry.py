"""Retry replay costs, measured through a real mitmdump with the addons.

    .venv/bin/python bench/retry.py [--requests 100]

1. Replay latency vs a sampled turn of the same size, JSON and SSE: the same body sent
   unflagged (a fresh turn, upstream sampled) and then flagged (``x-stainless-retry-count:
   1``, answered from the record).
2. Digest cost for 1 KB to 100 MB bodies (sha256, in-process).
3. Other sessions' latency while a 100 MB body goes through the proxy (read, hashed and
   parsed off the event loop): small requests of a second session, before and during.

Prints markdown tables for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai and anthropic SDKs use

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mitm import MitmProcess  # noqa: E402
from provider import ProviderSimulator, Reply  # noqa: E402

URL = "https://api.openai.com/v1/chat/completions"


def fmt(xs: list[float]) -> str:
    xs = sorted(xs)
    if len(xs) < 2:
        return f"{xs[0] * 1000:.2f}" if xs else "-"
    q = statistics.quantiles(xs, n=10)
    return f"{statistics.median(xs) * 1000:.2f} ({q[0] * 1000:.2f}-{q[-1] * 1000:.2f})"


def post(client: httpx.Client, secret: str, body: bytes, retry: int) -> float:
    t0 = time.perf_counter()
    headers = {"authorization": f"Bearer {secret}", "content-type": "application/json", "x-stainless-retry-count": str(retry)}
    with client.stream("POST", URL, content=body, headers=headers) as r:
        r.read()
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=100)
    args = ap.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.platform()}\n")

    print("| body size | digest ms: median (p10-p90) |")
    print("|---|---|")
    for size, name in ((1 << 10, "1 KB"), (1 << 20, "1 MB"), (10 << 20, "10 MB"), (100 << 20, "100 MB")):
        data = os.urandom(size)
        times = []
        for _ in range(max(3, min(50, (200 << 20) // size))):
            t0 = time.perf_counter()
            hashlib.sha256(data).hexdigest()
            times.append(time.perf_counter() - t0)
        print(f"| {name} | {fmt(times)} |")
    print()

    with ProviderSimulator() as sim, MitmProcess(options={"intercept_upstream": sim.url("/v1")}, workdir=Path(tempfile.mkdtemp(prefix="bench-retry-"))) as proxy:
        sim.default = Reply(text=[f"token{i} " for i in range(40)])
        session = proxy.create_session(upstream={"base_url": sim.url("/v1")})
        secret = session["model_secret"]
        client = httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=120)
        print("| answer | sampled turn ms | replayed retry ms |")
        print("|---|---|---|")
        for stream in (False, True):
            sampled, replayed = [], []
            for i in range(args.requests):
                body = json.dumps({"model": "m", "stream": stream, "messages": [{"role": "user", "content": f"q{i} " + "x" * 2000}]}).encode()
                sampled.append(post(client, secret, body, 0))
                replayed.append(post(client, secret, body, 1))
            print(f"| {'SSE' if stream else 'JSON'}, 40 deltas | {fmt(sampled)} | {fmt(replayed)} |")
        print()

        other = proxy.create_session(upstream={"base_url": sim.url("/v1")})
        small = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()

        def probe(n: int) -> list[float]:
            with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=120) as c:
                return [post(c, other["model_secret"], small, 0) for _ in range(n)]

        baseline = probe(args.requests)
        big = json.dumps({"model": "m", "messages": [{"role": "user", "content": "y" * (100 << 20)}]}).encode()
        done = threading.Event()
        big_time: list[float] = []

        def send_big():
            with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=300) as c:
                big_time.append(post(c, secret, big, 0))
            done.set()

        threading.Thread(target=send_big).start()
        during = []
        with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=120) as c:
            while not done.is_set():
                during.append(post(c, other["model_secret"], small, 0))
        print("| other session's small request | ms: median (p10-p90) | max ms | n |")
        print("|---|---|---|---|")
        print(f"| alone | {fmt(baseline)} | {max(baseline) * 1000:.1f} | {len(baseline)} |")
        print(f"| while a 100 MB request goes through ({big_time[0]:.2f} s) | {fmt(during)} | {max(during) * 1000:.1f} | {len(during)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

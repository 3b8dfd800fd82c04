"""Proxy overhead, side by side in one run: direct to the simulator, through bare mitmdump,
through mitmdump with this project's addons.

    .venv/bin/python bench/overhead.py [--requests 200] [--concurrency 16]

For each path, JSON and SSE chat completions with a 20 KB and a 1 MB request body, sent
sequentially and from 16 concurrent clients. Bare mitmdump intercepts TLS for
api.openai.com and maps it to the simulator (``map_remote``), so it does the same TLS and
HTTP work as the addon path minus the addons; "bare + stream" adds bench/stream_sse.py, the
one line that makes mitmproxy stream SSE at all (by default it buffers whole bodies). Prints a markdown table of per-request
latency (median, p10-p90) and, for SSE, time to the first event; paste it into
docs/benchmarks.md with the machine noted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai and anthropic SDKs use

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mitm import MitmProcess  # noqa: E402

KEY_ENV = "BENCH_PROVIDER_KEY"


def start_simulator(workdir: Path, command: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """The simulator in its own process; ``command`` runs another one that prints the same
    ``listening on URL`` banner (bench/trace_turns.py's)."""
    if command is None:
        script = workdir / "script.json"
        # A short fixed answer: the request size is what varies, not the reply.
        script.write_text(json.dumps({"default": {"text": ["The ", "answer ", "is ", "forty-two", "."]}}))
        command = [sys.executable, "-m", "provider", "--port", "0", "--script", str(script)]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
    )
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"simulator did not start: {line!r}")
    return proc, line.strip().split()[-1]


def body(size: int, stream: bool) -> bytes:
    filler = "x" * max(0, size - 200)
    data = {"model": "gpt-4o", "messages": [{"role": "user", "content": filler}], "stream": stream}
    if stream:
        data["stream_options"] = {"include_usage": True}
    return json.dumps(data).encode()


def one(client: httpx.Client, url: str, payload: bytes, stream: bool, secret: str) -> tuple[float, float | None]:
    headers = {"authorization": f"Bearer {secret}", "content-type": "application/json"}
    t0 = time.perf_counter()
    ttfe = None
    if stream:
        with client.stream("POST", url, content=payload, headers=headers) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
            for line in r.iter_lines():
                if ttfe is None and line.startswith("data:"):
                    ttfe = time.perf_counter() - t0
    else:
        r = client.post(url, content=payload, headers=headers)
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
    return time.perf_counter() - t0, ttfe


def run(make_client, url: str, payload: bytes, stream: bool, secret: str, n: int, concurrency: int):
    lat: list[float] = []
    ttfe: list[float] = []
    lock = threading.Lock()
    per_worker = max(1, n // concurrency)

    def worker():
        with make_client() as client:
            one(client, url, payload, stream, secret)  # warm the connection
            for _ in range(per_worker):
                total, first = one(client, url, payload, stream, secret)
                with lock:
                    lat.append(total)
                    if first is not None:
                        ttfe.append(first)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return lat, ttfe


def fmt(xs: list[float]) -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=10)
    return f"{statistics.median(xs) * 1000:.2f} ({q[0] * 1000:.2f}-{q[-1] * 1000:.2f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    sim, sim_url = start_simulator(work)
    remap = f"|https://api\\.openai\\.com/v1|{sim_url}/v1"
    bare = MitmProcess(script=False, workdir=work / "bare", options={"connection_strategy": "lazy", "map_remote": remap})
    # mitmproxy buffers whole bodies by default; streaming SSE is the fair baseline for it.
    streaming = MitmProcess(script=False, workdir=work / "stream", options={
        "connection_strategy": "lazy", "map_remote": remap, "scripts": str(ROOT / "bench" / "stream_sse.py")})
    addon = MitmProcess(workdir=work / "addon", options={"intercept_upstream": f"{sim_url}/v1", "intercept_api_key_env": KEY_ENV},
                        env={KEY_ENV: "sk-bench-real-key"})
    try:
        bare.start()
        streaming.start()
        addon.start()
        session = addon.create_session(upstream={"base_url": f"{sim_url}/v1"})
        paths = {
            "direct": (lambda: httpx.Client(timeout=60), f"{sim_url}/v1/chat/completions"),
            "bare mitmdump": (lambda: httpx.Client(proxy=bare.url, verify=str(bare.confdir / "mitmproxy-ca-cert.pem"), timeout=60),
                              "https://api.openai.com/v1/chat/completions"),
            "bare + stream": (lambda: httpx.Client(proxy=streaming.url, verify=str(streaming.confdir / "mitmproxy-ca-cert.pem"), timeout=60),
                              "https://api.openai.com/v1/chat/completions"),
            "interceptor": (lambda: httpx.Client(proxy=addon.url, verify=str(addon.ca_bundle), timeout=60),
                            "https://api.openai.com/v1/chat/completions"),
        }
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.platform()}")
        print(f"{args.requests} requests per cell; latency ms: median (p10-p90)\n")
        print("| body | mode | clients | direct | bare mitmdump | bare + stream | interceptor | SSE first event: direct | bare | bare + stream | interceptor |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for size, size_name in ((20_000, "20 KB"), (1_000_000, "1 MB")):
            for stream in (False, True):
                payload = body(size, stream)
                for conc in (1, args.concurrency):
                    n = args.requests if size < 100_000 else max(conc, args.requests // 4)
                    cells, firsts = [], []
                    for name, (make_client, url) in paths.items():
                        lat, ttfe = run(make_client, url, payload, stream, session["model_secret"], n, conc)
                        cells.append(fmt(lat))
                        firsts.append(fmt(ttfe) if stream else "-")
                    mode = "SSE" if stream else "JSON"
                    print(f"| {size_name} | {mode} | {conc} | " + " | ".join(cells) + " | " + " | ".join(firsts) + " |", flush=True)
    finally:
        addon.cleanup()
        streaming.cleanup()
        bare.cleanup()
        sim.terminate()
        sim.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

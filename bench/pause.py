"""Resume to first token: how long the held requests of a paused upstream take to get their
first token once it is resumed, with many sessions held at once (a weight swap in an
asynchronous RL loop), beside the same requests sent at once to an upstream never paused.

    .venv/bin/python bench/pause.py [--sessions 256] [--rounds 3]

The upstream is the simulator in its own process (a short streamed answer), declared as the
proxy's upstream ``vllm``. Each session is one client connection of its own (HTTPS through
the proxy, as a harness's SDK), all in one asyncio loop. Per round, in alternating order:

- ``resumed``: the upstream is paused, every session sends one streamed chat request, the run
  waits until the proxy says all are held (``GET /_interceptor/upstreams/vllm``), then resumes
  it; each request's time from the resume call to its first token;
- ``at once``: the same requests with no pause, from their sending to their first token (the
  floor: what N requests arriving together cost anyway).

Prints, per path, the median, p90 and max over every request of every round in milliseconds,
the resume call's own duration, and the machine; paste it into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai and anthropic SDKs use

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from interceptor.client.proxy import call as control_api  # noqa: E402
from mitm import MitmProcess  # noqa: E402
from overhead import KEY_ENV, body, start_simulator  # noqa: E402

URL = "https://api.openai.com/v1/chat/completions"


async def first_token(client: httpx.AsyncClient, secret: str, payload: bytes) -> float:
    """Send one streamed request; the monotonic time its first event arrived."""
    headers = {"authorization": f"Bearer {secret}", "content-type": "application/json"}
    async with client.stream("POST", URL, content=payload, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
        at = None
        async for line in r.aiter_lines():
            if at is None and line.startswith("data:"):
                at = time.monotonic()
        if at is None:
            raise RuntimeError("a stream without events")
        return at


def upstream(proxy: MitmProcess) -> dict:
    status, answer = control_api(proxy.url, proxy.admin_token, "GET", "upstreams/vllm")
    if status != 200:
        raise RuntimeError(f"GET upstreams/vllm: {status} {answer}")
    return answer


async def one_round(proxy: MitmProcess, secrets: list[str], paused: bool) -> tuple[list[float], float | None]:
    """Every session's request once; per request the milliseconds from the resume (or from
    the sending, with no pause) to its first token, and the resume call's milliseconds."""
    verify = ssl.create_default_context(cafile=str(proxy.ca_bundle))
    payload = body(400, True)
    clients = [httpx.AsyncClient(proxy=proxy.url, verify=verify, timeout=600) for _ in secrets]
    try:
        if paused:
            status, answer = await asyncio.to_thread(control_api, proxy.url, proxy.admin_token, "POST",
                                                     "upstreams/vllm/pause", {"timeout": 60})
            if status != 200 or not answer["drained"]:
                raise RuntimeError(f"pause: {status} {answer}")
        sent = time.monotonic()
        tasks = [asyncio.create_task(first_token(c, s, payload)) for c, s in zip(clients, secrets)]
        resume_ms = None
        if paused:
            while (await asyncio.to_thread(upstream, proxy))["held"] < len(secrets):
                if any(t.done() for t in tasks):
                    raise RuntimeError("a request was answered while its upstream was paused")
                await asyncio.sleep(0.05)
            sent = time.monotonic()
            status, answer = await asyncio.to_thread(control_api, proxy.url, proxy.admin_token, "POST",
                                                     "upstreams/vllm/resume")
            resume_ms = (time.monotonic() - sent) * 1000
            if status != 200 or answer["released"] != len(secrets):
                raise RuntimeError(f"resume: {status} {answer}")
        firsts = await asyncio.gather(*tasks)
        return [(t - sent) * 1000 for t in firsts], resume_ms
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))


def summary(ms: list[float]) -> dict:
    ordered = sorted(ms)
    return {"median": round(statistics.median(ordered), 1),
            "p90": round(ordered[int(0.9 * (len(ordered) - 1))], 1), "max": round(ordered[-1], 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-pause-"))
    sim, sim_url = start_simulator(workdir)
    upstreams = json.dumps({"vllm": {"base_url": f"{sim_url}/v1", "api_key_env": KEY_ENV}})
    proxy = MitmProcess(options={"intercept_upstreams": upstreams, "intercept_default_session": "false",
                                 "intercept_status": "0"}, env={KEY_ENV: "bench-key"})
    try:
        proxy.start()
        secrets = [proxy.create_session(upstream="vllm")["model_secret"] for _ in range(args.sessions)]
        results: dict[str, list[float]] = {"resumed": [], "at once": []}
        resumes: list[float] = []
        for k in range(args.rounds):
            for paused in ((True, False) if k % 2 == 0 else (False, True)):
                ms, resume_ms = asyncio.run(one_round(proxy, secrets, paused))
                results["resumed" if paused else "at once"] += ms
                if resume_ms is not None:
                    resumes.append(resume_ms)
        print(json.dumps({
            "sessions": args.sessions, "rounds": args.rounds,
            "first_token_ms": {name: summary(ms) for name, ms in results.items()},
            "resume_call_ms": summary(resumes),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load": os.getloadavg()},
        }, indent=1))
    finally:
        proxy.cleanup()
        sim.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

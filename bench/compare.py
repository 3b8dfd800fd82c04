"""The one-command benchmark: every path side by side in one run, with the two peers.

    .venv/bin/python bench/compare.py [--quick] [--reps 2] [--turns 300] [--paths a,b] [--no-peers]
    make bench                 # the full comparison (ARGS=--quick for a smoke run)

Paths, all live at once against one simulator process (``tests/provider``, run by this script
with ``--serve``), every one a real process in its own session (so each gets its own
autogroup share of a shared machine's CPU, as separate services would):

- ``direct``: the simulator itself, no proxy (the floor every other path is compared with);
- ``bare``: bare mitmdump, TLS intercepted for api.openai.com and mapped to the simulator
  (``map_remote``): mitmproxy's own cost for the same bytes; ``bare+stream`` adds
  bench/stream_sse.py (mitmproxy buffers whole bodies unless told to stream);
- ``proxy``: this proxy as ``make run`` starts it, one mitmdump with the script and no front
  (the figure to read against bare mitmdump's: the same one process);
- ``proxy 1w`` and ``proxy 2w``: this proxy behind scripts/serve.py's front (HAProxy) with
  1 and 2 workers, each client a session made through the front's control API that imposes
  a model; the harness is pointed at it with ``HTTPS_PROXY`` alone;
- ``litellm``: LiteLLM's proxy (``litellm --config``), a reverse proxy: clients use its base
  URL and its master key and ask for a model alias that its config maps to the simulator;
- ``verifiers``: the reference interception server, PrimeIntellect's verifiers from PyPI
  (``verifiers.v1.interception.server.InterceptionServer``, run by bench/verifiers_serve.py),
  also a base-URL server: each client a registered rollout session imposing a model.

The peers are installed by this script into their own virtual environments under
``.venv-bench/`` (once; a stamp file names what was installed). A peer that cannot be
installed or started is reported as skipped, with the reason, and the run goes on.

Workloads (each path in turn, the order rotating and reversing with every repetition):
sequential 20 KB JSON requests; sequential streams from a sync and from an async client (20 KB
request, 50-token answer); 16 and 64 concurrent JSON clients; 500-token streams at 16 and 64
concurrent streams, as fast as the simulator writes them; 200-token streams at 50 tokens/s (20 ms
apart, a provider's pace: each event read alone), 16 concurrent; then a growing rollout (``--turns``, each request restating the history and
adding 570 characters a side, every path in the same turn, rotating order).

Measured per path: latency p50/p99 and the latency added over direct (the difference of the
quantiles, per repetition), throughput as a share of direct's, proxy CPU (every thread of every
process of the path: front and workers, LiteLLM's process tree) per request and per event,
read from ``/proc/<pid>/task/*/schedstat``, and RSS. Each path is checked to have done what it
claims: the simulator tallies every model request by the model it names and whether it carried
the operator's key (the proxies must send the imposed or configured model and their own key,
never the client's), each cell's count must equal the requests its clients completed, every
answer's text must be whole, and each session's trace (read_trace for this proxy, verifiers' own
trace over its control API) must hold one call per request, no error, and for the rollout one
branch of ``--turns`` turns. A path that fails a check is marked in the tables and the run
exits non-zero.

Writes the markdown report (``--report``) and the plots (``--plots``, PNG, bench/plots.py's
conventions; matplotlib from ``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import secrets
import signal
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from interceptor.client.proxy import stop_process  # noqa: E402

REAL_KEY = "sk-bench-real-key"  # the operator's key, which only the proxies hold
KEY_ENV = "BENCH_PROVIDER_KEY"
TALLY = "__bench_tally__"  # a request naming this model gets the simulator's tally back
URL = "https://api.openai.com/v1/chat/completions"
SHORT = ["The ", "answer ", "is ", "forty-", "two."]
BENCH_VENVS = ROOT / ".venv-bench"

# LiteLLM: the release the test suite pins (tests/constraints.txt). Its `proxy` extra names a
# `litellm-proxy` distribution PyPI does not serve here, so the proxy server's own imports are
# installed by name instead (the 1.108 line's `proxy` extra, what `litellm --config` imports).
LITELLM = ["litellm==1.110.2", "fastapi>=0.136.3,<1", "starlette>=1.0.1,<2", "uvicorn>=0.33,<1", "uvloop>=0.22.1,<1",
           "backoff>=2.2.1,<3", "orjson>=3.11.6,<4", "apscheduler>=3.11.2,<4", "pyjwt>=2.13,<3",
           "python-multipart>=0.0.27,<1", "cryptography>=49,<51", "pynacl>=1.6.2,<2", "websockets>=15.0.1,<16",
           "gunicorn>=23,<24", "rq>=2.7,<3", "pyyaml>=6.0.3,<7", "semver", "expression>=5.6,<6",
           "fastapi-sso>=0.19,<1", "mcp>=2.3,<3", "soundfile>=0.12.1,<1", "litellm-proxy-extras", "litellm-enterprise"]
VERIFIERS = ["verifiers==0.4.0"]
# Said with the checks, failing nothing: a proxy path whose trace writes left its event loop
# during the run (its health says "thread"), so its figures after that are the writer thread's.
NOTES: list[str] = []


# -- the simulator, with a tally -------------------------------------------------------------


def _head(messages: list[dict]) -> str:
    text = messages[-1].get("content") if messages else ""
    return text.split(";", 1)[0] if isinstance(text, str) else ""


def reply_for(messages: list[dict]) -> list[str]:
    """The answer's pieces, named by the last user message's prefix: ``tokens=N;`` streams N
    one-token events (``tokens=N,gap=MS;``: MS milliseconds apart, ``gap_for``), ``chunk=N;``
    answers N characters, anything else a short answer."""
    head = _head(messages)
    if head.startswith("tokens="):
        return [f"w{k} " for k in range(int(head[7:].split(",")[0]))]
    if head.startswith("chunk="):
        n = int(head[6:])
        return [("The answer, at length. " * (n // 23 + 1))[:n]]
    return SHORT


def gap_for(messages: list[dict]) -> float:
    """Seconds between the answer's events (``tokens=N,gap=MS;``), else 0: as fast as it writes."""
    head = _head(messages)
    return float(head.split(",gap=", 1)[1]) / 1000 if head.startswith("tokens=") and ",gap=" in head else 0.0


def serve() -> None:
    """The simulator for this bench, in its own process: answers by reply_for, and counts every
    model request by (model, whether it carried the operator's key). A request for model
    ``TALLY`` is answered with that count as its text (JSON) and resets it. The request log is
    dropped as it goes: 300 turns of a 340 KB history through seven paths would hold ~1 GB."""
    from provider import ProviderSimulator, Reply

    tally: Counter = Counter()
    lock = threading.Lock()
    sim: ProviderSimulator

    def reply(record) -> Reply:
        body = record.json if isinstance(record.json, dict) else {}
        model = body.get("model")
        sim.clear()  # _take calls this outside the simulator's lock
        with lock:
            if model == TALLY:
                text = json.dumps({f"{m}|{real}": n for (m, real), n in tally.items()})
                tally.clear()
                return Reply(text=text)
            tally[(model, record.key == REAL_KEY)] += 1
        messages = body.get("messages") or []
        return Reply(text=reply_for(messages), delay=gap_for(messages))

    sim = ProviderSimulator(default=reply).start()
    print(f"listening on {sim.base_url}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    sim.stop()


def read_tally(httpx, sim_url: str) -> dict[tuple[str, bool], int]:
    r = httpx.post(f"{sim_url}/v1/chat/completions", json={"model": TALLY, "messages": [{"role": "user", "content": "t"}]},
                   headers={"authorization": "Bearer sk-tally"}, timeout=30)
    r.raise_for_status()
    raw = json.loads(r.json()["choices"][0]["message"]["content"])
    return {(k.rsplit("|", 1)[0], k.rsplit("|", 1)[1] == "True"): n for k, n in raw.items()}


# -- what each path must have done -------------------------------------------------------------


def tally_problems(expected: dict[str, tuple[int, bool]], tally: dict[tuple[str, bool], int]) -> list[str]:
    """``expected``: model -> (requests, whether each must carry the operator's key). Every
    request the simulator saw must be one of those, with the key as claimed, in that number."""
    problems = []
    seen: Counter = Counter()
    for (model, real), n in tally.items():
        seen[model] += n
        if model not in expected:
            problems.append(f"the simulator saw {n} request(s) for model {model!r}, which no path claims to send")
        elif real != expected[model][1]:
            problems.append(f"{n} request(s) for {model!r} {'carried' if real else 'lacked'} the operator's key")
    for model, (n, _) in expected.items():
        if seen[model] != n:
            problems.append(f"the simulator saw {seen[model]} request(s) for {model!r}, the clients completed {n}")
    return problems


def trace_problems(summary: dict[str, Any], sent: int, model: str, turns: int | None = None) -> list[str]:
    """One session's trace against what its client sent: one call per request, no error,
    every call as sent upstream naming ``model``; a rollout (``turns``) one branch of that many
    turns. ``summary``: calls, errors, turns, models, branches (summarise() or verifiers')."""
    problems = []
    if summary["calls"] != sent:
        problems.append(f"{summary['calls']} call(s) recorded for {sent} request(s)")
    if summary["errors"]:
        problems.append(f"{summary['errors']} error call(s)")
    if summary["calls"] and set(summary["models"]) != {model}:
        problems.append(f"calls recorded with model(s) {sorted(summary['models'])}, not {model!r}")
    if turns is not None:
        if summary["turns"] != turns:
            problems.append(f"{summary['turns']} turn(s) for a rollout of {turns}")
        if summary["branches"] != 1:
            problems.append(f"{summary['branches']} branches for one rollout")
    elif summary["turns"] != sent:
        problems.append(f"{summary['turns']} turn(s) for {sent} request(s)")
    return problems


def summarise(trace) -> dict[str, Any]:
    """This proxy's Trace in the shape trace_problems() reads (verifiers_serve.py's summary)."""
    return {"calls": len(trace.calls), "errors": len(trace.errors), "turns": trace.num_turns,
            "models": sorted({c.model or "" for c in trace.calls}), "branches": len(trace.branches)}


# -- processes ---------------------------------------------------------------------------------


def tree(pid: int) -> list[int]:
    """``pid`` and every live descendant (LiteLLM may fork workers)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def cpu_ns(pids: list[int]) -> dict[tuple[int, str], int]:
    out = {}
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                out[(pid, task.name)] = int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pass  # a thread that just ended
    return out


def cpu_between(before: dict, after: dict) -> int:
    return sum(ns - before.get(key, 0) for key, ns in after.items())


def rss_kb(pids: list[int], key: str = "VmRSS") -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith(key + ":"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


class Unavailable(Exception):
    """A peer that could not be installed or started: reported, and the run goes on."""


def ensure_venv(name: str, requirements: list[str], log: Path) -> Path:
    """``.venv-bench/<name>`` with ``requirements`` installed (once: a stamp names them)."""
    venv = BENCH_VENVS / name
    stamp = venv / ".installed"
    want = "\n".join(requirements)
    if stamp.exists() and stamp.read_text() == want:
        return venv
    print(f"installing {name} into {venv.relative_to(ROOT)} ({' '.join(requirements[:1])} ...); once, a few minutes",
          flush=True)
    with open(log, "ab") as out:
        try:
            if not (venv / "bin" / "python").exists():
                subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, stdout=out, stderr=out)
            subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *requirements],
                           check=True, stdout=out, stderr=out, timeout=1800)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
            tail = [line for line in log.read_text(errors="replace").splitlines()
                    if line.strip() and not line.startswith("WARNING: Location")][-3:]
            raise Unavailable(f"pip install {' '.join(requirements[:1])} ... into {venv.relative_to(ROOT)} failed "
                              f"(exit {getattr(e, 'returncode', e)}): {' / '.join(tail)[-400:]} (the whole log: {log})") from None
    stamp.write_text(want)
    return venv


def wait_banner(proc: subprocess.Popen, timeout: float, what: str, log: Path) -> str:
    """The first line of ``proc``'s stdout that says ``listening on``, within ``timeout``."""
    box: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            if "listening on" in line:
                box.append(line.strip())
                return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout)
    if not box:
        proc.kill()
        raise Unavailable(f"{what} did not start in {timeout:.0f} s; its log: {log}")
    return box[0]


# -- paths -------------------------------------------------------------------------------------


@dataclass
class Path_:
    """One way to the simulator: how a client reaches it, what it must send upstream, its
    processes, and (for the session-keeping paths) one session per client slot."""

    name: str
    what: str
    url: str                       # where a client posts
    request_model: str             # what the client names
    upstream_model: str            # what the simulator must see
    swaps_key: bool                # whether the simulator must see the operator's key
    pids: Callable[[], list[int]] = lambda: []
    new_session: Callable[[], Any] | None = None  # -> a slot: (secret, proxy url or None, verify)
    shared: tuple[str, str | None, Any] | None = None  # the one slot of a path without sessions
    traces: Callable[[], list[dict]] | None = None  # per session, in creation order
    stop: Callable[[], None] = lambda: None
    slots: list = field(default_factory=list)
    sent: list[int] = field(default_factory=list)  # completed requests per slot
    rollout_slot: int | None = None
    problems: list[str] = field(default_factory=list)
    rss_peak: int = 0

    def slot(self, k: int):
        if self.new_session is None:
            return self.shared
        while len(self.slots) <= k:
            self.slots.append(self.new_session())
            self.sent.append(0)
        return self.slots[k]

    def count(self, k: int, n: int = 1) -> None:
        if self.new_session is not None:
            self.sent[k] += n


def http_client(httpx, slot, asynchronous: bool):
    secret, proxy, verify = slot
    cls = httpx.AsyncClient if asynchronous else httpx.Client
    return cls(proxy=proxy, verify=verify, timeout=300, limits=httpx.Limits(max_connections=4))


# -- one cell: one path, one workload ---------------------------------------------------------


_REQUESTS = itertools.count()


@dataclass
class Workload:
    name: str
    clients: int
    count: int        # requests per client
    stream: bool
    tokens: int       # answer events (streams) or 0 for the short answer
    asynchronous: bool
    size: int = 20_000
    gap_ms: float = 0  # between a stream's events (0: as fast as the simulator writes them)

    @property
    def prefix(self) -> str:
        """What names the answer for ``reply_for`` and ``gap_for``."""
        if not self.tokens:
            return "short;"
        return f"tokens={self.tokens}" + (f",gap={self.gap_ms:g}" if self.gap_ms else "") + ";"

    def body(self, model: str) -> Callable[[], bytes]:
        """Each call a new request: a number after the reply's name makes every body its own
        (one session asked the same body twice is a retry to this proxy, rightly)."""
        prefix = self.prefix
        data: dict[str, Any] = {"model": model, "messages": [
            {"role": "user", "content": prefix + "#" * 12 + " " + "x" * max(0, self.size - 200)}]}
        if self.stream:
            data |= {"stream": True, "stream_options": {"include_usage": True}}
        raw = json.dumps(data).encode()
        mark = (prefix + "#" * 12).encode()
        return lambda: raw.replace(mark, f"{prefix}{next(_REQUESTS):012d}".encode(), 1)

    def expected(self) -> str:
        return "".join(reply_for([{"content": self.prefix}]))


def parse_answer(stream: bool, data: bytes | list[str]) -> tuple[str, int]:
    """The answer's text and its SSE event count (``data:`` lines; JSON: 0)."""
    if not stream:
        return json.loads(data)["choices"][0]["message"]["content"], 0
    text, events = [], 0
    for line in data:
        if line.startswith("data:"):
            events += 1
            if line.startswith("data: {"):
                text += [c["delta"].get("content") or "" for c in json.loads(line[6:]).get("choices") or []]
    return "".join(text), events


async def one_async(client, url: str, payload: bytes, headers: dict, stream: bool) -> tuple[str, int, float | None]:
    t0 = time.perf_counter()
    if not stream:
        r = await client.post(url, content=payload, headers=headers)
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
        return (*parse_answer(False, r.content), None)
    lines, first = [], None
    async with client.stream("POST", url, content=payload, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
        async for line in r.aiter_lines():
            if first is None and line.startswith("data:"):
                first = time.perf_counter() - t0
            lines.append(line)
    return (*parse_answer(True, lines), first)


def one_sync(client, url: str, payload: bytes, headers: dict, stream: bool) -> tuple[str, int, float | None]:
    t0 = time.perf_counter()
    if not stream:
        r = client.post(url, content=payload, headers=headers)
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
        return (*parse_answer(False, r.content), None)
    lines, first = [], None
    with client.stream("POST", url, content=payload, headers=headers) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
        for line in r.iter_lines():
            if first is None and line.startswith("data:"):
                first = time.perf_counter() - t0
            lines.append(line)
    return (*parse_answer(True, lines), first)


def run_cell(httpx, path: Path_, w: Workload) -> dict:
    """Every client warms its connection with one request, then all send ``w.count`` each at
    once; the path's CPU from just before the first measured request to 10 ms after the last."""
    payload, expected = w.body(path.request_model), w.expected()
    slots = [path.slot(k) for k in range(w.clients)]
    lat: list[float] = []
    first: list[float] = []
    events = [0]
    errors: list[str] = []
    wrong: list[str] = []

    def note(k: int, answer: tuple[str, int, float | None], t: float) -> None:
        text, n, f = answer
        path.count(k)
        if text != expected:
            wrong.append(text[:60])
        lat.append(t)
        events[0] += n
        if f is not None:
            first.append(f)

    def headers(slot) -> dict:
        return {"authorization": f"Bearer {slot[0]}", "content-type": "application/json"}

    if not w.asynchronous:  # one client, this thread
        assert w.clients == 1
        with http_client(httpx, slots[0], False) as c:
            note(0, one_sync(c, path.url, payload(), headers(slots[0]), w.stream), 0)
            lat.clear(), first.clear()
            events[0] = 0
            c0, t0 = cpu_ns(path.pids()), time.perf_counter()
            for _ in range(w.count):
                s = time.perf_counter()
                try:
                    answer = one_sync(c, path.url, payload(), headers(slots[0]), w.stream)
                except Exception as e:  # noqa: BLE001 - counted and reported, never hidden
                    errors.append(f"{type(e).__name__}: {e}"[:200])
                    continue
                note(0, answer, time.perf_counter() - s)
            wall = time.perf_counter() - t0
    else:
        async def main() -> tuple[dict, float]:
            clients = [http_client(httpx, s, True) for s in slots]
            try:
                async def warm(k: int) -> None:
                    note(k, await one_async(clients[k], path.url, payload(), headers(slots[k]), w.stream), 0)

                await asyncio.gather(*(warm(k) for k in range(w.clients)))
                lat.clear(), first.clear()
                events[0] = 0
                c0, t0 = cpu_ns(path.pids()), time.perf_counter()

                async def client(k: int) -> None:
                    for _ in range(w.count):
                        s = time.perf_counter()
                        try:
                            answer = await one_async(clients[k], path.url, payload(), headers(slots[k]), w.stream)
                        except Exception as e:  # noqa: BLE001 - counted and reported, never hidden
                            errors.append(f"{type(e).__name__}: {e}"[:200])
                            continue
                        note(k, answer, time.perf_counter() - s)

                await asyncio.gather(*(client(k) for k in range(w.clients)))
                return c0, time.perf_counter() - t0
            finally:
                for c in clients:
                    await c.aclose()

        c0, wall = asyncio.run(main())
    time.sleep(0.01)
    pids = path.pids()
    cpu = cpu_between(c0, cpu_ns(pids))
    rss = rss_kb(pids)
    path.rss_peak = max(path.rss_peak, rss)
    if errors:
        path.problems.append(f"{w.name}: {len(errors)} failed request(s), first: {errors[0]}")
    if wrong:
        path.problems.append(f"{w.name}: {len(wrong)} answer(s) not whole, first: {wrong[0]!r}")
    return {"lat": lat, "first": first, "wall": wall, "n": len(lat), "events": events[0], "cpu": cpu, "rss": rss}


# -- the rollout -------------------------------------------------------------------------------


def rollout(httpx, paths: list[Path_], turns: int, chunk: int) -> dict[str, dict[str, list[float]]]:
    """One growing conversation per path, every path in the same turn, rotating order: per
    turn, each path's latency and CPU (to 5 ms after the answer: the trace writer's share)."""
    out = {p.name: {"lat": [], "cpu": []} for p in paths}
    reply = reply_for([{"content": f"chunk={chunk};"}])[0]
    clients = {}
    try:
        for p in list(paths):
            try:
                if p.new_session is not None:
                    p.slot(len(p.slots))  # a fresh session: its trace is this rollout alone
                    p.rollout_slot = len(p.slots) - 1
            except Exception as e:  # noqa: BLE001 - the path is marked, the others go on
                p.problems.append(f"rollout: no session: {type(e).__name__}: {e}"[:300])
                paths.remove(p)
                continue
            slot = p.slots[p.rollout_slot] if p.rollout_slot is not None else p.shared
            clients[p.name] = (http_client(httpx, slot, False), slot)
        from trace_turns import settle

        settle([pid for p in paths for pid in p.pids()])  # start-up work in the background counts as no turn's
        messages = [{"role": "system", "content": "You are a patient assistant."}]
        for k in range(turns):
            messages.append({"role": "user", "content": (f"chunk={chunk}; turn {k}: " + "please go on. " * (chunk // 14 + 1))[:chunk]})
            order = paths[k % len(paths):] + paths[:k % len(paths)]
            for p in order:
                client, slot = clients[p.name]
                payload = json.dumps({"model": p.request_model, "messages": messages}).encode()
                pids = p.pids()
                c0 = cpu_ns(pids) if pids else None
                t0 = time.perf_counter()
                try:
                    text, _, _ = one_sync(client, p.url, payload, {"authorization": f"Bearer {slot[0]}",
                                                                   "content-type": "application/json"}, False)
                except Exception as e:  # noqa: BLE001 - the path is marked, the others go on
                    p.problems.append(f"rollout turn {k + 1}: {type(e).__name__}: {e}"[:300])
                    paths.remove(p)
                    continue
                out[p.name]["lat"].append(time.perf_counter() - t0)
                if c0 is not None:
                    time.sleep(0.005)
                    out[p.name]["cpu"].append(cpu_between(c0, cpu_ns(pids)))
                p.count(p.rollout_slot if p.rollout_slot is not None else 0)
                if text != reply:
                    p.problems.append(f"rollout turn {k + 1}: answer not whole: {text[:60]!r}")
            messages.append({"role": "assistant", "content": reply})
            if k % 50 == 49:
                print(f"  rollout: turn {k + 1} of {turns}", flush=True)
    finally:
        for client, _ in clients.values():
            client.close()
    return out


# -- setting the paths up ----------------------------------------------------------------------


def start_paths(httpx, work: Path, sim_url: str, names: list[str], skipped: dict[str, str],
                before: str | None = None) -> list[Path_]:
    from mitm import MitmProcess

    from interceptor.client import Proxy
    from interceptor.scripts.serve import Deployment

    paths: list[Path_] = []
    remap = f"|https://api\\.openai\\.com/v1|{sim_url}/v1"
    env = {KEY_ENV: REAL_KEY}

    def add(name: str, make: Callable[[], Path_]) -> None:
        if name not in names:
            return
        try:
            paths.append(make())
            print(f"  {name}: up", flush=True)
        except Unavailable as e:
            skipped[name] = str(e)
            print(f"  {name}: SKIPPED: {e}", flush=True)

    add("direct", lambda: Path_("direct", "the simulator, no proxy", f"{sim_url}/v1/chat/completions",
                                "bench-direct", "bench-direct", False, shared=("sk-client", None, True)))

    def bare(name: str, model: str, scripts: str | None) -> Path_:
        opts = {"connection_strategy": "lazy", "map_remote": remap, **({"scripts": scripts} if scripts else {})}
        m = MitmProcess(script=False, workdir=work / name.replace("+", "-"), options=opts, new_session=True).start()
        return Path_(name, "bare mitmdump, map_remote" + (" + bench/stream_sse.py" if scripts else ""), URL, model, model,
                     False, pids=lambda: [m.proc.pid], shared=("sk-client", m.url, str(m.confdir / "mitmproxy-ca-cert.pem")),
                     stop=m.cleanup)

    add("bare", lambda: bare("bare", "bench-bare", None))
    add("bare+stream", lambda: bare("bare+stream", "bench-bare-stream", str(ROOT / "bench" / "stream_sse.py")))

    upstreams = json.dumps({"sim": {"base_url": f"{sim_url}/v1", "api_key_env": KEY_ENV}})

    def attached(name: str, proxy, model: str, what: str, stop: Callable[[], None], pids: Callable[[], list[int]]) -> Path_:
        """A path through this proxy: each client a session made through its control API."""
        sessions: list = []

        def new():
            s = proxy.session(upstream="sim", model=model)
            sessions.append(s)
            return (s.secret, s.proxy_url, s.ssl_context())

        def traces() -> list[dict]:
            from interceptor.trace import read_trace
            try:
                if proxy.health().get("trace_writes") == "thread":
                    NOTES.append(f"{name}: a trace write on its event loop was slow, and its writer thread "
                                 "wrote every later record (trace/store.py): its figures after that are the thread's")
            except Exception:  # noqa: BLE001 - health is a note here; the traces are the check
                pass
            out = []
            for s in sessions:
                s.close()
                out.append(summarise(read_trace(s.trace_path)))
            return out

        return Path_(name, what, URL, "gpt-4o", model, True, new_session=new, traces=traces, stop=stop, pids=pids)

    def plain(rev: str | None = None) -> Path_:
        """As ``make run`` starts it: one mitmdump with the script, no front, in a session of its
        own as the bare paths are (a terminal of its own, as a service would be; the evaluator's
        ``Proxy.start`` would put it in this benchmark's session, and so in its autogroup).
        ``rev``: the proxy as it was at that revision (``git archive``), to read a change side by
        side with what came before it."""
        options = {"intercept_upstreams": upstreams}
        if rev is None:
            m = MitmProcess(workdir=work / "plain", options=options, env=env, new_session=True)
        else:
            from failclosed import checkout_proxy
            m = checkout_proxy(rev, work / "before", options, env, new_session=True)
        try:
            m.start()
            proxy = Proxy.attach(m.url, m.admin_token)
        except Exception as e:  # noqa: BLE001 - said, and the run goes on
            m.cleanup()
            raise Unavailable(f"mitmdump -s addons/interception.py{f' at {rev}' if rev else ''} did not start: {e}") from None
        name, model = ("proxy", "bench-proxy") if rev is None else (f"proxy@{rev}", "bench-proxy-before")
        return attached(name, proxy, model, f"this proxy{f' as it was at {rev}' if rev else ''}: one mitmdump -s "
                        "addons/interception.py (make run), HTTPS_PROXY", m.cleanup, lambda: [m.proc.pid])

    add("proxy", plain)
    if before:
        names.append(f"proxy@{before}")
        add(f"proxy@{before}", lambda: plain(before))

    def ours(n: int) -> Path_:
        name = f"proxy {n}w"
        dep = Deployment(n, listen_port=0, trace_dir=work / f"traces-{n}w", confdir=work / f"conf-{n}w",
                         options=[f"intercept_upstreams={upstreams}"], env=env, restart=False)
        try:
            dep.start()
        except Exception as e:  # noqa: BLE001 - said, and the run goes on
            dep.stop()
            raise Unavailable(f"scripts/serve.py with {n} worker(s) did not start: {e}") from None
        return attached(name, Proxy.attach(dep.url, dep.admin_token), f"bench-proxy-{n}w",
                        f"this proxy: scripts/serve.py, HAProxy + {n} worker{'s' * (n > 1)}, HTTPS_PROXY", dep.stop,
                        lambda: [p for p in ([dep.front.pid] if dep.front else []) + [w.proc.pid for w in dep.workers]])

    add("proxy 1w", lambda: ours(1))
    add("proxy 2w", lambda: ours(2))

    def litellm() -> Path_:
        venv = ensure_venv("litellm", LITELLM, work / "litellm-install.log")
        port = _free_port()
        config = work / "litellm.yaml"
        config.write_text(
            "model_list:\n"
            "  - model_name: bench-litellm-alias\n"
            "    litellm_params:\n"
            "      model: openai/bench-litellm\n"
            f"      api_base: {sim_url}/v1\n"
            f"      api_key: os.environ/{KEY_ENV}\n"
            "litellm_settings:\n"
            "  telemetry: false\n")
        master = "sk-" + secrets.token_hex(32)
        log = work / "litellm.log"
        out = open(log, "wb")
        proc = subprocess.Popen(
            [str(venv / "bin" / "litellm"), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
             "--num_workers", "1"], stdout=out, stderr=subprocess.STDOUT, cwd=work, start_new_session=True,
            env={**_clean_env(), **env, "LITELLM_MASTER_KEY": master, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 180
        while True:
            if proc.poll() is not None:
                raise Unavailable(f"litellm exited with {proc.returncode} at start; its log: {log}")
            try:
                if httpx.get(f"{base}/health/liveliness", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                stop_process(proc)
                raise Unavailable(f"litellm did not answer /health/liveliness in 180 s; its log: {log}")
            time.sleep(0.5)
        return Path_("litellm", f"LiteLLM's proxy ({LITELLM[0]}), base URL + master key, a model alias",
                     f"{base}/v1/chat/completions", "bench-litellm-alias", "bench-litellm", True,
                     pids=lambda: tree(proc.pid), shared=(master, None, True), stop=lambda: (stop_process(proc), out.close()))

    def verifiers() -> Path_:
        venv = ensure_venv("verifiers", VERIFIERS, work / "verifiers-install.log")
        log = work / "verifiers.log"
        proc = subprocess.Popen(
            [str(venv / "bin" / "python"), str(ROOT / "bench" / "verifiers_serve.py"), "--upstream", f"{sim_url}/v1",
             "--key-env", KEY_ENV], stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True, cwd=work,
            start_new_session=True, env={**_clean_env(), **env})
        banner = wait_banner(proc, 120, "verifiers_serve.py", log)
        base, control = banner.split()[2], banner.split()[4]
        model = "bench-verifiers"

        def new():
            r = httpx.post(f"{control}/sessions", json={"n": 1, "model": model}, timeout=30)
            r.raise_for_status()
            return (r.json()["secrets"][0], None, True)

        def traces() -> list[dict]:
            return httpx.get(f"{control}/sessions", timeout=60).json()["sessions"]

        return Path_("verifiers", f"verifiers' InterceptionServer ({VERIFIERS[0]}), base URL + rollout secret",
                     f"{base}/v1/chat/completions", "gpt-4o", model, True, pids=lambda: tree(proc.pid),
                     new_session=new, traces=traces, stop=lambda: stop_process(proc))

    add("litellm", litellm)
    add("verifiers", verifiers)
    return paths


def _free_port() -> int:
    from interceptor.client.proxy import free_port
    return free_port()


def _clean_env() -> dict[str, str]:
    from interceptor.client.proxy import PROXY_VARIABLES
    return {k: v for k, v in os.environ.items() if k not in PROXY_VARIABLES and not k.startswith("VIRTUAL_ENV")}


# -- the report --------------------------------------------------------------------------------


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list[float], f: str) -> str:
    if not xs:
        return "-"
    return format(med(xs), f) + (f" ({format(min(xs), f)}-{format(max(xs), f)})" if len(xs) > 1 else "")


def metrics(cs: list[dict], ds: list[dict] | None, stream: bool) -> dict[str, list[float]]:
    """Per repetition: p50/p99 (ms), added over direct's of the same repetition, throughput
    (/s) and its share of direct's (%), CPU per event (µs, streams) or per request (ms), RSS (MB)."""
    m: dict[str, list[float]] = {
        "p50": [quantile(c["lat"], 0.5) * 1e3 for c in cs], "p99": [quantile(c["lat"], 0.99) * 1e3 for c in cs],
        "first": [quantile(c["first"], 0.5) * 1e3 for c in cs], "rate": [c["n"] / c["wall"] for c in cs],
        "cpu": [c["cpu"] / max(c["events"], 1) / 1e3 if stream else c["cpu"] / max(c["n"], 1) / 1e6 for c in cs],
        "rss": [c["rss"] / 1024 for c in cs]}
    ds = ds or []
    m["add50"] = [a - quantile(d["lat"], 0.5) * 1e3 for a, d in zip(m["p50"], ds)]
    m["add99"] = [a - quantile(d["lat"], 0.99) * 1e3 for a, d in zip(m["p99"], ds)]
    m["share"] = [r / (d["n"] / d["wall"]) * 100 for r, d in zip(m["rate"], ds)]
    return m


def bare_share(cs: list[dict], bare: list[dict] | None) -> list[float]:
    """Throughput as a share of bare mitmdump's (%), paired repetition by repetition: the
    issue's throughput goal is stated against bare's, and a repetition's two cells ran
    seconds apart, where the medians of the shares of direct mix minutes (the machine's
    speed drifts by tens of percent within minutes here). Paired by repetition number: a path
    whose cell failed in one repetition has no figure for it."""
    rate = {b.get("rep", k): b["n"] / b["wall"] for k, b in enumerate(bare or [])}
    return [c["n"] / c["wall"] / rate[r] * 100 for k, c in enumerate(cs) if (r := c.get("rep", k)) in rate]


def cell_table(w: Workload, paths: list[Path_], cells: dict[str, list[dict]]) -> list[str]:
    """One workload's table: per path, medians over repetitions (min-max for the share)."""
    unit = "event, µs" if w.stream else "request, ms"
    rows = [f"| path | p50 ms | added p50 ms | p99 ms | added p99 ms | {'first event p50 ms | ' if w.stream else ''}"
            f"throughput/s | share of direct | share of bare's, paired | CPU per {unit} | RSS MB |",
            "|---" * (10 + w.stream) + "|"]
    for p in paths:
        cs = cells.get(p.name)
        if not cs:
            continue
        m = metrics(cs, cells.get("direct"), w.stream)
        d = p.name == "direct"
        proc = bool(p.pids())
        rows.append(f"| {p.name}{' ✗' if p.problems else ''} | {med(m['p50']):.2f} | {'-' if d else f'{med(m['add50']):+.2f}'} | "
                    f"{med(m['p99']):.2f} | {'-' if d else f'{med(m['add99']):+.2f}'} | "
                    f"{f'{med(m['first']):.2f} | ' if w.stream else ''}{med(m['rate']):.0f} | "
                    f"{'-' if d else spread(m['share'], '.0f') + '%'} | "
                    f"{spread(bare_share(cs, cells.get('bare')), '.0f') + '%' if p.name not in ('direct', 'bare') and cells.get('bare') else '-'} | "
                    f"{spread(m['cpu'], '.1f' if w.stream else '.2f') if proc else '-'} | "
                    f"{format(med(m['rss']), '.0f') if proc else '-'} |")
    return rows


def bands(n: int, band: int) -> tuple[tuple[int, int], tuple[int, int]]:
    return (0, min(band, n)), (max(0, n - band), n)


def minus_bare(xs: list[float], bare: list[float], lo_hi: tuple[int, int], unit: float = 1e3) -> str:
    """A path's figure minus bare mitmdump's for the same turn, over the turns ``lo_hi``:
    median (p25..p75), ms (``unit``: latency in seconds by default, ``1e-6`` for CPU in ns);
    ``-`` for bare itself."""
    if xs is bare:
        return "-"
    d = [(a - b) * unit for a, b in zip(xs[lo_hi[0]:lo_hi[1]], bare[lo_hi[0]:lo_hi[1]])]
    return f"{med(d):+.2f} ({quantile(d, 0.25):+.2f}..{quantile(d, 0.75):+.2f})"


def rollout_table(paths: list[Path_], data: dict[str, dict[str, list[float]]], band: int) -> list[str]:
    direct = data.get("direct", {}).get("lat", [])
    n = len(direct)
    if not n:
        return ["(the rollout did not run on direct)"]
    first, last = bands(n, band)
    # Paired with bare mitmdump turn by turn: the same request through both paths within a
    # second of each other, so the simulator's time for that body and the machine's load
    # mostly cancel. The difference of two bands' p50s (the columns before) carries the
    # noise of both, several ms on a shared VM; the median of the per-turn differences is
    # the A/B estimate of what the path adds over bare mitmdump. CPU is paired the same way, as
    # bench/rollout.py pairs it (two CPU band medians taken apart, read against its paired
    # figure, once looked like a 0.6 ms disagreement between the benchmarks: docs/benchmarks.md).
    bare = data.get("bare", {}).get("lat", [])
    bare_cpu = data.get("bare", {}).get("cpu", [])
    paired = len(bare) == n and len(bare_cpu) == n
    rows = [f"| path | CPU per turn ms, turns {first[0] + 1}-{first[1]} | turns {last[0] + 1}-{last[1]} | last / first | "
            f"added p50 ms, first band | last band | added p99 ms, first band | last band | all turns p50 / p99 |"
            + (" latency minus bare per turn, ms: median (p25..p75), first band | last band "
               "| CPU minus bare per turn, ms: median (p25..p75), first band | last band |" if paired else ""),
            "|---" * (9 + 4 * paired) + "|"]
    for p in paths:
        d = data.get(p.name)
        if p.name == "direct" or not d or len(d["lat"]) != n:
            continue
        cpu = [x / 1e6 for x in d["cpu"]]
        c1, c2 = med(cpu[first[0]:first[1]]), med(cpu[last[0]:last[1]])
        added = [a - b for a, b in zip(d["lat"], direct)]

        def at(lo_hi, q):
            return quantile(added[lo_hi[0]:lo_hi[1]], q) * 1e3

        rows.append(f"| {p.name}{' ✗' if p.problems else ''} | {c1:.2f} | {c2:.2f} | {c2 / c1:.2f} | {at(first, 0.5):+.2f} | "
                    f"{at(last, 0.5):+.2f} | {at(first, 0.99):+.1f} | {at(last, 0.99):+.1f} | "
                    f"{quantile(added, 0.5) * 1e3:+.2f} / {quantile(added, 0.99) * 1e3:+.1f} |"
                    + (" " + " | ".join([minus_bare(d["lat"], bare, b) for b in (first, last)]
                                        + [minus_bare(d["cpu"], bare_cpu, b, 1e-6) if len(d["cpu"]) == n else "-"
                                           for b in (first, last)]) + " |" if paired else ""))
    rows.append(f"\ndirect: median {med(direct) * 1e3:.2f} ms, p99 {quantile(direct, 0.99) * 1e3:.1f} ms")
    return rows


def summary_table(workloads: list[Workload], paths: list[Path_], cells: dict, data: dict, band: int) -> list[str]:
    """The issue's table: a few figures per workload, the paths as columns (medians)."""
    proxies = [p for p in paths if p.name != "direct"]
    rows = ["| workload: figure | " + " | ".join(p.name + (" ✗" if p.problems else "") for p in proxies) + " |",
            "|---" * (len(proxies) + 1) + "|"]
    picks = [(workloads[0], "add50", "added p50, ms", "+.2f"), (workloads[0], "add99", "added p99, ms", "+.1f")]
    for w in workloads[3:5]:
        picks += [(w, "share", "throughput, share of direct %", ".0f"), (w, "bare", "throughput, share of bare's %, paired", ".0f"),
                  (w, "add99", "added p99, ms", "+.1f")]
    picks += [(w, "cpu", "proxy CPU per event, µs", ".1f") for w in workloads[5:]]
    picks += [(workloads[1], "cpu", "proxy CPU per event, µs", ".1f"), (workloads[0], "cpu", "proxy CPU per request, ms", ".2f"),
              (workloads[0], "rss", "RSS, MB", ".0f")]
    for w, key, label, f in picks:
        vals = []
        for p in proxies:
            cs = cells[w.name].get(p.name)
            if key == "bare":
                xs = bare_share(cs, cells[w.name].get("bare")) if cs and p.name != "bare" else []
            else:
                xs = metrics(cs, cells[w.name].get("direct"), w.stream)[key] if cs else []
            vals.append((spread(xs, f) if key == "bare" else format(med(xs), f)) if xs else "-")
        rows.append(f"| {w.name}: {label} | " + " | ".join(vals) + " |")
    direct = data.get("direct", {}).get("lat", [])
    if direct:
        first, last = bands(len(direct), band)
        for label, fn in ((f"rollout: CPU per turn, ms, turns {first[0] + 1}-{first[1]} / {last[0] + 1}-{last[1]}",
                           lambda d: f"{med(d['cpu'][first[0]:first[1]]) / 1e6:.2f} / {med(d['cpu'][last[0]:last[1]]) / 1e6:.2f}"),
                          (f"rollout: latency minus bare per turn, ms, median, turns {last[0] + 1}-{last[1]}",
                           lambda d: minus_bare(d["lat"], data["bare"]["lat"], last).split(" ")[0]
                           if len(data.get("bare", {}).get("lat", [])) == len(direct) else "-"),
                          (f"rollout: CPU minus bare per turn, ms, median, turns {last[0] + 1}-{last[1]}",
                           lambda d: minus_bare(d["cpu"], data["bare"]["cpu"], last, 1e-6).split(" ")[0]
                           if len(data.get("bare", {}).get("cpu", [])) == len(direct) == len(d["cpu"]) else "-"),
                          ("rollout: added p50 / p99, ms, all turns",
                           lambda d: (lambda a: f"{quantile(a, 0.5) * 1e3:+.2f} / {quantile(a, 0.99) * 1e3:+.1f}")(
                               [x - y for x, y in zip(d["lat"], direct)]))):
            rows.append(f"| {label} | " + " | ".join(
                fn(data[p.name]) if p.name in data and len(data[p.name]["lat"]) == len(direct) else "-" for p in proxies) + " |")
    return rows


def plot(out_dir: Path, workloads: list[Workload], paths: list[Path_], cells: dict, rollout_data: dict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    proxies = [p for p in paths if p.name != "direct"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.4))
    x = range(len(workloads))
    width = 0.8 / max(1, len(proxies))
    for i, p in enumerate(proxies):
        added, share, cpu = [], [], []
        for w in workloads:
            cs = cells[w.name].get(p.name)
            m = metrics(cs, cells[w.name].get("direct"), False) if cs else {}
            added.append(med(m.get("add50", [])))
            share.append(med(m.get("share", [])))
            cpu.append(med(m.get("cpu", [])))
        offs = [k + (i - len(proxies) / 2 + 0.5) * width for k in x]
        axes[0][0].bar(offs, added, width, label=p.name)
        axes[0][1].bar(offs, share, width, label=p.name)
        axes[1][0].bar(offs, cpu, width, label=p.name)
    labels = [w.name for w in workloads]
    for ax, title, ylabel in ((axes[0][0], "added latency over direct (p50)", "ms"),
                              (axes[0][1], "throughput, share of direct", "%"),
                              (axes[1][0], "proxy CPU per request (all its processes)", "ms")):
        ax.set_xticks(list(x), labels, rotation=25, ha="right", fontsize=8)
        ax.set(title=title, ylabel=ylabel)
    axes[0][0].set_yscale("symlog", linthresh=1)
    axes[1][0].set_yscale("log")
    axes[0][0].legend(fontsize=8)
    ax = axes[1][1]
    for p in proxies:
        d = rollout_data.get(p.name)
        if d and d["cpu"]:
            ax.plot(range(1, len(d["cpu"]) + 1), [c / 1e6 for c in d["cpu"]], lw=0.8, label=p.name)
    ax.set(title="growing rollout: proxy CPU per turn", xlabel="turn", ylabel="ms")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = out_dir / "compare.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [out]


# -- main --------------------------------------------------------------------------------------


ALL = ["direct", "bare", "bare+stream", "proxy", "proxy 1w", "proxy 2w", "litellm", "verifiers"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="a smoke run of every path: few requests, few clients")
    ap.add_argument("--reps", type=int, default=None, help="repetitions of each cell (default 2, quick 1)")
    ap.add_argument("--turns", type=int, default=None, help="rollout turns (default 300, quick 20; 0 skips it)")
    ap.add_argument("--paths", default=",".join(ALL), help=f"comma-separated, of: {', '.join(ALL)}")
    ap.add_argument("--no-peers", action="store_true", help="leave out litellm and verifiers")
    ap.add_argument("--before", default=None, metavar="REV",
                    help="also this proxy as it was at REV (git archive), the path 'proxy@REV', side by side")
    ap.add_argument("--workloads", default=None, help="only the workloads whose names contain one of these "
                    "comma-separated words (e.g. '64,sequential'); the rollout is --turns")
    ap.add_argument("--report", default=str(ROOT / "bench-results" / "compare.md"))
    ap.add_argument("--keep", action="store_true", help="keep the work dir (logs, traces) when every check passed; "
                                                         "it is always kept when one failed")
    ap.add_argument("--plots", default=None, help="PNG folder (default docs/img; quick: beside the report)")
    args = ap.parse_args()
    if args.serve:
        serve()
        return 0
    import httpx2 as httpx

    from trace_turns import machine

    quick = args.quick
    reps = args.reps or (1 if quick else 2)
    turns = args.turns if args.turns is not None else (20 if quick else 300)
    names = [n.strip() for n in args.paths.split(",") if n.strip()]
    unknown = set(names) - set(ALL)
    if unknown:
        ap.error(f"unknown path(s): {', '.join(sorted(unknown))}")
    if args.no_peers:
        names = [n for n in names if n not in ("litellm", "verifiers")]
    if "direct" not in names:
        names.insert(0, "direct")  # every figure is relative to it
    c16, c64 = (4, 8) if quick else (16, 64)
    workloads = [
        Workload("sequential JSON", 1, 20 if quick else 200, False, 0, False),
        Workload("SSE, sync client", 1, 10 if quick else 100, True, 50, False),
        Workload("SSE, async client", 1, 10 if quick else 100, True, 50, True),
        # 80 and 25 per client: cells of a few seconds (20 and 10 made a 16-client cell ~0.7 s
        # long, and two repetitions of one path then spread by 20 points on a shared VM)
        Workload(f"JSON, {c16} clients", c16, 5 if quick else 80, False, 0, True),
        Workload(f"JSON, {c64} clients", c64, 3 if quick else 25, False, 0, True),
        Workload(f"500-token streams, {c16} concurrent", c16, 1 if quick else 2, True, 500, True, size=2_000),
        Workload(f"500-token streams, {c64} concurrent", c64, 1, True, 500, True, size=2_000),
        # A provider's pace (~50 tokens/s): each event read alone, where the relay's batching of
        # the events of one read (the fast workloads above) does not apply.
        Workload(f"200-token streams at 50 tokens/s, {c16} concurrent", c16, 1, True, 200, True, size=2_000, gap_ms=20),
    ]
    base_workloads = list(workloads)
    if args.workloads:
        wanted = [x.strip() for x in args.workloads.split(",") if x.strip()]
        workloads = [w for w in workloads if any(x in w.name for x in wanted)]
    work = Path(tempfile.mkdtemp(prefix="bench-compare-"))
    report = Path(args.report)
    report.parent.mkdir(parents=True, exist_ok=True)
    plots = Path(args.plots) if args.plots else (report.parent if quick else ROOT / "docs" / "img")
    started = time.time()
    loads = [" ".join(f"{x:.1f}" for x in os.getloadavg())]
    print(f"bench/compare.py{' --quick' if quick else ''}: {reps} repetition(s), rollout {turns} turns; work dir {work}",
          flush=True)

    sim = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT / "tests")}, start_new_session=True)
    sim_url = sim.stdout.readline().strip().split()[-1]
    skipped: dict[str, str] = {}
    paths: list[Path_] = []
    cells: dict[str, dict[str, list[dict]]] = {w.name: {} for w in base_workloads}
    rollout_data: dict = {}
    run_problems: list[str] = []
    try:
        print("starting the paths:", flush=True)
        paths = start_paths(httpx, work, sim_url, names, skipped, before=args.before)
        read_tally(httpx, sim_url)  # start counting from here
        for w in workloads:
            for r in range(reps):
                order = paths[r % len(paths):] + paths[:r % len(paths)]
                if r % 2:
                    order.reverse()
                for p in order:
                    try:
                        cell = run_cell(httpx, p, w)
                    except Exception as e:  # noqa: BLE001 - the path is marked, the run goes on
                        p.problems.append(f"{w.name}: {type(e).__name__}: {e}"[:300])
                        read_tally(httpx, sim_url)
                        continue
                    cell["rep"] = r
                    cells[w.name].setdefault(p.name, []).append(cell)
                    done = cell["n"] + w.clients  # the warm-up requests count too
                    for problem in tally_problems({p.upstream_model: (done, p.swaps_key)}, read_tally(httpx, sim_url)):
                        p.problems.append(f"{w.name}: {problem}")
            loads.append(" ".join(f"{x:.1f}" for x in os.getloadavg()))
            print(f"  {w.name}: done ({time.time() - started:.0f} s)", flush=True)
        if turns:
            live = list(paths)
            rollout_data = rollout(httpx, live, turns, 570)
            tally = read_tally(httpx, sim_url)
            for p in paths:
                mine = {k: n for k, n in tally.items() if k[0] == p.upstream_model}
                for problem in tally_problems({p.upstream_model: (len(rollout_data[p.name]["lat"]), p.swaps_key)}, mine):
                    p.problems.append(f"rollout: {problem}")
            claimed = {p.upstream_model for p in paths}
            run_problems += [f"rollout: the simulator saw {n} request(s) for {m!r}, which no path claims to send"
                             for (m, _), n in tally.items() if m not in claimed]
            loads.append(" ".join(f"{x:.1f}" for x in os.getloadavg()))
            print(f"  rollout: done ({time.time() - started:.0f} s)", flush=True)
        for p in paths:  # the traces: one call per request, one branch per rollout
            if p.traces is None:
                continue
            try:
                summaries = p.traces()
            except Exception as e:  # noqa: BLE001 - a trace that cannot be read is a failed check
                p.problems.append(f"traces could not be read: {type(e).__name__}: {e}")
                continue
            for k, (summary, sent) in enumerate(zip(summaries, p.sent)):
                is_rollout = k == p.rollout_slot
                for problem in trace_problems(summary, sent, p.upstream_model,
                                              turns=len(rollout_data.get(p.name, {}).get("lat", [])) if is_rollout else None):
                    p.problems.append(f"trace of {'the rollout' if is_rollout else f'client {k}'}: {problem}")
    finally:
        for p in paths:
            try:
                p.stop()
            except Exception as e:  # noqa: BLE001
                print(f"  {p.name}: stopping failed: {e}", flush=True)
        stop_process(sim)

    lines = [f"# bench/compare.py{' --quick (a smoke run)' if quick else ''}", "",
             f"machine: {machine()}; load average (1, 5, 15 min) at the start and after each workload: {' | '.join(loads)}",
             f"{reps} repetition(s) per cell, paths in rotating order (reversed every other repetition); "
             f"wall time {time.time() - started:.0f} s; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             "| path | what |", "|---|---|"]
    lines += [f"| {p.name} | {p.what} |" for p in paths]
    lines += [f"| {n} | SKIPPED: {why} |" for n, why in skipped.items()]
    band = max(5, turns // 12)
    if all(cells[w.name] for w in base_workloads):
        lines += ["", "**summary** (medians over repetitions, with min-max where it says paired; every figure relative to direct or bare where it says so)", ""]
        lines += summary_table(base_workloads, paths, cells, rollout_data, band)
    for w in workloads:
        lines += ["", f"**{w.name}** ({w.clients} client{'s' * (w.clients > 1)} x {w.count} request(s), "
                  f"{'streams of ' + str(w.tokens) + ' events' if w.stream else 'JSON'}, {w.size // 1000} KB request)", ""]
        lines += cell_table(w, paths, cells[w.name])
    if turns:
        lines += ["", f"**growing rollout** ({turns} turns, 570 characters a side per turn; bands of {band} turns)", ""]
        lines += rollout_table(paths, rollout_data, band)
    lines += ["", "**checks** (the simulator's tally of models and keys per cell, every answer whole, "
              "each session's trace one call per request, the rollout one branch)", ""]
    for p in paths:
        if p.problems:
            lines += [f"- {p.name}: FAILED"] + [f"  - {x}" for x in p.problems[:10]]
        else:
            lines.append(f"- {p.name}: ok")
    for n, why in skipped.items():
        lines.append(f"- {n}: SKIPPED ({why})")
    lines += [f"- FAILED: {x}" for x in run_problems]
    lines += [f"- note: {x}" for x in NOTES]
    try:
        plots.mkdir(parents=True, exist_ok=True)
        made = plot(plots, workloads, paths, cells, rollout_data)
        lines += ["", "plots: " + ", ".join(str(m) for m in made)]
    except ImportError:
        lines += ["", "plots: skipped (no matplotlib: `.venv/bin/pip install -e '.[bench]'`)"]
    text = "\n".join(lines) + "\n"
    print()
    print(text)
    report.write_text(text)
    print(f"report written to {report}")
    failed = bool(run_problems or any(p.problems for p in paths))
    if failed or args.keep:
        print(f"work dir kept: {work} (the paths' logs and traces)")
    else:  # ~200 MB of logs and traces a run: a nightly bench must not fill /tmp
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

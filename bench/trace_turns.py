"""What recording a trace costs, turn by turn, as a conversation grows to 300 turns.

    .venv/bin/python bench/trace_turns.py [--turns 300] [--reads 5]

1. Through the proxy: a conversation of ``--turns`` Chat Completions turns, each restating
   the whole history and adding a ~3.4 KB user message and a ~3.4 KB reply, so the last
   request is ~2 MB; run in several lanes in lockstep (each turn goes through every lane
   before the next turn), so that the machine's load hits every lane alike. Per turn: the CPU time mitmdump's threads used (schedstat, ns),
   for this project's addons and, side by side, for bare mitmdump relaying the same
   requests (streaming SSE through, as the addons do); and the bytes that turn's record added to the trace file. Once more streamed,
   in a ``collect_tokens`` session with the simulator playing vLLM (its answer carries the
   whole prompt's token ids, ~0.5 M at the end, which the proxy reads and strips).
2. In process: ``Recorder.commit_turn`` for the same conversation (the graph walk and the
   record, without HTTP), per turn; the writer thread's throughput in records/s; and
   ``read_trace`` of the 300-turn file the proxy wrote.

Prints markdown for docs/benchmarks.md: medians with p10-p90 per band of turns.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai and anthropic SDKs use

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mitm import MitmProcess  # noqa: E402
from overhead import start_simulator  # noqa: E402  (bench/ is this script's folder)

from interceptor.trace import Message, ModelCall, Recorder, Request, Response, Store, Usage, iter_records, read_trace  # noqa: E402

KEY_ENV = "BENCH_PROVIDER_KEY"
CHUNK = 3400  # characters a turn adds on each side: 300 turns restate ~2 MB at the end
REPLY = ("The answer, at length. " * (CHUNK // 23 + 1))[:CHUNK]


def machine() -> str:
    cpu = "unknown CPU"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"{platform.system()} {platform.release()}")


def _schedstat(pid: int, field: int) -> dict[str, int]:
    """One field of ``/proc/<pid>/task/*/schedstat`` per thread id; a thread that just ended is
    left out."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[task.name] = int((task / "schedstat").read_text().split()[field])
        except (OSError, ValueError, IndexError):
            pass
    return out


def cpu_ns(pid: int) -> dict[str, int]:
    """CPU time of each thread of ``pid`` so far (schedstat: ns on CPU), by thread id."""
    return _schedstat(pid, 0)


def runs(pid: int) -> dict[str, int]:
    """How many times each thread of ``pid`` has been put on a CPU so far (schedstat's third
    field): its wake-ups, each of which, on an idle virtual machine, finds cold caches."""
    return _schedstat(pid, 2)


def cpu_between(before: dict[str, int], after: dict[str, int]) -> int:
    """CPU used between two snapshots; a thread that ended in between is left out (only its
    last moments are lost), a thread that started is counted whole."""
    return sum(ns - before.get(tid, 0) for tid, ns in after.items())


def settle(pids: list[int], window: float = 0.2, quiet: float = 0.02, limit: float = 15.0) -> float:
    """Wait until the processes ``pids`` use less than ``quiet`` of a core over ``window``
    seconds (at most ``limit`` seconds); the seconds waited. A proxy's start-up work goes on
    in the background after it listens (the token estimator's ~0.4 s table, a thread of its
    own): measured from its first turn on, that CPU was counted as the first turns'."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        before = [cpu_ns(p) for p in pids]
        time.sleep(window)
        used = sum(cpu_between(b, cpu_ns(p)) for b, p in zip(before, pids))
        if used < quiet * window * 1e9:
            break
    return time.monotonic() - t0


ROLE_IDS = {"system": 200_001, "user": 200_002, "assistant": 200_003, "tool": 200_004}


def template_ids(messages: list[dict]) -> list[int]:
    """The prompt's token ids by this bench's chat template: ``[role] text`` per message, then
    ``[assistant]``, so the renderings of a growing conversation are prefixes of each other."""
    from provider import tokens

    ids = []
    for m in messages:
        ids += [ROLE_IDS[m["role"]], *tokens.ids(tokens.split(m["content"]))]
    return ids + [ROLE_IDS["assistant"]]


def serve(text: str = REPLY) -> None:
    """The simulator for this bench, in its own process: always the same long reply; asked
    for token ids, it plays vLLM with a chat template whose renderings of a conversation
    are prefixes of each other (``[role] text`` per message, then ``[assistant]``), so the
    trace stays one branch as with a real model."""
    import signal

    from provider import ProviderSimulator, Reply

    def reply(record) -> Reply:
        if not record.json.get("return_token_ids"):
            return Reply(text=text, input_tokens=1, output_tokens=1)
        return Reply(text=text, prompt_token_ids=template_ids(record.json["messages"]), output_tokens=1)

    sim = ProviderSimulator(default=reply).start()
    print(f"listening on {sim.base_url}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    sim.stop()


def stream_sse_script(workdir: Path) -> Path:
    """For bare mitmdump: stream SSE answers through, as the addons do (a plain
    ``stream = True``, no tee), so the comparison is streaming against streaming."""
    path = workdir / "stream_sse.py"
    path.write_text("def responseheaders(flow):\n"
                    "    if flow.response.headers.get('content-type', '').startswith('text/event-stream'):\n"
                    "        flow.response.stream = True\n")
    return path


def user_text(k: int) -> str:
    return (f"turn {k}: " + "please continue with the next step. " * (CHUNK // 36 + 1))[:CHUNK]


def ask(client: httpx.Client, payload: bytes, headers: dict, stream: bool) -> str:
    url = "https://api.openai.com/v1/chat/completions"
    if not stream:
        r = client.post(url, content=payload, headers=headers)
        r.raise_for_status()
        return r.json()["choices"][0]["message"]["content"]
    parts = []
    with client.stream("POST", url, content=payload, headers=headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                parts += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
    return "".join(parts)


@dataclass
class Lane:
    """One conversation: who it goes through, how, and mitmdump's CPU ns per turn."""

    client: httpx.Client
    pid: int
    secret: str
    stream: bool = False
    extra: dict = field(default_factory=dict)  # more request keys
    cpu: list[int] = field(default_factory=list)


def lockstep(lanes: dict[str, Lane], turns: int) -> None:
    """Grow every lane's conversation by one turn in turn, so that the machine's moods hit
    all of them alike and per-turn differences between lanes mean something. Every reply is
    the same text, so the lanes' histories are equal."""
    messages = [{"role": "system", "content": "You are a patient assistant."}]
    for k in range(turns):
        messages.append({"role": "user", "content": user_text(k)})
        for lane in lanes.values():
            headers = {"authorization": f"Bearer {lane.secret}", "content-type": "application/json"}
            payload = json.dumps({"model": "gpt-4o", "messages": messages, "stream": lane.stream,
                                  **lane.extra}).encode()
            before = cpu_ns(lane.pid)
            content = ask(lane.client, payload, headers, lane.stream)
            # the trace writer works just after the answer; let it finish inside this turn's window
            time.sleep(0.005)
            lane.cpu.append(cpu_between(before, cpu_ns(lane.pid)))
            assert content == REPLY, content[:80]
        messages.append({"role": "assistant", "content": REPLY})


def bands(values: list[float], turns: int, width: int, scale: float, digits: int = 2) -> list[str]:
    """Median (p10-p90) of each band of ``width`` turns, times ``scale``."""
    out = []
    for lo in range(0, turns, width):
        xs = sorted(values[lo:lo + width])
        if len(xs) < 2:
            continue
        q = statistics.quantiles(xs, n=10)
        m, lo_q, hi_q = (f"{v * scale:,.{digits}f}" for v in (statistics.median(xs), q[0], q[-1]))
        out.append(f"{m} ({lo_q}-{hi_q})")
    return out


def turn_record_sizes(path: Path) -> list[int]:
    records = list(iter_records(path))
    size = path.stat().st_size
    ends = [offset for offset, _ in records[1:]] + [size]
    return [end - offset for (offset, rec), end in zip(records, ends) if rec["kind"] == "turn"]


def in_process_commits(workdir: Path, turns: int) -> tuple[list[float], float]:
    """``commit_turn`` wall time per turn for the same conversation, and the file's size."""
    store = Store()
    rec = Recorder(workdir / "inproc.msgpack", {"id": "inproc"}, store=store, fsync="never")
    history = [Message(role="system", content="You are a patient assistant.")]
    times = []
    for k in range(turns):
        history = history + [Message(role="user", content=user_text(k))]
        reply = Message(role="assistant", content=REPLY)
        call = ModelCall(id=f"c{k}", started_at=1.0, ended_at=2.0)
        response = Response(message=reply, finish_reason="stop", usage=Usage(input_tokens=1, output_tokens=1))
        request = Request(messages=history)  # the dialect parsed it already in the proxy
        t0 = time.perf_counter()
        rec.commit_turn(request, response, call)
        times.append(time.perf_counter() - t0)
        history = history + [reply]
    store.flush(timeout=60)
    store.close()
    return times, (workdir / "inproc.msgpack").stat().st_size


def writer_throughput(workdir: Path, sizes: list[int], files: int, fsync: bool) -> tuple[float, float]:
    """Records/s and MB/s of one Store writing records shaped like turn records."""
    store = Store()
    count = 20_000 if not fsync else 4_000
    node = {"parent": 1, "message": {"role": "assistant", "content": ""}, "sampled": True, "timestamp": 1.0}
    blobs = [dict(node, message={"role": "assistant", "content": "x" * max(0, s - 200)}) for s in sizes[:50]]
    paths = [workdir / f"w{files}{'s' if fsync else ''}-{j}.msgpack" for j in range(files)]
    t0 = time.perf_counter()
    for k in range(count):
        record = {"kind": "turn", "nodes": [blobs[k % len(blobs)]], "call": {"id": f"c{k}"}}
        store.append(paths[k % files], record, sync=fsync, new=k < files)
    store.flush(timeout=300)
    elapsed = time.perf_counter() - t0
    store.close()
    written = sum(p.stat().st_size for p in paths)
    return count / elapsed, written / elapsed / 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=300)
    ap.add_argument("--reads", type=int, default=5)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the simulator process
    args = ap.parse_args()
    if args.serve:
        serve()
        return 0
    turns = args.turns
    width = max(2, turns // 6)

    work = Path(tempfile.mkdtemp(prefix="bench-trace-"))
    sim, sim_url = start_simulator(work, [sys.executable, __file__, "--serve"])
    bare = MitmProcess(script=False, workdir=work / "bare", options={
        "connection_strategy": "lazy", "map_remote": f"|https://api\\.openai\\.com/v1|{sim_url}/v1",
        "scripts": str(stream_sse_script(work))})
    addon = MitmProcess(workdir=work / "addon", options={"intercept_upstream": f"{sim_url}/v1",
                                                         "intercept_api_key_env": KEY_ENV},
                        env={KEY_ENV: "sk-bench-real-key"})
    try:
        bare.start()
        addon.start()
        upstream = {"base_url": f"{sim_url}/v1"}
        sessions = {name: addon.create_session(upstream=upstream, collect_tokens=collect)
                    for name, collect in (("json", False), ("sse", False), ("vllm", False), ("collect", True))}
        vllm_fields = {"return_token_ids": True, "logprobs": True}  # asked by the client itself
        with ExitStack() as stack:
            def client(proxy: MitmProcess, ca: Path) -> httpx.Client:
                return stack.enter_context(httpx.Client(proxy=proxy.url, verify=str(ca), timeout=120))

            bare_ca = bare.confdir / "mitmproxy-ca-cert.pem"
            lanes = {name: Lane(client(addon, addon.ca_bundle), addon.proc.pid, s["model_secret"],
                                stream=name != "json", extra=vllm_fields if name == "vllm" else {})
                     for name, s in sessions.items()}
            lanes["bare json"] = Lane(client(bare, bare_ca), bare.proc.pid, "sk-unused")
            lanes["bare sse"] = Lane(client(bare, bare_ca), bare.proc.pid, "sk-unused", stream=True)
            lockstep(lanes, turns)
        cpu = {name: lane.cpu for name, lane in lanes.items()}
        for s in sessions.values():
            addon.api("DELETE", f"sessions/{s['id']}")
        time.sleep(1)
        path = Path(sessions["json"]["trace_path"])
        sizes = turn_record_sizes(path)
        collect_sizes = turn_record_sizes(Path(sessions["collect"]["trace_path"]))
        collected = read_trace(sessions["collect"]["trace_path"])
        assert collected.num_turns == turns and len(collected.branches) == 1 and collected.branches[0].token_ids
        file_size = path.stat().st_size
        final_request = sum(len(user_text(k)) + len(REPLY) for k in range(turns))
        reads = []
        for _ in range(args.reads):
            t0 = time.perf_counter()
            trace = read_trace(path)
            reads.append(time.perf_counter() - t0)
        assert trace.num_turns == turns and len(trace.branches) == 1, (trace.num_turns, len(trace.branches))
        commits, inproc_size = in_process_commits(work, turns)
        throughput = [(files, fsync, *writer_throughput(work, sizes, files, fsync))
                      for files in (1, 16) for fsync in (False, True)]
    finally:
        addon.cleanup()
        bare.cleanup()
        sim.terminate()
        sim.wait(10)

    print(f"machine: {machine()}")
    print(f"{turns} turns; each adds {CHUNK} + {CHUNK} characters; last request ~{final_request / 1e6:.1f} MB of text\n")
    heads = [f"{lo + 1}-{min(lo + width, turns)}" for lo in range(0, turns, width)]
    print("| per turn, median (p10-p90) | " + " | ".join(f"turns {h}" for h in heads) + " |")
    print("|---" * (len(heads) + 1) + "|")
    rows = (("JSON: mitmdump + addons", "json"), ("JSON: bare mitmdump", "bare json"),
            (f"SSE ({len(REPLY.split())} words, one event per token): mitmdump + addons", "sse"),
            ("SSE: mitmdump + addons, the client asks vLLM for token ids and logprobs itself", "vllm"),
            ("SSE: mitmdump + addons, collect_tokens (vLLM)", "collect"), ("SSE: bare mitmdump", "bare sse"))
    for label, name in rows:
        print(f"| {label}, CPU ms | " + " | ".join(bands(cpu[name], turns, width, 1e-6)) + " |")
    for label, more, less in (("JSON: the addons' share", "json", "bare json"),
                              ("SSE: Collect's own share (collect_tokens - asked by the client)", "collect", "vllm")):
        diff = [a - b for a, b in zip(cpu[more], cpu[less])]
        print(f"| {label}, CPU ms | " + " | ".join(bands(diff, turns, width, 1e-6)) + " |")
    print("| `Recorder.commit_turn` in process, ms | " + " | ".join(bands(commits, turns, width, 1e3)) + " |")
    print("| trace bytes written (turn record) | " + " | ".join(bands(sizes, turns, width, 1, digits=0)) + " |")
    print("| trace bytes written, collect_tokens | " + " | ".join(bands(collect_sizes, turns, width, 1, digits=0)) + " |")
    print()
    print(f"trace file after {turns} turns: {file_size / 1e6:.2f} MB through the proxy "
          f"({inproc_size / 1e6:.2f} MB in process) for a last request of {final_request / 1e6:.2f} MB of "
          f"message text; a log of every request would hold ~{final_request * turns / 2 / 1e6:.0f} MB")
    cumulative = [sum(sizes[:k]) for k in range(width, turns + 1, width)]
    print("cumulative turn bytes every " + str(width) + " turns: " + ", ".join(f"{c / 1e6:.2f} MB" for c in cumulative))
    q = sorted(reads)
    print(f"read_trace of the {turns}-turn file ({file_size / 1e6:.2f} MB): median {statistics.median(q) * 1000:.0f} ms "
          f"(min {q[0] * 1000:.0f}, max {q[-1] * 1000:.0f}) over {len(q)} reads")
    print()
    print("| writer | files | fsync | records/s | MB/s |")
    print("|---|---|---|---|---|")
    for files, fsync, rps, mbs in throughput:
        print(f"| Store (one thread) | {files} | {'each batch' if fsync else 'never'} | {rps:,.0f} | {mbs:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

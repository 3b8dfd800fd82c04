"""What the dialects cost on the proxy's event loop: the stream tee's work per event and per
MB, and the request rewrite's work per body.

    .venv/bin/python bench/dialects.py [--repeats 7] [--quick]

1. **Assembly**: the tee's own path, ``SSEDecoder.feed`` on every network chunk, then
   ``assembler.feed`` on every event, then ``result()`` (the canonical response), on
   - the largest SSE capture in ``tests/fixtures`` (one chunk per event, as providers
     flush them, and in 16 KiB chunks);
   - synthetic streams of each dialect of 1, 2, 5 and 10 MB written by the provider
     simulator (reasoning, text and one tool call with long arguments; Anthropic's padded
     JSON included), one chunk per event. Linear means µs/event and ms/MB stay flat as
     the stream grows; quadratic would make them grow with it.
2. **Request parsing**: what Rewrite does with a body, step by step: ``json.loads``,
   ``parse_request`` (the canonical conversation), ``apply_overrides`` (the session's
   settings: here one changed temperature), the re-encoding Rewrite does when anything
   changed, and the retry digest (sha256), on agent histories of 1 MB and 20 MB.

Every figure is the median over repeated runs with the spread (min-max) next to it.
Prints markdown for docs/benchmarks.md, the machine noted first.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
sys.path.insert(0, str(ROOT / "tests"))  # the simulator writes the synthetic streams

from provider import Reply, ToolCall  # noqa: E402
from provider import anthropic_messages, openai_chat, openai_responses  # noqa: E402
from provider.turn import Turn  # noqa: E402

from interceptor.dialects import ANTHROPIC, CHAT, RESPONSES  # noqa: E402
from interceptor.dialects.sse import SSEDecoder  # noqa: E402
from interceptor.trace.messages import Sampling  # noqa: E402

MB = 1 << 20
DIALECTS = {"chat": CHAT, "responses": RESPONSES, "anthropic": ANTHROPIC}
WRITERS = {"chat": openai_chat, "responses": openai_responses, "anthropic": anthropic_messages}


# -- measuring ------------------------------------------------------------------------------


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds per run; one warm-up run first, a collection before each run so one run's
    garbage is not charged to the next."""
    fn()
    out = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def ms(xs: list[float], scale: float = 1.0) -> str:
    """median (min-max), in milliseconds divided by ``scale``."""
    k = 1000 / scale
    return f"{statistics.median(xs) * k:.2f} ({min(xs) * k:.2f}-{max(xs) * k:.2f})"


def us(xs: list[float], scale: float) -> str:
    k = 1e6 / scale
    return f"{statistics.median(xs) * k:.2f} ({min(xs) * k:.2f}-{max(xs) * k:.2f})"


# -- 1. assembly --------------------------------------------------------------------------


def assemble(dialect, chunks: list[bytes]):
    """The Tee's work on one stream, minus forwarding (content decoding is identity here)."""
    sse = SSEDecoder()
    asm = dialect.assembler()
    events = 0
    for chunk in chunks:
        for event in sse.feed(chunk):
            events += 1
            asm.feed(event)
    for event in sse.flush():
        events += 1
        asm.feed(event)
    return asm.result(), events


def events_of(body: bytes) -> list[bytes]:
    """One chunk per SSE event, blank line included (how providers flush)."""
    out, start = [], 0
    while (end := body.find(b"\n\n", start)) >= 0:
        out.append(body[start:end + 2])
        start = end + 2
    if start < len(body):
        out.append(body[start:])
    return out


def fixed_chunks(body: bytes, size: int) -> list[bytes]:
    return [body[i:i + size] for i in range(0, len(body), size)]


def synthetic(name: str, pieces: int) -> bytes:
    """A stream of ``pieces`` deltas as the simulator writes it for this dialect: a quarter
    reasoning, half text, a quarter arguments of one tool call."""
    q = max(1, pieces // 4)
    reasoning = [f"think{i % 997} " for i in range(q)]
    text = [f"word{i % 991} " for i in range(2 * q)]
    args = ['{"content": "'] + [f"line{i % 983} " for i in range(q)] + ['"}']
    reply = Reply(reasoning=reasoning, text=text, tool_calls=[ToolCall(name="write", arguments=args)])
    request = {"model": "bench-model", "stream": True, "messages": [{"role": "user", "content": "go"}],
               "stream_options": {"include_usage": True}}
    turn = Turn(request, reply, default_model="bench-model")
    return b"".join(WRITERS[name].stream_events(turn))


def synthetic_of_size(name: str, size: int) -> bytes:
    probe = synthetic(name, 4000)
    pieces = int(4000 * size / len(probe))
    return synthetic(name, pieces)


def largest_fixture() -> Path:
    return max(FIXTURES.rglob("*.sse"), key=lambda p: p.stat().st_size)


def dialect_of_fixture(path: Path):
    return ANTHROPIC if "anthropic" in path.parent.name else CHAT


def bench_fixture(repeats: int) -> list[str]:
    path = largest_fixture()
    body = path.read_bytes()
    dialect = dialect_of_fixture(path)
    rows = []
    for how, chunks in (("one chunk per event", events_of(body)), ("16 KiB chunks", fixed_chunks(body, 16384))):
        response, n = assemble(dialect, chunks)
        assert response.error is None, response.error
        runs = timed(lambda: assemble(dialect, chunks), repeats)
        rows.append(f"| `{path.parent.name}/{path.name}` | {dialect.name} | {len(body) / 1024:.1f} KB | {how} | {n} "
                    f"| {ms(runs)} | {us(runs, n)} | {ms(runs, len(body) / MB)} |")
    return rows


def bench_synthetic(sizes_mb: list[float], repeats: int) -> tuple[list[str], list[str]]:
    rows, verdicts = [], []
    for name, dialect in DIALECTS.items():
        per_mb, per_mb_min = [], []
        for size in sizes_mb:
            body = synthetic_of_size(name, int(size * MB))
            chunks = events_of(body)
            response, n = assemble(dialect, chunks)
            assert response.error is None and response.message.tool_calls, response.error
            runs = timed(lambda: assemble(dialect, chunks), repeats)
            mbs = len(body) / MB
            per_mb.append(statistics.median(runs) / mbs)
            per_mb_min.append(min(runs) / mbs)
            rows.append(f"| {name} | {mbs:.2f} MB | {n} | {ms(runs)} | {us(runs, n)} | {ms(runs, mbs)} |")
        verdicts.append(f"{name}: ms/MB at {sizes_mb[-1]:g} MB is {per_mb[-1] / per_mb[0]:.2f}x that at "
                        f"{sizes_mb[0]:g} MB by the median, {per_mb_min[-1] / per_mb_min[0]:.2f}x by the fastest run "
                        f"(linear: 1x; quadratic: {sizes_mb[-1] / sizes_mb[0]:g}x)")
    return rows, verdicts


# -- 2. request parsing -------------------------------------------------------------------

TOOL_OUTPUT = "".join(f"{i:05d} drwxr-xr-x  build/output/file_{i}.py  ünïcödé\n" for i in range(40))  # ~2.4 KB


def history(name: str, size: int) -> bytes:
    """An agent conversation of about ``size`` bytes in the dialect's native request shape:
    per turn a user line, an assistant tool call, its (2.4 KB) result and a short answer."""
    turns = []
    i = 0
    total = 0
    while total < size:
        call_id = f"call_{i:06d}"
        args = json.dumps({"cmd": f"ls -la build/output/{i}", "timeout": 30})
        if name == "chat":
            turn = [{"role": "user", "content": f"step {i}: list the build output"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": call_id, "type": "function", "function": {"name": "bash", "arguments": args}}]},
                    {"role": "tool", "tool_call_id": call_id, "content": TOOL_OUTPUT},
                    {"role": "assistant", "content": f"Step {i} done: 40 files listed."}]
        elif name == "responses":
            turn = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"step {i}: list the build output"}]},
                    {"type": "function_call", "call_id": call_id, "name": "bash", "arguments": args},
                    {"type": "function_call_output", "call_id": call_id, "output": TOOL_OUTPUT},
                    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"Step {i} done: 40 files listed."}]}]
        else:
            turn = [{"role": "user", "content": [{"type": "text", "text": f"step {i}: list the build output"}]},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": call_id, "name": "bash", "input": json.loads(args)}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": TOOL_OUTPUT}]},
                    {"role": "assistant", "content": [{"type": "text", "text": f"Step {i} done: 40 files listed."}]}]
        turns.extend(turn)
        total += len(json.dumps(turn, ensure_ascii=False).encode())
        i += 1
    schema = {"type": "object", "properties": {"cmd": {"type": "string"}, "timeout": {"type": "integer"}}}
    if name == "chat":
        body = {"model": "gpt-4o", "messages": [{"role": "system", "content": "You are an agent."}, *turns],
                "tools": [{"type": "function", "function": {"name": "bash", "parameters": schema}}], "temperature": 1.0}
    elif name == "responses":
        body = {"model": "gpt-4o", "instructions": "You are an agent.", "input": turns,
                "tools": [{"type": "function", "name": "bash", "parameters": schema}], "temperature": 1.0}
    else:
        body = {"model": "claude-x", "system": "You are an agent.", "messages": turns, "max_tokens": 4096,
                "tools": [{"name": "bash", "input_schema": schema}], "temperature": 1.0}
    return json.dumps(body, ensure_ascii=False).encode()


def bench_parse(sizes_mb: list[int], repeats: int) -> list[str]:
    sampling = Sampling(temperature=0.7)
    rows = []
    for size in sizes_mb:
        for name, dialect in DIALECTS.items():
            raw = history(name, size * MB)
            body = json.loads(raw)
            request = dialect.parse_request(body)
            assert len(request.messages) > 100
            reps = repeats if size < 5 else max(3, repeats // 2)
            loads = timed(lambda: json.loads(raw), reps)
            parse = timed(lambda: dialect.parse_request(body), reps)
            # apply_overrides mutates: each run gets a fresh shallow copy (the big lists are shared,
            # as they are untouched by the overrides).
            overrides = timed(lambda: dialect.apply_overrides(dict(body), "bench-model", sampling), reps)
            changed = dict(body)
            dialect.apply_overrides(changed, "bench-model", sampling)
            dumps = timed(lambda: json.dumps(changed, ensure_ascii=False, separators=(",", ":")).encode(), reps)
            digest = timed(lambda: hashlib.sha256(raw).hexdigest(), reps)
            total = [a + b + c + d + e for a, b, c, d, e in zip(loads, parse, overrides, dumps, digest)]
            rows.append(f"| {name} | {len(raw) / MB:.1f} MB | {len(request.messages)} | {ms(loads)} | {ms(parse)} "
                        f"| {ms(overrides)} | {ms(dumps)} | {ms(digest)} | {ms(total)} |")
    return rows


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.platform()}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7, help="runs per figure (the fixture gets 20x as many)")
    ap.add_argument("--quick", action="store_true", help="small sizes only, to check the script runs")
    args = ap.parse_args()
    stream_sizes = [0.1, 0.2] if args.quick else [1, 2, 5, 10]
    parse_sizes = [1] if args.quick else [1, 20]

    print(f"machine: {machine()}; load average at start {os.getloadavg()[0]:.1f}\n")
    print(f"Median (min-max) over {args.repeats} runs ({args.repeats * 20} for the fixture), after one warm-up run.\n")
    print("Assembly of the largest capture (SSE decoding + assembler + result):\n")
    print("| capture | dialect | size | chunking | events | ms per stream | µs per event | ms per MB |")
    print("|---|---|---|---|---|---|---|---|")
    for row in bench_fixture(args.repeats * 20):
        print(row, flush=True)
    print("\nAssembly of synthetic streams (one chunk per event; reasoning, text, one tool call):\n")
    print("| dialect | size | events | ms per stream | µs per event | ms per MB |")
    print("|---|---|---|---|---|---|")
    rows, verdicts = bench_synthetic(stream_sizes, args.repeats)
    for row in rows:
        print(row, flush=True)
    print()
    for v in verdicts:
        print(f"- {v}")
    print("\nRequest parsing (what Rewrite does with a body; ms):\n")
    print("| dialect | body | messages | json.loads | parse_request | apply_overrides | re-encode | sha256 digest | total |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in bench_parse(parse_sizes, args.repeats):
        print(row, flush=True)
    print(f"\nload average at end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

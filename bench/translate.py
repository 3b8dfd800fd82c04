"""What translation costs: a harness of another API on a Chat Completions upstream, against
the same answer in the harness's own dialect, side by side in one run.

    .venv/bin/python bench/translate.py [--repeats 7] [--requests 40]

1. **Per event, in process**: the proxy's answer-side work on one streamed answer.
   *native*: the harness's own stream (written by the provider simulator for its dialect)
   through ``SSEDecoder`` and its assembler, as the Tee does for an untranslated session;
   *translated*: the same answer as a Chat stream through the translated assembler (the
   Chat assembler the record is built from) plus the translate stage (``TranslateStream``:
   cut into events, translated, encoded for the harness). The difference per Chat event is
   what translation adds; the aim is under 20 µs.
2. **First event, in process**: from the first Chat chunk to the harness's first bytes
   (``message_start`` / ``response.created``), the translate stage alone.
3. **Per request, in process**: ``Translation.request`` on Claude Code's captured request
   and on agent histories of 1 MB, against what Rewrite does anyway (``parse_request`` and
   ``apply_overrides``).
4. **End to end**: the anthropic SDK's raw stream through a real mitmdump to the simulator,
   once to a Messages upstream (native) and once to a Chat upstream (translated), requests
   alternating: time to the first event and to the last; the aim is no more than 0.5 ms
   added to the first event.

Every figure is a median with its spread (min-max, or p10-p90 end to end). Prints markdown
for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def _bench_dialects():
    """bench/dialects.py's helpers, loaded by path: as a top-level ``dialects`` it would be
    confused with the package folder of the same name."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_dialects", ROOT / "bench" / "dialects.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_helpers = _bench_dialects()
events_of, machine, ms, synthetic, timed, us = (getattr(_helpers, n) for n in
                                                ("events_of", "machine", "ms", "synthetic", "timed", "us"))

from interceptor.addons.gateway.answer.translate import TranslateStream  # noqa: E402
from interceptor.dialects import ANTHROPIC, CHAT, RESPONSES  # noqa: E402
from interceptor.dialects.sse import SSEDecoder  # noqa: E402
from interceptor.dialects.translate import translation  # noqa: E402
from interceptor.trace.messages import Sampling  # noqa: E402

PAIRS = {"anthropic": (ANTHROPIC, translation("anthropic", "chat")),
         "responses": (RESPONSES, translation("responses", "chat"))}


def native_path(dialect, chunks: list[bytes]) -> int:
    sse, asm, n = SSEDecoder(), dialect.assembler(), 0
    for chunk in chunks:
        for event in sse.feed(chunk):
            n += 1
            asm.feed(event)
    asm.result()
    return n


def translated_path(tr, chunks: list[bytes]) -> int:
    """Assemble (the record) and translate (the harness's bytes), as the pipeline does."""
    sse, asm, n = SSEDecoder(), tr.assembler(), 0
    stream = TranslateStream(None, SimpleNamespace(), tr.events(), None)
    for chunk in chunks:
        for event in sse.feed(chunk):
            n += 1
            asm.feed(event)
        stream(chunk)
    stream(b"")
    asm.result()
    return n


def chat_only(chunks: list[bytes]) -> int:
    return native_path(CHAT, chunks)


def stage_only(tr, chunks: list[bytes]) -> None:
    stream = TranslateStream(None, SimpleNamespace(), tr.events(), None)
    for chunk in chunks:
        stream(chunk)
    stream(b"")


def bench_events(repeats: int) -> list[str]:
    rows = ["| harness | answer | Chat events | native: µs/event | Chat assembly alone: µs/event | translated "
            "(assembly + translation): µs/event | translation adds: µs/Chat event | the translate stage alone: "
            "µs/Chat event |", "|---|---|---|---|---|---|---|---|"]
    for name, (dialect, tr) in PAIRS.items():
        for pieces in (200, 4000):
            native = events_of(synthetic(name, pieces))
            chat = events_of(synthetic("chat", pieces))
            n_native = native_path(dialect, native)
            n_chat = chat_only(chat)
            t_native = timed(lambda: native_path(dialect, native), repeats)
            t_chat = timed(lambda: chat_only(chat), repeats)
            t_tr = timed(lambda: translated_path(tr, chat), repeats)
            t_stage = timed(lambda: stage_only(tr, chat), repeats)
            added = [a - b for a, b in zip(sorted(t_tr), sorted(t_chat))]
            rows.append(f"| {name} | {pieces} deltas | {n_chat} | {us(t_native, n_native)} | {us(t_chat, n_chat)} | "
                        f"{us(t_tr, n_chat)} | {us(added, n_chat)} | {us(t_stage, n_chat)} |")
    return rows


def bench_first_event(repeats: int) -> list[str]:
    rows = ["| harness | first Chat chunk to the harness's first bytes: µs |", "|---|---|"]
    for name, (_, tr) in PAIRS.items():
        first = events_of(synthetic("chat", 200))[0]

        def once() -> None:
            out = TranslateStream(None, SimpleNamespace(), tr.events(), None)(first)
            assert out

        xs = [timed(once, 1)[0] for _ in range(repeats * 50)]
        rows.append(f"| {name} | {us(xs, 1)} |")
    return rows


def history(name: str, size: int) -> dict:
    """An agent loop's request of about ``size`` bytes in the harness's dialect."""
    turns, i = [], 0
    filler = "x" * 2000
    while len(json.dumps(turns)) < size:
        if name == "anthropic":
            turns += [{"role": "assistant", "content": [
                {"type": "thinking", "thinking": f"step {i}", "signature": ""},
                {"type": "tool_use", "id": f"call_{i}", "name": "bash", "input": {"cmd": f"cat f{i}"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"call_{i}", "content": filler}]}]
        else:
            turns += [{"type": "reasoning", "summary": [{"type": "summary_text", "text": f"step {i}"}]},
                      {"type": "function_call", "call_id": f"call_{i}", "name": "bash", "arguments": '{"cmd": "ls"}'},
                      {"type": "function_call_output", "call_id": f"call_{i}", "output": filler}]
        i += 1
    if name == "anthropic":
        return {"model": "m", "max_tokens": 4096, "system": "You are an agent.",
                "messages": [{"role": "user", "content": "go"}, *turns]}
    return {"model": "m", "instructions": "You are an agent.", "input": [{"role": "user", "content": "go"}, *turns]}


def bench_requests(repeats: int) -> list[str]:
    rows = ["| harness | request | parse_request + apply_overrides (Rewrite, untranslated): ms | "
            "translation into Chat + Chat's apply_overrides + dump: ms |", "|---|---|---|---|"]
    captured = json.loads(next((ROOT / "tests" / "fixtures" / "claude-code-requests").glob("*.json")).read_text())["body"]
    cases = [("anthropic", "Claude Code's (captured)", captured),
             ("anthropic", "1 MB history", history("anthropic", 1 << 20)),
             ("responses", "1 MB history", history("responses", 1 << 20))]
    sampling = Sampling(temperature=0.5)
    for name, what, body in cases:
        dialect, tr = PAIRS[name]

        def native() -> None:
            b = json.loads(json.dumps(body))
            dialect.parse_request(b)
            dialect.apply_overrides(b, "policy", sampling)

        def translated() -> None:
            b = json.loads(json.dumps(body))
            dialect.parse_request(b)
            out, _ = tr.request(b)
            CHAT.apply_overrides(out, "policy", sampling)
            json.dumps(out, ensure_ascii=False, separators=(",", ":")).encode()

        rows.append(f"| {name} | {what} ({len(json.dumps(body)) // 1024} KB) | {ms(timed(native, repeats))} | "
                    f"{ms(timed(translated, repeats))} |")
    return rows


def bench_end_to_end(requests: int) -> list[str]:
    import httpx

    from clients import KEY_ENV, REAL_KEY
    from mitm import MitmProcess
    from provider import ProviderSimulator, Reply

    words = [f"w{i} " for i in range(40)]
    rows = ["| upstream | first event: ms | last event: ms |", "|---|---|---|"]
    with ProviderSimulator() as sim:
        sim.default = Reply(reasoning=["thinking "] * 5, text=words)
        upstreams = json.dumps({"msgs": {"base_url": sim.url("/v1"), "api_key_env": KEY_ENV},
                                "vllm": {"base_url": sim.url("/v1"), "api_key_env": KEY_ENV, "dialect": "chat"}})
        with MitmProcess(options={"intercept_upstreams": upstreams}, env={KEY_ENV: REAL_KEY}) as proxy:
            sessions = {up: proxy.create_session(upstream=up) for up in ("msgs", "vllm")}
            times: dict[str, list[tuple[float, float]]] = {up: [] for up in sessions}
            clients = {up: httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=30) for up in sessions}
            body = {"model": "m", "max_tokens": 500, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            for k in range(requests + 2):
                for up, s in sessions.items():
                    headers = {"x-api-key": s["model_secret"], "anthropic-version": "2023-06-01"}
                    t0 = time.perf_counter()
                    first = None
                    with clients[up].stream("POST", "https://api.anthropic.com/v1/messages", json=body,
                                            headers=headers) as r:
                        for chunk in r.iter_raw():
                            if first is None and chunk:
                                first = time.perf_counter()
                    end = time.perf_counter()
                    if k >= 2:  # two warm-up rounds (connections, TLS, first imports)
                        times[up].append((first - t0, end - t0))
            for c in clients.values():
                c.close()
    for up, label in (("msgs", "Messages (native)"), ("vllm", "Chat (translated)")):
        firsts = sorted(t[0] * 1000 for t in times[up])
        lasts = sorted(t[1] * 1000 for t in times[up])
        rows.append(f"| {label} | {_p(firsts)} | {_p(lasts)} |")
    return rows


def _p(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=10)
    return f"{statistics.median(xs):.2f} ({q[0]:.2f}-{q[-1]:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--requests", type=int, default=40)
    args = parser.parse_args()
    print(f"machine: {machine()}; load average at start {os.getloadavg()[0]:.1f}\n")
    for title, rows in (("Per event", bench_events(args.repeats)), ("First event", bench_first_event(args.repeats)),
                        ("Per request", bench_requests(args.repeats)),
                        (f"End to end, {args.requests} streamed requests each, alternating",
                         bench_end_to_end(args.requests))):
        print(f"**{title}**\n")
        print("\n".join(rows))
        print()


if __name__ == "__main__":
    main()

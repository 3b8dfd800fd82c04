"""The answer pipeline's own CPU per streamed event, in process (no sockets, no mitmproxy
layers): what ``bench/events.py`` measures end to end, minus mitmproxy.

    .venv/bin/python bench/pipeline.py [--streams 40] [--tokens 500] [--vllm | --collect] [--messages | --responses]

One session, the script's request-side addons (Claim, Rewrite, Collect, Retry) and the Tee
with its stages (``addons/gateway/answer/pipeline.py``) under ``mitmproxy.test.taddons``; per stream a new
flow: its request hooks, ``responseheaders``, the stream callable once per chunk (the
simulator's Chat stream, or with ``--messages`` its Messages stream, with ``--responses`` its
Responses stream, one event per chunk, as providers flush them), its end, and ``response``. Timed apart (``time.perf_counter_ns``, min and median of ``--streams``):

- *chunks*: the stream callable over every chunk, terminal commit included, per event;
- *answer*: that plus ``responseheaders`` and ``response`` (the per-stream set-up and close),
  per event;
- *request*: the request hooks, per stream (divided by the events, what they add per event).

Each stream's trace turn is checked: the reply whole.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mitmproxy import http  # noqa: E402
from mitmproxy.test import taddons, tflow  # noqa: E402
from provider import Reply, anthropic_messages, openai_chat, openai_responses  # noqa: E402
from provider.turn import Turn  # noqa: E402

from interceptor.addons.mitm.claim import Claim  # noqa: E402
from interceptor.addons.gateway.answer.collect import Collect  # noqa: E402
from interceptor.addons.gateway.retry import Retry  # noqa: E402
from interceptor.addons.gateway.rewrite import Rewrite  # noqa: E402
from interceptor.addons.gateway.sessions.session import Registry, SessionConfig  # noqa: E402
from interceptor.addons.mitm.settings import Settings  # noqa: E402
from interceptor.addons.gateway.answer.tee import Tee  # noqa: E402
from interceptor.addons.gateway.sessions.upstream import Upstream  # noqa: E402

ENV = "INTERCEPT_BENCH_KEY"
URL = "https://api.openai.com/v1/chat/completions"
MESSAGES_URL = "https://api.anthropic.com/v1/messages"
RESPONSES_URL = "https://api.openai.com/v1/responses"
RESPONSES_REQUEST = {"model": "gpt-5", "stream": True, "input": "count"}
REQUEST = {"model": "gpt-4o", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 4096,
           "messages": [{"role": "user", "content": "count"}]}


def stream_chunks(tokens: int, vllm: bool = False, messages: bool = False,
                  responses: bool = False) -> tuple[list[bytes], str]:
    """The simulator's stream of ``tokens`` one-token deltas, one event per chunk."""
    pieces = [f"w{k} " for k in range(tokens)]
    request = dict(RESPONSES_REQUEST if responses else REQUEST)
    if vllm:
        request.update(return_token_ids=True, logprobs=True)
    writer = anthropic_messages if messages else openai_responses if responses else openai_chat
    return writer.stream_events(Turn(request, Reply(text=pieces), default_model="gpt-4o")), "".join(pieces)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--vllm", action="store_true", help="token ids and logprobs on every chunk")
    ap.add_argument("--messages", action="store_true", help="an Anthropic Messages stream")
    ap.add_argument("--responses", action="store_true", help="an OpenAI Responses stream")
    ap.add_argument("--collect", action="store_true",
                    help="a collect_tokens session: the proxy asked for the token fields and strips them (implies --vllm)")
    args = ap.parse_args()
    os.environ[ENV] = "sk-bench-real-key"
    chunks, text = stream_chunks(args.tokens, args.vllm or args.collect, args.messages, args.responses)
    body = json.dumps(RESPONSES_REQUEST if args.responses else REQUEST).encode()
    registry = Registry()
    settings = Settings(registry)
    retry, collect = Retry(), Collect()
    claim, rewrite, tee = Claim(registry, settings), Rewrite(), Tee(strip=collect, capture=retry)
    chunk_ns: list[float] = []
    answer_ns: list[float] = []
    request_ns: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp, taddons.context(retry) as tctx:
        loop = tctx.master.event_loop
        session = registry.create(SessionConfig(collect_tokens=args.collect), Path(tmp), "never", Upstream(api_key_env=ENV))

        def run(value):
            return loop.run_until_complete(value) if hasattr(value, "__await__") else value

        for k in range(args.streams + 1):
            key = {"x-api-key": session.model_secret} if args.messages else {"authorization": f"Bearer {session.model_secret}"}
            flow = tflow.tflow(req=http.Request.make("POST", MESSAGES_URL if args.messages else RESPONSES_URL
                                                     if args.responses else URL, body, {
                "content-type": "application/json", **key}), client_conn=tflow.tclient_conn())
            t0 = time.perf_counter_ns()
            for hook in (claim.requestheaders, rewrite.request, collect.request, retry.request):
                run(hook(flow))
            t1 = time.perf_counter_ns()
            flow.response = http.Response.make(200, b"", {"content-type": "text/event-stream; charset=utf-8",
                                                          "transfer-encoding": "chunked"})
            gc.disable()  # the collector's pauses are the process's, not the pipeline's (bench/gcpause.py)
            t2 = time.perf_counter_ns()
            tee.responseheaders(flow)
            stream = flow.response.stream
            t3 = time.perf_counter_ns()
            sent = [stream(chunk) for chunk in chunks]
            stream(b"")
            t4 = time.perf_counter_ns()
            tee.response(flow)
            t5 = time.perf_counter_ns()
            gc.enable()
            if args.collect and k == 0:  # the harness gets no token fields
                got = b"".join(b"".join(x) if isinstance(x, list) else x for x in sent)
                assert b"token_ids" not in got and b'"logprobs":{' not in got, got[:300]
            if k:  # the first one warms up
                request_ns.append(t1 - t0)
                chunk_ns.append((t4 - t3) / len(chunks))
                answer_ns.append((t5 - t2) / len(chunks))
        trace = session.recorder.trace
        replies = [n.message.text() for n in trace.nodes if n.sampled]
        assert replies == [text], "the same prompt and reply each time: one sampled node"
        assert len(trace.calls) == args.streams + 1 and all(c.error is None and c.finish_reason == "stop"
                                                            for c in trace.calls), trace.calls[-1]
        assert all(len(c.event_gaps_ms) == len(chunks) for c in trace.calls)
        registry.seal_all("bench")
        registry.store.close()

    def line(name: str, xs: list[float], scale: float, unit: str) -> str:
        xs = [x / scale for x in xs]
        return f"| {name} | {min(xs):.2f} | {statistics.median(xs):.2f} | {unit} |"

    print(f"{args.streams} {'Messages' if args.messages else 'Responses' if args.responses else 'Chat'} streams of {len(chunks)} chunks (one event each)"
          f"{', vLLM token fields' if args.vllm or args.collect else ''}{', collect_tokens (stripped)' if args.collect else ''}; "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print()
    print("| part | min | median | unit |")
    print("|---|---|---|---|")
    print(line("chunks (stream callable, commit included)", chunk_ns, 1e3, "µs per event"))
    print(line("answer (responseheaders + chunks + response)", answer_ns, 1e3, "µs per event"))
    print(line("request hooks", request_ns, 1e6, "ms per stream"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

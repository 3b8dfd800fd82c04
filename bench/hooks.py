"""Which addon hook costs what, per request, in process: a growing rollout and a fixed 20 KB body.

    .venv/bin/python bench/hooks.py [--turns 300] [--mode rollout|fixed] [--band 25] [--hooks] [--no-tuning]
                                    [--collect-tokens] [--stream] [--memory] [--dialect chat|anthropic] [--tools]

Every hook of ``addons/interception.py``'s list, in its order, on ``tflow`` flows (mitmproxy's
``taddons``; no sockets, no TLS, the relay off, since there is no upstream to relay to), with
the start-up tuning (``RuntimeTuning.running``) done first, as in the proxy. Per request: the CPU
time of this thread (``time.thread_time_ns``, so the shared machine's load mostly cancels)
in each addon's ``requestheaders``, ``request``, ``responseheaders`` and ``response`` hook,
and the collector's passes (``gc.callbacks``). ``rollout``: the growing conversation (a
570-character user message and reply added per turn, the whole history restated, the session
imposing a model); ``fixed``: the same ~20 KB one-message request every time (bench/overhead.py's
small JSON body). The answer is a Chat Completions JSON reply. ``--hooks``: the session has a
request hook (a redaction of a word every tenth user message holds; the rewrites are spliced
into every later turn), as ``bench/rollout.py --hooks``. ``--collect-tokens``: the session
collects token ids and the answer is vLLM's to the request as the proxy rewrote it (the
prompt's ids by a template whose renderings are prefixes of each other, ``bench/trace_turns.py``'s;
each token's id and logprob), as ``bench/rollout.py --collect-tokens``. ``--stream``: every
turn streamed, its chunks (one event each, as the simulator writes them) through the stream
callable the Tee sets, its first chunk (the prompt's ids), the chunks between and the last
three (the commit) timed apart. Prints, for the first and the last band of turns, the median
per hook, largest first, the sum of all hooks and the minor page faults per request;
``--memory``: what the live session keeps of its token ids and logprobs at the end.

What this leaves out is what only a real mitmdump does: TLS, HTTP framing, the event loop's
round trips and the relay's loopback hop (bench/rollout.py and bench/relay.py measure those).
"""

from __future__ import annotations

import argparse
import base64
import gc
import importlib.util
import inspect
import json
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from mitmproxy import http
from mitmproxy.test import taddons, tflow

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
KEY_ENV = "BENCH_HOOKS_KEY"
MODEL = "gpt-4o-bench"
URL = "https://api.openai.com/v1/chat/completions"
# --hooks: what an evaluator's redaction looks like; it is shown the whole request each turn
# (bench/rollout.py --hooks uses the same).
SECRET = "SECRET"
REDACT = f"""
from interceptor.hooks import HookContext, Request, intercept

@intercept
def redact(request: Request, ctx: HookContext):
    for m in request.messages:
        if m.role == "user" and "{SECRET}" in m.text():
            m.content = m.text().replace("{SECRET}", "[redacted]")
    return request
"""
HOOKS = ("requestheaders", "request", "responseheaders", "response")


def load_script():
    spec = importlib.util.spec_from_file_location("interception_bench_hooks", ROOT / "addons" / "interception.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def answer(i: int, reply: str, dialect: str = "chat") -> bytes:
    if dialect == "anthropic":
        return json.dumps({"id": f"msg_{i}", "type": "message", "role": "assistant", "model": MODEL,
                           "content": [{"type": "text", "text": reply}], "stop_reason": "end_turn",
                           "usage": {"input_tokens": 10, "output_tokens": 10}}).encode()
    return json.dumps({"id": f"chatcmpl-{i}", "object": "chat.completion", "created": 1, "model": MODEL,
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                                    "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20}}).encode()


def token_memory(trace, session) -> dict[str, str]:
    """The bytes a live session's token data holds: the nodes' ``token_ids``, ``mask`` and
    ``logprobs`` lists and the list the next prompt extends (``Prior.ids``), and the int and
    float objects in them, each object counted once (``sys.getsizeof``)."""
    lists = 0
    objects: dict[int, int] = {}
    kept = [getattr(p, "ids", None) for p in session.last_prompts]
    for values in [v for n in trace.nodes for v in (n.token_ids, n.mask, n.logprobs)] + kept:
        if values is None:
            continue
        lists += sys.getsizeof(values)
        for x in values:
            if type(x) is not bool:
                objects.setdefault(id(x), sys.getsizeof(x))
    ids = sum(len(n.token_ids) for n in trace.nodes if n.token_ids is not None)
    return {"ids on the nodes": str(ids), "lists": f"{lists / 1e6:.2f} MB",
            "int and float objects": f"{len(objects)} ({sum(objects.values()) / 1e6:.2f} MB)",
            "in all": f"{(lists + sum(objects.values())) / 1e6:.2f} MB"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=300)
    ap.add_argument("--mode", choices=("rollout", "fixed"), default="rollout")
    ap.add_argument("--chunk", type=int, default=570)
    ap.add_argument("--band", type=int, default=25)
    ap.add_argument("--hooks", action="store_true",
                    help="the session has a request hook (it redacts a word the user writes every tenth turn)")
    ap.add_argument("--no-tuning", action="store_true",
                    help="intercept_runtime_tuning false: Python's collector and glibc's allocator at their defaults")
    ap.add_argument("--collect-tokens", action="store_true",
                    help="the session collects token ids; the answer is vLLM's, with the prompt's ids")
    ap.add_argument("--stream", action="store_true", help="every answer streamed through the Tee's stream callable")
    ap.add_argument("--tools", action="store_true",
                    help="every request advertises Claude Code's nine tools (tests/fixtures/claude-code-requests/)")
    ap.add_argument("--dialect", choices=("chat", "anthropic"), default="chat",
                    help="anthropic: Claude Code's shape (bench/rollout.py's request_body), a JSON answer; "
                         "not with --collect-tokens or --stream")
    ap.add_argument("--memory", action="store_true",
                    help="at the end, what the session keeps of its token ids and logprobs (objects and lists)")
    args = ap.parse_args()
    if args.dialect != "chat" and (args.collect_tokens or args.stream):
        ap.error("--dialect anthropic is JSON answers without token ids")
    from rollout import URLS, request_body
    tools = None
    if args.tools:
        captured = json.loads((ROOT / "tests/fixtures/claude-code-requests/interleaved-system-2.1.197.json").read_text())
        tools = captured.get("body", captured)["tools"]
        if args.dialect == "chat":
            tools = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                       "parameters": t["input_schema"]}} for t in tools]
    from provider import Reply, openai_chat, tokens
    from provider.turn import Turn
    from trace_turns import template_ids
    os.environ[KEY_ENV] = "sk-bench-real-key"
    script = load_script()
    from interceptor.addons.gateway.sessions.session import SessionConfig
    from interceptor.addons.mitm.tuning import RuntimeTuning
    from interceptor.addons.gateway.sessions.upstream import Upstream

    addons = script.addons  # timed one by one, in the order mitmproxy calls them
    work = Path(tempfile.mkdtemp(prefix="bench-hooks-"))
    reply = ("The answer, at length. " * (args.chunk // 23 + 1))[:args.chunk]
    rows: list[dict[str, int]] = []
    faulted: list[int] = []  # minor page faults per request (fresh pages of new blocks)
    upstream = socket.create_server(("127.0.0.1", 0))  # listening is all Reach's probe needs
    with upstream, taddons.context(*script.addons) as tctx:
        tctx.configure(script.addons[0], intercept_trace_dir=str(work), confdir=str(work / "conf"), intercept_drain_timeout=0,
                       intercept_runtime_tuning=not args.no_tuning)
        next(a for a in addons if isinstance(a, RuntimeTuning)).running()
        hooked = {}
        if args.hooks:
            from interceptor.addons.gateway.policy.hookload import load_hooks
            (work / "bench_redact.py").write_text(REDACT)
            hooked = {"hooks": load_hooks(str(work / "bench_redact.py"))}
        session = script.registry.create(
            SessionConfig(model=MODEL, collect_tokens=args.collect_tokens), work, "never",
            Upstream(base_url=f"http://127.0.0.1:{upstream.getsockname()[1]}/v1", api_key_env=KEY_ENV), **hooked)
        loop = tctx.master.event_loop
        per: dict[str, int] = defaultdict(int)
        started = [0]

        def collected(phase: str, info: dict) -> None:
            if phase == "start":
                started[0] = time.thread_time_ns()
            else:
                per[f"gc (generation {info['generation']})"] += time.thread_time_ns() - started[0]

        gc.callbacks.append(collected)

        async def phase(hook: str, flow: http.HTTPFlow) -> None:
            # One coroutine per hook, as mitmproxy's dispatch is: an async step that does not
            # suspend costs no pass of the loop (running each with run_until_complete gave
            # every async hook a loop pass of its own, ~30-50 µs it never costs in mitmdump).
            for addon in addons:
                method = getattr(addon, hook, None)
                if method is None:
                    continue
                t0 = time.thread_time_ns()
                value = method(flow)
                if inspect.isawaitable(value):
                    await value
                per[f"{type(addon).__name__}.{hook}"] += time.thread_time_ns() - t0

        def run(hook: str, flow: http.HTTPFlow) -> None:
            loop.run_until_complete(phase(hook, flow))

        auth = {"authorization": f"Bearer {session.model_secret}", "content-type": "application/json",
                "x-api-key": session.model_secret, "anthropic-version": "2023-06-01",
                "proxy-authorization": "Basic " + base64.b64encode(f"session:{session.model_secret}".encode()).decode()}
        messages = [{"role": "system", "content": "You are a patient assistant."}]
        filler = "x" * 20_000
        # One connection for the rollout, as a harness's keep-alive client: each request on it
        # settles the last answer's (Retry keeps a connection's answers until then).
        conn = tflow.tclient_conn()
        for k in range(args.turns):
            if args.mode == "rollout":
                said = f"{SECRET} " if args.hooks and k % 10 == 0 else ""
                messages.append({"role": "user", "content": (f"turn {k}: {said}" + "please go on. " * (args.chunk // 14 + 1))[:args.chunk]})
                payload = request_body(args.dialect, messages, k)
                if tools is not None:
                    payload = json.dumps({**json.loads(payload), "tools": tools}).encode()
            else:
                payload = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": f"{k} {filler}"}]}).encode()
            flow = tflow.tflow(req=http.Request.make("POST", URLS[args.dialect] if args.mode == "rollout" else URL,
                                                     payload, auth), client_conn=conn)
            per.clear()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            run("requestheaders", flow)
            run("request", flow)
            if flow.response is not None:
                raise SystemExit(f"turn {k} was answered by the proxy: {flow.response.content[:200]!r}")
            if args.collect_tokens or args.stream:  # the simulator's answer to the request as rewritten
                sent = json.loads(flow.request.content)
                ids = template_ids(sent["messages"]) if args.collect_tokens else None
                turn = Turn({**sent, "stream": args.stream}, Reply(text=reply, prompt_token_ids=ids), default_model=MODEL)
            if args.stream:
                chunks = openai_chat.stream_events(turn)
                flow.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
            else:
                body = openai_chat.json_body(turn) if args.collect_tokens else answer(k, reply, args.dialect)
                flow.response = http.Response.make(200, body, {"content-type": "application/json"})
            run("responseheaders", flow)
            if args.stream:
                stream, t0 = flow.response.stream, time.thread_time_ns()
                stream(chunks[0])
                t1 = time.thread_time_ns()
                for chunk in chunks[1:-3]:
                    stream(chunk)
                t2 = time.thread_time_ns()
                for chunk in chunks[-3:]:
                    stream(chunk)
                stream(b"")
                t3 = time.thread_time_ns()
                per["stream: the first chunk"] += t1 - t0
                per["stream: the chunks between"] += t2 - t1
                per["stream: the last three (the commit)"] += t3 - t2
            run("response", flow)
            rows.append(dict(per))
            faulted.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
            if args.mode == "rollout":
                messages.append({"role": "assistant", "content": reply})
        gc.callbacks.remove(collected)
        script.registry.store.flush(timeout=60)
        trace = session.recorder.trace
        if trace.num_turns != args.turns or len(trace.branches) != (1 if args.mode == "rollout" else args.turns):
            raise SystemExit(f"the trace does not hold the run: {trace.num_turns} turns, {len(trace.branches)} branches")
        if args.collect_tokens and args.mode == "rollout" and len(trace.branches[0].token_ids or ()) != len(ids) + len(
                tokens.split(reply)):
            raise SystemExit("the trace's branch does not hold every token id")
        if args.memory:
            kept = token_memory(trace, session)
        script.registry.seal_all("bench")
        script.registry.store.close()
    shutil.rmtree(work, ignore_errors=True)

    if args.memory:
        print("what the live session kept of its tokens at the end: " + ", ".join(f"{k} {v}" for k, v in kept.items()))
    print(f"{args.mode}, {args.turns} requests, last body {len(payload) / 1e3:.0f} KB; CPU of this thread, us")
    for lo, hi in ((0, args.band), (args.turns - args.band, args.turns)):
        band = rows[lo:hi]
        keys = set().union(*band)
        hooks = {key: statistics.median(r.get(key, 0) for r in band) / 1e3 for key in keys if not key.startswith("gc")}
        total = statistics.median(sum(v for key, v in r.items() if not key.startswith("gc")) for r in band) / 1e3
        collector = {key: statistics.mean(r.get(key, 0) for r in band) / 1e3 for key in keys if key.startswith("gc")}
        print(f"\nrequests {lo + 1}-{hi}: all hooks {total:.0f} (median)"
              + "".join(f"; {key} {v:.0f} (mean)" for key, v in sorted(collector.items()))
              + f"; page faults {statistics.median(faulted[lo:hi]):.0f} a request (median)")
        for key, v in sorted(hooks.items(), key=lambda kv: -kv[1]):
            if v >= 5:
                print(f"  {key:40s} {v:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A growing rollout, turn by turn: does the proxy's cost per turn grow with the history?

    .venv/bin/python bench/rollout.py [--turns 300] [--chunk 570] [--before REV] [--dialect anthropic|gemini|responses] [--hooks]
                                      [--collect-tokens] [--stream] [--warm N [--warm-live]] [--script PROBE.py]

One Chat Completions conversation of ``--turns`` turns, each restating the whole history and
adding a ``--chunk``-character user message and reply (300 x 2 x 570 characters: the last
request is ~340 KB), sent to every path **in the same turn, the
order rotating every turn**, so the machine's load (a shared 2-core box) hits every path
alike. ``--dialect anthropic`` sends the same conversation as Claude Code sends its own to
the Messages API: a system prompt opened by a billing header that changes every request, and
the ``cache_control`` marker on the newest block only, so the message that carried it is
restated without it every turn; ``--dialect gemini`` as Gemini CLI sends it to
``generateContent``; ``--dialect responses`` as a Responses client that restates its whole
input (``store: false``; the openai-agents SDK's default) does. ``--hooks``: each proxy session
has a request hook (an evaluator's redaction: every tenth user message holds a word it
replaces, and the rewrite is spliced into every later turn that restates the original).
``--collect-tokens`` (Chat): the simulator plays vLLM with a chat template whose renderings are
prefixes of each other (bench/trace_turns.py's), each proxy session collects token ids (the
proxy asks for them, records them and strips them), and ``direct`` and ``bare`` ask for them
themselves, so every path gets the same answer from upstream: the whole prompt's ids on every
turn (~70,000 at turn 300). ``--stream``: every turn streamed (bare mitmdump with a script
that streams SSE through, as the proxy does). ``--warm N``: before the rollout, every path
serves N other sessions of ``--warm-turns`` (10) turns of ~20 KB each, 16 at a time, each
session sealed (``DELETE``) when its last turn is answered, as an orchestrator ends each
rollout of a night (``--warm-live``: left live): what the rollout costs on a proxy that has
already served a night's sessions, against bare mitmdump that has relayed the same requests.

- ``direct``: to the simulator, no proxy (the latency floor);
- ``bare``: bare mitmdump, TLS intercepted for api.openai.com and mapped to the simulator
  (``map_remote``): mitmproxy's own cost for the same bytes;
- ``before``: this proxy at ``--before`` (default: the last commit before the prefix
  recognition), exported with ``git archive`` and run from there (omit with ``--before none``);
- ``proxy``: this checkout;
- ``no relay`` (with ``--relay-off``): this checkout with ``intercept_drain_timeout=0``, so
  mitmproxy talks to the upstream itself: the relay's loopback hop told apart from the addons;
- ``env`` (with ``--env NAME=VALUE``): this checkout with that variable in its environment
  (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, say), for a process setting no option can make.

Each proxy session imposes a model (so every request is rewritten, as in an evaluation).
Per turn and path: the wall time of the request, and the CPU time all of the mitmdump
process's threads used (``/proc/<pid>/task/*/schedstat``) from just before the request to
5 ms after the answer (the trace writer's share lands in that window), and the minor page
faults the process took in that window (``/proc/<pid>/stat``: pages touched for the first
time, a fresh block's). Reported: CPU per turn in bands of turns, the ratio of the last band
to the first, the page faults per turn, the resident set at each band's end, and the latency each proxy
adds to direct (p50 and p99 per band); then, paired turn by turn, this checkout minus each
other path in the first and last band (CPU and latency: the same request through both within
a second, so a shared machine's load mostly cancels; the A/B figure to read). Afterwards each proxy's trace is read back: one
branch, one turn per request, the imposed model on every call; a path that did not do what
it claims fails the run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx2 as httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from failclosed import checkout_proxy  # noqa: E402
from hooks import REDACT, SECRET  # noqa: E402 (--hooks: the same redaction as bench/hooks.py's)
from mitm import MitmProcess  # noqa: E402
from overhead import KEY_ENV, start_simulator  # noqa: E402
from trace_turns import cpu_between, cpu_ns, machine, serve, settle, stream_sse_script  # noqa: E402

from interceptor.trace import read_trace  # noqa: E402

MODEL = "gpt-4o-bench"  # what each proxy session imposes
URLS = {"chat": "https://api.openai.com/v1/chat/completions", "anthropic": "https://api.anthropic.com/v1/messages",
        "gemini": "https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-pro:generateContent",
        "responses": "https://api.openai.com/v1/responses"}


VLLM = {"return_token_ids": True, "logprobs": True}  # what a collect_tokens session asks vLLM for


def request_body(dialect: str, messages: list[dict], k: int, extra: dict | None = None) -> bytes:
    """Turn ``k``'s body: Chat as is (with ``extra`` fields); Anthropic as Claude Code sends it (the module docstring);
    Gemini as Gemini CLI does (the system prompt as ``systemInstruction``)."""
    if dialect == "chat":
        return json.dumps({"model": "gpt-4o", "messages": messages, **(extra or {})}).encode()
    system, *rest = messages
    if dialect == "responses":
        return json.dumps({"model": "gpt-5", "instructions": system["content"], "store": False, "input": [
            {"role": m["role"], "content": m["content"]} if m["role"] == "user" else
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": m["content"]}]}
            for m in rest]}).encode()
    if dialect == "gemini":
        return json.dumps({"systemInstruction": {"parts": [{"text": system["content"]}]},
                           "contents": [{"role": "model" if m["role"] == "assistant" else "user",
                                         "parts": [{"text": m["content"]}]} for m in rest]}).encode()
    rest = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in rest]
    rest[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
    return json.dumps({"model": "claude-sonnet-4-5", "max_tokens": 1024,
                       "system": [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; cch={k:05x};"},
                                  {"type": "text", "text": system["content"], "cache_control": {"type": "ephemeral"}}],
                       "messages": rest}).encode()


def answer_text(dialect: str, body: dict) -> str:
    if dialect == "gemini":
        return "".join(p.get("text", "") for p in body["candidates"][0]["content"]["parts"])
    if dialect == "responses":
        return "".join(c.get("text", "") for item in body["output"] if item.get("type") == "message"
                       for c in item["content"])
    return body["choices"][0]["message"]["content"] if dialect == "chat" else body["content"][0]["text"]


def before_rev() -> str:
    out = subprocess.run(["git", "log", "--format=%H", "--grep=^The restated history is recognised", "-n1"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    return out + "^" if out else "HEAD"


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def minflt(pid: int) -> int:
    """The process's minor page faults so far, all threads (``/proc/<pid>/stat``, field 10)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def rss_mb(pid: int) -> float:
    """The process's resident set now, MB (``/proc/<pid>/status``, VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def headers(secret: str) -> dict[str, str]:
    """The secret where each dialect's SDK puts its key."""
    return {"authorization": f"Bearer {secret}", "x-api-key": secret, "x-goog-api-key": secret,
            "anthropic-version": "2023-06-01", "content-type": "application/json"}


def warm_up(p: MitmProcess, bare: bool, args, url: str, base: str) -> int:
    """``--warm``: ``args.warm`` sessions of ``args.warm_turns`` turns through ``p``, 16 at a time,
    each a conversation of its own opened by an 18 KB user message (so ~20 KB a request); through
    a proxy (not ``bare``) each is a session made through the control API, imposing the model,
    and sealed after its last answer unless ``--warm-live``. Returns the number of requests answered."""
    from concurrent.futures import ThreadPoolExecutor

    ca = str(p.confdir / "mitmproxy-ca-cert.pem" if bare else p.ca_bundle)
    opening = ("Here is the file to read. " * 700)[:18_000]

    def worker(w: int) -> int:
        done = 0
        with httpx.Client(proxy=p.url, verify=ca, timeout=120) as client:
            for i in range(w, args.warm, 16):
                s = None if bare else p.create_session(upstream={"base_url": base}, model=MODEL)
                secret = s["model_secret"] if s else "sk-unused"
                messages = [{"role": "system", "content": "You are a patient assistant."},
                            {"role": "user", "content": f"session {i}: {opening}"}]
                for k in range(args.warm_turns):
                    r = client.post(url, content=request_body(args.dialect, messages, k), headers=headers(secret))
                    r.raise_for_status()
                    done += 1
                    messages += [{"role": "assistant", "content": answer_text(args.dialect, r.json())},
                                 {"role": "user", "content": f"turn {k} of session {i}: go on."}]
                if s and not args.warm_live:
                    status, _ = p.api("DELETE", f"sessions/{s['id']}")
                    assert status == 200, status
        return done

    with ThreadPoolExecutor(16) as pool:
        return sum(pool.map(worker, range(16)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=300)
    ap.add_argument("--chunk", type=int, default=570)
    ap.add_argument("--band", type=int, default=25, help="turns per band of the table")
    ap.add_argument("--before", default=None, help="a git revision, or 'none'")
    ap.add_argument("--relay-off", action="store_true", help="also this checkout without the relay")
    ap.add_argument("--env", metavar="NAME=VALUE", help="also this checkout with NAME=VALUE in its environment")
    ap.add_argument("--dialect", choices=tuple(URLS), default="chat")
    ap.add_argument("--hooks", action="store_true", help="each proxy session has a request hook (a redaction)")
    ap.add_argument("--stream", action="store_true", help="Chat: every turn streamed (SSE; bare with the stream script)")
    ap.add_argument("--collect-tokens", action="store_true",
                    help="Chat: the simulator plays vLLM; proxy sessions collect_tokens, direct and bare ask for the ids")
    ap.add_argument("--script", type=Path, action="append", default=[],
                    help="also load this mitmproxy script into every proxy path (a probe: a collector's log, say)")
    ap.add_argument("--warm", type=int, default=0, metavar="N", help="N sessions served through every path first")
    ap.add_argument("--warm-turns", type=int, default=10)
    ap.add_argument("--warm-live", action="store_true", help="leave the --warm sessions live (default: sealed)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the --collect-tokens simulator
    args = ap.parse_args()
    reply = ("The answer, at length. " * (args.chunk // 23 + 1))[:args.chunk]
    if args.serve:
        serve(reply)
        return 0
    if (args.collect_tokens or args.stream) and args.dialect != "chat":
        ap.error("--collect-tokens and --stream are for --dialect chat (vLLM's Chat Completions)")
    url = URLS[args.dialect]
    work = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    if args.collect_tokens:  # token ids whose renderings are prefixes of each other, as a real template's
        sim, sim_url = start_simulator(work, [sys.executable, __file__, "--serve", "--chunk", str(args.chunk)])
    else:
        script = work / "script.json"
        script.write_text(json.dumps({"default": {"text": [reply]}}))
        sim, sim_url = start_simulator(work, [sys.executable, "-m", "provider", "--port", "0", "--script", str(script)])
    host, path = "/".join(url.split("/")[:3]), "/" + url.split("/", 3)[3]
    remap = f"|{re.escape(host)}|{sim_url}"
    base = sim_url if args.dialect == "gemini" else f"{sim_url}/v1"  # Gemini's path carries its version
    opts = {"intercept_upstream": base, "intercept_api_key_env": KEY_ENV}
    env = {KEY_ENV: "sk-bench-real-key"}
    bare_opts = {"connection_strategy": "lazy", "map_remote": remap}
    if args.stream:  # streamed through, as the proxy does, not read whole
        bare_opts["scripts"] = str(stream_sse_script(work))
    procs = {"bare": MitmProcess(script=False, workdir=work / "bare", options=bare_opts)}
    rev = None
    if args.before != "none":
        rev = args.before or before_rev()
        procs["before"] = checkout_proxy(rev, work, opts, env)
    procs["proxy"] = MitmProcess(workdir=work / "proxy", options=opts, env=env)
    if args.relay_off:
        procs["no relay"] = MitmProcess(workdir=work / "norelay", options={**opts, "intercept_drain_timeout": 0}, env=env)
    if args.env:
        name, _, value = args.env.partition("=")
        procs["env"] = MitmProcess(workdir=work / "env", options=opts, env={**env, name: value})
    for n, p in procs.items():
        if n != "bare":
            p.extra_scripts = [s.resolve() for s in args.script]
    names = ["direct", *procs]
    cpu: dict[str, list[int]] = {n: [] for n in procs}
    faults: dict[str, list[int]] = {n: [] for n in procs}
    rss: dict[str, list[float]] = {n: [] for n in procs}  # at the end of each band
    lat: dict[str, list[float]] = {n: [] for n in names}
    loads = [load()]
    try:
        for p in procs.values():
            p.start()
        hooked = {}
        if args.hooks:
            (work / "bench_redact.py").write_text(REDACT)
            hooked = {"hooks": {"module": str(work / "bench_redact.py")}}
        collect = {"collect_tokens": True} if args.collect_tokens else {}
        sessions = {n: p.create_session(upstream={"base_url": base}, model=MODEL, **hooked, **collect)
                    for n, p in procs.items() if n != "bare"}
        warm = {n: p.create_session(upstream={"base_url": base}) for n, p in procs.items() if n != "bare"}
        with ExitStack() as stack:
            clients = {"direct": (stack.enter_context(httpx.Client(timeout=120)), f"{sim_url}{path}")}
            for n, p in procs.items():
                ca = p.confdir / "mitmproxy-ca-cert.pem" if n == "bare" else p.ca_bundle
                clients[n] = (stack.enter_context(httpx.Client(proxy=p.url, verify=str(ca), timeout=120)), url)

            def send(n: str, payload: bytes, secret: str) -> str:
                client, where = clients[n]
                if args.stream and payload is not hello:
                    with client.stream("POST", where, content=payload, headers=headers(secret)) as r:
                        r.raise_for_status()
                        return "".join(c["delta"].get("content") or "" for line in r.iter_lines()
                                       if line.startswith("data: {") for c in json.loads(line[6:])["choices"])
                r = client.post(where, content=payload, headers=headers(secret))
                r.raise_for_status()
                return answer_text(args.dialect, r.json())

            hello = request_body(args.dialect, [{"role": "system", "content": "hi"}, {"role": "user", "content": "hi"}], 0)
            for n in names:  # connections, TLS and certificates before the first measured turn
                send(n, hello, warm[n]["model_secret"] if n in warm else "sk-unused")
            if args.warm:
                for n, p in procs.items():
                    t0 = time.perf_counter()
                    served = warm_up(p, n == "bare", args, url, base)
                    print(f"warm-up: {n} served {served} requests of {args.warm} sessions "
                          f"({'live' if args.warm_live else 'sealed'}) in {time.perf_counter() - t0:.0f} s; "
                          f"RSS {rss_mb(p.proc.pid):.0f} MB", flush=True)
            waited = settle([p.proc.pid for p in procs.values()])
            print(f"the paths were quiet after {waited:.1f} s (start-up work in the background counts as no turn's)", flush=True)
            messages = [{"role": "system", "content": "You are a patient assistant."}]
            for k in range(args.turns):
                said = f"{SECRET} " if args.hooks and k % 10 == 0 else ""
                messages.append({"role": "user", "content": (f"turn {k}: {said}" + "please go on. " * (args.chunk // 14 + 1))[:args.chunk]})
                streamed = {"stream": True} if args.stream else {}
                payload = request_body(args.dialect, messages, k, streamed)
                # The same answer from upstream on every path: with --collect-tokens the proxy asks
                # for the ids and strips them; without a proxy the client asks and gets them.
                asked = request_body(args.dialect, messages, k, {**VLLM, **streamed}) if args.collect_tokens else payload
                order = names[k % len(names):] + names[:k % len(names)]
                for n in order:
                    pid = procs[n].proc.pid if n in procs else None
                    before_ns = cpu_ns(pid) if pid else None
                    before_faults = minflt(pid) if pid else None
                    t0 = time.perf_counter()
                    got = send(n, payload if n in sessions else asked, sessions[n]["model_secret"] if n in sessions else "sk-unused")
                    lat[n].append(time.perf_counter() - t0)
                    if pid:
                        time.sleep(0.005)
                        cpu[n].append(cpu_between(before_ns, cpu_ns(pid)))
                        faults[n].append(minflt(pid) - before_faults)
                    assert got == reply, (n, got[:60])
                messages.append({"role": "assistant", "content": reply})
                if (k + 1) % args.band == 0 or k + 1 == args.turns:
                    for n, p in procs.items():
                        rss[n].append(rss_mb(p.proc.pid))
                if k % 50 == 49:
                    loads.append(load())
        last_request = len(payload)
        for n, s in sessions.items():
            procs[n].api("DELETE", f"sessions/{s['id']}")
        time.sleep(1)
        for n, s in sessions.items():  # each path did what it claims
            trace = read_trace(s["trace_path"])
            assert trace.num_turns == args.turns and len(trace.branches) == 1, (n, trace.num_turns, len(trace.branches))
            assert {c.model for c in trace.calls} == {MODEL}, (n, {c.model for c in trace.calls})
            assert len(trace.nodes) == 1 + 2 * args.turns, (n, len(trace.nodes))  # the system prompt, then a pair a turn
            if args.collect_tokens:  # one training sample: the whole branch's ids, prompt and completions
                ids = trace.branches[0].token_ids
                assert ids and len(ids) > args.turns * args.chunk // 10, (n, len(ids or ()))
            if args.hooks:  # the model read the redaction, every turn
                assert not any(SECRET in node.message.text() for node in trace.nodes), n
                assert len(trace.request_rewrites) == (args.turns + 9) // 10, (n, len(trace.request_rewrites))
    finally:
        for p in procs.values():
            p.cleanup()
        sim.terminate()
        sim.wait(10)

    short = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True).stdout.strip() if rev else None
    print(f"machine: {machine()}; load average (1, 5, 15 min) at the start and every 50 turns: {' | '.join(loads)}")
    print(f"{args.dialect}{' stream' if args.stream else ''}{' collect_tokens' if args.collect_tokens else ''}"
          f"{' hooks' if args.hooks else ''}: "
          f"{args.turns} turns, {args.chunk} characters a side per turn, last request {last_request / 1e3:.0f} KB; "
          f"paths in rotating order every turn" + (f"; before = {short}" if short else "")
          + (f"; after {args.warm} {'live' if args.warm_live else 'sealed'} sessions of {args.warm_turns} turns" if args.warm else ""))
    print()
    bands = [(lo, min(lo + args.band, args.turns)) for lo in range(0, args.turns, args.band)]
    heads = [f"{lo + 1}-{hi}" for lo, hi in bands]
    print("| CPU per turn, ms: median (p10-p90) | " + " | ".join(heads) + " | last / first band |")
    print("|---" * (len(heads) + 2) + "|")
    for n in procs:
        cells, medians = [], []
        for lo, hi in bands:
            xs = [x / 1e6 for x in cpu[n][lo:hi]]
            medians.append(statistics.median(xs))
            cells.append(f"{medians[-1]:.2f} ({quantile(xs, 0.1):.2f}-{quantile(xs, 0.9):.2f})")
        print(f"| {n} | " + " | ".join(cells) + f" | {medians[-1] / medians[0]:.2f} |")
    print()
    print("| minor page faults per turn: median | " + " | ".join(heads) + " |")
    print("|---" * (len(heads) + 1) + "|")
    for n in procs:
        print(f"| {n} | " + " | ".join(f"{statistics.median(faults[n][lo:hi]):.0f}" for lo, hi in bands) + " |")
    print()
    print("| RSS at the band's end, MB | " + " | ".join(heads) + " |")
    print("|---" * (len(heads) + 1) + "|")
    for n in procs:
        print(f"| {n} | " + " | ".join(f"{x:.0f}" for x in rss[n]) + " |")
    print()
    print("| added latency over direct, ms: p50 / p99 | " + " | ".join(heads) + " | all turns |")
    print("|---" * (len(heads) + 2) + "|")
    for n in procs:
        added = [a - d for a, d in zip(lat[n], lat["direct"])]
        cells = [f"{statistics.median(added[lo:hi]) * 1e3:.2f} / {quantile(added[lo:hi], 0.99) * 1e3:.1f}" for lo, hi in bands]
        print(f"| {n} | " + " | ".join(cells) + f" | {statistics.median(added) * 1e3:.2f} / {quantile(added, 0.99) * 1e3:.1f} |")
    print(f"\ndirect latency, ms: median {statistics.median(lat['direct']) * 1e3:.2f}, p99 {quantile(lat['direct'], 0.99) * 1e3:.1f}")
    # Paired, turn by turn: the same request through two paths within a second of each other,
    # so the machine's load and the simulator's time for that body mostly cancel (a median of
    # per-path medians does not, on a shared machine).
    others = [n for n in procs if n != "proxy"]
    print("\n| proxy minus, per turn, ms: median (p25-p75) | CPU, " + f"turns {heads[0]} | CPU, turns {heads[-1]} | "
          f"latency, turns {heads[0]} | latency, turns {heads[-1]} |")
    print("|---|---|---|---|---|")
    for n in others:
        cells = []
        for series in (cpu, lat):
            for lo, hi in (bands[0], bands[-1]):
                d = [(a - b) / (1e6 if series is cpu else 1e-3) for a, b in zip(series["proxy"][lo:hi], series[n][lo:hi])]
                cells.append(f"{statistics.median(d):+.2f} ({quantile(d, 0.25):+.2f}..{quantile(d, 0.75):+.2f})")
        print(f"| {n} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Sessions at scale: 256 sessions at once x 20 turns on one worker, with random
faults, and what each session costs in memory, live and sealed.

    .venv/bin/python bench/scale.py [--sessions 256] [--turns 20] [--batches 2] [--faults 0.3] [--trim-ab | --ab OPTION=VALUE]

One mitmdump with the entry script, the simulator in this process (plain HTTP; the faults are
scripted per session by ``x-sim-key``), one thread per session with an openai SDK client of its
own (``max_retries=3``) in a harness loop that retries a failed call up to 3 times. Each turn is
JSON or SSE at random; with probability ``--faults`` its first attempt gets a 429, a 500 or a
cut answer (a stream cut after two events, a JSON body cut short). Checked, and the run fails
if any does not hold:

- no error the harness did not get from a fault: every exception the harness loop saw is at a
  turn that had one, and every answer is the session's own for that turn;
- every fault is on the record exactly once, as an error call of its kind, and nothing else is;
- no fork, no lost turn: each sealed trace reads without a torn record, is sealed, has exactly
  one branch and ``--turns`` turns.

Memory is the proxy's resident set (``VmRSS``): before the first batch, after each batch's
sessions are made, when its turns are done (live), after all are sealed (DELETE), which keeps
them in memory up to ``intercept_keep_sealed``, and settled (22 s later: what
``intercept_malloc_trim`` gave back). ``--trim-ab``: each batch also on a second proxy with
``intercept_malloc_trim=0``, the two in turn, order alternating. Per live session: (done - before) / sessions
for the first batch. Per sealed session: what a whole batch leaves behind once sealed, from the
second batch on (the first batch's freed memory is reused by the next, so that difference is
what a sealed session holds, not allocator slack).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import ssl
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai SDK uses
import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from interceptor.trace import read_trace  # noqa: E402
from mitm import MitmProcess  # noqa: E402
from provider import ProviderSimulator, Reply  # noqa: E402

KEY_ENV = "BENCH_PROVIDER_KEY"
FAULTS = ("429", "500", "cut")


def answer_of(key: str, turn: int) -> list[str]:
    return [f"{key} ", f"answer {turn}"]


def scripted(record) -> Reply:
    """A success derived from the question, so a spare reply can never answer another turn."""
    key, _, turn = record.json["messages"][-1]["content"].split()
    return Reply(text=answer_of(key, int(turn)))


class Rollout:
    """One session's harness: its turns in order, the faults it scripted, what it saw."""

    def __init__(self, idx: int, session: dict, proxy: MitmProcess, sim: ProviderSimulator, args, seed: int) -> None:
        self.key = f"b{seed}s{idx}"
        self.session = session
        self.sim = sim
        self.args = args
        self.rng = random.Random(seed * 100_003 + idx)
        self.faults: list[tuple[int, str, bool]] = []  # (turn, kind, stream)
        self.problems: list[str] = []
        self.seen_errors = 0
        self.http = httpx.Client(proxy=proxy.url, verify=ssl.create_default_context(cafile=str(proxy.ca_bundle)),
                                 timeout=120)
        self.client = openai.OpenAI(api_key=session["model_secret"], max_retries=3, timeout=120,
                                    http_client=self.http, default_headers={"x-sim-key": self.key})

    def run(self) -> None:
        messages = [{"role": "system", "content": f"session {self.key}"}]
        try:
            for turn in range(self.args.turns):
                stream = self.rng.random() < 0.5
                fault = self.rng.choice(FAULTS) if self.rng.random() < self.args.faults else None
                if fault == "429":
                    self.sim.script(Reply(status=429, retry_after="0"), key=self.key)
                elif fault == "500":
                    self.sim.script(Reply(status=500, retry_after="0"), key=self.key)
                elif fault == "cut":
                    self.sim.script(Reply(text=answer_of(self.key, turn), cut_after=2 if stream else 20), key=self.key)
                if fault:
                    self.faults.append((turn, fault, stream))
                messages.append({"role": "user", "content": f"{self.key} question {turn}"})
                text = self._ask(messages, stream, turn, fault)
                if text != "".join(answer_of(self.key, turn)):
                    self.problems.append(f"{self.key} turn {turn}: got {text!r}")
                messages.append({"role": "assistant", "content": text})
        except Exception as e:  # noqa: BLE001 - reported with the others
            self.problems.append(f"{self.key}: {type(e).__name__}: {e}")
        finally:
            self.http.close()

    def _ask(self, messages: list[dict], stream: bool, turn: int, fault: str | None) -> str | None:
        for attempt in range(4):  # the harness's own loop around the SDK's retries
            try:
                if stream:
                    with self.client.chat.completions.stream(model="m", messages=messages) as s:
                        return s.get_final_completion().choices[0].message.content
                return self.client.chat.completions.create(model="m", messages=messages).choices[0].message.content
            except (openai.APIError, httpx.HTTPError) as e:
                self.seen_errors += 1
                if fault is None or attempt == 3:
                    self.problems.append(f"{self.key} turn {turn} (fault {fault}): the harness got {type(e).__name__}: {e}")
                    if attempt == 3 or fault is None:
                        raise
        return None

    def verify(self, proxy: MitmProcess) -> None:
        status, _ = proxy.api("DELETE", f"sessions/{self.session['id']}")
        if status != 200:
            self.problems.append(f"{self.key}: sealing answered {status}")
            return
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a torn record is a TornRecordWarning: a failure here
            trace = read_trace(self.session["trace_path"])
        if not trace.sealed or len(trace.branches) != 1 or trace.num_turns != self.args.turns:
            self.problems.append(f"{self.key}: sealed={trace.sealed} branches={len(trace.branches)} "
                                 f"turns={trace.num_turns} (expected 1 branch, {self.args.turns} turns)")
        errors = Counter()
        for call in trace.calls:
            if call.error is None:
                continue
            errors[str(call.status) if call.status in (429, 500) else "cut"] += 1
        expected = Counter(kind for _, kind, _ in self.faults)
        if errors != expected:
            self.problems.append(f"{self.key}: error calls {dict(errors)}, faults {self.faults}; " + "; ".join(
                f"{c.status} {c.error.message[:120]!r}" for c in trace.calls if c.error is not None))
        if len(trace.calls) != self.args.turns + len(self.faults):
            self.problems.append(f"{self.key}: {len(trace.calls)} calls for {self.args.turns} turns and "
                                 f"{len(self.faults)} faults")


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def kib(n: float) -> str:
    return f"{n / 2**10:.0f} KiB"


SETTLE = 22.0  # seconds after the last seal before the "settled" reading: two of intercept_malloc_trim's 10 s


def run_batch(name: str, proxy: MitmProcess, sim: ProviderSimulator, size: int, seed: int, args) -> tuple:
    """One batch of ``size`` sessions at once on ``proxy``: its table row, and its figures."""
    before = proxy.memory()["VmRSS"]
    sessions = [proxy.create_session() for _ in range(size)]
    made = proxy.memory()["VmRSS"]
    rollouts = [Rollout(i, s, proxy, sim, args, seed) for i, s in enumerate(sessions)]
    attempts = len(sim.model_requests())
    threads = [threading.Thread(target=r.run) for r in rollouts]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done = proxy.memory()["VmRSS"]
    attempts = len(sim.model_requests()) - attempts
    for r in rollouts:
        r.verify(proxy)
    sealed = proxy.memory()["VmRSS"]
    time.sleep(SETTLE)
    settled = proxy.memory()["VmRSS"]
    problems = [p for r in rollouts for p in r.problems]
    turns = size * args.turns
    row = (f"| {name} | {turns} | {sum(len(r.faults) for r in rollouts)} | "
           f"{sum(r.seen_errors for r in rollouts)} | {attempts} | {wall:.1f} | {turns / wall:.1f} | "
           f"{mib(before)} | {mib(made)} | {mib(done)} | {mib(sealed)} | {mib(settled)} | {len(problems)} |")
    return row, problems, (before, made, done, sealed, proxy.memory()["VmHWM"], size, settled)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=256)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=64, help="sessions in a first batch that pays one-time costs")
    ap.add_argument("--faults", type=float, default=0.3, help="share of turns whose first attempt fails")
    ap.add_argument("--trim-ab", action="store_true",
                    help="also a second proxy with intercept_malloc_trim=0, each batch run on both in turn")
    ap.add_argument("--ab", metavar="OPTION=VALUE",
                    help="also a second proxy with this option set, each batch run on both in turn "
                         "(--trim-ab is --ab intercept_malloc_trim=0)")
    args = ap.parse_args()
    if args.trim_ab and args.ab:
        ap.error("--trim-ab and --ab: one second proxy at most")
    work = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    sim = ProviderSimulator(default=scripted).start()
    opts = {"intercept_upstream": sim.url("/v1"), "intercept_api_key_env": KEY_ENV}
    env = {KEY_ENV: "sk-bench-real-key"}
    proxies = {"proxy": MitmProcess(workdir=work / "proxy", options=opts, env=env)}
    if args.trim_ab:
        proxies["trim off"] = MitmProcess(workdir=work / "notrim", options={**opts, "intercept_malloc_trim": "0"},
                                          env=env)
    elif args.ab:
        key, _, value = args.ab.partition("=")
        proxies[args.ab] = MitmProcess(workdir=work / "ab", options={**opts, key: value}, env=env)
    failed = False
    try:
        for proxy in proxies.values():
            proxy.start()
        load = os.getloadavg()
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
              f"{platform.platform()}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start")
        print(f"{args.sessions} sessions at once x {args.turns} turns, one worker, faults on {args.faults:.0%} "
              f"of turns ({', '.join(FAULTS)}), a warm-up batch of {args.warmup}, then {args.batches} batches"
              + (f"; each batch on {' and '.join(proxies)} in turn (order alternating)" if len(proxies) > 1 else "")
              + f"; settled = RSS {SETTLE:.0f} s after the seal\n")
        print("| batch | turns | faults | errors the harness saw | attempts at the simulator | wall s | turns/s | "
              "RSS before | made | done (live) | sealed | settled | problems |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        figures: dict[str, list] = {n: [] for n in proxies}
        sizes = [args.warmup] * bool(args.warmup) + [args.sessions] * args.batches
        for batch, size in enumerate(sizes):
            order = list(proxies) if batch % 2 == 0 else list(proxies)[::-1]
            for k, pname in enumerate(order):
                label = "warm-up" if args.warmup and batch == 0 else str(batch + (0 if args.warmup else 1))
                if len(proxies) > 1:
                    label = f"{pname}: {label}"
                seed = batch * len(proxies) + list(proxies).index(pname)  # every session's key its own
                row, problems, fig = run_batch(label, proxies[pname], sim, size, seed, args)
                print(row, flush=True)
                for p in problems[:10]:
                    print(f"  problem: {p}")
                failed |= bool(problems)
                figures[pname].append(fig)
                sim.clear()
        for pname, figs in figures.items():
            print(f"\n{pname}:")
            # Freed memory is reused, never returned (without a trim): a batch's growth over the
            # high-water mark of the batch before is what the sessions it has beyond that one's cost.
            if args.warmup and len(figs) > 1:
                (_, _, _, _, hwm, warm, _), (_, _, done, _, _, size, _) = figs[0], figs[1]
                print(f"per live session (after {args.turns} turns): {kib((done - hwm) / (size - warm))} "
                      f"(first batch's RSS when done over the warm-up's peak, / {size - warm} more sessions)")
            for i in range(1 + bool(args.warmup), len(figs)):
                left = (figs[i][4] - figs[i - 1][4]) / figs[i][5]
                print(f"per sealed session (kept in memory up to intercept_keep_sealed): {kib(left)} "
                      f"(batch {i + (0 if args.warmup else 1)}'s peak over the one before, / {figs[i][5]})")
            for i, (before, _, done, sealed, _, size, settled) in enumerate(figs):
                print(f"batch {i}: live {kib((done - before) / size)} per session over the RSS before it; settled "
                      f"{SETTLE:.0f} s after the seal {kib((settled - before) / size)} per session "
                      f"({mib(done - settled)} given back)")
            print(f"peak RSS {mib(proxies[pname].memory()['VmHWM'])}, now {mib(proxies[pname].memory()['VmRSS'])}")
        print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print("\nRESULT:", "FAILED (problems above)" if failed else
              "every turn answered, every fault on the record once, one branch per session, no torn record")
    finally:
        for proxy in proxies.values():
            proxy.cleanup()
        sim.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

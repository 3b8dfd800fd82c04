"""The HTML viewer on a 300-turn trace: page size against the trace's, and time to usable.

    .venv/bin/python bench/viewer.py [--turns 300] [--runs 5]

Makes the 300-turn conversation of bench/trace_turns.py (in process, ~2 MB of msgpack) and
the same with token ids on every node (a collect_tokens trace: prompt ids once per node,
completion ids and logprobs on each reply), writes each one's page (``viewer.write``, what ``replay_trace.py html``
calls), and opens it ``--runs`` times in headless Chromium (fresh profile each time). Per
page: the file sizes and their ratio, the Python time to write it, and in the browser, from
navigation start, the first screenful of cards (``data-ready``), the whole branch rendered
(``data-rendered-at``) and the load event.

Prints markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from browser import Browser  # noqa: E402
from trace_turns import REPLY, machine, user_text  # noqa: E402  (bench/ is this script's folder)

from interceptor.scripts import viewer  # noqa: E402
from interceptor.trace import Message, ModelCall, Recorder, Request, Response, Store, Usage  # noqa: E402


def make_trace(path: Path, turns: int, tokens: bool) -> None:
    """The trace_turns conversation; with ``tokens``, vLLM-style ids (one id per word)."""
    store = Store()
    rec = Recorder(path, {"id": path.stem, "agent": {"name": "bench"}, "task": {"id": "viewer"}},
                   store=store, fsync="never")
    history = [Message(role="system", content="You are a patient assistant.")]
    ids: list[int] = []
    for k in range(turns):
        user = Message(role="user", content=user_text(k))
        history = history + [user]
        reply = Message(role="assistant", content=REPLY)
        extra = {}
        if tokens:
            if k == 0:
                ids += [200_001, *(1000 + len(w) for w in history[0].content.split())]
            ids += [200_002, *(1000 + (len(w) * 7 + k) % 5000 for w in user.content.split()), 200_003]
            out = [1000 + (len(w) * 13) % 5000 for w in REPLY.split()]
            extra = dict(prompt_token_ids=list(ids), token_ids=out,
                         logprobs=[-((j * 37) % 100) / 40 for j in range(len(out))])
        call = ModelCall(id=f"c{k}", dialect="chat", model="bench-model", status=200,
                         started_at=1000.0 + k, first_byte_at=1000.1 + k, ended_at=1000.5 + k)
        rec.commit_turn(Request(messages=history), Response(
            message=reply, finish_reason="stop", usage=Usage(input_tokens=len(ids) or 1, output_tokens=1),
            **extra), call)
        history = history + [reply]
        if tokens:
            ids += extra["token_ids"]
    rec.seal("done")
    store.flush(timeout=60)
    store.close()


def stats(values: list[float], digits: int = 0) -> str:
    values = sorted(values)
    lo, hi = values[0], values[-1]
    return f"{statistics.median(values):.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=300)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-viewer-") as tmp:
        for tokens in (False, True):
            trace = Path(tmp) / f"turns{args.turns}{'-tokens' if tokens else ''}.msgpack"
            make_trace(trace, args.turns, tokens)
            page = trace.with_suffix(".html")
            t0 = time.perf_counter()
            viewer.write([trace], page)
            build = time.perf_counter() - t0
            ready, rendered, load = [], [], []
            for _ in range(args.runs):
                with Browser() as b:
                    b.open(page.as_uri())
                    b.wait("document.body.dataset.rendered.startsWith('conversation:')", 60)
                    ready.append(float(b.eval("document.body.dataset.ready")))
                    rendered.append(float(b.eval("document.body.dataset.renderedAt")))
                    load.append(float(b.wait("performance.getEntriesByType('navigation')[0].loadEventEnd")))
            size_t, size_h = trace.stat().st_size, page.stat().st_size
            rows.append((trace.name, size_t, size_h, build, ready, rendered, load))
    print(f"machine: {machine()}; {args.runs} page loads each, headless Chromium")
    print("| trace | trace size | page size | page / trace | write page, s | first cards, ms | branch rendered, ms | load event, ms |")
    print("|---|---|---|---|---|---|---|---|")
    for name, st, sh, build, ready, rendered, load in rows:
        print(f"| {name} | {st / 1e6:.2f} MB | {sh / 1e6:.2f} MB | {sh / st:.2f} | {build:.2f} | "
              f"{stats(ready)} | {stats(rendered)} | {stats(load)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

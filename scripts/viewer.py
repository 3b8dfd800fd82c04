"""A trace as one self-contained HTML page: ``replay_trace.py html <trace>... -o out.html``.

People debugging a harness or auditing a reward want to look, not read: which branch a
sub-agent took, what the model saw at turn 37, which tool result was rewritten, where the
tokens a trainer weights came from. The page must open from ``file://`` on a machine with no
network and leak nothing when it does, so everything is inline (``viewer.html``: the CSS and
the script) and a Content-Security-Policy forbids the page every fetch, font, frame and
remote image.

Size and speed: the trace is embedded once, as compact JSON in the on-disk shape (each node
once, as the records store it, never each branch's restated history), and the script builds
the views on demand: only the selected branch's cards, token cells a page at a time. So a
page is about the size of its trace file, however long the rollout (``bench/viewer.py``).

Several traces make an index page (one row per session) plus one view per trace beside it,
so that a night's hundred rollouts do not become one page of hundreds of megabytes.
"""

from __future__ import annotations

import html
import json
import re
import sys
import warnings
from pathlib import Path
from typing import Any

from interceptor.trace import Trace
from interceptor.trace.records import fold, iter_records, node_record

# Record kinds the reader folds into the Trace; anything else (a newer producer's stop
# records, say) is shown as an event as it was written.
_FOLDED = {"header", "turn", "call", "replay", "rewrite", "undelivered", "footer"}
_MARK = "/*__TRACE_DATA__*/"


def _template() -> str:
    # package data beside this module (setup.cfg lists it), so installed and editable alike
    return Path(__file__).with_name("viewer.html").read_text(encoding="utf-8")


def load(path: str | Path) -> tuple[Trace, list[dict[str, Any]], list[str]]:
    """The trace, the records the reader does not fold (in file order) and the reader's
    warnings (a torn tail is shown on the page, not fatal)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = list(iter_records(path))
    trace = fold(iter(records), source=str(path))
    events = [rec for _, rec in records if isinstance(rec, dict) and rec.get("kind") not in _FOLDED]
    return trace, events, [str(w.message) for w in caught]


def summary(trace: Trace) -> dict[str, Any]:
    """The totals the index and the header show, computed by the trace model itself (the
    page must not re-derive ``num_input_tokens``' once-per-prefix rule in JavaScript)."""
    return {
        "turns": trace.num_turns,
        "calls": len(trace.calls),
        "errors": len(trace.errors),
        "replays": sum(1 for c in trace.calls if c.replay_of),
        "input_tokens": trace.num_input_tokens,
        "output_tokens": trace.num_output_tokens,
        "total_tokens": trace.num_total_tokens,
        "usage": trace.usage.model_dump(exclude_defaults=True),
        "nodes": len(trace.nodes),
        "branches": len(trace.leaves()),
        "rewrites": len(trace.request_rewrites) + len(trace.response_rewrites),
    }


def page_data(path: str | Path) -> dict[str, Any]:
    """What the page embeds: the header, each node once (as its record, without ``i``),
    each call, the rewrites and unfolded events, the totals."""
    trace, events, notes = load(path)
    nodes = []
    for i, node in enumerate(trace.nodes):
        rec = node_record(i, node)
        del rec["i"]
        nodes.append(rec)
    return {
        "file": Path(path).name,
        "header": trace.model_dump(mode="json", include={
            "id", "schema_version", "producer", "producer_version", "started_at", "ended_at",
            "agent", "task", "info", "config"}),
        "footer": trace.model_dump(mode="json", include={
            "sealed", "stop_condition", "stopped_by", "truncated", "reward", "rewards", "metrics",
            "timing"}),
        "totals": summary(trace),
        "tools": [t.model_dump(mode="json", exclude_defaults=True) for t in trace.tools],
        "nodes": nodes,
        "calls": [c.model_dump(mode="json", exclude_defaults=True) for c in trace.calls],
        "rewrites": [r.model_dump(mode="json", exclude_defaults=True)
                     for r in (*trace.request_rewrites, *trace.response_rewrites)],
        "events": events,
        "notes": notes,
    }


def _embed(data: dict[str, Any]) -> str:
    """JSON that is safe inside ``<script type="application/json">``: no ``</script>``,
    no ``<!--``, and the two line separators JavaScript once treated as newlines."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), default=str)
    return (text.replace("<", "\\u003c").replace("\u2028", "\\u2028")
            .replace("\u2029", "\\u2029"))


def render(data: dict[str, Any], *, title: str, index_href: str | None = None) -> str:
    page = {"kind": "trace", "trace": data, "index": index_href}
    return (_template().replace("__TITLE__", html.escape(title))
            .replace(_MARK, _embed(page), 1))


def render_index(rows: list[dict[str, Any]]) -> str:
    page = {"kind": "index", "rows": rows}
    return _template().replace("__TITLE__", f"{len(rows)} traces").replace(_MARK, _embed(page), 1)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:120] or "trace"


def write(paths: list[str | Path], out: str | Path) -> list[Path]:
    """One trace: its view at ``out``. Several: an index at ``out`` and each view beside it
    as ``<out stem>.<trace stem>.html`` (relative links, so the folder can be moved whole).
    Returns the files written."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if len(paths) == 1:
        data = page_data(paths[0])
        out.write_text(render(data, title=data["header"]["id"]), encoding="utf-8")
        return [out]
    written, rows, used = [], [], set()
    for path in paths:
        data = page_data(path)
        name = f"{out.stem}.{_slug(Path(path).stem)}"
        while name in used:
            name += "_"
        used.add(name)
        view = out.with_name(name + ".html")
        view.write_text(render(data, title=data["header"]["id"], index_href=out.name),
                        encoding="utf-8")
        written.append(view)
        h, f = data["header"], data["footer"]
        rows.append({"href": view.name, "file": data["file"], "id": h["id"],
                     "agent": h.get("agent"), "task": h.get("task"),
                     "started_at": h.get("started_at"), "ended_at": h.get("ended_at"),
                     "stop_condition": f["stop_condition"], "sealed": f["sealed"],
                     "reward": f["reward"], "notes": data["notes"], **data["totals"]})
    out.write_text(render_index(rows), encoding="utf-8")
    return [out, *written]


def cmd_html(args) -> int:
    try:
        written = write(args.files, args.out)
    except Exception as e:  # noqa: BLE001 - say which file is unreadable, no traceback
        print(f"replay_trace html: {e}", file=sys.stderr)
        return 1
    print(f"{len(args.files)} trace(s) -> {written[0]}"
          + (f" (+{len(written) - 1} views beside it)" if len(written) > 1 else ""), file=sys.stderr)
    return 0


def add_subcommand(sub) -> None:
    """``replay_trace.py html``: registered from here so that script keeps one line of it."""
    p = sub.add_parser("html", help="a self-contained HTML viewer (several traces: an index "
                                    "page plus one view each)")
    p.add_argument("files", nargs="+")
    p.add_argument("-o", "--out", required=True, help="output .html path")
    p.set_defaults(func=cmd_html)

#!/usr/bin/env python3
"""Read trace files: show them to a person, check them, export training samples.

    python scripts/replay_trace.py show traces/abc.msgpack [--json]
    python scripts/replay_trace.py verify traces/*.msgpack
    python scripts/replay_trace.py export traces/*.msgpack --out samples.jsonl
    python scripts/replay_trace.py export traces/*.msgpack --format parquet --out samples.parquet --min-reward 1
    python scripts/replay_trace.py diff traces/abc.msgpack traces/abc-replayed.msgpack
    python scripts/replay_trace.py resend traces/abc.msgpack --upstream vllm --upstreams upstreams.json --out new.msgpack

``show`` is for "what did the model see and say, and what did each exchange cost";
``verify`` is the gate before a trainer consumes files (exit 1 at the first bad one);
``export`` writes one row per branch, the shape trainers read (``--format jsonl|parquet|messages``),
or a document per trace other tools read (``--format atif|otel``), of files or ``--follow``ed as sealed;
``diff`` names the first turn where two traces part (a replayed run against its source);
``resend`` asks every recorded prompt again of another upstream or model (``resend.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from interceptor.trace import HoleWarning, Message, ModelCall, Rewrite, Trace, export, follow_traces, interchange, read_trace
from interceptor.trace import match
from interceptor.trace.match import Ignore
from interceptor.trace.records import CHECKSUMS_SINCE
from interceptor.trace.verify import problems

PREVIEW = 240  # characters of a message shown by ``show``


def _load(path: str) -> tuple[Trace, list[str], bool]:
    """The trace, the reader's warnings (a torn tail is shown, not fatal) and whether one
    of them is a hole in the middle of the file (fatal to ``verify``)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trace = read_trace(path)
        except Exception as e:
            # What the reader warned about first (a changed record) is often why it failed:
            # a header that fails its checksum leaves a file with no header to fold.
            for w in caught:
                e.add_note(str(w.message))
            raise
    return trace, [str(w.message) for w in caught], any(issubclass(w.category, HoleWarning) for w in caught)


def _preview(message: Message) -> str:
    """One line per message: its pieces in the order the model produced them."""
    parts = []
    for tag, piece in message.pieces():
        if tag == "reasoning":
            if piece.text:
                parts.append(f"[reasoning] {piece.text}")
            elif piece.encrypted or piece.redacted:
                parts.append("[reasoning: encrypted]")
        elif tag == "tool_call":
            parts.append(f"-> {piece.name}({piece.arguments})")
        elif piece.type == "text" and piece.text:
            parts.append(piece.text)
    if message.refusal:
        parts.append(f"[refusal] {message.refusal}")
    text = " | ".join(parts).replace("\n", "\\n")
    return text if len(text) <= PREVIEW else text[:PREVIEW - 3] + "..."


def _call_line(call: ModelCall) -> str:
    usage = "usage ?"
    if call.usage is not None:
        usage = f"in {call.usage.input_tokens} out {call.usage.output_tokens}"
        if call.usage.estimated:
            usage += " (estimated)"
    duration = f"{call.duration:.2f}s" if call.duration is not None else "?s"
    line = (f"call {call.id}  {call.model or '?'}  status {call.status or '-'}  "
            f"finish {call.finish_reason or '-'}"
            f"{'/' + call.native_finish_reason if call.native_finish_reason else ''}  "
            f"{usage}  {duration}")
    if call.node is not None:
        line += f"  node {call.node}"
    if call.delivered_node is not None:
        line += f"  delivered {call.delivered_node} (a response hook replaced the reply)"
    if call.replay_of:
        line += f"  replay of {call.replay_of}"
    if call.error is not None:
        line += f"  error {call.error.type}: {call.error.message}"
    return line


def show_text(trace: Trace) -> str:
    lines = [f"trace {trace.id}  schema {trace.schema_version}  "
             f"{'sealed (' + str(trace.stop_condition) + ')' if trace.sealed else 'not sealed'}",
             f"turns {trace.num_turns}  input tokens {trace.num_input_tokens}  "
             f"output tokens {trace.num_output_tokens}  calls {len(trace.calls)}  "
             f"errors {len(trace.errors)}"]
    if trace.sealed:
        lines.append(_ending_line(trace))
    printed: list[set[int]] = []
    for b in trace.branches:
        # Branches share prefixes; print each node once and say where a branch forks.
        shared = 0
        owner = None
        for k, nodes in enumerate(printed):
            common = 0
            for i in b.nodes:
                if i not in nodes:
                    break
                common += 1
            if common > shared:
                shared, owner = common, k
        lines.append("")
        tokens = f", {len(b.token_ids)} tokens" if b.token_ids is not None else ""
        head = f"== branch {b.index} ({len(b.nodes)} messages, {len(b.calls)} calls{tokens})"
        if owner is not None:
            head += f", first {shared} shared with branch {owner}"
        lines.append(head + " ==")
        for pos, i in enumerate(b.nodes[shared:], start=shared):
            node = trace.nodes[i]
            mark = "*" if node.sampled else " "
            lines.append(f"{pos:4d}{mark}{node.message.role:>9}: {_preview(node.message)}")
        printed.append(set(b.nodes))
    lines.append("")
    lines.append("== calls ==")
    lines.extend(_call_line(c) for c in trace.calls)
    rewrites = [*trace.request_rewrites, *trace.response_rewrites]
    if rewrites:
        lines.append("")
        lines.append("== rewrites ==")
        lines.extend(_rewrite_line(r) for r in rewrites)
    return "\n".join(lines)


def _ending_line(trace: Trace) -> str:
    """How the rollout ended: the stop, who made it, the reward, the time split."""
    line = f"stopped {trace.stop_condition} by {trace.stopped_by or '?'}"
    if trace.truncated:
        line += "  truncated"
    if trace.reward is not None:
        line += f"  reward {trace.reward:g}"
    for name, r in trace.rewards.items():
        line += f"  {name} {r.score:g}x{r.weight:g}"
    if trace.timing is not None:
        t = trace.timing
        line += f"  wall {t.wall:.2f}s (model {t.model:.2f}s, harness {t.harness:.2f}s)"
    return line


def _rewrite_line(rewrite: Rewrite) -> str:
    rest = rewrite.model_dump(mode="json", exclude_defaults=True, exclude={"direction", "call", "by"})
    where = f"call {rewrite.call}  " if rewrite.call else ""
    return f"{rewrite.direction}  {where}{rewrite.by}  " + json.dumps(rest, ensure_ascii=False)


def show_json(trace: Trace) -> dict:
    return {
        "id": trace.id,
        "schema_version": trace.schema_version,
        "sealed": trace.sealed,
        "stop_condition": trace.stop_condition,
        "stopped_by": trace.stopped_by,
        "truncated": trace.truncated,
        "reward": trace.reward,
        "rewards": {k: r.model_dump() for k, r in trace.rewards.items()},
        "metrics": trace.metrics,
        "timing": trace.timing.model_dump() if trace.timing else None,
        "turns": trace.num_turns,
        "input_tokens": trace.num_input_tokens,
        "output_tokens": trace.num_output_tokens,
        "total_tokens": trace.num_total_tokens,
        "branches": len(trace.branches),
        "nodes": len(trace.nodes),
        "request_rewrites": [r.model_dump(mode="json", exclude_defaults=True) for r in trace.request_rewrites],
        "response_rewrites": [r.model_dump(mode="json", exclude_defaults=True) for r in trace.response_rewrites],
        "calls": [
            {
                "id": c.id,
                "model": c.model,
                "requested_model": c.requested_model,
                "dialect": c.dialect,
                "endpoint": c.endpoint,
                "stream": c.stream,
                "sampling": c.sampling.set_fields(),
                "overrides": [o.model_dump(mode="json") for o in c.overrides],
                "usage": c.usage.model_dump(mode="json") if c.usage else None,
                "finish_reason": c.finish_reason,
                "native_finish_reason": c.native_finish_reason,
                "status": c.status,
                "error": c.error.model_dump(mode="json") if c.error else None,
                "node": c.node,
                "replay_of": c.replay_of,
                "duration": c.duration,
            }
            for c in trace.calls
        ],
    }


def _sample_message(message: Message) -> dict:
    """A message as exported; one whose pieces came interleaved (think, call, think, call)
    also lists them in that order under ``pieces``, ready for a chat template."""
    out = message.model_dump(mode="json", exclude_defaults=True)
    if message.order:
        out["pieces"] = [{"kind": tag, **piece.model_dump(mode="json", exclude_defaults=True)}
                         for tag, piece in message.pieces()]
    return out


def samples(trace: Trace):
    """One training sample per branch, with the tools that branch's own calls advertised
    (a sub-agent's samples get the sub-agent's tools). ``reference_logprobs`` and
    ``loss_weights`` appear only when a trainer put them on the trace."""
    for b in trace.branches:
        sample = {
            "trace_id": trace.id,
            "branch": b.index,
            "messages": [_sample_message(m) for m in b.messages],
            "tools": [t.model_dump(mode="json", exclude_defaults=True) for t in b.tools],
            "token_ids": b.token_ids,
            "sampled_mask": b.sampled_mask,
            "logprobs": b.logprobs,
            "advantages": b.advantages,
            "reward": trace.reward,
            "metrics": trace.metrics or None,
            "task": trace.task or None,
            "calls": b.calls,
            # Which weights sampled each token, and each message (None: not sampled, or no
            # version declared); always present, so one parquet file holds every trace's rows.
            "policy_versions": b.policy_versions,
            "message_versions": b.message_versions,
        }
        for name in ("reference_logprobs", "loss_weights"):
            if getattr(b, name) is not None:
                sample[name] = getattr(b, name)
        yield sample


def cmd_show(args) -> int:
    try:
        trace, notes, _ = _load(args.file)
    except Exception as e:  # noqa: BLE001 - say what is wrong with the file, no traceback
        print(f"{args.file}: {e}", file=sys.stderr)
        return 1
    for note in notes:
        print(f"warning: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(show_json(trace), indent=2))
    else:
        print(show_text(trace))
    return 0


def cmd_verify(args) -> int:
    for path in args.files:
        try:
            trace, notes, hole = _load(path)
        except Exception as e:  # noqa: BLE001 - any unreadable file is a verify failure
            for note in getattr(e, "__notes__", ()):
                print(f"{path}: error: {note}", file=sys.stderr)
            print(f"{path}: {e}", file=sys.stderr)
            return 1
        for note in notes:
            print(f"{path}: {'error' if hole else 'warning'}: {note}", file=sys.stderr)
        if hole:
            return 1
        found = problems(trace)
        if found:
            print(f"{path}: {found[0]}", file=sys.stderr)
            return 1
        unchecked = "" if trace.schema_version >= CHECKSUMS_SINCE else (
            f"; schema version {trace.schema_version}: its records carry no checksums, so only "
            "their structure was checked")
        print(f"{path}: ok ({trace.num_turns} turns, {len(trace.branches)} branches, "
              f"{len(trace.calls)} calls{unchecked})")
    return 0


def cmd_export(args) -> int:
    if bool(args.files) == bool(args.follow):
        print("export: name trace files or a folder to --follow (one of the two)", file=sys.stderr)
        return 2
    if args.follow and args.format == "parquet":
        print("export: a parquet file is readable only once closed; --follow it as jsonl", file=sys.stderr)
        return 2
    per_trace = args.format in interchange.FORMATS
    try:
        target = sys.stdout if args.out == "-" else args.out
        if args.follow and isinstance(target, str) and args.format in ("jsonl", "messages"):
            target = open(target, "w", encoding="utf-8", buffering=1)  # whole lines as traces land
        if per_trace:
            out = interchange.Writer(args.format, target, capture_content=args.capture_content)
        elif args.capture_content:
            raise ValueError("--capture-content is the otel format's")
        else:
            out = export.Writer(args.format, target)
    except (ValueError, RuntimeError) as e:
        print(f"export: {e}", file=sys.stderr)
        return 2
    unit = {"atif": "trajectories", "otel": "spans"}.get(args.format, "samples")
    traces = 0
    with out:
        try:
            for path, trace in _export_sources(args):
                traces += 1
                if per_trace:
                    out.write(trace, sampled_only=args.sampled_only, min_reward=args.min_reward)
                else:
                    out.write(export.filtered(trace, samples(trace), sampled_only=args.sampled_only,
                                              min_reward=args.min_reward))
                    if target is sys.stdout:
                        sys.stdout.flush()
        except ValueError as e:
            print(f"export: {e}", file=sys.stderr)
            return 2
        finally:
            if target not in (sys.stdout, args.out):
                target.close()
    print(f"{out.count} {unit} from {traces} traces -> {args.out}", file=sys.stderr)
    return 0


def _export_sources(args):
    """(path, trace) of each file named, or with ``--follow`` of each trace in the folder as
    it is sealed (``follow_traces``: resumable with ``--state``; ends after ``--idle-timeout``
    seconds with nothing new, or never)."""
    if args.follow:
        for item in follow_traces(args.follow, args.state, idle_timeout=args.idle_timeout):
            yield item.path, item.trace
        return
    for path in args.files:
        trace, notes, _ = _load(path)
        for note in notes:
            print(f"{path}: warning: {note}", file=sys.stderr)
        yield path, trace


def _ignore_rules(trace: Trace) -> list[str]:
    """The ``replay.ignore`` rules the session that wrote ``trace`` matched with."""
    rules = ((trace.config or {}).get("replay") or {}).get("ignore") or []
    return [r for r in rules if isinstance(r, str)]


def cmd_diff(args) -> int:
    try:
        (a, notes_a, _), (b, notes_b, _) = _load(args.a), _load(args.b)
        ignore = Ignore.parse(list(dict.fromkeys([*_ignore_rules(a), *_ignore_rules(b), *args.ignore])))
    except Exception as e:  # noqa: BLE001 - say what is wrong, no traceback
        print(f"diff: {e}", file=sys.stderr)
        return 2
    for path, notes in ((args.a, notes_a), (args.b, notes_b)):
        for note in notes:
            print(f"{path}: warning: {note}", file=sys.stderr)
    found = match.diff(a, b, ignore)
    if found.equal:
        print(f"equal: {found.turns[0]} turns")
        return 0
    p = found.parting
    ids = " vs ".join(c or "-" for c in p.calls)
    print(f"the traces part at turn {p.turn} (calls {ids}): {p.why}")
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="replay_trace.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("show", help="the transcript of each branch and one line per call")
    p.add_argument("file")
    p.add_argument("--json", action="store_true", help="machine-readable summary")
    p.set_defaults(func=cmd_show)
    p = sub.add_parser("verify", help="schema, graph, token alignment, call links; exit 1 "
                                      "at the first problem")
    p.add_argument("files", nargs="+")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("export", help="one row per branch for trainers (JSON lines, Parquet or chat "
                                      "conversations), or a document per trace for other tools (ATIF, "
                                      "OpenTelemetry); see interceptor.trace.export and .interchange")
    p.add_argument("files", nargs="*")
    p.add_argument("--out", required=True, help="output path, or - for stdout (not for parquet)")
    p.add_argument("--format", choices=export.FORMATS + interchange.FORMATS, default="jsonl",
                   help="jsonl: the trace's row; parquet: the same with list columns (needs pyarrow, the "
                        "parquet extra); messages: OpenAI-style chat conversations for chat templates/SFT; "
                        "atif: an ATIF trajectory document per trace, a trajectory per branch; otel: OTLP JSON "
                        "of OpenTelemetry GenAI spans per trace (atif and otel need the export extra)")
    p.add_argument("--capture-content", action="store_true",
                   help="otel: put the messages, system instructions and tool definitions on the spans "
                        "(the GenAI conventions' opt-in)")
    p.add_argument("--follow", metavar="FOLDER",
                   help="export each trace in FOLDER as it is sealed, instead of the files named")
    p.add_argument("--state", help="with --follow: a file naming what was exported, to resume from")
    p.add_argument("--idle-timeout", type=float, help="with --follow: stop after this many seconds with nothing new")
    p.add_argument("--sampled-only", action="store_true",
                   help="only branches holding at least one message the model produced")
    p.add_argument("--min-reward", type=float, help="only traces sealed with a reward of at least this")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("diff", help="the first turn where two traces part (a replay against its source) "
                                    "and why; exit 0 when they are equal, 1 when not")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--ignore", action="append", default=[],
                   help="a JSON path into the canonical request or a regex to leave out (repeatable); "
                        "the replay.ignore rules in either trace's header are used too")
    p.set_defaults(func=cmd_diff)
    from interceptor.scripts import resend, viewer
    resend.add_subcommand(sub)
    viewer.add_subcommand(sub)
    args = parser.parse_args(argv)
    return args.func(args)


def run(argv: list[str] | None = None) -> int:
    """``main``, ending quietly when the reader goes away (``replay_trace.py show f | head``)."""
    try:
        code = main(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # Python would complain again at exit flushing the dead pipe: point stdout elsewhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(run())

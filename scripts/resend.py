"""``replay_trace.py resend``: ask a trace's recorded prompts again, of another upstream or model.

Comparing two models on the same states, or regenerating samples off-policy, needs the exact
prompts a rollout's model saw, not a new rollout. Every committed call of the source trace
is a canonical prompt (its path through the graph) with its tools and the sampling the model
received; ``resend`` renders each in the call's dialect, sends it to the named upstream (the
model and sampling laid over the recorded ones), and writes a new trace: the source's turns
first, then each new sample committed on the very same prompt, so the graph's prefix is the
source's and every new answer is a sibling of the recorded one. Each new call says which
source call it re-asked (``resent_from``).

It is resumable: a run that is interrupted (Ctrl-C, SIGTERM) lets the calls in flight finish
and land, and the next run with the same ``--out`` reads what landed (the old file, and any
earlier copy set aside beside it) and asks only the rest: no call is asked twice. Only a
resend of the same source is resumed so: an ``--out`` that names any other file is refused,
never overwritten. A 429
waits its ``retry-after`` (a 5xx a short back-off) and is asked again.

Every dialect is rendered (``Dialect.request_body``: Chat Completions, Messages, Responses,
Gemini), each prompt in the dialect it was asked in and as a JSON request; a prompt the record
cannot restore (an inline image, kept as its digest) is refused by name before anything is
sent.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
import warnings
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

from interceptor.addons.gateway.sessions.upstream import KNOWN, Upstream, parse_upstreams
from interceptor.dialects import DIALECTS
from interceptor.dialects.base import Dialect
from interceptor.trace import ModelCall, Recorder, Request, ResponseError, Sampling, Store, Trace, read_trace
from interceptor.trace.match import Matcher
from interceptor.trace.model import ReplaySource

ATTEMPTS = 8  # per call, for 429 and 5xx answers
MAX_WAIT = 120.0  # seconds: a retry-after beyond this is capped
TIMEOUT = 600.0


class ResendError(Exception):
    """What the user must fix; printed as one line, exit status 2."""


def pick_upstream(name: str, declared: str | None) -> Upstream:
    ups = parse_upstreams(declared) if declared else {}
    if name not in ups and name in KNOWN:
        ups = {**ups, **parse_upstreams(json.dumps([name]))}
    if name not in ups:
        raise ResendError(f"--upstream {name!r} is not declared (declare it with --upstreams, in the "
                          f"format of intercept_upstreams; known providers: {', '.join(KNOWN)})")
    up = ups[name]
    if up.replay is not None or not up.base_url:
        raise ResendError(f"--upstream {name!r} needs a base_url: resend asks a model, not a trace")
    if up.api_key_env and not up.key():
        raise ResendError(f"--upstream {name!r}: its key variable {up.api_key_env} is not set")
    return up


def _prompt(trace: Trace, call: ModelCall) -> Request:
    nodes = trace.nodes
    sets = trace.tool_sets
    tools = sets[call.tool_set] if call.tool_set is not None and call.tool_set < len(sets) else []
    return Request(messages=[nodes[i].message for i in trace.path(call.node)[:-1]], tools=list(tools))


def body_of(trace: Trace, call: ModelCall, model: str | None, sampling: Sampling,
            collect_tokens: bool) -> tuple[str, dict[str, Any]]:
    """The call's prompt as a request of its dialect, JSON: the path and the body, with the
    recorded sampling (what the model received) and ``sampling`` laid over it, ``model`` or
    the recorded one (in the body, or in the path where the dialect names it there)."""
    dialect = DIALECTS.get(call.dialect)
    if dialect is None:
        raise ResendError(f"call {call.id} was asked in the {call.dialect or 'unknown'} dialect, which this "
                          f"version does not know (nothing was sent)")
    try:
        rendered = dialect.request_body(_prompt(trace, call))
    except ValueError as e:
        raise ResendError(f"call {call.id} cannot be asked again: {e} (nothing was sent)") from e
    name = model or call.model or call.requested_model or ""
    path = dialect.json_path(call.endpoint or "", name)
    in_path = dialect.requested_model({}, path) is not None  # Gemini: /v1beta/models/<m>:generateContent
    body: dict[str, Any] = rendered if in_path else {"model": name, **rendered}
    merged = Sampling.model_validate({**call.sampling.set_fields(), **sampling.set_fields()})
    dialect.apply_overrides(body, name, merged, requested=call.model)
    if collect_tokens:  # as a live session's Collect asks a vLLM/SGLang upstream
        if dialect.tokens is None:
            raise ResendError(f"--collect-tokens asks a vLLM/SGLang upstream for token fields, which the "
                              f"{call.dialect} dialect has none of (call {call.id}; nothing was sent)")
        plan = dialect.tokens.wanted(body)
        for key in plan.asks if plan is not None else ():
            body[key] = True
    return path, body


def _url(up: Upstream, dialect: Dialect, path: str, query: dict[str, str]) -> str:
    u = urlsplit(up.base_url)
    return urlunsplit((u.scheme, u.netloc, dialect.upstream_path(u.path, path), urlencode(query), ""))


def ask(up: Upstream, dialect: Dialect, path: str, body: dict[str, Any],
        stop: threading.Event) -> tuple[int, Any, float, float]:
    """POST one body; 429 and 5xx are asked again (429 after its retry-after). Returns the
    status, the parsed answer, and when it was sent and answered."""
    data = json.dumps(body).encode()
    headers = {"content-type": "application/json", **dialect.api_headers()}
    query: dict[str, str] = {}
    dialect.put_key(headers, query, up.key() or None)
    for attempt in range(ATTEMPTS):
        started = time.time()
        req = urllib.request.Request(_url(up, dialect, path, query), data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
                return resp.status, json.loads(resp.read() or b"null"), started, time.time()
        except urllib.error.HTTPError as e:
            status, raw, retry_after = e.code, e.read(), e.headers.get("retry-after")
        except OSError as e:
            raise ResendError(f"upstream {up.name!r} at {up.base_url} does not answer ({e})") from e
        if (status != 429 and status < 500) or attempt == ATTEMPTS - 1 or stop.is_set():
            try:
                return status, json.loads(raw or b"null"), started, time.time()
            except ValueError:
                return status, None, started, time.time()
        try:
            delay = float(retry_after) if retry_after is not None else min(MAX_WAIT, 2.0 ** attempt)
        except ValueError:
            delay = min(MAX_WAIT, 2.0 ** attempt)
        time.sleep(min(MAX_WAIT, max(0.0, delay)))
    raise AssertionError("unreachable")


def _asides(out: Path) -> list[Path]:
    """The copies of ``out`` an earlier run set aside when a new trace took its place
    (``<stem>.<n>``, ``_set_aside``)."""
    return sorted(p for p in out.parent.glob(f"{out.stem}.*{out.suffix}")
                  if p.name[len(out.stem) + 1:len(p.name) - len(out.suffix)].isdigit())


def _set_aside(out: Path) -> Path:
    """Give an earlier run's ``out`` the first free ``<stem>.<n>`` name (a hard link made
    exclusively, then the old name removed: no file there is ever replaced), so the new trace
    can be created at ``out``; the store never moves or overwrites a trace itself."""
    for n in itertools.count(1):
        aside = out.with_name(f"{out.stem}.{n}{out.suffix}")
        try:
            os.link(out, aside)
        except FileExistsError:
            continue
        out.unlink()
        return aside
    raise AssertionError("unreachable")


def _done(out: Path) -> list[tuple[Path, Trace]]:
    """Earlier runs' output: the file and the copies set aside before (``<stem>.<n>``)."""
    found = []
    for path in [out, *_asides(out)]:
        if path.is_file() and path.stat().st_size:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a torn tail: everything before it stands
                try:
                    found.append((path, read_trace(path)))
                except Exception:  # noqa: BLE001 - an unreadable leftover holds nothing to keep
                    continue
    return found


def _recommit(recorder: Recorder, trace: Trace, matcher: Matcher, call: ModelCall) -> None:
    """A turn of an earlier trace, committed again as it was recorded (no request sent)."""
    recorder.commit_turn(_prompt(trace, call), matcher.response(call),
                         call.model_copy(update={"node": None, "choice_nodes": []}))


def resend(source_path: str, out: Path, up: Upstream, *, model: str | None, sampling: Sampling,
           branch: int | None, concurrency: int, collect_tokens: bool, progress=sys.stderr) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        source = read_trace(source_path)
    calls = [c for c in source.calls if c.node is not None and c.error is None]
    if branch is not None:
        branches = source.branches
        if not 0 <= branch < len(branches):
            raise ResendError(f"--branch {branch}: the trace has branches 0..{len(branches) - 1}")
        on = set(branches[branch].calls)
        calls = [c for c in calls if c.id in on]
    bodies = {c.id: body_of(source, c, model, sampling, collect_tokens) for c in calls}  # refuse before sending
    earlier = _done(out)
    for path, t in earlier:  # only a resend of this source is taken over (and removed once it is in the new file)
        if ((t.info or {}).get("resend") or {}).get("source") != source.id:
            raise ResendError(f"--out: {path} is not an earlier resend of {source.id!r}, and a trace is "
                              f"never overwritten: choose another --out")
    taken_over = [path for path, _ in earlier if path != out]
    if os.path.lexists(out):
        if not any(path == out for path, _ in earlier):
            raise ResendError(f"--out: {out} exists and is not a trace this resend can resume; a trace "
                              f"is never overwritten: choose another --out")
        taken_over.append(_set_aside(out))
    landed: dict[str, tuple[Trace, ModelCall]] = {}
    for _, t in earlier:
        for c in t.calls:
            if c.resent_from is not None and c.node is not None and c.resent_from.trace == source.id:
                landed.setdefault(c.resent_from.call, (t, c))
    todo = [c for c in calls if c.id not in landed]

    store = Store()
    recorder = Recorder(out, {"id": out.stem, "info": {"resend": {
        "source": source.id, "upstream": up.name, "model": model, "sampling": sampling.set_fields()}},
        "task": source.task, "agent": source.agent}, store=store)
    matchers = {id(t): Matcher(t) for t in [source, *(t for _, t in earlier)]}
    for c in source.calls:  # the source's graph first: the new answers land beside its replies
        if c.node is not None and c.error is None:
            _recommit(recorder, source, matchers[id(source)], c)
    for t, c in landed.values():
        _recommit(recorder, t, matchers[id(t)], c)
    store.flush(timeout=30)
    for path in taken_over:
        path.unlink(missing_ok=True)  # what the earlier runs landed is in the new file now

    stop = threading.Event()
    # Ctrl-C or SIGTERM: stop asking, let the calls in flight land (see the module docstring).
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    total, done_before, asked = len(calls), len(calls) - len(todo), 0
    errors = 0

    def show() -> None:
        print(f"\rresend: {done_before + asked}/{total} calls ({done_before} from an earlier run, "
              f"{errors} failed)", end="", file=progress, flush=True)

    show()
    try:
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            queue = list(todo)
            running: dict[Future, ModelCall] = {}
            while queue or running:
                while queue and len(running) < max(1, concurrency) and not stop.is_set():
                    c = queue.pop(0)
                    path, body = bodies[c.id]
                    running[pool.submit(ask, up, DIALECTS[c.dialect], path, body, stop)] = c
                if not running:
                    break
                finished, _ = wait(running, timeout=0.5, return_when=FIRST_COMPLETED)
                for fut in finished:
                    c = running.pop(fut)
                    status, answer, started, ended = fut.result()
                    ok = _land(recorder, source, c, *bodies[c.id], status, answer, started, ended)
                    asked += 1
                    errors += not ok
                    show()
                if stop.is_set():
                    queue.clear()  # the calls in flight land; the rest wait for the next run
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print(file=progress)
        recorder.seal("interrupted" if stop.is_set() else "resent")
        store.flush(timeout=30)
        store.close()
    if stop.is_set():
        print(f"resend: interrupted; {done_before + asked - errors} of {total} landed in {out}; "
              "run it again with the same --out to ask the rest", file=progress)
        return 130
    return 1 if errors else 0


def _land(recorder: Recorder, source: Trace, c: ModelCall, path: str, body: dict[str, Any], status: int,
          answer: Any, started: float, ended: float) -> bool:
    dialect = DIALECTS[c.dialect]
    call = ModelCall(id=uuid.uuid4().hex[:16], dialect=c.dialect, endpoint=path,
                     requested_model=dialect.requested_model(body, path), sampling=dialect.sampling(body), status=status,
                     started_at=started, first_byte_at=None, ended_at=ended,
                     resent_from=ReplaySource(trace=source.id, call=c.id))
    if status == 200 and isinstance(answer, dict):
        try:
            response = dialect.parse_response(answer)
        except Exception as e:  # noqa: BLE001 - recorded as what it is
            call.error = ResponseError(type="invalid_response", message=f"{type(e).__name__}: {e}", status=status)
        else:
            if response.error is None:
                recorder.commit_turn(_prompt(source, c), response, call)
                return call.node is not None
            call.error = response.error
    else:
        call.error = dialect.response_error(status, answer)
    recorder.record_call(call)
    return False


def add_subcommand(sub) -> None:
    p = sub.add_parser("resend", help="ask every recorded prompt again of another upstream or model; "
                                      "the new answers land beside the recorded ones (resumable)")
    p.add_argument("file")
    p.add_argument("--upstream", required=True, help="the upstream to ask, by name (openai, or one --upstreams declares)")
    p.add_argument("--upstreams", help="upstreams as intercept_upstreams takes them: inline JSON or a JSON file")
    p.add_argument("--model", help="the model to ask (default: each call's recorded model)")
    p.add_argument("--sampling", default="{}", help="sampling laid over the recorded, as JSON: "
                                                     '\'{"temperature": 1.0}\'')
    p.add_argument("--branch", type=int, help="only the calls on this branch (replay_trace.py show numbers them)")
    p.add_argument("--concurrency", type=int, default=1, help="calls in flight at once (default 1)")
    p.add_argument("--collect-tokens", action="store_true",
                   help="ask a vLLM/SGLang upstream for token ids and logprobs, as collect_tokens does")
    p.add_argument("--out", required=True, help="the new trace; an existing one is resumed")
    p.set_defaults(func=cmd_resend)


def cmd_resend(args) -> int:
    try:
        up = pick_upstream(args.upstream, args.upstreams)
        sampling = Sampling.model_validate(json.loads(args.sampling))
        return resend(args.file, Path(args.out), up, model=args.model, sampling=sampling, branch=args.branch,
                      concurrency=args.concurrency, collect_tokens=args.collect_tokens)
    except (ResendError, ValueError) as e:
        print(f"resend: {e}", file=sys.stderr)
        return 2

"""One session's recorder: the in-memory Trace plus the records that mirror it on disk.

Called on mitmproxy's event loop, so every method is cheap: a turn costs the hashing of its
prompt (the dialect already parsed it) and the dump of the nodes it added; nothing here waits
for a disk or re-serialises the history. The Store's writer thread does the rest.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from collections.abc import Iterable
from typing import Any

from interceptor.trace import tokens
from interceptor.trace._version import VERSION
from interceptor.trace.graph import Graph
from interceptor.trace.messages import Message, Request, Response, ResponseError, Tool, Usage
from interceptor.trace.prefix import Listed, Prefixes
from interceptor.trace.model import (
    SCHEMA_VERSION, EgressRefusal, Header, MessageNode, ToolDecision, ModelCall, Reward, Rewrite, StateWrite, StopRecord,
    Timing, Trace, Version, VersionChange,
)
from interceptor.trace.records import call_record, node_record
from interceptor.trace.store import FSYNC_POLICIES, Store

log = logging.getLogger(__name__)

# Config keys that must never reach a trace, whatever the caller passes: traces are shared
# with trainers and uploaded; a secret in one is a leaked secret. The names of the headers a
# credential arrives in are the wire formats' (the dialects', which sit above the trace): the
# recorder's maker passes them (``secret_keys``).
_SECRET_KEYS = frozenset({"secret", "model_secret", "state_secret", "api_key", "admin_token",
                          "authorization", "password"})


def _scrub(value: Any, keys: frozenset[str] = _SECRET_KEYS) -> Any:
    if isinstance(value, dict):
        return {k: _scrub(v, keys) for k, v in value.items()
                if not (isinstance(k, str) and (k.lower() in keys
                                                or k.lower().endswith(("_secret", "_password"))))}
    if isinstance(value, list):
        return [_scrub(v, keys) for v in value]
    return value


def _counted(response: Response) -> Usage | None:
    """Exact usage from the upstream's own token ids, or None without them."""
    if response.prompt_token_ids is None or response.token_ids is None:
        return None
    output = len(response.token_ids) + sum(len(c.token_ids or ()) for c in response.choices)
    return Usage(input_tokens=len(response.prompt_token_ids), output_tokens=output)


def _timing(trace: Trace) -> Timing:
    """Wall time from the session's start to the seal, split into model time (the sum of
    the upstream calls' durations; replays never reached the model) and the harness's rest."""
    calls = [c for c in trace.calls if c.replay_of is None and c.replayed_from is None and c.started_at]
    model = sum(c.duration or 0.0 for c in calls)
    wall = max(0.0, (trace.ended_at or time.time()) - trace.started_at)
    ended = [c.ended_at for c in calls if c.ended_at is not None]
    return Timing(wall=wall, model=model, harness=max(0.0, wall - model),
                  first_request_at=min((c.started_at for c in calls), default=None),
                  last_answer_at=max(ended, default=None))


#: What ``Recorder.release`` lets go of, and ``Recorder.__getattr__`` makes again on demand.
_RELEASED = ("_trace", "_graph", "prefixes", "_last_tools")


class Recorder:
    """Record one session to ``path`` through ``store``.

    ``header`` is a ``Header`` or a dict of its fields (``id``, ``agent``, ``task``, ``info``,
    ``config``, ``started_at``); any other key is refused (``ValidationError``), since a
    misspelt field would otherwise vanish from every trace. ``id`` defaults to the file's
    stem, ``started_at`` to now; the schema and producer versions are always this code's.
    Secrets are scrubbed from ``agent``, ``task``, ``info`` and ``config`` (and from metrics,
    rewrites and the footer's info): keys named like one, and ``secret_keys`` (the headers a
    credential arrives in, which the caller's wire formats know). ``fsync``:
    ``never``, ``turn`` (every turn or call record, the store grouping them:
    ``Store.fsync_interval``) or ``seal`` (only the footer).
    """

    def __init__(self, path: Path, header: Header | dict[str, Any], *, store: Store, fsync: str = "turn",
                 secret_keys: Iterable[str] = ()):
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {', '.join(FSYNC_POLICIES)}, not {fsync!r}")
        self.path = Path(path)
        self._secret_keys = _SECRET_KEYS | {k.lower() for k in secret_keys}
        self.store = store
        self.fsync = fsync
        if not isinstance(header, Header):
            header = Header.model_validate({"id": self.path.stem, **header})
        header = header.model_copy(update={
            "schema_version": SCHEMA_VERSION, "producer_version": VERSION,
            "started_at": header.started_at or time.time(),
            **{k: self._scrub(getattr(header, k)) for k in ("agent", "task", "info", "config")}})
        self._trace = Trace(**header.model_dump())
        self._graph = Graph(self._trace)
        # The session's last message lists as sent, so a restated history is not parsed again.
        self.prefixes = Prefixes()
        self._estimates: dict[int, int] = {}
        self._by_response_id: dict[str, int] = {}
        self._last_tools: tuple[list[Tool], int | None] = ([], None)  # the previous turn's set
        self._tools_estimates: dict[int | None, int] = {}  # tool set index -> its token count
        self._released: dict | None = None  # the summary, once the graph was let go
        self._chain = 0  # the checksum of the last record appended: the next one chains on it
        self._append({"kind": "header", **header.model_dump()}, sync=fsync == "turn", new=True)

    def _scrub(self, value: Any) -> Any:
        """``value`` without any key that names a secret, at any depth."""
        return _scrub(value, self._secret_keys)

    # --- public API --------------------------------------------------------------------

    @property
    def trace(self) -> Trace:
        return self._trace

    @property
    def sealed(self) -> bool:
        return self._released is not None or self._trace.sealed

    @property
    def state_version(self) -> int:
        """The task state's version (a released trace keeps it without its ``Trace``)."""
        return self._kept["state_version"] if "_trace" not in self.__dict__ else self._trace.state_version

    def __getattr__(self, name: str) -> Any:
        """Only for an attribute that is not set: what ``release`` let go of, made again (empty)
        if an exchange still in flight at the seal asks for it."""
        kept = self.__dict__.get("_kept")
        if kept is None or name not in _RELEASED:
            raise AttributeError(name)
        if name == "_trace":
            value: Any = Trace(**kept, sealed=True)
        elif name == "_graph":
            value = Graph(self._trace)
        elif name == "prefixes":
            value = Prefixes()
            value.generation = self._generation  # past every scan made before the release
        else:
            value = ([], None)
        setattr(self, name, value)
        return value

    def commit_turn(self, request: Request, response: Response, call: ModelCall,
                    listed: Listed | None = None, rewrites: list[Rewrite] = (),
                    delivered: Message | None = None, held: int | None = None) -> ModelCall:
        """Add the turn's new nodes and its sampled reply, link ``call`` to the reply
        (``call.node``), fill what the call lacks from the response, append and record.

        ``listed``: the request's message list as scanned from its body (trace/prefix.py),
        when ``request.messages`` are its lead's and then its elements' messages. Its known
        leading messages skip the graph walk (their nodes are known) when the lead is the one
        they were remembered under, and the list is remembered so the next request that
        restates it is not parsed again. ``rewrites`` (request hooks' rewrites
        first carried by this request) follow the turn, each naming the node its
        ``position`` became. ``delivered``: what a response hook gave the harness instead of
        the sampled reply, a non-sampled sibling (``call.delivered_node``); a response
        rewrite among ``rewrites`` is named after it. ``held``: how many leading messages
        the caller found to be nodes on this graph as it is now (a hooked request's pass,
        ``intercept.remembered``), so that they are not compared with their nodes again."""
        if self._released is not None:
            # The graph is gone (see ``release``); the exchange still goes on the record.
            call.error = call.error or ResponseError(
                type="after_seal", message="the session was sealed while this exchange was in flight")
            self.record_call(call, rewrites)
            return call
        trace = self._trace
        mark = (len(trace.nodes), len(trace.calls), len(trace.tool_sets), self._last_tools)
        try:
            record = self._turn(request, response, call, listed, delivered, held)
            self._append(record, sync=self.fsync == "turn")
        except Exception as e:  # noqa: BLE001 - one bad exchange must not end the record
            # Atomic: the turn is in memory and queued for the file, or in neither and an
            # error call in both. The next turn starts from the graph as it was.
            self._rollback(*mark)
            call.node, call.choice_nodes, call.delivered_node = None, [], None
            call.error = ResponseError(type="record_error",
                                       message=f"the turn could not be recorded: {type(e).__name__}: {e}")
            log.exception(f"trace: {self.path.name}: turn {call.id} recorded as an error call")
            self.record_call(call, rewrites)
            return call
        if rewrites:  # the path is a walk from the root: only a rewrite needs it
            self._record_rewrites(rewrites, self._trace.path(call.node)[:-1] if call.node is not None else [], call)
        return call

    def holds(self, leaf: int, node: MessageNode) -> bool:
        """Whether node ``leaf`` is still ``node`` (a rollback lets an index be reused; a
        released trace has no nodes)."""
        nodes = self._trace.nodes
        return leaf < len(nodes) and nodes[leaf] is node

    def prompt_ids(self, leaf: int, node: MessageNode, into: list[int]) -> bool:
        """Append to ``into`` the token ids stored along the path to ``leaf``, a prompt's last
        node: the ids that prompt carried, in order (``Graph.add_turn`` keeps every path's
        concatenation exact). False when ``leaf`` is no longer ``node`` (a rollback let its
        index be reused), a node on the path has no ids, or the graph was released."""
        if not self.holds(leaf, node):
            return False
        nodes = self._trace.nodes
        path = self._graph.lineage(leaf)
        if any(nodes[i].token_ids is None for i in path):
            return False
        for i in path:
            into += nodes[i].token_ids
        return True

    def _record_rewrites(self, rewrites: list[Rewrite], path: list[int], call: ModelCall | None = None) -> None:
        for rewrite in rewrites:
            if rewrite.direction == "response":
                if call is not None:
                    rewrite.node, rewrite.sampled_node = call.delivered_node, call.node
            elif rewrite.position is not None and rewrite.position < len(path):
                rewrite.node = path[rewrite.position]
            self.record_rewrite(rewrite)

    def _turn(self, request: Request, response: Response, call: ModelCall,
              listed: Listed | None = None, delivered: Message | None = None,
              held: int | None = None) -> dict[str, Any]:
        trace = self._trace
        messages = request.messages
        sent = _sent(listed, messages)
        if listed is not None and (sent is None or not listed.complete or len(sent) != listed.lead + listed.marks[-1]):
            listed = None  # not the list as scanned (a chained or rewritten request)
        known: list[int] = []
        if listed is not None:
            known = self._known(listed, sent)
            if sent is not messages:  # what was delivered: the nodes hold it, or are not used
                known = known[:held if held is not None else self._held(messages, known)]
        turn = self._graph.add_turn(
            messages,
            response.message,
            known=known,
            prompt_token_ids=response.prompt_token_ids,
            token_ids=response.token_ids,
            logprobs=response.logprobs,
            choices=[(c.message, c.token_ids, c.logprobs) for c in response.choices],
            now=call.ended_at or time.time(),
        )
        call.node = turn.sampled
        call.choice_nodes = turn.choices
        version = call.answered_version if call.answered_version is not None else call.policy_version
        if version is not None:  # before the nodes are dumped: each new sampled node says which weights made it
            for i in (turn.sampled, *turn.choices):
                if i in turn.added:
                    trace.nodes[i].policy_version = version
        if delivered is not None:
            call.delivered_node = self._graph.add_delivered(turn.sampled, delivered, turn.added,
                                                            now=call.ended_at or time.time())
        record: dict[str, Any] = {"kind": "turn"}
        call.tool_set = self._tool_set(request.tools, record)
        self._fill(call, request, response, turn.prompt_path)
        trace.calls.append(call)
        if call.response_id:
            # A Responses chain continues from what the harness received.
            self._by_response_id[call.response_id] = (call.delivered_node if call.delivered_node is not None
                                                      else call.node)
        record["nodes"] = [node_record(i, trace.nodes[i]) for i in turn.added]
        record["call"] = call_record(call)
        if listed is not None:
            self.prefixes.remember(listed, self._as_held(sent, turn.prompt_path, listed.lead + len(listed.messages)),
                                   turn.prompt_path)
        return record

    def _as_held(self, sent: list[Message], path: list[int], known: int) -> list[Message]:
        """``sent`` with each new message (from ``known`` on) that is equal to its node's
        message replaced by that very object, so a later request's check of its known
        messages against their nodes is one identity test each, not a comparison (a
        restated reply is parsed into a new object, equal to the sampled one the node holds).
        Equal values: a request that takes them is the one a full parse gives."""
        stored = self._trace.nodes
        out = list(sent)
        for i in range(known, min(len(out), len(path))):
            held = stored[path[i]].message
            if held is not out[i] and held == out[i]:
                out[i] = held
        return out

    def _known(self, listed: Listed, sent: list[Message]) -> list[int]:
        """The graph nodes of ``listed``'s known messages (its lead's first), or [] when they
        cannot be used: remembered before a rollback or release, under another lead, or for
        other messages than ``sent`` (the request's, as parsed)."""
        if (listed.known and listed.generation == self.prefixes.generation and listed.messages
                and sent[listed.lead + len(listed.messages) - 1] is listed.messages[-1]
                and _same(sent[:listed.lead], listed.lead_known)):
            return listed.nodes
        return []

    def _held(self, messages: list[Message], nodes: list[int]) -> int:
        """How many leading ``messages`` are the messages of ``nodes``, one each."""
        stored = self._trace.nodes
        for k, (node, message) in enumerate(zip(nodes, messages)):
            held = stored[node].message
            if held is not message and held != message:
                return k
        return min(len(nodes), len(messages))

    def held_path(self, listed: Listed | None, messages: list[Message]) -> list[int]:
        """The graph nodes of the leading ``messages`` a request's scan knows (its lead's and
        its known elements'), each checked to hold its message (a request hook's session
        delivers other messages than its list was remembered with: ``Listed.sent``); []
        when the scan knows none, or once the graph is released. One identity or equality
        check per message instead of a walk that hashes and looks up each."""
        known = self.scan_path(listed, messages)
        return known[:self._held(messages, known)]

    def scan_path(self, listed: Listed | None, messages: list[Message]) -> list[int]:
        """``held_path`` unchecked: the nodes a scan knows for the leading ``messages``, for
        a caller that checks each before it uses it."""
        if listed is None or self._released is not None:
            return []
        sent = _sent(listed, messages)
        if sent is None or len(sent) < listed.lead + len(listed.messages):
            return []
        return self._known(listed, sent)

    def _rollback(self, nodes: int, calls: int, tool_sets: int, last_tools: tuple) -> None:
        trace = self._trace
        self.prefixes.clear()  # they may name nodes that are gone now
        if len(trace.nodes) > nodes:
            del trace.nodes[nodes:]
            self._graph = Graph(trace)  # O(nodes), on this rare path only
            self._estimates = {i: n for i, n in self._estimates.items() if i < nodes}
            self._by_response_id = {k: i for k, i in self._by_response_id.items() if i < nodes}
        del trace.calls[calls:]
        # A tool set first seen in the failed turn was never written: it must not be referred to.
        del trace.tool_sets[tool_sets:]
        self._tools_estimates = {k: n for k, n in self._tools_estimates.items() if k is None or k < tool_sets}
        self._last_tools = last_tools

    def commit_prompt(self, request: Request, call: ModelCall, rewrites: list[Rewrite] = ()) -> ModelCall:
        """A request that was answered without the model (a refusal): its new messages join
        the graph as prompt nodes, the call (no ``node``) goes on the record with them."""
        if self._released is not None:
            self.record_call(call, rewrites)
            return call
        added, path = self._graph.add_prompt(request.messages, now=call.ended_at or time.time())
        call.node = None
        self._trace.calls.append(call)
        self._append({"kind": "prompt", "nodes": [node_record(i, self._trace.nodes[i]) for i in added],
                      "call": call_record(call)}, sync=self.fsync == "turn")
        self._record_rewrites(rewrites, path)
        return call

    def record_metric(self, name: str, value: Any) -> None:
        """A metric measured during the rollout; folded into the footer's ``metrics`` (a
        later value of the same name wins, the evaluator's at the seal over all)."""
        value = self._scrub(value)
        self._trace.metrics[name] = value
        self._append({"kind": "metric", "name": name, "value": value})

    def record_stop(self, stop: dict) -> None:
        """Why the rollout ends (``StopRecord``); only the first stop counts."""
        record = StopRecord.model_validate(stop)
        if self._trace.stop is None:
            self._trace.stop = record
        self._append({"kind": "stop", "stop": record.model_dump(exclude_defaults=True)})

    def child(self, parent: int | None, message: Message) -> int | None:
        """The stored node under ``parent`` that is ``message``, or None (also once released)."""
        if self._released is not None:
            return None
        return self._graph._match(parent, message, None, 0)

    def conversation(self, response_id: str) -> list[Message] | None:
        """The messages up to and including the reply the provider called ``response_id``,
        or None if this session never committed it. A Responses request that chains on
        ``previous_response_id`` sends only its new items; prepending this keeps its turn on
        the same branch instead of starting a new root."""
        node = self._by_response_id.get(response_id)
        if node is None:
            return None
        return [self._trace.nodes[i].message for i in self._trace.path(node)]

    def record_call(self, call: ModelCall, rewrites: list[Rewrite] = ()) -> None:
        """An exchange that committed no node: an error, a refusal, a replayed retry. Never
        raises: a call whose record cannot be packed is kept as its id, status and error.
        ``rewrites`` first carried by its request follow it (no node: none was made)."""
        call.node = None
        self._trace.calls.append(call)
        kind = "replay" if call.replay_of else "call"
        try:
            self._append({"kind": kind, "call": call_record(call)}, sync=self.fsync == "turn")
        except Exception as e:  # noqa: BLE001
            log.exception(f"trace: {self.path.name}: call {call.id} recorded in short")
            error = {"type": "record_error", "message": f"{type(e).__name__}: {e}"}
            if call.error is not None:
                error = {"type": str(call.error.type), "message": f"{call.error.message} "
                         f"(and the call could not be recorded in full: {type(e).__name__})"}
            self._append({"kind": kind, "call": {"id": call.id, "status": call.status, "error": error}},
                         sync=self.fsync == "turn")
        for rewrite in rewrites:
            try:
                self.record_rewrite(rewrite)
            except Exception:  # noqa: BLE001 - never raises, as the call above
                log.exception(f"trace: {self.path.name}: rewrite {rewrite.id} of call {call.id} not recorded")

    def record_undelivered(self, call_id: str) -> None:
        """The answer of call ``call_id`` (already recorded) did not reach the harness whole."""
        for call in reversed(self._trace.calls):
            if call.id == call_id:
                call.delivered = False
                break
        self._append({"kind": "undelivered", "call": call_id}, sync=self.fsync == "turn")

    def record_rewrite(self, rewrite: Rewrite | dict[str, Any]) -> None:
        """What the proxy changed in what passed through (``Rewrite``; a dict of its fields is
        validated, unknown keys refused)."""
        if not isinstance(rewrite, Rewrite):
            rewrite = Rewrite.model_validate(self._scrub(dict(rewrite)))
        if rewrite.direction == "response":
            self._trace.response_rewrites.append(rewrite)
        else:
            self._trace.request_rewrites.append(rewrite)
        self._append({"kind": "rewrite", "rewrite": rewrite.model_dump(exclude_defaults=True)})

    def record_state(self, write: StateWrite) -> None:
        """An accepted write of the task state (the caller made ``write`` from its own copy;
        it is never a secret: the state secret authorises writes, it is not in them)."""
        trace = self._trace
        trace.state_writes.append(write)
        trace.state_version, trace.state_digest = write.version, write.digest
        self._append({"kind": "state", "state": write.model_dump(exclude_defaults=True)},
                     sync=self.fsync == "turn")

    def record_tool(self, decision: ToolDecision) -> None:
        """One call of the tool route (``addons/mitm/toolroute.py``)."""
        self._trace.tool_decisions.append(decision)
        self._append({"kind": "tool", "tool": decision.model_dump(exclude_defaults=True)})

    def record_egress(self, host: str, port: int, count: int) -> None:
        """A connection the network policy refused (never anything the harness sent on it)."""
        refusal = EgressRefusal(host=host, port=port, count=count, at=time.time())
        self._trace.egress_refusals.append(refusal)
        self._trace.egress[host] = count
        self._append({"kind": "egress", "egress": refusal.model_dump(exclude_defaults=True)})

    def record_version(self, upstream: str, version: Version, at: float | None = None) -> None:
        """The weights version of the session's upstream, as the orchestrator declared it."""
        change = VersionChange(upstream=upstream, version=version, at=at if at is not None else time.time())
        self._trace.versions.append(change)
        self._append({"kind": "version", "version": change.model_dump()}, sync=self.fsync == "turn")

    def seal(self, stop_condition: str = "sealed", *, reward: float | None = None,
             rewards: dict[str, Reward] | None = None, metrics: dict | None = None,
             info: dict | None = None, stopped_by: str | None = None,
             truncated: bool = False) -> None:
        """Write the footer (stop condition, who stopped, totals, timing, the evaluator's
        reward and metrics) and close the file. Idempotent: a second seal changes nothing.
        Exchanges recorded after it are still appended (lossless over tidy); the footer's
        totals then describe the trace as it was at the seal.

        ``reward`` defaults to the weighted sum of ``rewards``; ``metrics`` are laid over
        those recorded during the rollout (``record_metric``); ``info`` over the header's."""
        trace = self._trace
        if trace.sealed:
            return
        trace.sealed = True
        trace.stop_condition = stop_condition
        trace.stopped_by = stopped_by
        trace.truncated = truncated
        trace.ended_at = time.time()
        if rewards:
            trace.rewards = {k: Reward.model_validate(v) for k, v in rewards.items()}
            if reward is None:
                reward = sum(r.score * r.weight for r in trace.rewards.values())
        if reward is not None:
            trace.reward = float(reward)
        if metrics:
            trace.metrics.update(self._scrub(dict(metrics)))
        if info:
            trace.info.update(self._scrub(dict(info)))
        trace.timing = _timing(trace)
        footer: dict[str, Any] = {
            "kind": "footer", "stop_condition": stop_condition, "ended_at": trace.ended_at,
            **self._totals(), "truncated": truncated, "timing": trace.timing.model_dump(),
            "state_version": trace.state_version}
        if trace.state_digest is not None:
            footer["state_digest"] = trace.state_digest
        if stopped_by is not None:
            footer["stopped_by"] = stopped_by
        if trace.reward is not None:
            footer["reward"] = trace.reward
        if trace.rewards:
            footer["rewards"] = {k: r.model_dump() for k, r in trace.rewards.items()}
        if trace.metrics:
            footer["metrics"] = dict(trace.metrics)
        if info:
            footer["info"] = self._scrub(dict(info))
        self._append(footer, sync=self.fsync != "never", close=True)

    def release(self) -> None:
        """Let go of a sealed trace's graph: a proxy that runs thousands of rollouts in a
        night keeps each one's summary, not its messages; the file is the record. An exchange
        still in flight when the session was sealed is appended as a call without nodes."""
        if not self._trace.sealed or self._released is not None:
            return
        self._released = self.summary()
        t = self._trace
        # Only atoms, so the collector does not track it. Everything else goes, not replaced by
        # empty ones: up to ``intercept_keep_sealed`` released sessions stay in memory, and each
        # empty Trace (eight lists, a set, a dict), Graph, Prefixes... is objects every full
        # collection walks, for every kept session (``bench/gcpause.py``). ``__getattr__``
        # makes one again if a late exchange asks.
        self._kept = {"id": t.id, "started_at": t.started_at, "ended_at": t.ended_at, "stop_condition": t.stop_condition,
                      "state_version": t.state_version, "state_digest": t.state_digest}
        self._generation = self.prefixes.generation + 1  # as ``Prefixes.clear`` would bump it
        for name in _RELEASED:
            self.__dict__.pop(name, None)
        self._estimates, self._by_response_id, self._tools_estimates = {}, {}, {}

    def summary(self) -> dict:
        if self._released is not None:
            return {**self._released, "released": True}
        trace = self._trace
        out = {"id": trace.id, **self._totals(), "stop_condition": trace.stop_condition,
               "sealed": trace.sealed, "trace_path": str(self.path)}
        if trace.calls:  # what run_harness's progress line shows
            last = trace.calls[-1]
            out["last_call"] = {"status": last.status, "finish_reason": last.finish_reason,
                                "error": last.error.type if last.error else None}
        if trace.sealed:
            out.update(stopped_by=trace.stopped_by, truncated=trace.truncated)
            if trace.reward is not None:
                out["reward"] = trace.reward
            if trace.metrics:
                out["metrics"] = dict(trace.metrics)
        health = self.store.health(self.path)
        if not health.ok or health.late:
            out["store"] = health.as_dict()
            out["store_error"] = health.error or self.store.errors.get(self.path)
        return out

    def write_health(self):
        """The store's account of this trace's file (``WriteHealth``)."""
        return self.store.health(self.path)

    # --- internals ---------------------------------------------------------------------

    def _totals(self) -> dict[str, int]:
        trace = self._trace
        return {"turns": trace.num_turns, "input_tokens": trace.num_input_tokens,
                "output_tokens": trace.num_output_tokens, "calls": len(trace.calls),
                "errors": len(trace.errors)}

    def _append(self, record: dict, *, sync: bool = False, close: bool = False,
                new: bool = False) -> None:
        self._chain = self.store.append(self.path, record, sync=sync, close=close, new=new, prev=self._chain)

    def _fill(self, call: ModelCall, request: Request, response: Response,
              prompt_path: list[int]) -> None:
        """The addon fills what it knows; the response supplies the rest. Usage the provider
        did not report (a stream without ``include_usage``) is counted from the token ids
        when the upstream returned them, else estimated locally (marked so)."""
        for field, value in (("model", response.model), ("response_id", response.id),
                             ("requested_model", request.model),
                             ("finish_reason", response.finish_reason),
                             ("native_finish_reason", response.native_finish_reason),
                             ("error", response.error)):
            if getattr(call, field) is None:
                setattr(call, field, value)
        if call.usage is None:
            call.usage = response.usage or _counted(response) or self._estimate(request, call, prompt_path)

    def _tool_set(self, tools: list[Tool], record: dict[str, Any]) -> int | None:
        """The index of the tool set this request advertised; a set never seen before is
        added and written once, in this turn's record. The previous turn's set is checked
        first: a harness sends the same tools every turn."""
        if not tools:
            return None
        last, index = self._last_tools
        if tools != last:
            index = self._trace.tool_set_index(tools)
            if index is None:
                index = len(self._trace.tool_sets)
                self._trace.tool_sets.append(list(tools))
                record["tools"] = [t.model_dump(exclude_defaults=True) for t in tools]
            self._last_tools = (tools, index)
        return index

    def _estimate(self, request: Request, call: ModelCall, prompt_path: list[int]) -> Usage:
        nodes = self._trace.nodes
        est = self._estimates

        def count(i: int) -> int:
            if i not in est:  # each node is tokenised once, however often it is restated
                est[i] = tokens.count_message(nodes[i].message)
            return est[i]

        tools = self._tools_estimates.get(call.tool_set)
        if tools is None:
            sets = self._trace.tool_sets
            tools = self._tools_estimates[call.tool_set] = tokens.count_tools(
                sets[call.tool_set] if call.tool_set is not None else [])
        output = count(call.node) + sum(count(i) for i in call.choice_nodes)
        return Usage(input_tokens=sum(count(i) for i in prompt_path) + tools,
                     output_tokens=output, estimated=True)


def _sent(listed: Listed | None, messages: list[Message]) -> list[Message] | None:
    """The messages ``listed`` was parsed into: its ``sent``, or ``messages`` themselves when
    nothing else can be delivered; None when the two are not one message each."""
    if listed is None or listed.sent is None:
        return messages
    return listed.sent if len(listed.sent) == len(messages) else None


def _same(lead: list[Message], known: tuple[Message, ...]) -> bool:
    """Whether a request's messages before its list (Anthropic's system prompt) are those of
    the remembered request: its list's nodes hang under theirs only then."""
    return len(lead) == len(known) and all(a is b or a == b for a, b in zip(lead, known))

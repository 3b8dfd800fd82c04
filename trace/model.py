"""The Trace: what one session's model saw and produced, as a message graph plus one record
per provider exchange.

One object serves two readers. An evaluator reads ``calls`` (model, effective sampling,
usage, finish reason, errors, timing); a trainer reads ``branches`` (each root-to-leaf path of
the graph, with token ids, the sampled mask and logprobs aligned token by token). The graph
exists because harnesses restate the whole history every turn: storing each prompt would
grow quadratically, while the graph stores each distinct message once and shows compaction
or sub-agents as extra leaves instead of duplicated prefixes.

The models here are the in-memory and export shape; the on-disk record stream is in
``store.py`` and ``recorder.py`` (append-only, one record per event).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, PrivateAttr

from interceptor.trace.messages import (
    FinishReason,
    Message,
    ResponseError,
    Sampling,
    Tool,
    Usage,
    message_hash,
    restated_hash,
)

# 2: per-call tool sets, per-node reference_logprobs and loss_weights, a typed header and
# typed rewrites (unknown fields refused); ``prompt``, ``stop`` and ``metric`` records, the
# footer's stopped_by, truncated, timing, rewards and info. 3: every record ends in an XXH3-64
# checksum chained to the record before it (trace/records.py). 4: policy versions: ``version``
# records (an upstream's weights declared), a call's ``policy_version``, ``answered_version``,
# ``version_mismatch`` and ``held_ms``, a sampled node's ``policy_version``. README "Record
# format" says what each version reads.
SCHEMA_VERSION = 4
# The oldest record format this reader still folds. Raise it only with a migration note in
# the README: trainers keep old files for years.
MIN_SCHEMA_VERSION = 1


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


#: A weights version as the orchestrator declares it: a number, or a name (a checkpoint's).
Version = int | str


class MessageNode(_Model):
    """One message in the graph. Its position is its index in ``Trace.nodes``.

    ``token_ids``/``mask``/``logprobs`` are set only when the upstream returned token ids
    (vLLM, SGLang): prompt tokens of a turn go onto the nodes that turn added (mask False),
    completion tokens onto the sampled node (mask True, logprobs aligned). ``None`` means
    "not known", which is different from ``[]`` ("known to contribute no tokens").
    """

    parent: int | None = None
    message: Message
    sampled: bool = False  # True only for a reply the model produced
    timestamp: float = 0.0
    token_ids: list[int] | None = None
    mask: list[bool] | None = None
    logprobs: list[float] | None = None
    advantages: list[float] | None = None  # None until a trainer sets it
    # Reserved for trainers (the proxy never sets them), aligned with token_ids like
    # logprobs: a reference model's logprobs of the same tokens (KL terms), and a per-token
    # loss weight (None: the sampled mask is the weight).
    reference_logprobs: list[float] | None = None
    loss_weights: list[float] | None = None
    # A sampled node's: the weights version that sampled it (the one the upstream said answered,
    # else the one declared when the request was sent; ``ModelCall.policy_version``). Every
    # token of the node carries it (``Branch.policy_versions``). None: no version was declared.
    policy_version: Version | None = None


class Override(_Model):
    """One change the proxy made to a request body: which key (dotted when nested,
    ``reasoning.effort``), what it was, what it is now (None: removed), and why (``session``
    for the session's settings, else the provider rule that forced it). Never a credential."""

    key: str
    old: Any = None
    new: Any = None
    reason: str = "session"


class Rewrite(_Model):
    """What the proxy changed in what passed through, beyond the session's settings: in a
    request (a hook replaced a tool result) or in a response (``collect_tokens`` took out the
    token ids it had asked for). ``by`` says what did it; ``call`` and ``node`` where.

    A request hook's rewrite (``by: "hook"``) is written once, with the call that first
    carried it; it names the ``hooks`` that changed the message, the message's ``target``
    role, ``position`` in that request and ``tool_call_id``, the node the delivered content
    became, digests and sizes (UTF-8 bytes of the content) before and after, and the
    ``original`` content (cut to ``intercept_rewrite_keep_bytes``: ``original_truncated``).
    Every call that carried it, the later restatements included, lists its ``id`` in
    ``ModelCall.rewrites``."""

    direction: Literal["request", "response"] = "request"
    by: str = ""
    id: str | None = None
    call: str | None = None
    node: int | None = None
    hooks: list[str] = Field(default_factory=list)
    target: Literal["tool", "user", "assistant"] | None = None
    position: int | None = None
    tool_call_id: str | None = None
    digest_before: str | None = None  # sha256 of the content as canonical JSON
    digest_after: str | None = None
    size_before: int | None = None
    size_after: int | None = None
    is_error: bool | None = None  # the delivered tool result's error flag, when a hook changed it
    original_truncated: bool = False
    what: str | None = None  # what was rewritten (tool_result, web_search, ...)
    message: str | None = None  # which message, as a person finds it ("tool call_1")
    reason: str | None = None
    original: Any = None  # what the harness sent or the provider answered, when kept
    delivered: Any = None  # what went on instead
    body: Literal["json", "sse"] | None = None  # the answer's framing (collect_tokens)
    sampled_node: int | None = None  # a response hook's: the reply the model produced (``node`` is the delivered one)
    removed: list[str] = Field(default_factory=list)  # paths taken out
    events: int | None = None  # SSE events rewritten
    dropped_events: int | None = None  # SSE events dropped whole (they carried only token ids)


class ReplaySource(_Model):
    """A call of another trace: its id and the trace's (which recorded call answered a replayed
    exchange, or whose prompt a resent one asked again)."""

    trace: str
    call: str


class ModelCall(_Model):
    """One provider exchange as the proxy saw it, committed or not.

    ``node`` is the sampled node the exchange committed; ``None`` for an exchange that added
    nothing to the graph (an error, a refusal, a replayed retry). ``sampling`` is what the
    upstream actually received, after the session's settings were imposed; ``overrides`` says
    what was changed (each ``{key, old, new, reason}``, never a credential).
    """

    id: str
    node: int | None = None
    choice_nodes: list[int] = Field(default_factory=list)  # sibling samples of n > 1
    dialect: str = ""
    endpoint: str = ""
    model: str | None = None
    requested_model: str | None = None
    stream: bool = False
    sampling: Sampling = Field(default_factory=Sampling)
    overrides: list[Override] = Field(default_factory=list)
    status: int | None = None
    finish_reason: FinishReason | None = None
    native_finish_reason: str | None = None
    usage: Usage | None = None
    started_at: float = 0.0
    first_byte_at: float | None = None
    ended_at: float | None = None
    # A streamed answer's timing, event by event (SSE events, or a WebSocket's frames): the
    # gap in milliseconds before each event, the first counted from ``first_byte_at``. Gaps,
    # not offsets, because a gap under 128 milliseconds is one byte on disk (a msgpack
    # positive fixint) where an offset grows with the stream; ``event_offsets`` adds them up. A paced replay sends each event
    # at its time. None: not streamed (or read whole), or recorded before the field existed.
    event_gaps_ms: list[int] | None = None
    error: ResponseError | None = None
    replay_of: str | None = None
    # Answered from another trace by a replay upstream (the harness re-ran; no model did).
    replayed_from: ReplaySource | None = None
    # Re-asked by ``replay_trace.py resend``: the source trace and the call whose prompt it is.
    resent_from: ReplaySource | None = None
    response_id: str | None = None  # the provider's id of the answer (Responses chains on it)
    # Which of Trace.tool_sets the request advertised; None: no tools (or not known, for an
    # exchange that committed nothing). Two sub-agents in one session advertise different sets.
    tool_set: int | None = None
    # The answer this request continued (Responses previous_response_id); `unknown`: this
    # session never recorded it, so the turn starts a new root from its own input.
    previous_response_id: str | None = None
    previous_response_unknown: bool = False
    # The upstream speaks another dialect than the harness (``dialect``): the request was
    # translated into ``upstream_dialect`` and sent as the body whose sha256 is
    # ``translated_digest``; ``sampling`` is what that body set, ``overrides`` include what
    # the translation could not carry (reason ``translation``).
    upstream_dialect: str | None = None
    translated_digest: str | None = None
    # Whether the harness received the whole answer. False: its connection closed first (an
    # SDK timeout, a client that stops reading after the content it needs); the proxy read the
    # rest from the upstream itself, so the turn is whole on the record (an ``undelivered``
    # record says so when the turn was committed before the harness went away).
    delivered: bool = True
    # The request rewrites (Rewrite.id) this call's request carried, re-applications included.
    rewrites: list[str] = Field(default_factory=list)
    # A response hook replaced the reply: ``node`` keeps what the model sampled (a training
    # sample, with its token ids), ``delivered_node`` is the non-sampled sibling the harness
    # received, on which the next turn chains. None: the harness got the sampled reply.
    delivered_node: int | None = None
    # Policy versions (an asynchronous RL loop swaps the weights while rollouts run): the
    # upstream's version declared when the request was sent (``version`` records), and the one
    # the upstream said answered (the header its declaration names), when it says;
    # ``version_mismatch``: both known and different, the answer is not the declared policy's.
    policy_version: Version | None = None
    answered_version: Version | None = None
    version_mismatch: bool = False
    # Milliseconds the request was held before it was sent, its upstream paused for a weight
    # swap (None: never held).
    held_ms: int | None = None

    @property
    def duration(self) -> float | None:
        if self.ended_at is None or not self.started_at:
            return None
        return self.ended_at - self.started_at

    @property
    def event_offsets(self) -> list[float] | None:
        """Each event's arrival in seconds after ``first_byte_at`` (``event_gaps_ms`` summed)."""
        if self.event_gaps_ms is None:
            return None
        out, at = [], 0
        for gap in self.event_gaps_ms:
            at += gap
            out.append(at / 1000)
        return out


class StateWrite(_Model):
    """One accepted write of the task state that tool servers share through the proxy
    (``/_interceptor/state``): the version it made, who wrote it (``tool``: a tool server with
    the state secret; ``admin``: the orchestrator; ``config``: the session's initial state,
    version 0), how (``put`` whole, ``patch`` RFC 7396, ``init``), the size and digest of the
    whole state after it, and that state itself when it is at most ``STATE_VALUE_MAX`` bytes
    (``value_omitted`` otherwise: the digest still says what it was)."""

    version: int
    by: Literal["tool", "admin", "config"] = "tool"
    op: Literal["put", "patch", "init"] = "put"
    size: int = 0
    digest: str = ""
    value: Any = None
    value_omitted: bool = False
    at: float = 0.0


class EgressRefusal(_Model):
    """A connection the harness tried to open to a host outside the session's network allow
    list (``network.egress``), refused by the proxy: the host, the port, and how many times
    that host was refused so far (this one included)."""

    host: str
    port: int = 0
    count: int = 1
    at: float = 0.0


class ToolDecision(_Model):
    """One call of the tool route (``POST /_interceptor/tool``): the phase (``before`` the tool
    runs, ``after``), the tool call's id and name, the action answered (``allow``, ``block``,
    ``rewrite``, ``stop``, or ``error`` for a hook that failed), the hooks that changed it,
    the digest and size of what the harness reported (its output, after) and that content
    when it is at most ``STATE_VALUE_MAX`` bytes, and ``delivered``: what the model reads
    instead (a block's or a rewrite's content)."""

    phase: Literal["before", "after"] = "before"
    tool_call_id: str
    name: str | None = None
    action: Literal["allow", "block", "rewrite", "stop", "error"] = "allow"
    hooks: list[str] = Field(default_factory=list)
    digest: str = ""
    size: int = 0
    content: Any = None
    content_omitted: bool = False
    delivered: Any = None
    at: float = 0.0


# A state (or a tool route's content) larger than this is recorded by size and digest only.
STATE_VALUE_MAX = 64 << 10


class Reward(_Model):
    """One named reward component; the rollout's ``reward`` is their weighted sum unless
    the evaluator gives it outright."""

    score: FiniteFloat
    weight: FiniteFloat = 1.0


class StopRecord(_Model):
    """Why the rollout ended: ``condition`` (``max_turns``, ``context_length``, a stop
    hook's name, the evaluator's own, a tool server's reason), ``by`` whom (``limit``,
    ``hook``, ``upstream``, ``tool``, ``control``, ``shutdown``), the call that met it, and
    when. The first stop is final."""

    condition: str
    by: str
    call: str | None = None
    at: float = 0.0


class Timing(_Model):
    """Where a rollout's wall-clock time went, written in the footer. ``model`` is the sum
    of the upstream calls' durations (replays excluded); ``harness`` is the rest of ``wall``
    (never negative: parallel calls can overlap). Timestamps are Unix seconds."""

    wall: float = 0.0
    model: float = 0.0
    harness: float = 0.0
    first_request_at: float | None = None
    last_answer_at: float | None = None


class VersionChange(_Model):
    """A ``version`` record: the orchestrator declared the weights version of the session's
    upstream (through the control API), or the session started on it. Calls sent after it
    carry it as their ``policy_version``."""

    upstream: str
    version: Version
    at: float = 0.0


class Branch(_Model):
    """One root-to-leaf path: a training sample.

    ``token_ids`` is ``None`` unless every node on the path carries token ids; when set,
    ``sampled_mask``, ``logprobs`` and ``advantages`` have the same length (logprobs and
    advantages are 0.0 off the sampled tokens). ``reference_logprobs`` and ``loss_weights``
    are set only when a trainer put them on some node of the path (nodes without them count
    0.0, and their sampled mask as the weight).

    ``tools`` is what the branch's last call advertised (``tool_set`` its index in
    ``Trace.tool_sets``): the schema the sample's final prompt was written against, which a
    sub-agent or a compaction does not share with the main conversation.
    """

    index: int
    leaf: int
    nodes: list[int]
    messages: list[Message]
    calls: list[str]  # ids of the calls whose sampled node lies on this path
    token_ids: list[int] | None = None
    sampled_mask: list[bool] | None = None
    logprobs: list[float] | None = None
    advantages: list[float] | None = None
    reference_logprobs: list[float] | None = None
    loss_weights: list[float] | None = None
    tool_set: int | None = None
    tools: list[Tool] = Field(default_factory=list)
    # Which weights sampled each token (aligned with ``token_ids``: the sampled node's
    # ``policy_version``, None on tokens the model did not sample), and each message
    # (aligned with ``messages``); both None when no node of the path has a version.
    policy_versions: list[Version | None] | None = None
    message_versions: list[Version | None] | None = None


class Header(_Model):
    """The first record of a trace file: which session, which code wrote it, and what the
    evaluator said about the rollout (``agent``, ``task``, ``info``) and how it was set up
    (``config``: the session's settings, secrets removed)."""

    schema_version: int = SCHEMA_VERSION
    producer: str = "llm-interceptor"
    producer_version: str = ""
    id: str
    started_at: float = 0.0
    agent: dict[str, Any] = Field(default_factory=dict)
    task: dict[str, Any] = Field(default_factory=dict)
    info: dict[str, Any] = Field(default_factory=dict)
    config: dict[str, Any] = Field(default_factory=dict)


def _call_nodes(call: ModelCall) -> list[int]:
    """The nodes a call put its answer in: the sampled reply, the delivered one a response
    hook made of it, the sibling samples of n > 1."""
    out = [call.node] if call.node is not None else []
    if call.delivered_node is not None:
        out.append(call.delivered_node)
    return out + call.choice_nodes


class Trace(_Model):
    """A session's full account. Built incrementally by the recorder, folded back by
    ``read_trace``; the derived views (branches, token totals) are computed, not stored."""

    id: str
    schema_version: int = SCHEMA_VERSION
    producer: str = "llm-interceptor"
    producer_version: str = ""
    started_at: float = 0.0
    ended_at: float | None = None
    agent: dict[str, Any] = Field(default_factory=dict)
    task: dict[str, Any] = Field(default_factory=dict)
    info: dict[str, Any] = Field(default_factory=dict)
    config: dict[str, Any] = Field(default_factory=dict)
    tool_sets: list[list[Tool]] = Field(default_factory=list)  # each distinct set once, first seen first
    nodes: list[MessageNode] = Field(default_factory=list)
    calls: list[ModelCall] = Field(default_factory=list)
    request_rewrites: list[Rewrite] = Field(default_factory=list)
    response_rewrites: list[Rewrite] = Field(default_factory=list)
    stop_condition: str | None = None
    sealed: bool = False
    reward: float | None = None
    rewards: dict[str, Reward] = Field(default_factory=dict)
    metrics: dict[str, Any] = Field(default_factory=dict)
    stop: StopRecord | None = None  # the first stop record
    truncated: bool = False  # the rollout was cut short (a limit, a context too long)
    stopped_by: str | None = None  # limit, hook, upstream, tool, control, shutdown
    timing: Timing | None = None  # set by the footer
    # The task state's accepted writes in order, and where it ended (the footer's version and
    # digest; before the seal, the last write's).
    state_writes: list[StateWrite] = Field(default_factory=list)
    # num_input_tokens' count so far: (calls counted, the last of them, its node, nodes then,
    # the total, each counted reply's call by node).
    _inputs: tuple | None = PrivateAttr(default=None)
    _counts: tuple | None = PrivateAttr(default=None)  # _tally's: (calls, the last, its node, turns, output)
    # ``messages_now``'s: (the last node, the node, the shared list of the path's messages, its length)
    _last_path: tuple | None = PrivateAttr(default=None)

    def __eq__(self, other: object) -> bool:
        # The kept count is not part of a trace's value.
        if not isinstance(other, Trace):
            return NotImplemented
        return self.__dict__ == other.__dict__

    __hash__ = None
    state_version: int = 0
    state_digest: str | None = None
    # Connections refused by the network policy (``egress`` records), and per host how many.
    egress_refusals: list[EgressRefusal] = Field(default_factory=list)
    egress: dict[str, int] = Field(default_factory=dict)
    versions: list[VersionChange] = Field(default_factory=list)  # ``version`` records, in order
    tool_decisions: list[ToolDecision] = Field(default_factory=list)  # the tool route's answers (``tool`` records)

    # --- graph views -------------------------------------------------------------------

    def children(self) -> dict[int | None, list[int]]:
        kids: dict[int | None, list[int]] = {}
        for i, node in enumerate(self.nodes):
            kids.setdefault(node.parent, []).append(i)
        return kids

    def path(self, index: int) -> list[int]:
        """Node indices from the root down to ``index``."""
        out = []
        seen = set()
        cur: int | None = index
        while cur is not None:
            if cur in seen:  # a corrupt file must not hang the reader
                raise ValueError(f"cycle in the message graph at node {cur}")
            seen.add(cur)
            out.append(cur)
            cur = self.nodes[cur].parent
        out.reverse()
        return out

    def leaves(self) -> list[int]:
        has_child = {n.parent for n in self.nodes if n.parent is not None}
        return [i for i in range(len(self.nodes)) if i not in has_child]

    @property
    def branches(self) -> list[Branch]:
        """Every root-to-leaf path, in the order their leaves were created."""
        node_calls: dict[int, list[ModelCall]] = {}
        for call in self.calls:
            for n in _call_nodes(call):
                node_calls.setdefault(n, []).append(call)
        return [self._branch(k, leaf, node_calls) for k, leaf in enumerate(self.leaves())]

    def _branch(self, index: int, leaf: int, node_calls: dict[int, list[ModelCall]]) -> Branch:
        path = self.path(leaf)
        nodes = [self.nodes[i] for i in path]
        calls = [c for i in path for c in node_calls.get(i, [])]
        tool_set = calls[-1].tool_set if calls else None
        branch = Branch(
            index=index,
            leaf=leaf,
            nodes=path,
            messages=[n.message for n in nodes],
            calls=[c.id for c in calls],
            tool_set=tool_set,
            tools=self.tool_sets[tool_set] if tool_set is not None and tool_set < len(self.tool_sets) else [],
        )
        if nodes and all(n.token_ids is not None for n in nodes):
            ids, mask, lps, adv, ref, weights = [], [], [], [], [], []
            for n in nodes:
                k = len(n.token_ids)
                ids += n.token_ids
                m = n.mask if n.mask is not None else [n.sampled] * k
                mask += m
                lps += n.logprobs if n.logprobs is not None else [0.0] * k
                adv += n.advantages if n.advantages is not None else [0.0] * k
                ref += n.reference_logprobs if n.reference_logprobs is not None else [0.0] * k
                weights += n.loss_weights if n.loss_weights is not None else [float(x) for x in m]
            branch.token_ids, branch.sampled_mask = ids, mask
            branch.logprobs, branch.advantages = lps, adv
            if any(n.reference_logprobs is not None for n in nodes):
                branch.reference_logprobs = ref
            if any(n.loss_weights is not None for n in nodes):
                branch.loss_weights = weights
        if any(n.policy_version is not None for n in nodes):
            branch.message_versions = [n.policy_version if n.sampled else None for n in nodes]
            if branch.token_ids is not None:
                branch.policy_versions = [v for n, v in zip(nodes, branch.message_versions)
                                          for _ in range(len(n.token_ids))]
        return branch

    @property
    def tools(self) -> list[Tool]:
        """The tools the last committed call advertised (what most single-agent readers
        want); a branch's own are ``Branch.tools``."""
        last = next((c for c in reversed(self.calls) if c.node is not None), None)
        if last is None or last.tool_set is None or last.tool_set >= len(self.tool_sets):
            return []
        return self.tool_sets[last.tool_set]

    def tool_set_index(self, tools: list[Tool]) -> int | None:
        """The index of ``tools`` in ``tool_sets``, or None (also for no tools)."""
        if not tools:
            return None
        for k in range(len(self.tool_sets) - 1, -1, -1):  # the newest set is the likeliest
            if self.tool_sets[k] == tools:
                return k
        return None

    @property
    def messages(self) -> list[Message]:
        """The conversation as it stands: the path of the last committed reply (or the
        newest leaf when nothing was committed)."""
        shared, n = self.messages_now()
        return shared[:n]

    def messages_now(self) -> tuple[list[Message], int]:
        """``messages`` as a list shared from call to call and its length now: the list only
        ever grows at its end (a branch that does not go on from the last one asked for gets a
        list of its own), so ``shared[:n]`` is this moment's conversation whenever it is read,
        on any thread (a hook reads its context in a worker thread while the loop commits).
        Hooks are handed the branch every turn, and each turn's is the one before plus the
        turn: building its list would walk every node of the conversation, where this walks
        the turn's."""
        last = next((c.delivered_node if c.delivered_node is not None else c.node
                     for c in reversed(self.calls) if c.node is not None), None)
        if last is None:
            leaves = self.leaves()
            if not leaves:
                return [], 0
            last = leaves[-1]
        nodes, memo = self.nodes, self._last_path
        if memo is not None and memo[0] < len(nodes) and nodes[memo[0]] is memo[1] and len(memo[2]) == memo[3]:
            up: list[int] = []
            cur: int | None = last
            for _ in range(len(nodes)):  # bounded, as path's cycle check
                if cur is None or cur == memo[0]:
                    break
                up.append(cur)
                cur = nodes[cur].parent
            if cur == memo[0]:
                shared = memo[2]  # grown in place: what was read of it before is unchanged
                shared += [nodes[i].message for i in reversed(up)]
                self._last_path = (last, nodes[last], shared, len(shared))
                return shared, len(shared)
        shared = [nodes[i].message for i in self.path(last)]
        self._last_path = (last, nodes[last], shared, len(shared))
        return shared, len(shared)

    # --- totals ------------------------------------------------------------------------

    @property
    def committed_calls(self) -> list[ModelCall]:
        return [c for c in self.calls if c.node is not None]

    @property
    def num_turns(self) -> int:
        """Sampled replies committed (one per call that committed a node)."""
        return self._tally()[0]

    def _tally(self) -> tuple[int, int]:
        """The turns and the output tokens, kept (``_counts``) and counted on from the calls
        since the last count: hooks and limits read them every turn, and counting every call
        each time would make a turn cost the session's age. A call is only ever appended
        or, the last one, rolled back (the last counted call and its node are checked)."""
        calls, memo = self.calls, self._counts
        done, turns, output = 0, 0, 0
        if memo is not None:
            done, last, last_node, turns, output = memo
            if not (len(calls) >= done and (done == 0 or (calls[done - 1] is last and last.node == last_node))):
                done, turns, output = 0, 0, 0
        for call in calls[done:]:
            turns += call.node is not None
            output += call.usage.output_tokens if call.usage is not None else 0
        if len(calls) != done or memo is None:
            last = calls[-1] if calls else None
            self._counts = (len(calls), last, last.node if last is not None else None, turns, output)
        return turns, output

    @property
    def num_input_tokens(self) -> int:
        """Fed-in tokens counted once: each call's input beyond the previous call's total on
        its branch. A prefix shared by two branches is counted once because each call is
        visited once; a compaction restarts the count on its new branch.

        Hooks and limits read it every turn, and counting every call again would make each
        turn cost the session's age: the count is kept (``_inputs``) and only the calls
        since are counted, when that is sure to give the same: each new call's reply is a
        node made after the count (nothing counted before hangs under it), none delivered
        another message, and no count ever met a restated copy of a reply (whose lookup
        depends on every call). Anything else (a rollback, a reused sample) counts afresh."""
        calls, memo = self.calls, self._inputs
        if memo is not None:
            done, last, last_node, nodes, total, by_node = memo
            if (len(calls) >= done and len(self.nodes) >= nodes
                    and (done == 0 or (calls[done - 1] is last and last.node == last_node))):
                new = calls[done:]
                if all(c.delivered_node is None and (c.node is None or c.node >= nodes) for c in new):
                    by_node = {**by_node, **{c.node: c for c in new if c.node is not None}}
                    for call in new:
                        if call.usage is None or call.node is None:
                            continue
                        met: dict = {}
                        prev = self._previous_call(call.node, by_node, met)
                        if met:
                            break  # a restated copy: count afresh, every time
                        base = prev.usage.total_tokens if prev is not None and prev.usage else 0
                        total += max(0, call.usage.input_tokens - base)
                    else:
                        self._remember_inputs(total, by_node)
                        return total
        total, met = self._count_input_tokens()
        if met or any(c.delivered_node is not None for c in calls):
            self._inputs = None
        else:
            self._remember_inputs(total, {c.node: c for c in calls if c.node is not None})
        return total

    def _remember_inputs(self, total: int, by_node: dict[int, ModelCall]) -> None:
        calls = self.calls
        last = calls[-1] if calls else None
        self._inputs = (len(calls), last, last.node if last is not None else None, len(self.nodes), total, by_node)

    def _count_input_tokens(self) -> tuple[int, bool]:
        """``num_input_tokens`` counted from every call, and whether a restated copy of a
        reply was met on the way."""
        by_node = {c.node: c for c in self.calls if c.node is not None}
        by_node.update({c.delivered_node: c for c in self.calls if c.delivered_node is not None})
        by_key: dict = {}
        total = 0
        for call in self.calls:
            if call.usage is None or call.node is None:
                continue
            prev = self._previous_call(call.node, by_node, by_key)
            base = prev.usage.total_tokens if prev is not None and prev.usage else 0
            total += max(0, call.usage.input_tokens - base)
        return total, bool(by_key)

    def _previous_call(self, node: int, by_node: dict[int, ModelCall],
                       by_key: dict) -> ModelCall | None:
        """The call whose reply is the nearest ancestor of ``node``. A retokenised
        restatement of a reply (a non-sampled copy beside the sampled node, see graph.py)
        stands for that reply's call."""
        cur = self.nodes[node].parent
        for _ in range(len(self.nodes)):  # bounded: a corrupt graph must not hang
            if cur is None:
                return None
            if cur in by_node:
                return by_node[cur]
            n = self.nodes[cur]
            if not n.sampled and n.message.role == "assistant":
                if not by_key:  # built once, and only when a copy is met
                    for i, c in by_node.items():
                        msg, parent = self.nodes[i].message, self.nodes[i].parent
                        by_key[(parent, message_hash(msg))] = c
                        bare = restated_hash(msg)  # the copy may have dropped its reasoning
                        if bare is not None:
                            by_key.setdefault((parent, bare), c)
                by_key[None] = True  # a copy was met (num_input_tokens counts afresh then)
                prev = by_key.get((n.parent, message_hash(n.message)))
                if prev is not None:
                    return prev
            cur = n.parent
        return None

    @property
    def num_output_tokens(self) -> int:
        return self._tally()[1]

    @property
    def num_total_tokens(self) -> int:
        return self.num_input_tokens + self.num_output_tokens

    @property
    def usage(self) -> Usage:
        """Provider usage summed over every call, as billed (restated prefixes counted each
        time; ``estimated`` if any call's count was estimated locally)."""
        total = Usage()
        for c in self.calls:
            if c.usage is None:
                continue
            for field in ("input_tokens", "output_tokens", "cached_input_tokens",
                          "cache_creation_input_tokens", "reasoning_tokens"):
                setattr(total, field, getattr(total, field) + getattr(c.usage, field))
            total.estimated = total.estimated or c.usage.estimated
        return total

    @property
    def errors(self) -> list[ResponseError]:
        return [c.error for c in self.calls if c.error is not None]

    # --- export ------------------------------------------------------------------------

    def to_record(self) -> dict[str, Any]:
        """A JSON-able dict of the whole trace plus its derived views, for export and
        ``show --json``. Token arrays are plain lists of numbers."""
        data = self.model_dump(mode="json")
        data["tools"] = [t.model_dump(mode="json") for t in self.tools]
        data["branches"] = [b.model_dump(mode="json") for b in self.branches]
        data["num_turns"] = self.num_turns
        data["num_input_tokens"] = self.num_input_tokens
        data["num_output_tokens"] = self.num_output_tokens
        data["num_total_tokens"] = self.num_total_tokens
        data["usage"] = self.usage.model_dump(mode="json")
        data["errors"] = [e.model_dump(mode="json") for e in self.errors]
        return data

"""A session is one rollout: its secrets, model, sampling, upstream and trace.

``SessionConfig`` is the boundary model (the sessions file, the control API); unknown
fields are an error so a typo like ``temprature`` never silently samples at the default.
``Session`` is the live object the addons share; the registry finds it by secret.
"""

from __future__ import annotations

import hmac
import logging
import re
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, field_validator, model_validator

from interceptor.addons.gateway.policy.hookpool import TIMEOUT as HOOK_TIMEOUT, HookPool
from interceptor.addons.gateway.policy.network import NetworkPolicy
from interceptor.addons.gateway.sessions.state import TaskState
from interceptor.addons.gateway.sessions.upstream import DEFAULT, Upstream, UpstreamRef
from interceptor.addons.gateway.sessions.weights import Fleet, Weights
from interceptor.addons.gateway.policy.limits import Limits, Stop, StopBy
from interceptor.addons.gateway.policy.memory import KEEP_BYTES, Handed, Memory
from interceptor.dialects import credential_headers
from interceptor.dialects.prompt_ids import Prior, PromptRead
from interceptor.trace import Recorder, Store
from interceptor.trace.graph import KnownIds
from interceptor.trace.match import Ignore
from interceptor.trace.messages import Sampling
from interceptor.trace.model import Reward, Version

if TYPE_CHECKING:
    from interceptor.addons.gateway.policy.hookload import HookSet

log = logging.getLogger(__name__)
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class ReplayConfig(BaseModel):
    """How a session whose upstream is a replay source matches its requests to recorded
    turns: what else to leave out of the comparison, beyond what the dialects already take
    out (``interceptor.trace.match``): JSON paths into the canonical request
    (``$.messages[*].content``, ``$.tools``) and regular expressions blanked in every string
    (a tool's ``Wall time [0-9.]+ seconds``, a date, a temporary path)."""

    model_config = ConfigDict(extra="forbid")

    ignore: list[str] = Field(default_factory=list)

    @field_validator("ignore")
    @classmethod
    def _rules(cls, v: list[str]) -> list[str]:
        Ignore.parse(v)  # ValueError naming the bad rule
        return v


class SessionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = None
    model: str | None = None
    sampling: Sampling = Field(default_factory=Sampling)
    # "overlay": the session's keys laid over the harness's (unset keeps, null removes);
    # "exact": the harness's decoding keys dropped, only the session's applied (README).
    sampling_mode: Literal["overlay", "exact"] = "overlay"
    # A declared upstream by name (or a base_url equal to a declared one); None: the default
    # upstream. Resolved once, when the session is made (``interceptor.addons.gateway.sessions.upstream``).
    upstream: UpstreamRef | None = None
    collect_tokens: bool = False
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    limits: Limits | None = None
    # Absent: the proxy's intercept_hooks; null: none. Loaded once, when the session is made.
    hooks: HooksConfig | None = None
    on_hook_error: Literal["stop", "pass"] = "stop"
    # Seconds a hook may take before it is a hook_error (None: the proxy's intercept_hook_timeout).
    hook_timeout: FiniteFloat | None = Field(default=None, gt=0, le=86400)
    task: dict[str, Any] = Field(default_factory=dict)
    agent: dict[str, Any] = Field(default_factory=dict)
    info: dict[str, Any] = Field(default_factory=dict)
    # The task state tool servers share (addons/gateway/sessions/state.py): its initial value (version 0), and
    # a JSON Schema every accepted write must satisfy (the initial value too).
    state: dict[str, Any] | None = None
    state_schema: dict[str, Any] | None = None
    # What the rollout may reach through the provider and around it (addons/gateway/policy/network.py).
    network: NetworkPolicy | None = None
    # The oldest weights version of its upstream this rollout accepts (addons/gateway/sessions/weights.py):
    # an answer from an older one is an error on the record, not a turn.
    min_version: Version | None = None
    # Seconds a request may wait for its paused upstream before it is answered a retryable
    # error (None: the proxy's intercept_pause_limit).
    pause_limit: FiniteFloat | None = Field(default=None, gt=0, le=86400)

    @model_validator(mode="after")
    def _state(self) -> SessionConfig:
        if self.state is not None or self.state_schema is not None:
            TaskState.initial(self.state, self.state_schema)  # ValueError: a 400 naming why
        return self

    @field_validator("id")
    @classmethod
    def _id(cls, v: str | None) -> str | None:
        # The id names the trace file, so it must be a safe file name.
        if v is not None and not _ID.match(v):
            raise ValueError(
                "id must be 1-128 characters of letters, digits, '.', '_' or '-', "
                f"starting with a letter or digit; got {v!r}"
            )
        return v


class HooksConfig(BaseModel):
    """``"hooks": {"module": "pkg.module" | "path/to/file.py", "config": {...}}``: the
    evaluator's code at the model boundary (``interceptor.hooks``); ``config`` is handed to
    every hook as ``ctx.config``."""

    model_config = ConfigDict(extra="forbid")

    module: str = Field(min_length=1)
    config: dict[str, Any] = Field(default_factory=dict)


class SealConfig(BaseModel):
    """The optional body of ``DELETE /_interceptor/sessions/<id>``: what the evaluator knows
    when the rollout ends, written into the footer. Unknown keys are an error, as in
    ``SessionConfig``: a misspelt ``rewrad`` must not seal a rollout without its reward."""

    model_config = ConfigDict(extra="forbid")

    stop_condition: str | None = Field(default=None, min_length=1, max_length=200)
    reward: FiniteFloat | None = None
    rewards: dict[str, Reward] = Field(default_factory=dict)
    metrics: dict[str, Any] = Field(default_factory=dict)
    info: dict[str, Any] = Field(default_factory=dict)


def new_secret(kind: str, worker: str | None = None) -> str:
    """``sk-ic-<kind>-...``; behind a front (``intercept_worker``) ``sk-ic-<worker>-<kind>-...``:
    the front routes a connection by the worker its secret names (scripts/serve.py)."""
    return f"sk-ic-{worker + '-' if worker else ''}{kind}-{secrets.token_urlsafe(24)}"


#: Prompts whose ids a session remembers (``Session.last_prompts``): a miss costs a digest of
#: the array's bytes, far less than reading the whole array again.
PROMPTS_KEPT = 4


def _above(nodes: list, last: Prior, leaf: int) -> bool:
    """Whether ``last``'s node is gone, or on the path to ``leaf``."""
    if last.leaf >= len(nodes) or nodes[last.leaf] is not last.node:
        return True  # gone: nothing to keep
    cur: int | None = leaf
    while cur is not None and cur >= last.leaf:  # a parent is always an older node
        if cur == last.leaf:
            return True
        cur = nodes[cur].parent
    return False


_LAZY = ("memory", "handed")  # what ``Session.release`` lets go of and ``__getattr__`` makes again


@dataclass(eq=False)
class Session:
    id: str
    config: SessionConfig
    model_secret: str
    state_secret: str
    recorder: Recorder
    upstream: Upstream | None = None  # where its requests go and whose key they carry
    created_at: float = field(default_factory=time.time)
    # Per-session state of other addons (Retry's book), let go of with the trace on release.
    state: dict[str, Any] = field(default_factory=dict)
    tls_rejections: int = 0  # handshakes the harness refused: it does not trust the CA (TlsGuard)
    oversized: int = 0  # requests refused unread for their size (BodyCap); never recorded otherwise
    # What tool servers read and write with the state secret (addons/gateway/sessions/state.py).
    task_state: TaskState = field(default_factory=lambda: TaskState.initial(None, None))
    egress: dict[str, int] = field(default_factory=dict)  # refused connections per host (network.egress)
    stop: Stop | None = None  # why the rollout ended early; final, the first one wins
    admitted: list[Any] = field(default_factory=list)  # model requests let through, not yet recorded
    hooks: HookSet | None = None  # the loaded hooks module, if any
    hooks_config: dict[str, Any] = field(default_factory=dict)  # handed to hooks as ctx.config
    hook_pool: HookPool = field(default_factory=HookPool)  # its hooks' own threads and limit
    memory: Memory = field(default_factory=Memory)  # request hooks' rewrites, applied once
    handed: Handed = field(default_factory=Handed)  # what request hooks were handed of the graph's
    # vLLM's last few prompt ids, most recent first, that the next are parsed past
    # (``dialects/prompt_ids.py``): one per branch a turn went on lately (a harness and its
    # sub-agents take turns). Replaced whole, never changed in place: a stream holds it.
    last_prompts: tuple[Prior, ...] = ()
    weights: Weights | None = None  # its upstream's version and pause, shared by every session of it

    def remember_prompt(self, read: PromptRead, reply: int, ids: list[int] | None = None) -> None:
        """A committed turn's prompt ids: they read as ``read`` and end at the parent of its
        sampled reply ``reply``, the prompt's last node, where the record holds them
        (``Recorder.prompt_ids``). It replaces the one it went on from (a prefix of its path,
        its bytes a prefix of its own), so each entry is a branch. ``ids``, the committed
        Response's list, is kept for the next prompt to extend (``Prior.ids``) if it is the
        record's own (``KnownIds``); only the newest entry keeps one."""
        nodes, recorder = self.recorder.trace.nodes, self.recorder
        leaf = nodes[reply].parent
        if leaf is None:
            return
        node = nodes[leaf]
        kept = [last for last in self.last_prompts if not _above(nodes, last, leaf)]
        for last in kept:
            last.ids = None
        prior = Prior(read, leaf, node, recorder, ids if type(ids) is KnownIds else None)
        self.last_prompts = (prior, *kept)[:PROMPTS_KEPT]

    @property
    def trace_path(self) -> Path:
        return self.recorder.path

    @property
    def sealed(self) -> bool:
        return self.recorder.sealed

    def upstream_key(self) -> str | None:
        """The real provider key, read from the proxy's environment at each use: never copied
        into the session config or a record."""
        return self.upstream.key() if self.upstream else None

    def record_metrics(self, metrics: dict[str, Any]) -> None:
        """What hooks measured (``ctx.record_metric``): on the record now, in the footer later."""
        for name, value in metrics.items():
            self.recorder.record_metric(name, value)

    def stop_with(self, condition: str, by: StopBy, call: str | None = None) -> Stop:
        """Stop the rollout (the first stop is final: a later one returns it unchanged);
        every later model request is refused with its condition. On the record at once."""
        if self.stop is None:
            self.stop = Stop(condition, by, call, time.time())
            self.recorder.record_stop(self.stop.record())
            log.info(f"interceptor: session {self.id!r}: rollout stopped: {condition} (by {by})")
        return self.stop

    def seal(self, seal: SealConfig | None = None, *, condition: str = "deleted",
             by: StopBy = "control") -> None:
        """End the rollout: the footer gets the stop condition (a stop the proxy made
        first wins; else the evaluator's own, else ``condition``), who ended it, and the
        evaluator's reward, metrics and info."""
        seal = seal or SealConfig()
        if self.recorder.sealed:
            return
        # A rollout that ran to its end needs no stop record: the footer says who ended it.
        stop = self.stop or Stop(seal.stop_condition or condition, by)
        self.recorder.seal(stop.condition, reward=seal.reward, rewards=seal.rewards, metrics=seal.metrics,
                           info=seal.info, stopped_by=stop.by, truncated=stop.truncated)

    def release(self) -> None:
        """After the seal: keep the summary, drop the graph and every addon's state. What is
        dropped is not replaced by empty ones (``__getattr__`` makes one if a late exchange
        asks): a kept sealed session's every container is walked by each full collection."""
        self.recorder.release()
        self.state = {}  # empty: not tracked by the collector (a cleared dict stays tracked)
        self.task_state = TaskState.initial(None, None)  # its history is on the record
        self.admitted.clear()
        self.hook_pool.close()
        for name in _LAZY:
            self.__dict__.pop(name, None)
        self.last_prompts = ()

    def __getattr__(self, name: str) -> Any:
        """Only for an attribute that is not set: one ``release`` let go of, made again."""
        if name not in _LAZY:
            raise AttributeError(name)
        value = Memory() if name == "memory" else Handed()
        setattr(self, name, value)
        return value

    def summary(self) -> dict[str, Any]:
        s = self.recorder.summary()
        if self.stop is not None and not self.sealed:  # stopped, not yet sealed by the evaluator
            s.update(stop_condition=self.stop.condition, stopped_by=self.stop.by)
        s["id"] = self.id
        s["trace_path"] = str(self.trace_path)
        s["tls_rejections"] = self.tls_rejections
        s["oversized_requests"] = self.oversized
        s["egress"] = dict(self.egress)  # refusals per host (network.egress)
        s["state_version"] = self.recorder.state_version  # kept by a released trace too
        return s


class Registry:
    """All live sessions, found by model secret, state secret or id.

    Lookups happen on every request from the event loop; writes (create, seal) come from the
    control API on the same loop. The lock only guards the rare case of a sessions file being
    loaded from another thread.
    """

    def __init__(self, keep_sealed: int = 1000) -> None:
        self._by_id: dict[str, Session] = {}
        self._by_model_secret: dict[str, Session] = {}
        self._by_state_secret: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.store: Store = Store()
        # Released sessions still in memory, oldest first; beyond ``keep_sealed`` of them the
        # oldest is dropped, and only its trace path is kept (its summary is read from there).
        self.keep_sealed = keep_sealed
        self.rewrite_keep_bytes = KEEP_BYTES  # intercept_rewrite_keep_bytes
        self.hook_timeout = HOOK_TIMEOUT  # intercept_hook_timeout
        self.weights = Fleet()  # each upstream's weights version and pause
        self._released: deque[str] = deque()
        # Dropped sessions' trace paths, as strings: one entry per session the process ever
        # dropped, so as small as it can be (a Path is several objects more).
        self._dropped: dict[str, str] = {}
        # intercept_worker: this process is one worker behind a front; every session id, trace
        # file and secret it makes starts with the tag, so the front routes by them without
        # knowing any session, and workers sharing one trace folder never pick the same name.
        self.worker: str | None = None
        # Called after each release (addons/mitm/tuning.py: the freed heap back to the system).
        self.on_release: Callable[[], None] | None = None

    def session_id(self, requested: str | None) -> str:
        """The id a session gets: the requested one (else a random one), behind the worker's tag."""
        sid = requested or uuid.uuid4().hex[:16]
        return f"{self.worker}-{sid}" if self.worker else sid

    def create(self, config: SessionConfig, trace_dir: Path, fsync: str,
               upstream: Upstream | None = None, file_stem: str | None = None,
               hooks: HookSet | None = None, hooks_config: dict[str, Any] | None = None) -> Session:
        sid = self.session_id(config.id)
        with self._lock:
            if sid in self._by_id:
                raise ValueError(f"session {sid!r} exists already")
            path = self.trace_file(trace_dir, sid, file_stem)
            header = {
                "id": sid,
                "config": {
                    "model": config.model,
                    "sampling": config.sampling.set_fields(),
                    "upstream": ({"name": upstream.name, "base_url": upstream.base_url,
                                  "api_key_env": upstream.api_key_env, "dialect": upstream.dialect,
                                  **({"replay": upstream.replay, "on_miss": upstream.on_miss}
                                     if upstream.replay else {})}
                                 if upstream else None),
                    **({"replay": config.replay.model_dump()} if config.replay.ignore else {}),
                    "collect_tokens": config.collect_tokens,
                    **({"state_schema": config.state_schema} if config.state_schema is not None else {}),
                    **({"network": config.network.model_dump()} if config.network is not None else {}),
                    "limits": config.limits.model_dump(exclude_defaults=True) if config.limits else None,
                    "hooks": ({"module": hooks.module, "hooks": list(hooks.names),
                               **({"sha256": hooks.sha256} if hooks.sha256 else {})} if hooks else None),
                    "on_hook_error": config.on_hook_error,
                    **({"min_version": config.min_version} if config.min_version is not None else {}),
                },
                "task": config.task,
                "agent": config.agent,
                "info": config.info,
            }
            # Its file is created exclusively here: TraceExistsError (the caller's 409, or a
            # proxy that does not start) if a trace is there already, from an earlier run on
            # this folder or a session dropped from memory; nothing is registered then.
            recorder = Recorder(path, header, store=self.store, fsync=fsync, secret_keys=credential_headers())
            self._dropped.pop(sid, None)
            session = Session(sid, config, new_secret("m", self.worker), new_secret("s", self.worker), recorder, upstream,
                              task_state=TaskState.initial(config.state, config.state_schema))
            if config.state:
                recorder.record_state(session.task_state.record("config", "init"))
            session.hooks, session.hooks_config = hooks, dict(hooks_config or {})
            session.hook_pool = HookPool(config.hook_timeout or self.hook_timeout)
            session.memory = Memory(keep_bytes=self.rewrite_keep_bytes)
            session.weights = self.weights.of(upstream.name if upstream else DEFAULT)
            if session.weights.version is not None:  # the version its first calls are sent under
                recorder.record_version(session.weights.name, session.weights.version, session.weights.declared_at)
            self._by_id[sid] = session
            self._by_model_secret[session.model_secret] = session
            self._by_state_secret[session.state_secret] = session
            return session

    def trace_file(self, trace_dir: Path, sid: str, file_stem: str | None = None) -> Path:
        """Where the session ``sid`` (its id as ``session_id`` made it) writes its trace."""
        if file_stem and self.worker:
            file_stem = f"{self.worker}-{file_stem}"
        return trace_dir / f"{file_stem or sid}.msgpack"

    def get(self, sid: str) -> Session | None:
        return self._by_id.get(sid)

    def retire(self, session: Session) -> None:
        """A sealed session was released: count it, and drop the oldest beyond ``keep_sealed``
        from memory (an exchange still in flight holds the object and is still recorded)."""
        with self._lock:
            self._released.append(session.id)
            while len(self._released) > self.keep_sealed:
                old = self._by_id.pop(self._released.popleft(), None)
                if old is None:
                    continue
                self._by_model_secret.pop(old.model_secret, None)
                self._by_state_secret.pop(old.state_secret, None)
                self._dropped[old.id] = str(old.trace_path)
                self.store.forget(old.trace_path)
        if self.on_release is not None:
            self.on_release()

    def dropped(self, sid: str) -> Path | None:
        """The trace file of a session dropped from memory, None if there is no such session."""
        path = self._dropped.get(sid)
        return Path(path) if path is not None else None

    def page(self, *, after: str | None, limit: int, state: str | None) -> tuple[list[Session], str | None]:
        """Sessions in creation order after the one with id ``after``: up to ``limit`` of them,
        and the id to continue after (None at the end). ``state``: live, sealed or None (both)."""
        sessions = list(self._by_id.values())
        start = 0
        if after is not None:
            ids = list(self._by_id)
            start = ids.index(after) + 1 if after in self._by_id else len(ids)
        out: list[Session] = []
        for i in range(start, len(sessions)):
            s = sessions[i]
            if state is None or (state == "sealed") == s.sealed:
                if len(out) == limit:
                    return out, out[-1].id
                out.append(s)
        return out, None

    def by_model_secret(self, secret: str) -> Session | None:
        return _lookup(self._by_model_secret, secret)

    def by_state_secret(self, secret: str) -> Session | None:
        return _lookup(self._by_state_secret, secret)

    def all(self) -> list[Session]:
        return list(self._by_id.values())

    def seal_all(self, stop_condition: str) -> None:
        for s in self.all():
            s.seal(condition=stop_condition, by="shutdown")
        self.store.flush(timeout=10)


def _lookup(table: dict[str, Session], secret: str) -> Session | None:
    session = table.get(secret)
    # The dict lookup is by hash; a constant-time compare of the hit keeps the final
    # comparison from leaking how much of a guessed secret was right.
    if session is not None and any(hmac.compare_digest(k, secret) for k in (session.model_secret, session.state_secret)):
        return session
    return None

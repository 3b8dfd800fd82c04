"""The proxy's own HTTP API under ``/_interceptor/``, for requests sent straight to its port.

An orchestrator creates a session per rollout, hands the returned environment to the
harness, and deletes the session when the rollout ends (which seals the trace). Everything
but ``health`` needs ``Authorization: Bearer <admin token>``; a wrong token changes nothing.
The tool servers' routes (``task``, ``state``, ``stop``: addons/gateway/sessions/state.py) take the session's
state secret instead, and nothing else; the tool route (``tool``: addons/mitm/toolroute.py) takes
the harness's own credential, the model secret. An upstream's weights version and pause
(``upstreams``: addons/mitm/upstreamroutes.py) take the admin token.
"""

from __future__ import annotations

import hmac
import logging
import re
import traceback
import warnings
from pathlib import Path

from mitmproxy import ctx, http

from interceptor.addons.gateway.answers import api_error, json_response, read_body
from interceptor.addons.mitm.redact import Secrets
from interceptor.addons.gateway.sessions.session import Registry, SealConfig, SessionConfig
from interceptor.addons.mitm.settings import Settings
from interceptor.addons.gateway.sessions.state import TOOL_SERVER_ROUTES
from interceptor.addons.mitm.stateroutes import StateRoutes
from interceptor.addons.mitm.toolroute import ToolRoute
from interceptor.addons.mitm.upstreamroutes import UpstreamRoutes
from interceptor.trace import read_trace
from interceptor.trace.store import TraceExistsError

log = logging.getLogger(__name__)
PREFIX = "/_interceptor/"
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
DEFAULT_PAGE = 100
MAX_PAGE = 1000
# How long a DELETE waits for the sealed trace to reach the disk before answering 503 ("retry
# the GET"): under the control client's own 15 s timeout, so the caller hears why.
FLUSH_WAIT = 10


def summary_from_file(sid: str, path: Path) -> dict:
    """The summary of a session dropped from memory (``intercept_keep_sealed``), from its trace."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trace = read_trace(path)
    except Exception as e:  # moved or deleted by the operator
        return {"id": sid, "trace_path": str(path), "sealed": True, "released": True, "dropped": True,
                "error": f"trace not readable: {type(e).__name__}: {e}"}
    return {"id": sid, "turns": trace.num_turns, "input_tokens": trace.num_input_tokens,
            "output_tokens": trace.num_output_tokens, "calls": len(trace.calls), "errors": len(trace.errors),
            "stop_condition": trace.stop_condition, "sealed": trace.sealed, "trace_path": str(path),
            "released": True, "dropped": True}


def is_control(flow: http.HTTPFlow, front: tuple[str, int] | None = None) -> bool:
    """A request addressed to the proxy itself (not tunnelled, not for another host): to the
    address and port the client connected to, whatever port that is (``--listen-port 0``,
    none at all, a ``--mode regular@port``), never the listen_port option's value. Behind a
    front (``intercept_front``) also one addressed to the front: the front sets ``Host`` to
    its own address on every control request it passes on (scripts/serve.py)."""
    req = flow.request
    if not req.path.startswith(PREFIX) or req.scheme != "http":
        return False
    if front is not None and (req.host, req.port) == front:
        return True  # through the front (scripts/serve.py), which names itself in Host
    sockname = flow.client_conn.sockname
    if not sockname or req.port != sockname[1]:
        return False
    return req.host in _LOOPBACK or req.host == sockname[0] or req.host == ctx.options.listen_host


_error = api_error
# Any session's secret, a worker's too (``sk-ic-<worker>-m-...``), live or gone: by its shape.
SESSION_SECRET = re.compile(r"sk-ic-[A-Za-z0-9_-]{8,}")


class Control:
    def __init__(self, registry: Registry, settings: Settings) -> None:
        self.registry = registry
        self.settings = settings
        self.secrets = Secrets(settings)
        self.state_routes = StateRoutes(registry, settings, self.holds_secret)
        self.tool_route = ToolRoute(registry, settings)
        self.upstream_routes = UpstreamRoutes(registry, settings)

    def holds_secret(self, text: str) -> bool:
        """Any secret of the proxy in ``text``: a session's (this one's or another's), the
        admin token, an upstream's key. What a rollout writes into a trace is refused
        when it holds one (``state.checked_text``, the state's own check)."""
        return self.secrets.holds(text) or SESSION_SECRET.search(text) is not None

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if is_control(flow, self.settings.front):
            flow.metadata["interceptor_control"] = True

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live or not flow.metadata.get("interceptor_control"):
            return
        try:
            path = flow.request.path.split("?", 1)[0]
            if path == f"{PREFIX}tool":  # the hooks may take their time
                flow.response = await self.tool_route.handle(flow)
                return
            if path.startswith(f"{PREFIX}upstreams") and self._authorized(flow):  # a pause waits for a drain
                parts = path[len(PREFIX):].strip("/").split("/")
                if parts[0] == "upstreams":
                    flow.response = await self.upstream_routes.handle(flow.request, parts)
                    return
            flow.response = self._handle(flow)
        except Exception as e:  # noqa: BLE001 - every answer of this API is its JSON, a fault's too
            flow.response = self._fault(flow, e)
            return
        if flow.request.method == "DELETE" and flow.response.status_code == 200:
            # A sealed session's file is complete when DELETE answers: the orchestrator reads
            # it next. The loop goes on serving meanwhile.
            try:
                await self.registry.store.drained(FLUSH_WAIT)
            except TimeoutError as e:
                log.error(f"interceptor: {e}")
                flow.response = _error(503, "the trace writer is behind; the footer is queued, retry the GET later")

    @staticmethod
    def _fault(flow: http.HTTPFlow, e: Exception) -> http.Response:
        """A fault of the API itself: a 500 in its JSON shape (mitmproxy's HTML page would
        tell a client nothing it can parse). The log names the route, the exception's type
        and where it was raised, never its message (which may quote a body or a secret)."""
        where = "".join(traceback.format_tb(e.__traceback__))
        log.error(f"interceptor: control {flow.request.method} {flow.request.path.split('?', 1)[0]}: "
                  f"{type(e).__name__} in\n{where}")
        return _error(500, f"the proxy's API failed on this request ({type(e).__name__}); its log says where")

    def _health(self) -> http.Response:
        """Not ok (503) while any live session's trace cannot be written (held records, or
        a degraded file, or a writer thread dead or stuck): a rollout recorded with holes must
        not look healthy. Names the sessions, never their secrets."""
        sessions = self.registry.all()
        failing = {s.id: s.recorder.write_health().as_dict() for s in sessions
                   if not s.sealed and not s.recorder.write_health().ok}
        trouble = self.registry.store.trouble  # no writer, or one stuck on the disk: all records wait
        body = {"ok": not failing and not trouble, "sessions": len(sessions),
                # "thread" once a slow write made the writer thread take every record
                # (trace/store.py), or by intercept_trace_writes: what a benchmark measured.
                "trace_writes": "loop" if self.registry.store.write_on_loop else "thread"}
        if failing:
            body["store"] = failing
        if trouble:
            body["writer"] = trouble
        return json_response(200 if body["ok"] else 503, body)

    def _authorized(self, flow: http.HTTPFlow) -> bool:
        auth = flow.request.headers.get("authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        expected = self.settings.admin_token or ""
        return bool(token) and bool(expected) and hmac.compare_digest(token.encode(), expected.encode())

    def _handle(self, flow: http.HTTPFlow) -> http.Response:
        req = flow.request
        parts = req.path.split("?", 1)[0][len(PREFIX):].strip("/").split("/")
        if parts == ["health"] and req.method == "GET":
            if not self.settings.ready:  # the servers are still binding: the env would name no port
                return json_response(503, {"ok": False, "starting": True}, retry=True)
            return self._health()
        if len(parts) == 1 and parts[0] in TOOL_SERVER_ROUTES:  # the state secret's, not the admin's
            return self.state_routes.handle(flow, parts[0])
        if not self._authorized(flow):
            where = self.settings.token_path or "the proxy's INTERCEPT_ADMIN_TOKEN"
            return _error(401, f"missing or wrong admin token: send Authorization: Bearer <token from {where}>")
        if parts[0] != "sessions" or len(parts) > 3 or (len(parts) == 3 and parts[2] not in ("env", "state")):
            return _error(404, f"no such endpoint: {req.method} {req.path}")
        if len(parts) == 1:
            if req.method == "POST":
                return self._create(req)
            if req.method == "GET":
                return self._list(req)
            return _error(405, "use POST to create a session, GET to list them")
        session = self.registry.get(parts[1])
        if session is None:
            path = self.registry.dropped(parts[1])
            if path is not None and req.method == "GET" and len(parts) == 2:
                return json_response(200, summary_from_file(parts[1], path))
            if path is not None:
                return _error(410, f"session {parts[1]!r} is sealed and no longer in memory; its trace is {path}")
            return _error(404, f"no session {parts[1]!r}")
        if len(parts) == 3 and parts[2] == "state":  # the orchestrator seeds or scores the state
            return self.state_routes.state(session, req, by="admin")
        if len(parts) == 3:
            if req.method != "GET":
                return _error(405, "use GET on a session's env")
            if session.sealed:  # its secrets open nothing any more: not handed out either
                return _error(410, f"session {session.id!r} is sealed; create a new one")
            # Sessions from a sessions file were never answered a POST: this is how an
            # orchestrator gets their secrets and harness environment.
            return json_response(200, self._credentials(session))
        if req.method == "GET":
            return json_response(200, session.summary())
        if req.method == "DELETE":
            seal = read_body(SealConfig, req.content, "DELETE body", b"{}")
            if isinstance(seal, http.Response):
                return seal
            if self.holds_secret(seal.model_dump_json()):  # the footer is in the trace
                return _error(400, "the DELETE body holds a secret of this proxy: it is not written into the trace")
            if session.sealed:
                return json_response(200, session.summary())  # DELETE is idempotent
            session.seal(seal)
            session.release()  # a long night of rollouts keeps summaries, not graphs
            self.registry.retire(session)
            return json_response(200, session.summary())
        return _error(405, "use GET or DELETE on a session")

    def _list(self, req: http.Request) -> http.Response:
        q = req.query
        state = q.get("state") or None
        if state not in (None, "live", "sealed"):
            return _error(400, "state must be live or sealed")
        try:
            limit = int(q.get("limit", DEFAULT_PAGE))
        except ValueError:
            limit = -1
        if not 1 <= limit <= MAX_PAGE:
            return _error(400, f"limit must be a whole number from 1 to {MAX_PAGE}")
        page, next_after = self.registry.page(after=q.get("after") or None, limit=limit, state=state)
        return json_response(200, {"sessions": [s.summary() for s in page], "next_after": next_after})

    def _create(self, req: http.Request) -> http.Response:
        config = read_body(SessionConfig, req.content, "session config", b"{}")
        if isinstance(config, http.Response):
            return config
        try:
            upstream = self.settings.pick_upstream(config)
            hooks, hooks_config = self.settings.pick_hooks(config)  # HookError: hooks: <module>:<function>: <reason>
        except ValueError as e:  # the message names the field
            return _error(400, f"bad session config: {e}")
        try:
            session = self.registry.create(config, self.settings.trace_dir, self.settings.fsync, upstream,
                                           hooks=hooks, hooks_config=hooks_config)
        except (ValueError, TraceExistsError) as e:  # the id is taken, or its trace file is there
            return _error(409, str(e))
        log.info(f"interceptor: session {session.id!r} created")
        return json_response(201, self._credentials(session))

    def _credentials(self, session) -> dict:
        return {
            "id": session.id,
            "model_secret": session.model_secret,
            "state_secret": session.state_secret,
            "trace_path": str(session.trace_path),
            "upstream": session.upstream.public() if session.upstream else None,
            "env": self.settings.harness_env(session),
        }


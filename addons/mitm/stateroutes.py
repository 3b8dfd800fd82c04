"""The task state's routes: a tool server's ``/_interceptor/task``, ``/state`` and ``/stop``
(its state secret) and the admin's ``/_interceptor/sessions/<id>/state`` (the admin token).

They find the session by its secret in the Registry, so they live above the session; the
state itself (``TaskState``, what the session holds) is in ``state.py``, below it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mitmproxy import http

from interceptor.addons.gateway.answers import json_response
from interceptor.addons.gateway.sessions.state import (
    MERGE_PATCH, STOP_REASON_MAX, HoldsSecret, StateRefused, bearer, checked_text, error, merge_patch, parse,
    same_secret, unreadable,
)

if TYPE_CHECKING:
    from interceptor.addons.gateway.sessions.session import Registry, Session


class StateRoutes:
    """The tool servers' routes (state secret) and the admin's state route (admin token).
    Control hands each request here; answers are plain JSON, never a dialect's shape."""

    def __init__(self, registry: Registry, settings, holds_secret: HoldsSecret) -> None:
        self.registry = registry
        self.settings = settings
        self.holds_secret = holds_secret

    # -- who is asking --------------------------------------------------------------------

    def tool_server(self, req: http.Request) -> tuple[Session | None, http.Response | None]:
        """The session whose state secret the request carries, or the 401 that says which
        secret this route needs (a model secret or the admin token opens nothing here)."""
        token = bearer(req)
        need = "send Authorization: Bearer <the session's state secret> (a tool server's INTERCEPT_STATE_SECRET)"
        if not token:
            return None, error(401, f"no state secret: {need}")
        session = self.registry.by_state_secret(token)
        if session is not None and same_secret(token, session.state_secret):
            return session, None
        if self.registry.by_model_secret(token) is not None:
            return None, error(401, f"a model secret cannot open the task state: {need}")
        if same_secret(token, self.settings.admin_token):
            return None, error(401, "the admin token opens /_interceptor/sessions/<id>/state, not this route: "
                                    f"{need}")
        return None, error(401, f"unknown state secret: it matches no session of this proxy; {need}")

    # -- the routes -----------------------------------------------------------------------

    def handle(self, flow: http.HTTPFlow, route: str) -> http.Response:
        """``/_interceptor/task``, ``/state``, ``/stop`` for a tool server."""
        req = flow.request
        session, refused = self.tool_server(req)
        if refused is not None:
            return refused
        if route == "task":
            if req.method != "GET":
                return error(405, "use GET on /_interceptor/task")
            config = session.config
            return json_response(200, {"session": session.id, "task": config.task, "agent": config.agent,
                                       "info": config.info})
        if route == "stop":
            return self.stop(session, req)
        return self.state(session, req, by="tool")

    def stop(self, session: Session, req: http.Request) -> http.Response:
        if req.method != "POST":
            return error(405, "use POST on /_interceptor/stop")
        if session.sealed:
            return error(409, f"session {session.id!r} is sealed")
        try:
            body = parse(req.content or b"{}")
            if not isinstance(body, dict) or set(body) - {"reason"} or not isinstance(body.get("reason", ""), str):
                return error(400, 'the body is {"reason": "<why the rollout ends>"} (reason optional)')
            reason = checked_text("reason", (body.get("reason") or "").strip(), self.holds_secret, STOP_REASON_MAX)
        except StateRefused as e:
            return error(e.status, str(e))
        reason = reason or "tool_server"
        # The first stop is final: a rollout a limit or a hook stopped already keeps its condition.
        stop = session.stop_with(reason, "tool")
        return json_response(200, {"ok": True, "condition": stop.condition, "by": stop.by})

    def state(self, session: Session, req: http.Request, *, by: str) -> http.Response:
        """GET, PUT or PATCH of a session's state (by a tool server or the admin)."""
        if session.sealed:
            return error(409, f"session {session.id!r} is sealed: its state is final (the trace's state records "
                              "and footer hold it)")
        state = session.task_state
        if req.method == "GET":
            return json_response(200, state.snapshot(), headers={"etag": state.etag()})
        if req.method not in ("PUT", "PATCH"):
            return error(405, "use GET, PUT (the whole state) or PATCH (application/merge-patch+json)")
        kind = req.headers.get("content-type", "").split(";")[0].strip().lower()
        if req.method == "PATCH" and kind not in (MERGE_PATCH, "application/json", ""):
            return error(415, f"PATCH takes {MERGE_PATCH} (RFC 7396), not {kind}")
        max_bytes = self.settings.state_max_bytes
        if max_bytes and len(req.content or b"") > max_bytes:
            return error(413, f"the body is {len(req.content)} bytes, above intercept_state_max_bytes ({max_bytes})")
        try:
            body = parse(req.content)
            if (why := unreadable(body)) is not None:  # before merge_patch walks it
                raise StateRefused(400, f"the body is not taken: {why}")
            state.check_precondition(req.headers.get("if-match"))
            new = body if req.method == "PUT" else merge_patch(state.value, body)
            data = state.write(new, max_bytes=max_bytes, holds_secret=self.holds_secret)
            record = state.record_of(new, data, state.version + 1, by, "put" if req.method == "PUT" else "patch")
        except StateRefused as e:
            more = {"version": e.version} if e.version is not None else {}
            answer = error(e.status, str(e), **more)
            answer.headers["etag"] = state.etag()
            return answer
        session.recorder.record_state(record)  # first: if it fails, the state is as it was
        state.commit(new, data)
        return json_response(200, {"ok": True, "version": state.version}, headers={"etag": state.etag()})

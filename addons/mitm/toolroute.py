"""The tool route: a harness's own tool calls, decided by the session's request hooks.

A harness that can run a command around its tools (Claude Code's ``PreToolUse`` and
``PostToolUse`` hooks, ``scripts/tool_hook.py``) asks ``POST /_interceptor/tool`` with its own
credential (the model secret, where Claim reads it) before a tool runs and after. The request
hooks see the branch that issued the call plus the tool's message (empty before the call, its
output after) as the only message they may change, with ``ctx.tool_phase`` set; the answer is
``allow``, ``block`` (before: do not run it; this is its result), ``rewrite`` (after: this is
its result instead of the output) or ``stop`` (the rollout is over). A block is an error result
(``is_error`` true: the model must not read a tool that never ran as one that succeeded)
unless the hook sets ``is_error`` false on the message it writes.

The answer is advice to the harness, and enforced where the proxy stands: a ``block`` or a
``rewrite`` is remembered under the tool call's id (``Memory.by_call``), so the next model
request carries the decided content whatever the harness sends for that call (it ran a
blocked tool anyway, or sends the original output), the graph holds it, and the call's
record lists the rewrite (``by: "tool_route"``); the hooks do not decide it again. Every
route call is a ``tool`` record. Answers are plain JSON (the route is the proxy's, not a
provider's); nothing here raises out of ``handle``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any, Literal

from mitmproxy import http
from pydantic import BaseModel, ConfigDict, Field

from interceptor.addons.gateway.answers import api_error as error, json_response, read_body
from interceptor.addons.mitm.claim import proxy_auth_secret
from interceptor.addons.gateway.policy.hookrun import HookFailure, session_context
from interceptor.addons.gateway.policy.intercept import TOOL_ROUTE, rewrite_record, run_hooks
from interceptor.addons.gateway.policy.memory import Remembered, digest
from interceptor.addons.mitm.redact import SHAPED, REDACTED
from interceptor.addons.gateway.sessions.state import same_secret
from interceptor.addons.gateway.policy.stops import HOOK_ERROR
from interceptor.dialects import secret_of, secret_places
from interceptor.trace.messages import Message, Request, message_hash
from interceptor.trace.model import STATE_VALUE_MAX, ToolDecision

if TYPE_CHECKING:
    from interceptor.addons.gateway.sessions.session import Registry, Session

log = logging.getLogger(__name__)

NEED = ("send the harness's own key, the session's model secret (where its SDK puts it: "
        f"{', '.join(secret_places())}; or in the proxy URL)")


class ToolCallBody(BaseModel):
    """``POST /_interceptor/tool``'s body; an unknown key is a 400."""

    model_config = ConfigDict(extra="forbid")

    phase: Literal["before", "after"]
    tool_call_id: str = Field(min_length=1, max_length=512)
    name: str | None = None
    arguments: Any = None
    content: Any = None  # the tool's output (after): text, or any JSON (kept as its JSON text)
    is_error: bool = False


def _text(content: Any) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)


def _wire(content: str | list) -> Any:
    return content if isinstance(content, str) else [p.model_dump(exclude_defaults=True) for p in content]


class ToolRoute:
    def __init__(self, registry: Registry, settings) -> None:
        self.registry = registry
        self.settings = settings

    def _session(self, req: http.Request) -> tuple[Session | None, http.Response | None]:
        """The session whose model secret the request carries, or the 401 saying which
        secret this route needs (the state secret or the admin token opens nothing here)."""
        token = secret_of(req.headers, req.query) \
            or proxy_auth_secret(req.headers.get("proxy-authorization", "")) or ""
        if not token:
            return None, error(401, f"no model secret: {NEED}")
        session = self.registry.by_model_secret(token)
        if session is not None and same_secret(token, session.model_secret):
            return session, None
        if self.registry.by_state_secret(token) is not None:
            return None, error(401, f"a state secret cannot use the tool route: {NEED}")
        if same_secret(token, self.settings.admin_token):
            return None, error(401, f"the admin token cannot use the tool route: {NEED}")
        return None, error(401, f"unknown model secret: it matches no session of this proxy; {NEED}")

    async def handle(self, flow: http.HTTPFlow) -> http.Response:
        try:
            return await self._handle(flow.request)
        except Exception as e:  # noqa: BLE001 - fail closed, in the route's own shape
            log.exception("interceptor: the tool route failed")
            return error(500, f"the tool route failed: {type(e).__name__}; the call is not decided")

    async def _handle(self, req: http.Request) -> http.Response:
        if req.method != "POST":
            return error(405, "use POST on /_interceptor/tool")
        session, refused = self._session(req)
        if refused is not None:
            return refused
        body = read_body(ToolCallBody, req.content, "tool call")
        if isinstance(body, http.Response):
            return body
        if session.sealed:
            return error(409, f"session {session.id!r} is sealed")
        trace = session.recorder.trace
        leaves = [i for i in trace.leaves() if trace.nodes[i].sampled
                  and any(tc.id == body.tool_call_id for tc in trace.nodes[i].message.tool_calls)]
        if not leaves:
            return error(404, f"no reply on this session's current branches issued tool call {body.tool_call_id!r}")
        if len(leaves) > 1:
            return error(409, f"{len(leaves)} current branches issued tool call {body.tool_call_id!r}; "
                              "the route cannot tell which one this is")
        try:
            answer, hooks = await self._decide(session, leaves[0], body)
        except HookFailure as e:
            self._record(session, body, "error", [e.spec.name])
            if session.config.on_hook_error == "pass":
                log.warning(f"interceptor: session {session.id!r}: {e}; on_hook_error is pass, the tool call is allowed")
                return json_response(200, {"action": "allow"})
            log.warning(f"interceptor: session {session.id!r}: {e}; the rollout stops")
            session.stop_with(HOOK_ERROR, "hook")
            return json_response(500, {"error": {"message": str(e), "status": 500, "type": HOOK_ERROR}})
        self._record(session, body, answer["action"], hooks, answer.get("content"))
        return json_response(200, answer)

    async def _decide(self, session: Session, leaf: int, body: ToolCallBody) -> tuple[dict[str, Any], list[str]]:
        """The answer and the hooks that made it. A call decided once keeps its answer."""
        if session.stop is not None:
            return {"action": "stop", "reason": session.stop.condition}, []
        memory = session.memory
        decided = memory.by_call.get(body.tool_call_id)
        if decided is not None:  # the same answer again, no hook runs (a blocked tool reported after all)
            return self._answer(decided), decided.rewrite.hooks
        hooks = session.hooks
        if hooks is None or not hooks.request:
            return {"action": "allow"}, []
        trace = session.recorder.trace
        branch = [trace.nodes[i].message for i in trace.path(leaf)]
        tool = Message(role="tool", tool_call_id=body.tool_call_id, name=body.name,
                       content=_text(body.content) if body.phase == "after" else "", is_error=body.is_error)
        # Before the call the hooks are offered an error result: content written into it blocks
        # the tool as an error, unless the hook sets is_error false itself.
        offered = tool.model_copy(update={"is_error": True}) if body.phase == "before" else tool
        model = next((c.model for c in reversed(trace.calls) if c.node == leaf), None)
        ctx = session_context(session, branch, tool_phase=body.phase)
        try:
            current, changed_by = await run_hooks(hooks.request, ctx, Request(messages=[*branch, offered], model=model),
                                                  len(branch))
        finally:
            session.record_metrics(ctx.metrics)
        new = current.messages[-1]
        unchanged = new.content == offered.content and (body.phase == "before" or new.is_error == offered.is_error)
        if not changed_by or unchanged:  # before the call, a block is content written for it
            return {"action": "allow"}, [s.name for specs in changed_by.values() for s in specs]
        names = [s.name for s in changed_by[len(branch)]]
        if not isinstance(new.content, str) and any(p.type != "text" for p in new.content):
            raise HookFailure(changed_by[len(branch)][-1], "a tool result decided before the model reads it "
                                                           "may hold text parts only")
        action = "block" if body.phase == "before" else "rewrite"
        record = rewrite_record(tool, new, names, memory.keep_bytes if body.phase == "after" else 0,
                                by=TOOL_ROUTE, reason=action)
        entry = Remembered(record, new.content, new.is_error, message_hash(tool))
        memory.decide(body.tool_call_id, entry)
        return self._answer(entry), names

    @staticmethod
    def _answer(entry: Remembered) -> dict[str, Any]:
        return {"action": entry.rewrite.reason, "content": _wire(entry.content), "is_error": entry.is_error}

    @staticmethod
    def _record(session: Session, body: ToolCallBody, action: str, hooks: list[str], delivered: Any = None) -> None:
        """The ``tool`` record: what the harness reported (its secrets, if a tool printed
        them, redacted) and what the model reads instead."""
        text = _text(body.content)
        size = len(text.encode())
        small = size <= STATE_VALUE_MAX
        session.recorder.record_tool(ToolDecision(
            phase=body.phase, tool_call_id=body.tool_call_id, name=body.name, action=action, hooks=hooks,
            digest=digest(text)[0], size=size, content=SHAPED.sub(REDACTED, text) if small and text else None,
            content_omitted=not small, delivered=delivered, at=time.time()))

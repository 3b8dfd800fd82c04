"""WsRelay: the Responses API over a WebSocket (Codex CLI's default transport), claimed,
rewritten and recorded frame by frame.

Codex opens ``GET /v1/responses`` with ``Upgrade: websocket``; Claim resolves it as a model
route and claims it by the upgrade's credential, Rewrite swaps the key and points it at the
session's upstream, like any request. After the 101 the exchanges are text frames: each
client ``response.create`` is a request body and the server's ``response.*`` frames are its
stream. So this addon takes over the flow's Exchange at the 101 (the upgrade itself is no
model call; the Tee never sees it) and, per frame:

- a client ``response.create`` gets the session's model and sampling (the responses
  dialect's ``apply_overrides``, exactly as a POST body would) and opens a turn;
- a server frame is relayed unchanged (mitmproxy forwards it when the hook returns; nothing
  here waits) after being fed to the turn's assembler; the turn is committed before the
  frame that ends it (``response.completed`` and the other terminals, or ``error``) is
  forwarded, so Codex never sends its next frame ahead of the record;
- ``generate: false`` frames are warm-ups: rewritten too, never turns;
- a frame chained on ``previous_response_id`` carries only the new input items; the turn's
  prompt is the conversation the id ends (``Recorder.conversation``, or the warm-up's
  prompt) plus those items, so both transports give the same graph.

An upgrade the upstream refuses (an upstream without the transport, e.g. vLLM) is no model
call either and is never recorded: the proxy serves Codex's next upgrade itself
(``addons/gateway/transport/wsserve.py``) and sends its frames to the upstream as HTTP. Without that (WsRelay
alone), it is logged once per session, with what to do; Codex falls back to ``POST
/v1/responses`` by itself after a few seconds of retries.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from mitmproxy import ctx, http

from interceptor.addons.gateway.exchange import KEY, EventClock, Exchange, exchange_of
from interceptor.addons.gateway.feedback import Refused
from interceptor.addons.gateway.policy.network import mediate
from interceptor.addons.gateway.record import commit
from interceptor.addons.gateway.policy.limits import output_cap
from interceptor.addons.gateway.policy import intercept
from interceptor.addons.gateway.policy.hookrun import HookFailure
from interceptor.addons.gateway.policy.memory import Remembered
from interceptor.addons.gateway.policy.stops import (
    HOOK_ERROR, STOPPED, decide, hook_failed, hook_stop, record_refusal, stop_message, upstream_error,
)
from interceptor.dialects.base import header
from interceptor.dialects.body import parse_body
from interceptor.dialects.sse import SSEEvent
from interceptor.trace.messages import Message, Request, ResponseError, Tool

log = logging.getLogger(__name__)

WS_KEY = "interceptor_ws"


def is_upgrade(request: http.Request) -> bool:
    return header(request.headers, "upgrade", "").lower() == "websocket"


@dataclass(eq=False)
class _Pending:
    """The answer a client frame is waiting for: a turn (with its Exchange) or a warm-up."""

    ex: Exchange
    warmup: bool
    status: int | None = None  # from an error frame: {"type": "error", "status": 529, ...}
    assembler: Any = None

    def __post_init__(self) -> None:
        self.assembler = self.ex.dialect.assembler()


@dataclass(eq=False)
class Socket:
    """One WebSocket's state. Codex sends one ``response.create`` at a time per socket and
    waits for its terminal frame, so one pending answer is all there is."""

    upgrade: Exchange
    pending: _Pending | None = None
    # What a previous_response_id can name besides a committed turn: a warm-up's prompt.
    warmups: dict[str, list[Message]] = field(default_factory=dict)
    warmup_rewrites: dict[str, list[Remembered]] = field(default_factory=dict)
    # Tools travel once (``additional_tools`` in the first frame); later chained frames
    # carry none but the model still has them.
    tools: list[Tool] = field(default_factory=list)
    # The last client frame this relay vetted (rewritten, or not a request): the Gate drops
    # any other client frame instead of forwarding it unprepared.
    passed: Any = None


class WsRelay:
    def __init__(self, learned: Refused | None = None, served: Any = None) -> None:
        self._refused: set[str] = set()  # sessions already told their upstream refused
        self.learned = learned  # what providers refused per model (Feedback), not sent again
        self.served = served  # WsServe: serves the next upgrade for an upstream that refused one

    # -- the upgrade ---------------------------------------------------------------------

    def response(self, flow: http.HTTPFlow) -> None:
        """Listed before the Tee: takes the upgrade's Exchange away from it."""
        ex = exchange_of(flow)
        if ex is None or flow.request.method != "GET" or not is_upgrade(flow.request):
            return
        flow.metadata.pop(KEY, None)
        if flow.websocket is not None:
            flow.metadata[WS_KEY] = Socket(ex)
            return
        status = flow.response.status_code if flow.response else None
        if ex.committed:
            return  # Reach found the upstream down and recorded it already
        if self.served is not None and self.served.upstream_refused(ex, status):
            return  # Codex's next upgrade is served by the proxy (addons/gateway/transport/wsserve.py)
        if ex.session.id not in self._refused:
            self._refused.add(ex.session.id)
            log.warning(
                f"interceptor: session {ex.session.id!r}: the upstream answered the Responses "
                f"WebSocket upgrade with {status}; Codex falls back to HTTPS after a few seconds "
                "of retries (to skip them, give its provider profile supports_websockets = false)"
            )

    # -- frames --------------------------------------------------------------------------

    async def websocket_message(self, flow: http.HTTPFlow) -> None:
        # async: a session's hooks may run for a client frame; mitmproxy holds the frame (and
        # the connection's next ones) until this returns, as it holds an HTTP request.
        sock = flow.metadata.get(WS_KEY)
        if not isinstance(sock, Socket) or flow.websocket is None:
            return
        message = flow.websocket.messages[-1]
        try:
            # An exception here is the Gate's to answer (addons/mitm/gate.py): the frame is dropped
            # and the harness gets an error frame, never a frame forwarded unprepared.
            if message.injected:
                return
            if message.from_client:
                if message.is_text:
                    await self._client_frame(sock, flow, message)
                else:
                    sock.passed = message  # binary frames are not requests: relayed as they are
            elif message.is_text:
                self._server_frame(sock, flow, message.content)
        finally:
            # mitmproxy keeps every frame on the flow; a long Codex session would hold its
            # whole conversation in memory for nothing. The frame in hand is all anyone needs.
            del flow.websocket.messages[:-1]

    async def _client_frame(self, sock: Socket, flow: http.HTTPFlow, message) -> None:
        try:
            parsed = parse_body(message.content)
        except ValueError:
            sock.passed = message
            return  # not ours to judge: the upstream answers it
        body = parsed.data
        if not isinstance(body, dict) or body.get("type") != "response.create":
            sock.passed = message
            return  # response.processed and the like: relayed as they are
        if sock.pending is not None and not sock.pending.warmup:
            self._abandon(sock, flow, "a new response.create was sent before this one ended")
        upgrade = sock.upgrade
        dialect = upgrade.dialect
        config = upgrade.session.config
        ex = Exchange(session=upgrade.session, route=upgrade.route, raw_body=message.content, stream=True)
        ex.requested_model = body.get("model") if isinstance(body.get("model"), str) else None
        try:
            ex.request = self._request(sock, body, ex)
            model = config.model or ex.requested_model
            learned = self.learned.get(dialect.name, model) if self.learned else frozenset()
            ex.overrides = dialect.apply_overrides(body, config.model, config.sampling, config.sampling_mode, learned)
            if config.network is not None:  # the frame's own chain is known when this proxy saw it
                previous = body.get("previous_response_id")
                known = isinstance(previous, str) and (previous in sock.warmups or
                                                       upgrade.session.recorder.conversation(previous) is not None)
                mediation = mediate(dialect, body, config.network, known_previous=known)
                ex.overrides += mediation.overrides
            cap = output_cap(config.limits, upgrade.session.recorder.trace)
            if cap is not None:
                ex.overrides += dialect.clamp_max_tokens(body, cap)
        except Exception as e:  # never forward a frame the session's settings were not imposed on
            log.warning(f"interceptor: session {upgrade.session.id!r}: response.create frame not understood: "
                        f"{type(e).__name__}: {e}")
            self.refuse(flow, message, dialect, f"request not understood by the {dialect.name} dialect: {e}")
            return
        ex.body = body
        warmup = body.get("generate") is False
        if intercept.has_request_hooks(ex):
            ex.parsed = parsed
            intercept.remembered(ex)
        # A warm-up samples nothing: no budget counts it, only a stopped rollout refuses it,
        # and only the rewriting hooks run for it (its input is the chain's first prompt).
        stop = ex.session.stop if warmup else decide(ex)
        if stop is None and ex.session.hooks is not None:
            try:
                stop = await hook_stop(ex, flow.request.path.split("?", 1)[0], stops=not warmup)
            except HookFailure as e:
                if self._hook_failed(flow, message, ex, e):
                    return
        if stop is not None:
            self.refuse(flow, message, dialect, stop_message(stop), type=STOPPED)
            record_refusal(ex, flow, stop)
            return
        if ex.overrides or ex.edits:
            # Only what changed is written anew (the overrides' keys, the hooks' contents).
            message.text = (intercept.spliced(ex) or parsed.encode({o.key.split(".", 1)[0] for o in ex.overrides})
                            ).decode()
        sock.pending = _Pending(ex, warmup=warmup)
        sock.passed = message

    def _hook_failed(self, flow: http.HTTPFlow, message, ex: Exchange, failure: HookFailure) -> bool:
        """``on_hook_error`` for a frame, as Stops does for a POST: ``pass`` goes on (False);
        ``stop`` answers an error frame typed ``hook_error`` and records it (True)."""
        stop = hook_failed(ex, failure)
        if stop is None:
            return False
        self.refuse(flow, message, ex.dialect, str(failure), status=500, type=HOOK_ERROR)
        record_refusal(ex, flow, stop, ResponseError(type=HOOK_ERROR, message=str(failure), status=500))
        return True

    @staticmethod
    def refuse(flow: http.HTTPFlow, message, dialect, text: str, status: int = 400, type: str | None = None) -> None:
        """What a POST's error answer is: the frame goes nowhere, the harness gets the error
        as the API sends one over the socket. (A request not understood is not recorded; a
        stopped rollout's refusal is, by the caller.)"""
        message.drop()
        error = dialect.socket_error(status, text, type)
        ctx.master.commands.call("inject.websocket", flow, True, json.dumps(error).encode(), True)

    def _request(self, sock: Socket, body: dict[str, Any], ex: Exchange) -> Request:
        """The frame as a canonical request over the whole conversation (see the module
        docstring); a chain on an id this proxy never saw starts from the frame alone."""
        previous = body.get("previous_response_id")
        dialect = sock.upgrade.dialect
        prefix: list[Message] | None = None
        if isinstance(previous, str):
            prefix = sock.upgrade.session.recorder.conversation(previous) or sock.warmups.get(previous)
            if prefix is None:
                log.warning(f"interceptor: session {sock.upgrade.session.id!r}: previous_response_id "
                            f"{previous!r} is unknown to this proxy; the turn is recorded from its own input")
        if prefix is None:
            request = dialect.parse_request(body)
        else:  # the instructions are in the prefix already
            request = dialect.parse_request({k: v for k, v in body.items() if k != "instructions"})
            request = request.model_copy(update={"messages": prefix + request.messages})
            ex.prefix_len = len(prefix)
            # A warm-up is never recorded: the rewrites its input carried go with the first turn.
            ex.carried += sock.warmup_rewrites.pop(previous, [])
        if request.tools:
            sock.tools = list(request.tools)
        elif sock.tools:
            request = request.model_copy(update={"tools": list(sock.tools)})
        return request

    def _server_frame(self, sock: Socket, flow: http.HTTPFlow, content: bytes) -> None:
        pending = sock.pending
        if pending is None:
            return
        text = content.decode("utf-8", "replace")
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        kind = obj.get("type") if isinstance(obj, dict) else None
        ex = pending.ex
        if ex.first_byte_at is None:
            ex.first_byte_at = time.time()
            ex.clock = None if pending.warmup else EventClock()
        if ex.clock is not None:
            ex.clock.times.append(time.monotonic())  # each frame is one event of the answer's stream
        if kind == "error" and isinstance(obj.get("status"), int):
            pending.status = obj["status"]
        if pending.warmup:
            if kind in ex.dialect.terminal_events:
                response_id = ((obj.get("response") or {}).get("id")) if kind != "error" else None
                if response_id and ex.request is not None:
                    sock.warmups[response_id] = list(ex.request.messages)
                    if ex.carried:
                        sock.warmup_rewrites[response_id] = list(ex.carried)
                sock.pending = None
            return
        if pending.assembler.feed(SSEEvent(event=kind, data=text)):
            response = pending.assembler.result()
            if response.error is not None and pending.status is not None:
                response.error = response.error.model_copy(update={"status": pending.status})
            # A frame has no status line: a complete answer is what HTTP would have sent
            # as 200, so both transports record the same.
            commit(ex, flow, response, status=pending.status or (200 if response.error is None else None))
            upstream_error(ex, response.error)
            sock.pending = None

    def _abandon(self, sock: Socket, flow: http.HTTPFlow, reason: str) -> None:
        pending = sock.pending
        sock.pending = None
        if pending is None or pending.warmup or pending.ex.committed:
            return
        commit(pending.ex, flow, None, ResponseError(type="incomplete_stream", message=reason),
               status=pending.status)

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        sock = flow.metadata.get(WS_KEY)
        if not isinstance(sock, Socket) or sock.pending is None:
            return
        ws = flow.websocket
        code = ws.close_code if ws is not None else None
        self._abandon(sock, flow, f"the WebSocket closed (code {code}) before the answer's terminal frame")

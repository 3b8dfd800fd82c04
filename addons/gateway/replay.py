"""Replay: a session whose upstream is a trace gets the recorded answers, not a model's.

The operator declares a replay source like any upstream (``intercept_upstreams``:
``{"yesterday": {"replay": "traces/abc.msgpack", "on_miss": "error"}}``); a session picks it
by name. Each model request is then matched to a recorded turn through the source's graph
(``interceptor.trace.match``: the canonical conversation and tools, never the bytes, so
billing headers, ids and ``cache_control`` do not matter, and the session's
``replay.ignore`` rules take out what else moves between runs) and answered with that turn's
reply, usage and finish reason, rendered by the harness's own dialect in its own transport:
a JSON body, an SSE stream (``stream_events``), or frames on Codex's WebSocket.

The answer goes on the replay session's own record as a turn like any other (so its graph
is the replayed run's, and ``replay_trace.py diff`` can hold it against the source), its call
marked ``replayed_from`` (source trace id and call id). The pipeline sees it as an answer: Retry
captures it, so an SDK retry of a replayed answer gets the same bytes and no second turn.

With ``pace: true`` the answer takes the time the recorded one took: a stream's events each
at their recorded time (``ModelCall.event_gaps_ms``; over HTTP from the Pacer, a local server
in the proxy's loop, because mitmproxy sends an answer an addon makes all at once; over the
WebSocket as frames injected at their times: ``addons/gateway/pacer.py``), a JSON answer whole at the
recorded call's end. Without ``pace`` nothing waits.

A request no turn matches: with ``on_miss: error`` (nothing is ever forwarded; Reach does not
even probe) an error in the dialect's shape with ``x-should-retry: false`` whose message names
the nearest recorded turn and the first differing message, one error call on the record;
with ``on_miss: upstream`` the request goes on, to the upstream the declaration names, and is
recorded as new. A WebSocket upgrade is answered by the proxy itself when nothing is ever
forwarded (its frames are then answered one by one here and dropped); with ``on_miss:
upstream`` it is forwarded, so a missed frame can reach the upstream.

Listed after Retry (whose decision a replayed answer gets, like any answer) and after WsRelay
(which has made a frame's canonical request by the time its ``websocket_message`` ends).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import os
import uuid
import warnings
from dataclasses import dataclass, field

from mitmproxy import ctx, http

from interceptor.addons.gateway.answers import error_response
from interceptor.addons.gateway.exchange import Exchange, Step, exchange_of
from interceptor.addons.gateway.pacer import TICKET, Pacer, schedule, send_paced
from interceptor.addons.gateway.record import commit
from interceptor.addons.gateway.sessions.upstream import Upstream
from interceptor.addons.gateway.transport.wsrelay import WS_KEY, Socket, WsRelay, is_upgrade
from interceptor.trace import Response, ResponseError, read_trace
from interceptor.trace.match import Hit, Ignore, Matcher
from interceptor.trace.model import ReplaySource

log = logging.getLogger(__name__)

WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 section 1.3
MISS_STATUS = 400  # not retryable: the same request misses again
HEADER = "x-interceptor-replayed-from"


@dataclass(eq=False)
class _State:
    """A session's replay book: how many answers each recorded prompt has given."""

    used: dict[int | None, int] = field(default_factory=dict)


def accept(key: str) -> str:
    """``Sec-WebSocket-Accept`` for a client's ``Sec-WebSocket-Key`` (RFC 6455 section 4.2.2)."""
    return base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()


def _headers(ex: Exchange, source: ReplaySource) -> dict[str, str]:
    return {HEADER: f"{source.trace}/{source.call}", "x-should-retry": "false",
            "content-type": "text/event-stream; charset=utf-8" if ex.stream else "application/json"}


def rendered(ex: Exchange, response: Response, source: ReplaySource) -> http.Response:
    """The recorded answer as the harness's dialect sends it, JSON or SSE."""
    if ex.stream:
        body = b"".join(e.encode() for e in ex.dialect.stream_events(response))
    else:
        body = json.dumps(ex.dialect.json_body(response), ensure_ascii=False).encode()
    return http.Response.make(200, body, _headers(ex, source))


class Replay:
    def __init__(self) -> None:
        self._matchers: dict[tuple[str, float, tuple[str, ...]], Matcher] = {}
        self.pacer = Pacer()
        self._pacing: set[asyncio.Task] = set()  # WebSocket answers being sent at their pace

    # -- the source --------------------------------------------------------------------

    def _load(self, up: Upstream, rules: list[str]) -> Matcher:
        """The source's matcher for these rules, read once (again if the file changed)."""
        path = up.replay
        key = (path, os.stat(path).st_mtime, tuple(rules))
        matcher = self._matchers.get(key)
        if matcher is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a torn tail: everything before it stands
                trace = read_trace(path)
            matcher = Matcher(trace, Ignore.parse(rules))
            self._matchers = {k: m for k, m in self._matchers.items() if k[0] != path}
            self._matchers[key] = matcher
        return matcher

    @staticmethod
    def _state(ex: Exchange) -> _State:
        return ex.session.state.setdefault("replay", _State())

    def _match(self, ex: Exchange, up: Upstream):
        matcher = self._load(up, ex.session.config.replay.ignore)
        req = ex.request
        return matcher, matcher.match(req.messages, req.tools, ex.dialect.name, self._state(ex).used)

    # -- HTTP ------------------------------------------------------------------------------

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        ex = exchange_of(flow)
        up = ex.session.upstream if ex is not None else None
        if ex is None or up is None or up.replay is None:
            return
        if flow.request.method == "GET" and is_upgrade(flow.request):
            if up.local:  # nothing to forward to: the proxy is the other end of the socket
                flow.response = http.Response.make(101, b"", {
                    "upgrade": "websocket", "connection": "Upgrade",
                    "sec-websocket-accept": accept(flow.request.headers.get("sec-websocket-key", ""))})
                await asyncio.to_thread(self._load, up, ex.session.config.replay.ignore)
            return
        if ex.route.kind != "model" or flow.request.method != "POST" or ex.request is None:
            if up.local:
                flow.response = error_response(ex.dialect, 404, "this session replays a trace: only model "
                                                                "calls are answered, from the record")
            return
        try:
            await asyncio.to_thread(self._load, up, ex.session.config.replay.ignore)
            matcher, found = self._match(ex, up)
        except Exception as e:  # noqa: BLE001 - an unreadable source: fail closed, in shape
            self._fail(flow, ex, f"the replay source {up.name!r} cannot be read: {type(e).__name__}: {e}")
            return
        if not isinstance(found, Hit):
            log.info(f"interceptor: session {ex.session.id!r}: replay miss: {found.message()}")
            if up.local:
                # Each dialect's own type for a 400 (invalid_request_error; Gemini: INVALID_ARGUMENT).
                flow.response = error_response(ex.dialect, MISS_STATUS, found.message())
                commit(ex, flow, None, ResponseError(type="replay_miss", message=found.message(), status=MISS_STATUS))
            return  # on_miss upstream: the request goes on and is recorded as new
        ex.replayed_from = ReplaySource(trace=matcher.trace.id, call=found.call.id)
        ex.translation = None  # answered in the harness's own dialect: nothing to translate back
        if up.pace and ex.stream:
            await self._paced(flow, ex, found)
            return
        if up.pace:  # a JSON answer arrives whole: at the recorded call's end
            await asyncio.sleep(schedule(found.call, 1)[1][0])
            if not flow.live:
                return
        flow.response = rendered(ex, found.response, ex.replayed_from)
        ex.first_byte_at = ex.first_byte_at or ex.started_at
        commit(ex, flow, found.response)

    async def _paced(self, flow: http.HTTPFlow, ex: Exchange, found: Hit) -> None:
        """The stream from the Pacer, each event at its recorded time (``addons/gateway/pacer.py``)."""
        await self.pacer.start()
        events = [e.encode() for e in ex.dialect.stream_events(found.response)]
        ttfb, times = schedule(found.call, len(events))
        self.pacer.book(flow, 200, _headers(ex, ex.replayed_from), ttfb, list(zip(times, events)))
        # Answered from the record, as a retry Retry answers is: never refused by Stops (which
        # skips a committed exchange), and never sent anywhere but to the Pacer.
        ex.done |= Step.ADMITTED
        ex.first_byte_at = ex.started_at
        commit(ex, flow, found.response, status=200)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        """A paced answer streams on as the Pacer sends it (the Tee, with the turn already
        committed, would otherwise leave the body to be read whole)."""
        ex = exchange_of(flow)
        if ex is not None and ex.replayed_from is not None and flow.response is not None:
            flow.request.headers.pop(TICKET, None)
            if not flow.response.stream:
                flow.response.stream = True

    def done(self) -> None:
        self.pacer.stop()

    @staticmethod
    def _fail(flow: http.HTTPFlow, ex: Exchange, message: str) -> None:
        flow.response = error_response(ex.dialect, 500, message)
        commit(ex, flow, None, ResponseError(type="replay_error", message=message, status=500))

    # -- WebSocket frames (after WsRelay has read the frame) -------------------------------

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        sock = flow.metadata.get(WS_KEY)
        if not isinstance(sock, Socket) or flow.websocket is None or not flow.websocket.messages:
            return
        message = flow.websocket.messages[-1]
        up = sock.upgrade.session.upstream
        if up is None or up.replay is None or not message.from_client or message.injected or message.dropped:
            return
        pending = sock.pending
        if pending is None or sock.passed is not message:
            if up.local:
                message.drop()  # no server behind this socket: nothing to relay to
            return
        ex = pending.ex
        if pending.warmup:
            # A warm-up asks for no answer, only an id later frames can chain on.
            response = Response(id=f"resp_replay_{uuid.uuid4().hex}", model=ex.dialect.requested_model(ex.body, ""),
                                finish_reason="stop")
            response.message.content = ""
            if ex.request is not None:
                sock.warmups[response.id] = list(ex.request.messages)
            self._send(flow, sock, message, ex.dialect.stream_events(response))
            return
        try:
            matcher, found = self._match(ex, up)
        except Exception as e:  # noqa: BLE001 - an unreadable source: fail closed, in shape
            text = f"the replay source {up.name!r} cannot be read: {type(e).__name__}: {e}"
            self._refuse_frame(flow, sock, message, ex, 500, "replay_error", text)
            return
        if not isinstance(found, Hit):
            log.info(f"interceptor: session {ex.session.id!r}: replay miss: {found.message()}")
            if up.local:
                self._refuse_frame(flow, sock, message, ex, MISS_STATUS, "replay_miss", found.message())
            return
        ex.replayed_from = ReplaySource(trace=matcher.trace.id, call=found.call.id)
        ex.first_byte_at = ex.started_at
        commit(ex, flow, found.response, status=200)
        events = ex.dialect.stream_events(found.response)
        if up.pace:
            sock.pending = None
            message.drop()
            _, times = schedule(found.call, len(events))
            task = asyncio.get_running_loop().create_task(
                send_paced(flow, list(zip(times, (e.data.encode() for e in events)))))
            self._pacing.add(task)
            task.add_done_callback(self._pacing.discard)
            return
        self._send(flow, sock, message, events)

    @staticmethod
    def _send(flow: http.HTTPFlow, sock: Socket, message, events) -> None:
        """Drop the client's frame (it is answered here) and send the answer's events, one
        text frame each, as the Responses WebSocket does."""
        sock.pending = None
        message.drop()
        for event in events:
            ctx.master.commands.call("inject.websocket", flow, True, event.data.encode(), True)

    @staticmethod
    def _refuse_frame(flow, sock: Socket, message, ex: Exchange, status: int, kind: str, text: str) -> None:
        sock.pending = None
        commit(ex, flow, None, ResponseError(type=kind, message=text, status=status), status=status)
        WsRelay.refuse(flow, message, ex.dialect, text, status=status)

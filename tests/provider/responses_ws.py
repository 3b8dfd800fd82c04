"""OpenAI Responses over a WebSocket (`GET /v1/responses` with `Upgrade: websocket`), the
transport Codex CLI uses by default.

After the upgrade the client sends JSON text frames `{"type": "response.create", ...}` (the
body of a `POST /v1/responses`) and the server answers each with the same `response.*`
events the SSE stream carries, one text frame per event, ending with `response.completed`.
What differs from HTTP, and what the proxy must get right:

- `generate: false` is a warm-up: no model answer, only `response.created` and an empty
  `response.completed`; its id can be chained on like any other.
- `previous_response_id` chains a frame on an earlier response of the connection: the frame
  carries only the new input items, and the server prepends what it remembers (the earlier
  input and output). Usage is counted over the whole conversation, as the real API bills it.
- An error is a text frame `{"type": "error", "status": N, "error": {...}}`; Codex reads the
  status from it as it would from an HTTP response.

wsproto (a mitmproxy dependency) does the framing and negotiates `permessage-deflate` when
the client offers it, as Codex does. Each `response.create` frame is logged as a
`RequestRecord` with `transport="websocket"`, the upgrade's headers (so tests see the key the
proxy forwarded) and the frame as its body.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Message,
    Ping,
    Request,
    TextMessage,
)
from wsproto.extensions import PerMessageDeflate

from . import errors, openai_responses, strict
from .records import Headers, RequestRecord
from .reply import Reply
from .turn import Turn

if TYPE_CHECKING:
    from .server import _Handler


class Cut(Exception):
    """The scripted reply asked for the connection to drop mid-stream."""


def is_upgrade(headers: Headers) -> bool:
    return headers.get("upgrade", "").lower() == "websocket"


def serve(handler: _Handler, headers: Headers, request_id: str) -> None:
    """Complete the handshake on `handler`'s connection, then answer frames until the client
    closes. Runs on the connection's own thread."""
    conn = _Connection(handler, headers, request_id)
    conn.handshake()
    conn.run()


class _Connection:
    def __init__(self, handler: _Handler, headers: Headers, request_id: str) -> None:
        self.handler = handler
        self.sim = handler.server.sim
        self.headers = headers
        self.request_id = request_id
        self.ws = WSConnection(ConnectionType.SERVER)
        # response id -> every input and output item up to it (what previous_response_id
        # refers to on the real server).
        self.history: dict[str, list[Any]] = {}
        self.parts: list[str] = []

    # -- wire --------------------------------------------------------------------------

    def handshake(self) -> None:
        h = self.handler
        head = h.requestline + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.headers.items()) + "\r\n"
        self.ws.receive_data(head.encode("latin-1"))
        request = next((e for e in self.ws.events() if isinstance(e, Request)), None)
        if request is None:
            raise ValueError("not a WebSocket handshake")
        offered = self.headers.get("sec-websocket-extensions", "")
        extensions = [PerMessageDeflate()] if self.sim.websocket_deflate and "permessage-deflate" in offered else []
        extra = [(b"x-request-id", self.request_id.encode()), (b"openai-version", b"2020-10-01")]
        h.log_request(101)
        self._send(AcceptConnection(extensions=extensions, extra_headers=extra))

    def _send(self, event: Any) -> None:
        self.handler.wfile.write(self.ws.send(event))

    def send_json(self, obj: dict[str, Any]) -> None:
        self._send(TextMessage(data=json.dumps(obj, separators=(",", ":"), ensure_ascii=False)))

    def run(self) -> None:
        rfile = self.handler.rfile
        while True:
            data = rfile.read1(65536)
            if not data:
                return
            self.ws.receive_data(data)
            for event in self.ws.events():
                if isinstance(event, Message):
                    if isinstance(event, BytesMessage):
                        continue  # the API speaks text frames only
                    self.parts.append(event.data)
                    if event.message_finished:
                        text, self.parts = "".join(self.parts), []
                        self.frame(text)
                elif isinstance(event, Ping):
                    self._send(event.response())
                elif isinstance(event, CloseConnection):
                    self._send(event.response())
                    return

    # -- frames --------------------------------------------------------------------------

    def frame(self, text: str) -> None:
        try:
            obj = json.loads(text)
        except ValueError:
            self.error(400, Reply(error_message="The frame is not valid JSON."))
            return
        if not isinstance(obj, dict) or obj.get("type") != "response.create":
            return  # response.processed and the like need no answer
        body = {k: v for k, v in obj.items() if k not in ("type", "previous_response_id", "generate")}
        previous = obj.get("previous_response_id")
        if previous:
            earlier = self.history.get(previous)
            if earlier is None:
                self.error(400, Reply(error_code="previous_response_not_found",
                                      error_message=f"Previous response with id '{previous}' not found."))
                return
            body["input"] = earlier + input_items(obj.get("input"))
        warmup = obj.get("generate") is False
        record = RequestRecord("WS", self.handler.path, self.headers, text.encode(), time.time(),
                               route="responses_warmup" if warmup else "responses",
                               key=_key(self.headers), transport="websocket")
        self.sim._log(record)
        if self.sim.strict:
            # The frame is checked as sent: only its new input, the frame's own keys allowed.
            refusal = strict.check("responses", obj, self.sim.refuse, frame=True)
            if refusal is not None:
                record.refusal = refusal
                self.error(refusal.status, refusal.reply())
                return
        if warmup:
            self.answer(body, Reply(text="", output_tokens=0), warmup=True)
            return
        reply = self.sim._take(record)
        record.reply = reply
        self.answer(body, reply)

    def answer(self, body: dict[str, Any], reply: Reply, *, warmup: bool = False) -> None:
        if reply.raw is not None:
            raise ValueError("Reply.raw is not supported over the WebSocket transport")
        if reply.first_byte_delay:
            time.sleep(reply.first_byte_delay)
        if reply.status >= 400:
            self.error(reply.status, reply)
            return
        turn = Turn(body, reply, default_model=self.sim.default_model)
        answer = openai_responses._Answer(turn)
        events = [_data(e) for e in answer.events]
        if warmup:  # no output at all, not even an empty message
            answer.output = []
            events = [events[0], {**events[-1], "sequence_number": 1,
                                  "response": answer.response(answer.status, final=True)}]
        for index, event in enumerate(events):
            if reply.gap(index):
                time.sleep(reply.gap(index))
            if reply.cut_after is not None and index >= reply.cut_after:
                raise Cut
            if reply.error_after is not None and index >= reply.error_after:
                self._send(TextMessage(data=_data_line(openai_responses.error_event(turn, self.request_id, index))))
                return
            self.send_json(event)
        final = events[-1].get("response") or {}
        if final.get("id"):
            self.history[final["id"]] = input_items(body.get("input")) + list(final.get("output") or [])
        if reply.cut_after is not None:
            raise Cut

    def error(self, status: int, reply: Reply) -> None:
        body = errors.openai_error(status, reply)
        headers = {"x-request-id": self.request_id}
        if reply.retry_after is not None:
            headers["retry-after"] = str(reply.retry_after)
        self.send_json({"type": "error", "status": status, **body, "headers": headers})


def input_items(value: Any) -> list[Any]:
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    return list(value or [])


def _data_line(event: bytes) -> str:
    """The JSON text of one SSE event as the stream renderer wrote it (its `data:` line):
    the same objects travel as WebSocket text frames."""
    for line in event.decode().split("\n"):
        if line.startswith("data: "):
            return line[6:]
    raise ValueError(f"no data line in {event!r}")


def _data(event: bytes) -> dict[str, Any]:
    return json.loads(_data_line(event))


def _key(headers: Headers) -> str | None:
    from .server import key_of

    return key_of(headers)

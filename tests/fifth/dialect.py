"""A fifth API, made up for the tests: what adding an API to the proxy takes.

tests/test_fifth_api.py copies the product, puts this file in as ``dialects/fifth.py`` and adds
one line to ``REGISTRY``; nothing else of the product changes. It speaks:

- ``POST /v2/answer`` on ``api.fifth.test``: ``{"engine": <model>, "turns": [{"who": "user" |
  "system" | "model", "says": <text>}], "heat": <temperature>, "stream": <bool>}``;
- the key in ``x-fifth-key`` (its whole value), sent on upstream in ``x-fifth-key`` too;
- a JSON answer ``{"answer_id", "engine", "says", "why": "stop" | "cut", "spent": {"in", "out"}}``,
  or a stream of ``event: piece`` (``{"says": <text>}``) ended by ``event: done`` (``{"why",
  "spent"}``);
- errors as ``{"fault": {"code": <status>, "reason": <text>}}``; ``GET /v2/status``, which its
  harness asks at start, answered by the proxy;
- token ids for training when asked (``"want_tokens": true``): ``"tokens": {"prompt": [...],
  "sampled": [...]}`` on the JSON answer and on the ``done`` event, which the harness never sees.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from interceptor.dialects.base import Dialect, Override, StreamAssembler
from interceptor.dialects.sse import SSEEvent
from interceptor.dialects.tokens import TokenFields
from interceptor.trace.messages import Message, Request, Response, ResponseError, Sampling, Usage

ROLES = {"user": "user", "system": "system", "model": "assistant"}
WHO = {v: k for k, v in ROLES.items()}
WHY = {"stop": "stop", "cut": "length"}


class FifthTokens(TokenFields):
    keys = ("want_tokens",)
    proof = "tokens"
    hint = "use a fifth upstream that returns tokens"
    quoted = ('"tokens"',)

    def strip(self, obj: dict[str, Any]) -> bool:
        if self.token_ids and "tokens" in obj:
            del obj["tokens"]
            self.removed.add("tokens")
            return True
        return False


def _ids(body: dict[str, Any]) -> dict[str, Any]:
    tokens = body.get("tokens") if isinstance(body.get("tokens"), dict) else {}
    return {"prompt_token_ids": tokens.get("prompt"), "token_ids": tokens.get("sampled")}


def _usage(spent: Any) -> Usage | None:
    if not isinstance(spent, dict):
        return None
    return Usage(input_tokens=int(spent.get("in") or 0), output_tokens=int(spent.get("out") or 0))


class _Assembler(StreamAssembler):
    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.end: dict[str, Any] | None = None

    def feed(self, event: SSEEvent) -> bool:
        data = json.loads(event.data) if event.data else {}
        if event.event == "piece":
            self.pieces.append(str(data.get("says") or ""))
        elif event.event == "done":
            self.end, self.done = data, True
        return self.done

    def result(self) -> Response:
        text = "".join(self.pieces)
        if self.end is None:
            return Response(message=Message(role="assistant", content=text),
                            error=ResponseError(type="incomplete", message="the stream ended without its done event"))
        why = self.end.get("why")
        return Response(message=Message(role="assistant", content=text), finish_reason=WHY.get(why),
                        native_finish_reason=why, usage=_usage(self.end.get("spent")), **_ids(self.end))


class FifthDialect(Dialect):
    name = "fifth"
    hosts = ("api.fifth.test",)
    routes = {("POST", "/v2/answer"): "model"}
    local_answers = {("GET", "/v2/status"): {"status": "answered by the proxy"}}
    key_variables = ("FIFTH_API_KEY",)
    known_upstreams = {"fifth": {"base_url": "https://api.fifth.test/v2", "api_key_env": "FIFTH_API_KEY"}}
    secret_places = ("x-fifth-key",)
    credential_headers = ("x-fifth-key", "authorization")
    tokens = FifthTokens

    def upstream_path(self, base_path: str, path: str) -> str:
        rest = path[3:] if path.startswith("/v2/") else path
        return base_path.rstrip("/") + rest

    def auth_headers(self, key: str) -> dict[str, str]:
        return {"x-fifth-key": key}

    def requested_model(self, body: dict[str, Any] | None, path: str) -> str | None:
        engine = (body or {}).get("engine")
        return engine if isinstance(engine, str) else None

    def side_overrides(self, body: dict[str, Any], model: str | None) -> list[Override]:
        return []

    def parse_request(self, body: dict[str, Any], listed: Any = None) -> Request:
        turns = body.get("turns")
        if not isinstance(turns, list):
            raise ValueError("turns must be a list")
        messages = [Message(role=ROLES[t["who"]], content=str(t["says"])) for t in turns]
        heat = body.get("heat")
        return Request(messages=messages, model=self.requested_model(body, ""),
                       sampling=Sampling(temperature=heat if isinstance(heat, (int, float)) else None),
                       stream=bool(body.get("stream")))

    def request_body(self, request: Request) -> dict[str, Any]:
        return {"turns": [{"who": WHO[m.role], "says": m.text()} for m in request.messages]}

    def parse_response(self, body: dict[str, Any]) -> Response:
        why = body.get("why")
        return Response(id=body.get("answer_id"), model=body.get("engine"),
                        message=Message(role="assistant", content=str(body.get("says") or "")),
                        finish_reason=WHY.get(why), native_finish_reason=why, usage=_usage(body.get("spent")),
                        **_ids(body))

    def assembler(self) -> StreamAssembler:
        return _Assembler()

    def apply_overrides(self, body: dict[str, Any], model: str | None, sampling: Sampling,
                        mode: Literal["overlay", "exact"] = "overlay", refused: frozenset[str] = frozenset(),
                        requested: str | None = None) -> list[Override]:
        changes: list[Override] = []
        if model and body.get("engine") != model:
            changes.append(Override("engine", body.get("engine"), model))
            body["engine"] = model
        if sampling.temperature is not None and body.get("heat") != sampling.temperature:
            changes.append(Override("heat", body.get("heat"), sampling.temperature))
            body["heat"] = sampling.temperature
        return changes

    def stream_events(self, response: Response) -> list[SSEEvent]:
        why = {"length": "cut"}.get(response.finish_reason or "", "stop")
        spent = {"in": response.usage.input_tokens, "out": response.usage.output_tokens} if response.usage else None
        return [SSEEvent(event="piece", data=json.dumps({"says": response.message.text()})),
                SSEEvent(event="done", data=json.dumps({"why": why, "spent": spent}))]

    def json_body(self, response: Response) -> dict[str, Any]:
        why = {"length": "cut"}.get(response.finish_reason or "", "stop")
        spent = {"in": response.usage.input_tokens, "out": response.usage.output_tokens} if response.usage else None
        return {"answer_id": response.id, "engine": response.model, "says": response.message.text(), "why": why,
                "spent": spent}

    def error_body(self, status: int, message: str, type: str | None = None) -> dict[str, Any]:
        return {"fault": {"code": status, "reason": message}}

    def response_error(self, status: int, body: Any) -> ResponseError:
        fault = body.get("fault") if isinstance(body, dict) else None
        if isinstance(fault, dict):
            return ResponseError(type="fault", message=str(fault.get("reason") or ""), status=status)
        return ResponseError(type="http_error", message=f"HTTP {status}", status=status)


FIFTH = FifthDialect()

"""Google's Gemini API (`generativelanguage.googleapis.com`), as Gemini CLI reaches it.

Routes (https://ai.google.dev/api/generate-content, https://ai.google.dev/api/tokens,
https://ai.google.dev/api/models): `POST /v1beta/models/<model>:generateContent`,
`:streamGenerateContent` (`?alt=sse`: server-sent events; without: one JSON array),
`:countTokens`, `GET /v1beta/models[/<model>]`. The key arrives in `x-goog-api-key` or
the `key` query parameter.

Byte conventions, as Google documents and serves them:
- a JSON body is pretty-printed with two spaces;
- an SSE chunk is `data: <compact GenerateContentResponse>\\r\\n\\r\\n`: no `event:` line, no
  `[DONE]`; the stream ends after the chunk that carries `finishReason` and the final
  `usageMetadata` (https://ai.google.dev/gemini-api/docs/text-generation#streaming-responses);
- the array stream is `[` + the same objects, pretty-printed, joined by `,\\r\\n` + `]`;
- text arrives in pieces; a `functionCall` arrives whole in one chunk, with no id; thought
  parts (`thought: true`) come first when the request asks for `includeThoughts`; the first
  part after them, or else the first `functionCall`, carries the `thoughtSignature`
  (https://ai.google.dev/gemini-api/docs/thought-signatures);
- `usageMetadata`: `promptTokenCount`, `candidatesTokenCount`, `thoughtsTokenCount` (when
  the model thought), `totalTokenCount`, `cachedContentTokenCount` (when cached);
- an error is `{"error": {"code", "message", "status"}}`
  (https://ai.google.dev/gemini-api/docs/troubleshooting); a failure after a 200 is an
  `error` object in place of the next chunk.
"""

from __future__ import annotations

import json
import re
from typing import Any

from . import strict, wire
from .reply import Reply
from .turn import Turn, random_id

FAMILY = "gemini"

_PATH = re.compile(r"^(?:/[^/]+)*?/(v1|v1beta|v1alpha)/models/([^/:]+):([A-Za-z]+)$")
_MODELS = re.compile(r"^(?:/[^/]+)*?/(v1|v1beta|v1alpha)/models(?:/([^/:]+))?$")
ROUTES = {"generateContent": "gemini", "streamGenerateContent": "gemini", "countTokens": "gemini_count"}

_FINISH = {"stop": "STOP", "tool_calls": "STOP", "length": "MAX_TOKENS", "refusal": "SAFETY", "failed": "OTHER"}

# Google's canonical google.rpc.Code names (https://github.com/googleapis/googleapis/blob/master/
# google/rpc/code.proto): the only ones the API puts in an error's `status`, so a scripted
# `error_type` of another API's vocabulary never reaches a Gemini client.
CANONICAL = frozenset({
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
    "PERMISSION_DENIED", "UNAUTHENTICATED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",
    "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
})
# Per HTTP status, code.proto's name and the API's usual message
# (https://ai.google.dev/gemini-api/docs/troubleshooting#error-codes).
_STATUS = {
    400: ("INVALID_ARGUMENT", "Request contains an invalid argument."),
    401: ("UNAUTHENTICATED", "Request had invalid authentication credentials."),
    403: ("PERMISSION_DENIED", "Method doesn't allow unregistered callers."),
    404: ("NOT_FOUND", "Requested entity was not found."),
    409: ("ABORTED", "The operation was aborted."),
    429: ("RESOURCE_EXHAUSTED", "Resource has been exhausted (e.g. check quota)."),
    500: ("INTERNAL", "An internal error has occurred. Please retry or report in https://developers.generativeai.google/guide/troubleshooting"),
    503: ("UNAVAILABLE", "The model is overloaded. Please try again later."),
    501: ("UNIMPLEMENTED", "Operation is not implemented, or supported, or enabled."),
    504: ("DEADLINE_EXCEEDED", "The request timed out. Please try again."),
}


def route_of(method: str, path: str) -> str | None:
    m = _PATH.match(path)
    if m is not None:
        return ROUTES.get(m.group(3)) if method == "POST" else None
    m = _MODELS.match(path)
    if m is not None and method == "GET" and m.group(1) != "v1":  # /v1/models is everyone's
        return "gemini_model" if m.group(2) else "gemini_models"
    return None


def claims(route: str | None, headers: Any, query: dict[str, list[str]]) -> str | None:
    """A model list on `/v1` (where a proxy's `/v1` base URL puts it) is Gemini's when it
    carries Gemini's key; any other request keeps its route."""
    if route in ("models", "model") and key_of(headers, query):
        return "gemini_" + route
    return route


def model_of(path: str) -> str | None:
    m = _PATH.match(path)
    return m.group(2) if m else None


def is_stream(path: str) -> bool:
    m = _PATH.match(path)
    return bool(m) and m.group(3) == "streamGenerateContent"


def request_view(body: Any, path: str) -> dict[str, Any]:
    """The body as the shared `Turn` reads requests: the model from the path, the prompt
    under keys the token counter knows."""
    body = body if isinstance(body, dict) else {}
    return {"model": model_of(path), "system": body.get("systemInstruction"),
            "messages": body.get("contents"), "tools": body.get("tools")}


def last_user_text(body: Any) -> str | None:
    for content in reversed((body or {}).get("contents") or []):
        if isinstance(content, dict) and content.get("role", "user") == "user":
            texts = [p["text"] for p in content.get("parts") or [] if isinstance(p.get("text"), str)]
            if texts:
                return "".join(texts)
    return None


# --------------------------------------------------------------------------- answers


def _thinking(turn: Turn) -> bool:
    config = ((turn.request.get("_body") or {}).get("generationConfig") or {}).get("thinkingConfig") or {}
    return bool(turn.reasoning) and config.get("includeThoughts") is True


def _usage(turn: Turn) -> dict[str, Any]:
    thoughts = turn.reasoning_tokens
    candidates = max(0, turn.output_tokens - thoughts)
    usage: dict[str, Any] = {"promptTokenCount": turn.input_tokens, "candidatesTokenCount": candidates,
                             "totalTokenCount": turn.input_tokens + candidates + thoughts}
    if thoughts:
        usage["thoughtsTokenCount"] = thoughts
    if turn.cached_tokens:
        usage["cachedContentTokenCount"] = turn.cached_tokens
    usage["promptTokensDetails"] = [{"modality": "TEXT", "tokenCount": turn.input_tokens}]
    return usage


def _chunks(turn: Turn) -> list[list[dict[str, Any]]]:
    """The parts of each streamed chunk, in generation order."""
    signature = turn.request["_signature"]
    chunks: list[list[dict[str, Any]]] = []
    if _thinking(turn):
        chunks += [[{"text": p.text, "thought": True}] for p in turn.reasoning]
    # The first part after the thoughts carries the signature; without thoughts, the first
    # functionCall does (Gemini 3 signs every step that calls a function).
    signed = False
    for p in turn.text:
        part: dict[str, Any] = {"text": p.text}
        if not signed and turn.reasoning:
            part["thoughtSignature"] = signature
            signed = True
        chunks.append([part])
    for call in turn.calls:
        part = {"functionCall": {"name": call.name, "args": call.arguments_object}}
        if call.id:
            part["functionCall"]["id"] = call.id
        if not signed:
            part["thoughtSignature"] = signature
            signed = True
        chunks.append([part])
    return chunks or [[{"text": ""}]]


def _candidate(parts: list[dict[str, Any]], finish: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"content": {"parts": parts, "role": "model"}}
    if finish:
        out["finishReason"] = finish
    out["index"] = 0
    return out


def _finish(turn: Turn) -> str:
    finish = turn.finish()
    return _FINISH.get(finish, finish)


def _merged(chunks: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The parts of a non-streamed answer: text pieces of one kind joined."""
    parts: list[dict[str, Any]] = []
    for chunk in chunks:
        for part in chunk:
            prev = parts[-1] if parts else None
            if (prev is not None and "text" in part and "text" in prev
                    and bool(prev.get("thought")) == bool(part.get("thought"))):
                prev["text"] += part["text"]
                if part.get("thoughtSignature"):
                    prev["thoughtSignature"] = part["thoughtSignature"]
            else:
                parts.append(dict(part))
    return parts


def json_body(turn: Turn) -> bytes:
    body = {"candidates": [_candidate(_merged(_chunks(turn)), _finish(turn))],
            "usageMetadata": _usage(turn), "modelVersion": turn.model, "responseId": random_id("", 22)}
    return wire.pretty(body)


def stream_objects(turn: Turn) -> list[dict[str, Any]]:
    response_id = random_id("", 22)
    chunks = _chunks(turn)
    out = []
    for k, parts in enumerate(chunks):
        last = k == len(chunks) - 1
        obj: dict[str, Any] = {"candidates": [_candidate(parts, _finish(turn) if last else None)]}
        # Every chunk carries the usage so far; the last one the final counts.
        obj["usageMetadata"] = _usage(turn) if last else {"promptTokenCount": turn.input_tokens,
                                                          "totalTokenCount": turn.input_tokens}
        obj["modelVersion"] = turn.model
        obj["responseId"] = response_id
        out.append(obj)
    return out


def sse_events(turn: Turn) -> list[bytes]:
    return [f"data: {wire.compact(o)}\r\n\r\n".encode() for o in stream_objects(turn)]


def array_events(turn: Turn) -> list[bytes]:
    """The array stream, one element per chunk: `[` opens the first, `,\\r\\n` precedes the
    others, `]` closes the last."""
    objects = stream_objects(turn)
    out = []
    for k, obj in enumerate(objects):
        lead = b"[" if k == 0 else b",\r\n"
        out.append(lead + wire.pretty(obj) + (b"]" if k == len(objects) - 1 else b""))
    return out


def error(status: int, reply: Reply) -> dict[str, Any]:
    kind, message = _STATUS.get(status, _STATUS[500] if status >= 500 else _STATUS[400])
    name = reply.error_type if reply.error_type in CANONICAL else kind
    return {"error": {"code": status, "message": reply.error_message or message, "status": name}}


def error_body(status: int, reply: Reply) -> bytes:
    custom = reply.error_body
    if isinstance(custom, (bytes, str)):
        return custom.encode() if isinstance(custom, str) else custom
    return wire.pretty(custom if custom is not None else error(status, reply))


def error_event(turn: Turn, sse: bool) -> bytes:
    obj = error(500, turn.reply)
    return f"data: {wire.compact(obj)}\r\n\r\n".encode() if sse else b",\r\n" + wire.pretty(obj) + b"]"


def count_tokens_body(turn: Turn) -> bytes:
    return wire.pretty({"totalTokens": turn.input_tokens,
                        "promptTokensDetails": [{"modality": "TEXT", "tokenCount": turn.input_tokens}]})


def models_body(names: list[str], wanted: str | None) -> bytes:
    def one(name: str) -> dict[str, Any]:
        return {"name": f"models/{name}", "version": "001", "displayName": name,
                "inputTokenLimit": 1048576, "outputTokenLimit": 65536,
                "supportedGenerationMethods": ["generateContent", "countTokens"]}

    if wanted is not None:
        return wire.pretty(one(wanted))
    return wire.pretty({"models": [one(n) for n in names]})


def turn_of(record: Any, reply: Reply, default_model: str) -> Turn:
    view = request_view(record.json, record.route_path)
    turn = Turn(view, reply, default_model=default_model)
    turn.request["_body"] = record.json if isinstance(record.json, dict) else {}
    turn.request["_signature"] = reply.signature or ("sig-" + random_id("", 32))  # one per answer
    return turn


def serve(handler: Any, record: Any, sim: Any, base: dict[str, str]) -> None:
    """Answer one Gemini request on the simulator's handler."""
    route = record.route
    if route in ("gemini_models", "gemini_model"):
        wanted = record.route_path.rsplit("/models/", 1)[-1] if route == "gemini_model" else None
        names = list(dict.fromkeys([*sim.models, sim.default_model]))
        handler._send_body(200, models_body(names, wanted), "application/json; charset=UTF-8", Reply(), base)
        return
    if not isinstance(record.json, dict):
        reply = Reply(status=400, error_message="Invalid JSON payload received.")
        handler._send_body(400, error_body(400, reply), "application/json; charset=UTF-8", reply, base)
        return
    if route == "gemini_count":
        turn = turn_of(record, Reply(text=""), sim.default_model)
        handler._send_body(200, count_tokens_body(turn), "application/json; charset=UTF-8", Reply(), base)
        return
    if sim.strict and (refusal := strict.check("gemini", record.json, sim.refuse,
                                                model=model_of(record.route_path))) is not None:
        record.refusal = refusal
        reply = refusal.reply().replace(error_type="INVALID_ARGUMENT")
        handler._send_body(400, error_body(400, reply), "application/json; charset=UTF-8", reply, base)
        return
    reply = sim._take(record)
    record.reply = reply
    if reply.first_byte_delay:
        import time

        time.sleep(reply.first_byte_delay)
    if reply.status >= 400:
        headers = dict(base)
        if reply.retry_after is not None:
            headers["retry-after"] = str(reply.retry_after)
        handler._send_body(reply.status, error_body(reply.status, reply), "application/json; charset=UTF-8",
                           reply, headers)
        return
    turn = turn_of(record, reply, sim.default_model)
    if not is_stream(record.route_path):
        handler._send_body(reply.status, json_body(turn), "application/json; charset=UTF-8", reply, base)
        return
    sse = record.query.get("alt", [""])[0] == "sse"
    events = sse_events(turn) if sse else array_events(turn)
    ctype = "text/event-stream" if sse else "application/json; charset=UTF-8"
    handler._send_events(reply.status, events, ctype, reply, base, lambda i: error_event(turn, sse))


def model_of(path: str) -> str | None:
    """The model a generateContent path names (`/v1beta/models/<model>:<method>`)."""
    tail = path.rsplit("/models/", 1)[-1]
    return tail.split(":", 1)[0] if "/models/" in path else None


def key_of(headers: Any, query: dict[str, list[str]]) -> str | None:
    if "x-goog-api-key" in headers:
        return headers["x-goog-api-key"]
    keys = query.get("key")
    return keys[0] if keys else None



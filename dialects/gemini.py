"""Google's Gemini API (``generativelanguage.googleapis.com``), as Gemini CLI and the genai
SDKs speak it.

The wire format, from Google's reference (https://ai.google.dev/api/generate-content,
https://ai.google.dev/api/tokens, https://ai.google.dev/api/models,
https://ai.google.dev/gemini-api/docs/thinking, https://ai.google.dev/gemini-api/docs/function-calling):

- routes: ``POST /v1beta/models/<model>:generateContent`` (JSON),
  ``:streamGenerateContent`` (SSE with ``?alt=sse``, else one JSON array delivered as it
  grows), ``:countTokens`` (a side route), ``GET /v1beta/models[/<model>]`` (side). The model
  lives in the path, not the body: the session's model rewrites the path.
- the key arrives in ``x-goog-api-key`` or the ``key`` query parameter; the real key is
  sent the same way.
- a body is ``contents`` (role ``user`` or ``model``, ``parts``), ``systemInstruction``,
  ``tools[].functionDeclarations``, ``toolConfig``, ``generationConfig`` (sampling, with
  ``thinkingConfig``); an answer is ``candidates[].content.parts``, ``finishReason``,
  ``usageMetadata``, ``modelVersion``, ``responseId``; a streamed answer is a sequence of
  such answers, each carrying the parts generated since the last, the last one with the
  ``finishReason`` (the terminal event) and the final ``usageMetadata``.
- an error is ``{"error": {"code": <status>, "message", "status": "INVALID_ARGUMENT"}}``
  (https://ai.google.dev/gemini-api/docs/troubleshooting).

Gemini has no tool-call ids (a ``functionCall`` is paired with its ``functionResponse`` by
order and name), and a harness may invent its own when it restates a call (Gemini CLI sends
``run_shell_command_<time>_0``). So the canonical id is derived from the call itself (name
and arguments, plus its rank among identical calls of the same message), never taken from
the wire: the call the model sampled and the call the harness restates next turn get the same
id, and the graph reuses the node. Each ``functionResponse`` takes the id of the call it
answers: the one whose wire ``id`` it names, else the n-th call named N of the model turn
before it for the n-th response named N. Likewise the placeholder signature a client puts on
a call the model sent unsigned (``skip_thought_signature_validator``,
https://ai.google.dev/gemini-api/docs/thought-signatures) is no signature.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from interceptor.dialects.base import Before, Mediation, Override, RouteKind, drop
from interceptor.dialects.common import (
    REMOVED_PART,
    notice_first_user,
    Mode,
    Knob,
    KnobDialect,
    Plan,
    apply_knobs,
    NativeAssembler,
    inline_part,
    other_part,
    restorable_ref,
    undo,
    url_part,
)
from interceptor.dialects.models import Capabilities, capabilities
from interceptor.dialects.sse import SSEDecoder, SSEEvent
from interceptor.trace.prefix import Listed
from interceptor.trace.messages import (
    FinishReason,
    Message,
    Part,
    Reasoning,
    Request,
    Response,
    ResponseError,
    Sampling,
    Tool,
    ToolCall,
    Usage,
    canonical_json,
)

_PATH = re.compile(r"^/(v1|v1beta|v1alpha)/models/([^/:]+):([A-Za-z]+)$")
_MODELS = re.compile(r"^/(v1|v1beta|v1alpha)/models(/[^/:]+)?$")
_VERSION = re.compile(r"^/(v1|v1beta|v1alpha)(?=/|$)")
_METHODS: dict[str, RouteKind] = {"generateContent": "model", "streamGenerateContent": "model", "countTokens": "side"}

FINISH: dict[str, FinishReason] = {
    "STOP": "stop",
    "MAX_TOKENS": "length",
    "SAFETY": "content_filter",
    "RECITATION": "content_filter",
    "BLOCKLIST": "content_filter",
    "PROHIBITED_CONTENT": "content_filter",
    "SPII": "content_filter",
    "IMAGE_SAFETY": "content_filter",
    "MALFORMED_FUNCTION_CALL": "error",
}
_NATIVE_FINISH = {"stop": "STOP", "tool_calls": "STOP", "length": "MAX_TOKENS",
                  "content_filter": "SAFETY", "error": "OTHER"}

# google.rpc.Code: the canonical names, and the HTTP status each maps to, as
# https://github.com/googleapis/googleapis/blob/master/google/rpc/code.proto gives them
# (https://cloud.google.com/apis/design/errors#handling_errors). A Gemini error's ``status`` is
# always one of them: Google's clients classify an error by it and know no other name.
CODES = {
    "OK": 200, "CANCELLED": 499, "UNKNOWN": 500, "INVALID_ARGUMENT": 400, "DEADLINE_EXCEEDED": 504,
    "NOT_FOUND": 404, "ALREADY_EXISTS": 409, "PERMISSION_DENIED": 403, "UNAUTHENTICATED": 401,
    "RESOURCE_EXHAUSTED": 429, "FAILED_PRECONDITION": 400, "ABORTED": 409, "OUT_OF_RANGE": 400,
    "UNIMPLEMENTED": 501, "INTERNAL": 500, "UNAVAILABLE": 503, "DATA_LOSS": 500,
}
# The name for each HTTP status the proxy answers with: code.proto's own for the status (the
# API's, https://ai.google.dev/gemini-api/docs/troubleshooting#error-codes), and for the two it
# has none for, a body over the size limit is an invalid argument, a gateway's failure
# (502) an unavailable service. Any other status is UNKNOWN.
_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ABORTED",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    501: "UNIMPLEMENTED",
    502: "UNAVAILABLE",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
# Where the proxy's own kind of error (``hook_error``, ...) goes: Google's ErrorInfo detail,
# whose ``reason`` is the machine-readable cause (https://cloud.google.com/apis/design/errors#error_info).
ERROR_INFO = "type.googleapis.com/google.rpc.ErrorInfo"
ERROR_DOMAIN = "llm-interceptor"

_GC = "generationConfig"
# Where Gemini's error messages name a field (see GeminiDialect.refused_parameters).
_FIELD_PATH = re.compile(r"GenerateContentRequest\.([A-Za-z_][A-Za-z0-9_.]*)")
_UNKNOWN_NAME = re.compile(r"Unknown name \"([A-Za-z_][A-Za-z0-9_]*)\"(?: at '([A-Za-z_][A-Za-z0-9_.]*)')?")
_TOP_LEVEL = ("contents", "tools", "toolConfig", "safetySettings", "systemInstruction", _GC, "cachedContent")


def _camel(path: str) -> str:
    return ".".join(re.sub(r"_([a-z0-9])", lambda m: m.group(1).upper(), part) for part in path.split("."))


MAX_STOPS = 5  # stopSequences: "up to 5" (https://ai.google.dev/api/generate-content#generationconfig)
_LEVELS = ("minimal", "low", "medium", "high")


def _set_by_session(changes: list[Override], name: str) -> bool:
    return any(o.key == f"{_GC}.{name}" and o.new is not None for o in changes)


def _nearest_level(level: str, allowed: tuple[str, ...]) -> str:
    """The allowed thinking level closest to ``level`` (ties: the higher)."""
    rank = _LEVELS.index(level) if level in _LEVELS else len(_LEVELS) - 1
    return min(allowed, key=lambda a: (abs(_LEVELS.index(a) - rank) if a in _LEVELS else 9,
                                       -_LEVELS.index(a) if a in _LEVELS else 0))


def _budget_for(level: str, caps: Capabilities) -> int:
    """A thinkingLevel as a budget, on a model that only takes budgets: the least for
    minimal/low, the most for high, dynamic (-1) for medium or when the range is unknown."""
    if caps.budget is None or level not in ("minimal", "low", "high"):
        return -1
    return caps.budget[1] if level == "high" else caps.budget[0]
KNOBS = (
    Knob("temperature", (_GC, "temperature")),
    Knob("top_p", (_GC, "topP")),
    Knob("top_k", (_GC, "topK")),
    Knob("max_tokens", (_GC, "maxOutputTokens")),
    Knob("seed", (_GC, "seed")),
    Knob("presence_penalty", (_GC, "presencePenalty")),
    Knob("frequency_penalty", (_GC, "frequencyPenalty")),
    # thinkingConfig whole (thinkingBudget, includeThoughts, thinkingLevel), then the level
    # alone as the canonical effort (Gemini 3's "low" / "high").
    Knob("thinking", (_GC, "thinkingConfig")),
    Knob("reasoning_effort", (_GC, "thinkingConfig", "thinkingLevel")),
    Knob("stop", (_GC, "stopSequences"), owner="harness",
         to_native=lambda v: v, from_native=lambda v: [v] if isinstance(v, str) else list(v)),
    Knob("n", (_GC, "candidateCount"), owner="harness"),
    Knob("logprobs", (_GC, "responseLogprobs"), owner="harness"),
    Knob("top_logprobs", (_GC, "logprobs"), owner="harness"),
    Knob("tool_choice", ("toolConfig", "functionCallingConfig"), owner="harness"),
)

_REQUEST_KEYS = {"contents", "systemInstruction", "system_instruction", "tools", "model"}


#: What a client sends in place of a signature the model never gave (documented, see above).
PLACEHOLDER_SIGNATURE = "skip_thought_signature_validator"


def _signature(part: dict[str, Any]) -> str | None:
    sig = part.get("thoughtSignature")
    return None if sig == PLACEHOLDER_SIGNATURE else sig


def _call_id(name: str, args: Any, rank: int) -> str:
    digest = hashlib.sha256(canonical_json([name, args]).encode()).hexdigest()[:16]
    return f"gemini-{name}-{digest}-{rank}"


def _text_parts(parts: list[dict[str, Any]]) -> str | list[Part]:
    """User-side content: text, inline data and file references; anything else kept whole."""
    out: list[Part] = []
    for p in parts:
        if "text" in p and not p.get("thought"):
            out.append(Part(type="text", text=p["text"]))
        elif isinstance(p.get("inlineData"), dict):
            d = p["inlineData"]
            kind = "image" if str(d.get("mimeType", "")).startswith("image/") else "file"
            part = inline_part(kind, d.get("data") or "")
            part.media_type = d.get("mimeType") or part.media_type
            out.append(part)
        elif isinstance(p.get("fileData"), dict):
            d = p["fileData"]
            kind = "image" if str(d.get("mimeType", "")).startswith("image/") else "file"
            out.append(url_part(kind, d.get("fileUri") or "", media_type=d.get("mimeType")))
        else:
            out.append(other_part(p))
    if all(p.type == "text" for p in out):
        return "".join(p.text or "" for p in out)
    return out


def _model_message(parts: list[dict[str, Any]]) -> Message:
    """A ``model`` turn: text is content, ``thought`` parts are reasoning (consecutive ones
    are one, whatever the stream's split), a signature on any other part travels with it
    (on its call, or as signature-only reasoning), ``functionCall`` parts are tool calls."""
    content: list[Part] = []
    reasoning: list[Reasoning] = []
    calls: list[ToolCall] = []
    ranks: dict[str, int] = {}
    thought_open = False
    for p in parts:
        signature = _signature(p)
        if p.get("thought"):
            if thought_open:
                last = reasoning[-1]
                last.text += p.get("text") or ""
                last.signature = signature or last.signature
            else:
                reasoning.append(Reasoning(text=p.get("text") or "", signature=signature))
                thought_open = True
            continue
        thought_open = False
        if _is_call(p):
            fc = p["functionCall"]
            name, args = str(fc.get("name") or ""), fc.get("args") or {}
            key = canonical_json([name, args])
            rank = ranks[key] = ranks.get(key, -1) + 1
            extra = {"thoughtSignature": signature} if signature else None
            calls.append(ToolCall(id=_call_id(name, args, rank), name=name,
                                  arguments=json.dumps(args, ensure_ascii=False), extra=extra))
            continue
        if signature:
            reasoning.append(Reasoning(signature=signature))
        if "text" in p:
            if content and content[-1].type == "text":
                content[-1].text = (content[-1].text or "") + p["text"]
            else:
                content.append(Part(type="text", text=p["text"]))
        else:
            content.append(other_part(p))
    text: str | list[Part] = content
    if all(c.type == "text" for c in content):
        text = "".join(c.text or "" for c in content)
    return Message(role="assistant", content=text, tool_calls=calls, reasoning=reasoning)


def _user_messages(parts: list[dict[str, Any]], answered: list[ToolCall], wire_ids: dict[str, str]) -> list[Message]:
    """A ``user`` turn: each ``functionResponse`` is a tool message paired with a call of the
    model turn before it (by id, else the n-th of that name); the rest is one user message."""
    out: list[Message] = []
    rest: list[dict[str, Any]] = []
    taken: set[int] = set()
    for p in parts:
        fr = p.get("functionResponse")
        if not isinstance(fr, dict):
            rest.append(p)
            continue
        name = str(fr.get("name") or "")
        call_id = wire_ids.get(str(fr.get("id")))
        if call_id is not None:
            taken.update(k for k, call in enumerate(answered) if call.id == call_id)
        else:
            for k, call in enumerate(answered):
                if k not in taken and call.name == name:
                    taken.add(k)
                    call_id = call.id
                    break
            else:
                call_id = f"gemini-{name}-unpaired-{len(taken) + len(out)}"
        response = fr.get("response")
        out.append(Message(role="tool", tool_call_id=str(call_id), name=name,
                           content=json.dumps(response, ensure_ascii=False, sort_keys=True)))
    if rest:
        out.append(Message(role="user", content=_text_parts(rest)))
    return out


def _element(content: dict[str, Any], before: Before | None) -> list[Message]:
    """A ``contents`` element's canonical messages (``Dialect.list_messages``): a model turn
    on its own; a user turn's function responses paired with the calls of the model turn
    right before it, if that is one (its message's calls, and their wire ids from its parts)."""
    parts = content.get("parts") or []
    if content.get("role") == "model":
        return [_model_message(parts)]
    answered: list[ToolCall] = []
    wire_ids: dict[str, str] = {}
    if before is not None and isinstance(before[0], dict) and before[0].get("role") == "model" and before[1]:
        answered = list(before[1][0].tool_calls)
        calls = [p["functionCall"] for p in before[0].get("parts") or [] if _is_call(p)]
        # the wire id of a call -> its canonical id; the parts make the calls one for one, in order
        wire_ids = {str(fc["id"]): call.id for fc, call in zip(calls, answered) if fc.get("id")}
    return _user_messages(parts, answered, wire_ids)


def _is_call(part: dict[str, Any]) -> bool:
    """A part ``_model_message`` makes a tool call of (a thought part never is one)."""
    return not part.get("thought") and isinstance(part.get("functionCall"), dict)


def _tools(tool: dict[str, Any]) -> list[Tool]:
    decls = tool.get("functionDeclarations") or tool.get("function_declarations")
    if isinstance(decls, list):
        return [Tool(name=d.get("name", ""), description=d.get("description"),
                     parameters=d.get("parametersJsonSchema") or d.get("parameters")) for d in decls]
    # Google's own tools (googleSearch, codeExecution, urlContext): kept by kind.
    return [Tool(name=k, type=k, parameters=v if isinstance(v, dict) else None) for k, v in tool.items()]


def _usage(raw: dict[str, Any] | None) -> Usage | None:
    if not raw:
        return None
    thoughts = raw.get("thoughtsTokenCount") or 0
    return Usage(
        input_tokens=raw.get("promptTokenCount") or 0,
        output_tokens=(raw.get("candidatesTokenCount") or 0) + thoughts,
        cached_input_tokens=raw.get("cachedContentTokenCount") or 0,
        reasoning_tokens=thoughts,
    )


def _native_usage(usage: Usage) -> dict[str, Any]:
    out = {"promptTokenCount": usage.input_tokens,
           "candidatesTokenCount": usage.output_tokens - usage.reasoning_tokens,
           "totalTokenCount": usage.input_tokens + usage.output_tokens}
    if usage.reasoning_tokens:
        out["thoughtsTokenCount"] = usage.reasoning_tokens
    if usage.cached_input_tokens:
        out["cachedContentTokenCount"] = usage.cached_input_tokens
    return out


def _native_parts(message: Message) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    signatures: list[str] = []
    for r in message.reasoning:
        if r.text:
            part: dict[str, Any] = {"text": r.text, "thought": True}
            if r.signature:
                part["thoughtSignature"] = r.signature
            parts.append(part)
        elif r.signature:
            signatures.append(r.signature)
    content = message.content
    blocks = [Part(type="text", text=content)] if isinstance(content, str) else content
    for block in blocks:
        if block.type == "text":
            if block.text:
                parts.append({"text": block.text})
        elif block.data is not None:
            parts.append(dict(block.data))
    if signatures and parts and "thought" not in parts[-1] and "text" in parts[-1]:
        parts[-1]["thoughtSignature"] = signatures[0]
    for call in message.tool_calls:
        try:
            args = json.loads(call.arguments) if call.arguments else {}
        except ValueError:
            args = {}
        part = {"functionCall": {"name": call.name, "args": args}}
        if call.extra and call.extra.get("thoughtSignature"):
            part["thoughtSignature"] = call.extra["thoughtSignature"]
        parts.append(part)
    return parts


def _native_user_parts(content: str | list[Part], where: str) -> list[dict[str, Any]]:
    """User-side content as parts (what ``_text_parts`` reads)."""
    if isinstance(content, str):
        return [{"text": content}]
    parts: list[dict[str, Any]] = []
    for k, part in enumerate(content):
        if part.type == "text":
            parts.append({"text": part.text or ""})
        elif part.type in ("image", "file"):
            data = {"fileUri": restorable_ref(part, f"{where} part {k}")}
            media = part.media_type or (part.data or {}).get("media_type")  # url_part keeps it in data
            if media:
                data["mimeType"] = media
            parts.append({"fileData": data})
        else:
            parts.append(dict(part.data or {}))
    return parts


def _native_request(request: Request) -> dict[str, Any]:
    """A canonical request as a ``generateContent`` body (``GeminiDialect.request_body``): a
    leading system message is ``systemInstruction``; tool results are ``functionResponse``
    parts of one user turn (with any user text after them), as ``_user_messages`` reads them."""
    body: dict[str, Any] = {}
    contents: list[dict[str, Any]] = []
    open_results = False  # the last user turn holds tool results: what follows joins it
    for k, m in enumerate(request.messages):
        where = f"message {k} ({m.role})"
        if m.role == "system" and k == 0:
            body["systemInstruction"] = {"parts": _native_user_parts(m.content, where)}
            continue
        if m.role == "assistant":
            contents.append({"role": "model", "parts": _native_parts(m)})
            open_results = False
        elif m.role == "tool":
            try:
                response = json.loads(m.content) if isinstance(m.content, str) else None
            except ValueError:
                response = None
            if not isinstance(response, dict):
                response = {"output": m.text()}
            part = {"functionResponse": {"name": m.name or "", "response": response}}
            if open_results:
                contents[-1]["parts"].append(part)
            else:
                contents.append({"role": "user", "parts": [part]})
                open_results = True
        else:  # user, or a system message mid-conversation (Gemini has no such role)
            parts = _native_user_parts(m.content, where)
            if open_results:
                contents[-1]["parts"].extend(parts)
            else:
                contents.append({"role": "user", "parts": parts})
            open_results = False
    body["contents"] = contents
    if request.tools:
        declared = [t for t in request.tools if t.type == "function"]
        tools: list[dict[str, Any]] = []
        if declared:
            tools.append({"functionDeclarations": [
                {k: v for k, v in {"name": t.name, "description": t.description,
                                   "parametersJsonSchema": t.parameters}.items() if v is not None}
                for t in declared]})
        tools += [{t.type: t.parameters or {}} for t in request.tools if t.type != "function"]
        body["tools"] = tools
    return body


class JSONArrayFrames:
    """``streamGenerateContent`` without ``alt=sse``: one JSON array whose elements arrive
    as they are generated (``[{...}\\r\\n,{...}\\r\\n]``). Each complete top-level element is
    an event; the scan keeps only the element in progress and its nesting state, O(chunk)."""

    _SPECIAL = re.compile(rb'[\[\]{}"\\]')
    _STRING = re.compile(rb'["\\]')

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.buf = bytearray()

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        start = 0 if self.depth > 1 or self.in_string else None
        i = 0
        n = len(chunk)
        while i < n:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                    i += 1
                    continue
                m = self._STRING.search(chunk, i)
                if m is None:
                    break
                i = m.start()
                if chunk[i] == 0x5C:  # backslash
                    self.escaped = True
                else:
                    self.in_string = False
                i += 1
                continue
            m = self._SPECIAL.search(chunk, i)
            if m is None:
                break
            i = m.start()
            c = chunk[i]
            if c == 0x22:  # quote
                self.in_string = True
            elif c in (0x7B, 0x5B):  # { [
                self.depth += 1
                if self.depth == 2:
                    start = i
            elif c in (0x7D, 0x5D):  # } ]
                if self.depth == 2 and start is not None:
                    self.buf += chunk[start:i + 1]
                    events.append(self._event())
                    start = None
                self.depth -= 1
            i += 1
        if start is not None:
            self.buf += chunk[start:]
        return events

    def _event(self) -> SSEEvent:
        raw = bytes(self.buf)
        self.buf.clear()
        try:
            return SSEEvent(data=raw.decode("utf-8"))
        except UnicodeDecodeError:
            return SSEEvent(data=raw.decode("utf-8", "replace"), malformed=True)

    def flush(self) -> list[SSEEvent]:
        if self.buf:  # an element cut off by the end of the body: the assembler sees the damage
            return [self._event()]
        return []


# -- network policy: what the API runs or fetches itself ------------------------------------

_GOOGLE_TOOLS = {
    "googleSearch": "google search", "google_search": "google search",
    "googleSearchRetrieval": "google search", "google_search_retrieval": "google search",
    "enterpriseWebSearch": "google search", "enterprise_web_search": "google search",
    "codeExecution": "code execution", "code_execution": "code execution",
    "urlContext": "url context", "url_context": "url context",
    "fileSearch": "file search", "file_search": "file search",
    "googleMaps": "google maps", "google_maps": "google maps",
    "retrieval": "retrieval",
}


class GeminiDialect(KnobDialect):
    name = "gemini"
    hosts = ("generativelanguage.googleapis.com",)
    key_variables = ("GEMINI_API_KEY",)
    # The genai SDKs' places first, then any other SDK's.
    secret_places = ("x-goog-api-key", "?key", *KnobDialect.secret_places)
    credential_headers: ClassVar[tuple[str, ...]] = ("x-goog-api-key", "authorization", "x-api-key", "api-key")
    knobs = KNOBS
    # After the system instruction, each element read with the one before it (_element).
    message_list = "contents"

    # -- where it is spoken ----------------------------------------------------------------

    def route(self, method: str, path: str) -> RouteKind | None:
        m = _PATH.match(path)
        if m is not None:
            return _METHODS.get(m.group(3)) if method == "POST" else None
        if method == "GET" and _MODELS.match(path):
            return "side"
        return None

    def upstream_path(self, base_path: str, path: str) -> str:
        """A base URL that ends in an API version (``/v1beta``) replaces the harness's; one
        without (``https://host`` or ``/proxy``) keeps it, as the genai SDKs build URLs."""
        base = base_path.rstrip("/")
        if _VERSION.fullmatch("/" + base.rsplit("/", 1)[-1]):
            return base + _VERSION.sub("", path, count=1)
        return base + path

    # -- credentials -------------------------------------------------------------------------

    def put_key(self, headers: MutableMapping[str, str], query: MutableMapping[str, str], key: str | None) -> None:
        in_query = "key" in query
        query.pop("key", None)
        drop(headers, self.credential_headers)
        if key and in_query:
            query["key"] = key
        elif key:
            headers["x-goog-api-key"] = key

    # -- where the model lives ----------------------------------------------------------------

    def requested_model(self, body: dict[str, Any] | None, path: str) -> str | None:
        m = _PATH.match(path.split("?", 1)[0])
        return m.group(2) if m else None

    def json_path(self, path: str, model: str | None) -> str:
        m = _PATH.match(path.split("?", 1)[0])
        if m is None:
            return path
        return f"/{m.group(1)}/models/{model or m.group(2)}:generateContent"

    def path_with_model(self, path: str, model: str | None) -> tuple[str, Override | None]:
        route, sep, query = path.partition("?")
        m = _PATH.match(route)
        if not model or m is None or m.group(2) == model:
            return path, None
        new = f"/{m.group(1)}/models/{model}:{m.group(3)}" + sep + query
        return new, Override("model", m.group(2), model)

    def side_overrides(self, body: dict[str, Any], model: str | None) -> list[Override]:
        return []  # countTokens names the model in the path

    def apply_overrides(self, body: dict[str, Any], model: str | None, sampling: Sampling,
                        mode: Mode = "overlay", refused: frozenset[str] = frozenset(),
                        requested: str | None = None) -> list[Override]:
        """The knobs, what the provider refused earlier for this model (provider feedback:
        the proxy's change undone), and the model's rules; the model is ``path_with_model``'s
        (a body with a ``model`` would no longer be the harness's bytes), so the row of the
        table is the session's model's, else the one the harness asked for (``requested``)."""
        changes, mine = apply_knobs(body, self.knobs, sampling, mode)
        for key in sorted(refused):
            changes += undo(body, key, changes)
        if model and model != requested:
            mine.add("model")  # another model than the harness wrote its request for
        self.reconcile(body, Plan(capabilities("gemini", model or requested), changes, mine))
        return changes

    # -- bodies ---------------------------------------------------------------------------------

    def request_body(self, request: Request) -> dict[str, Any]:
        return _native_request(request)

    def parse_request(self, body: dict[str, Any], listed: Listed | None = None) -> Request:
        messages: list[Message] = []
        system = body.get("systemInstruction") or body.get("system_instruction")
        if isinstance(system, dict):
            messages.append(Message(role="system", content=_text_parts(system.get("parts") or [])))
        elif isinstance(system, str):
            messages.append(Message(role="system", content=system))
        messages += self.list_messages(body.get("contents") or [], listed, _element)
        return Request(
            messages=messages,
            tools=[t for tool in body.get("tools") or [] for t in _tools(tool)],
            model=body.get("model"),
            sampling=self.sampling(body),
            stream=False,
            extra={k: v for k, v in body.items() if k not in _REQUEST_KEYS and k not in (_GC, "toolConfig")},
        )

    def parse_response(self, body: dict[str, Any]) -> Response:
        if isinstance(body.get("error"), dict):
            return Response(error=self.response_error(body["error"].get("code"), body), finish_reason="error")
        candidates = sorted(body.get("candidates") or [], key=lambda c: c.get("index", 0))
        head = candidates[0] if candidates else {}
        message = _model_message((head.get("content") or {}).get("parts") or [])
        native = head.get("finishReason")
        finish = FINISH.get(native, "stop") if native else None
        if finish == "stop" and message.tool_calls:
            finish = "tool_calls"
        extra = {k: body[k] for k in ("promptFeedback",) if body.get(k) is not None}
        if not candidates and (body.get("promptFeedback") or {}).get("blockReason"):
            finish, native = "content_filter", body["promptFeedback"]["blockReason"]
        return Response(
            id=body.get("responseId"),
            model=body.get("modelVersion"),
            message=message,
            finish_reason=finish,
            native_finish_reason=native,
            usage=_usage(body.get("usageMetadata")),
            extra=extra,
        )

    def assembler(self) -> GeminiAssembler:
        return GeminiAssembler(self)

    def reconcile(self, body: dict[str, Any], plan: Plan) -> None:
        """What Gemini refuses in ``generationConfig``, fixed where the proxy caused it
        (https://ai.google.dev/api/generate-content#generationconfig,
        https://ai.google.dev/gemini-api/docs/thinking), by the model's row of the table:

        - ``thinkingBudget`` with ``thinkingLevel`` (400 "#levels-budgets"): the level, the
          newer setting, wins, but on a model that takes no level (before Gemini 3) the
          budget does; a level alone there becomes a budget (minimal/low: the family's least,
          medium: dynamic, high: its most);
        - a level the model does not take: the nearest it does;
        - a budget outside the family's range: the nearest end; 0 (thinking off) on a model
          that always thinks: its least;
        - ``logprobs`` only with ``responseLogprobs``; at most 5 ``stopSequences``.
        """
        caps, changes = plan.caps, plan.changes
        gc = body.get(_GC)
        if not isinstance(gc, dict):
            return
        thinking = gc.get("thinkingConfig")
        touched = "model" in plan.session or any(
            o.key.startswith(f"{_GC}.thinkingConfig") for o in changes)
        if isinstance(thinking, dict):
            self._thinking(thinking, caps, changes, touched)
        if gc.get("logprobs") is not None and not gc.get("responseLogprobs") and _set_by_session(changes, "logprobs"):
            old = gc.get("responseLogprobs")
            gc["responseLogprobs"] = True
            changes.append(Override(f"{_GC}.responseLogprobs", old, True,
                                    "Gemini takes logprobs only with responseLogprobs"))
        stops = gc.get("stopSequences")
        if isinstance(stops, list) and len(stops) > MAX_STOPS and _set_by_session(changes, "stopSequences"):
            gc["stopSequences"] = stops[:MAX_STOPS]
            changes.append(Override(f"{_GC}.stopSequences", stops, stops[:MAX_STOPS],
                                    f"Gemini takes at most {MAX_STOPS} stop sequences"))

    @staticmethod
    def _thinking(thinking: dict[str, Any], caps: Capabilities, changes: list[Override], touched: bool) -> None:
        key = f"{_GC}.thinkingConfig"
        source = f" ({caps.source})" if caps.source else ""
        if "thinkingBudget" in thinking and "thinkingLevel" in thinking:
            loser = "thinkingLevel" if caps.levels == () else "thinkingBudget"
            changes.append(Override(f"{key}.{loser}", thinking.pop(loser), None,
                                    f"Gemini rejects thinkingBudget together with thinkingLevel: kept "
                                    f"{'thinkingBudget' if loser == 'thinkingLevel' else 'thinkingLevel'}{source}"))
        if not touched:
            return  # the harness's own settings: the provider's answer is the harness's to read
        level = thinking.get("thinkingLevel")
        if level is not None and caps.levels == ():
            budget = _budget_for(str(level).lower(), caps)
            del thinking["thinkingLevel"]
            thinking["thinkingBudget"] = budget
            changes.append(Override(f"{key}.thinkingLevel", level, None,
                                    f"this model takes no thinkingLevel (Gemini 3 and later do): a "
                                    f"thinkingBudget instead{source}"))
            changes.append(Override(f"{key}.thinkingBudget", None, budget,
                                    f"thinkingLevel {level} as a budget{source}"))
        elif level is not None and caps.levels and str(level).lower() not in caps.levels:
            nearest = _nearest_level(str(level).lower(), caps.levels)
            thinking["thinkingLevel"] = nearest
            changes.append(Override(f"{key}.thinkingLevel", level, nearest,
                                    f"this model takes thinkingLevel {', '.join(caps.levels)}: the nearest{source}"))
        budget = thinking.get("thinkingBudget")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget == -1:
            return
        fixed = budget
        low, high = caps.budget or (None, None)
        if budget == 0 and caps.budget_off is False:
            fixed = low if low is not None else -1
        elif budget != 0 and low is not None and budget < low:
            fixed = low
        elif high is not None and budget > high:
            fixed = high
        if fixed != budget:
            thinking["thinkingBudget"] = fixed
            span = f"-1 or {low}-{high}" if low is not None else "-1 or a positive one"
            never = ", never 0 (it always thinks)" if caps.budget_off is False else ""
            changes.append(Override(f"{key}.thinkingBudget", budget, fixed,
                                    f"this model takes a thinkingBudget of {span}{never}{source}"))

    def refused_parameters(self, body: Any) -> list[str]:
        """Gemini names fields by their proto paths in snake_case ("* GenerateContentRequest.
        generation_config.temperature: ...", 'Unknown name "x" at generation_config',
        "Remove 'thinking_config.thinking_budget'", ``details[].fieldViolations[].field``):
        as body paths in lowerCamel, a bare GenerationConfig field under ``generationConfig``.
        ``generationConfig`` alone blames nothing in particular and is left out."""
        err = body.get("error") if isinstance(body, dict) else None
        if not isinstance(err, dict):
            return []
        message = str(err.get("message") or "")
        found = [m.group(1) for m in _FIELD_PATH.finditer(message)]
        found += [f"{m.group(2)}.{m.group(1)}" if m.group(2) else m.group(1) for m in _UNKNOWN_NAME.finditer(message)]
        for detail in err.get("details") or []:
            for violation in (detail.get("fieldViolations") or []) if isinstance(detail, dict) else []:
                if isinstance(violation, dict) and isinstance(violation.get("field"), str):
                    found.append(violation["field"])
        found += super().refused_parameters(body)
        out: list[str] = []
        for name in found:
            path = _camel(name.strip(".")).removeprefix("generateContentRequest.").removeprefix("GenerateContentRequest.")
            if path.split(".", 1)[0] not in _TOP_LEVEL:
                path = f"{_GC}.{path}"
            if path != _GC:
                out.append(path)
        return list(dict.fromkeys(out))

    def is_stream(self, body: dict[str, Any], path: str = "") -> bool:
        return ":streamGenerateContent" in path.split("?", 1)[0]

    def frames(self, status: int, content_type: str, stream: bool):
        if status != 200 or not stream:
            return None
        if content_type.startswith("text/event-stream"):
            return SSEDecoder()
        if content_type.startswith("application/json"):
            return JSONArrayFrames()
        return None

    # -- network policy ------------------------------------------------------------------

    def mediate_network(self, body: dict[str, Any], domains: list[str] | None, *,
                        keep_previous: bool = False) -> Mediation:
        """Google's own tools (Search grounding, code execution, URL context, file search,
        Maps; ai.google.dev: "Grounding with Google Search", "URL context") in either JSON
        spelling, and ``fileData`` parts (a URI the API reads). Search has no domain filter
        in the Gemini API, so ``restrict`` strips it too. A request whose only tools were
        Google Search exists to search (Gemini CLI's web search call; the API has no forced
        choice of a built-in tool): it is answered locally."""
        changes: list[Override] = []
        tools = body.get("tools")
        searched = False
        if isinstance(tools, list):
            kept = []
            for k, tool in enumerate(tools):
                if not isinstance(tool, dict):
                    kept.append(tool)
                    continue
                removed = [key for key in tool if key in _GOOGLE_TOOLS]
                for key in removed:
                    changes.append(Override(f"tools.{k}.{key}", _GOOGLE_TOOLS[key], None))
                    searched = searched or _GOOGLE_TOOLS[key] == "google search"
                rest = {key: v for key, v in tool.items() if key not in _GOOGLE_TOOLS}
                if rest:
                    kept.append(rest)
            if changes:
                if kept:
                    body["tools"] = kept
                else:
                    del body["tools"]
        for i, content in enumerate(body.get("contents") or []):
            parts = content.get("parts") if isinstance(content, dict) else None
            for j, part in enumerate(parts if isinstance(parts, list) else []):
                if isinstance(part, dict) and ("fileData" in part or "file_data" in part):
                    parts[j] = {"text": REMOVED_PART.format(what="a file by URI")}
                    changes.append(Override(f"contents.{i}.parts.{j}", "file by URI", "text"))
        return Mediation(changes, searched and "tools" not in body)

    def append_notice(self, body: dict[str, Any], notice: str) -> Override | None:
        return notice_first_user(body.get("contents"), "contents", notice, lambda: {"text": notice}, content="parts")

    def json_body(self, response: Response) -> dict[str, Any]:
        native = response.native_finish_reason or (
            _NATIVE_FINISH.get(response.finish_reason) if response.finish_reason else None)
        candidate: dict[str, Any] = {"content": {"role": "model", "parts": _native_parts(response.message)}}
        if native:
            candidate["finishReason"] = native
        candidate["index"] = 0
        body: dict[str, Any] = {"candidates": [candidate]}
        if response.usage is not None:
            body["usageMetadata"] = _native_usage(response.usage)
        if response.model:
            body["modelVersion"] = response.model
        if response.id:
            body["responseId"] = response.id
        body.update(response.extra)
        return body

    def stream_events(self, response: Response) -> list[SSEEvent]:
        """One chunk per part, then the finish chunk with the usage, as the API streams."""
        body = self.json_body(response)
        candidate = body["candidates"][0]
        head = {k: body[k] for k in ("modelVersion", "responseId") if k in body}
        chunks = [{"candidates": [{"content": {"role": "model", "parts": [p]}, "index": 0}], **head}
                  for p in candidate["content"]["parts"]]
        last = {"candidates": [{"content": {"role": "model", "parts": []}, "index": 0}], **head}
        if chunks:
            last = chunks.pop()
        if "finishReason" in candidate:
            last["candidates"][0]["finishReason"] = candidate["finishReason"]
        if "usageMetadata" in body:
            last["usageMetadata"] = body["usageMetadata"]
        chunks.append(last)
        return [SSEEvent(data=json.dumps(c, separators=(",", ":"), ensure_ascii=False)) for c in chunks]

    # -- errors -------------------------------------------------------------------------------

    def error_body(self, status: int, message: str, type: str | None = None) -> dict[str, Any]:
        """Google's error shape: ``status`` the canonical name (``type`` when it is one, else
        the HTTP status's); a kind of the proxy's own goes into an ErrorInfo detail."""
        name = type if type in CODES else _STATUS.get(status, "UNKNOWN")
        error: dict[str, Any] = {"code": status, "message": message, "status": name}
        if type is not None and type not in CODES:
            error["details"] = [{"@type": ERROR_INFO, "reason": type.upper(), "domain": ERROR_DOMAIN}]
        return {"error": error}

    def response_error(self, status: int, body: Any) -> ResponseError:
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict):
            return ResponseError(type=str(err.get("status") or err.get("code") or "error"),
                                 message=str(err.get("message") or ""), status=status)
        if isinstance(body, list) and body and isinstance(body[0], dict) and "error" in body[0]:
            return self.response_error(status, body[0])  # an error inside the array stream
        return super().response_error(status, body)


@dataclass(slots=True)
class _Candidate:
    parts: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, part: dict[str, Any]) -> None:
        """Text pieces of one kind are joined (kept in a list, joined once in ``native``);
        every other part comes whole."""
        prev = self.parts[-1] if self.parts else None
        if (prev is not None and "text" in part and "_texts" in prev
                and bool(prev.get("thought")) == bool(part.get("thought"))
                and not prev.get("thoughtSignature")):
            prev["_texts"].append(part["text"])
            if part.get("thoughtSignature"):
                prev["thoughtSignature"] = part["thoughtSignature"]
            return
        if "text" in part:
            part = {**part, "_texts": [part["text"]]}
        self.parts.append(part)

    def native(self, index: int) -> dict[str, Any]:
        parts = []
        for p in self.parts:
            if "_texts" in p:
                p = {k: v for k, v in p.items() if k != "_texts"} | {"text": "".join(p["_texts"])}
            parts.append(p)
        out: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": index, **self.extra}
        if self.finish_reason:
            out["finishReason"] = self.finish_reason
        return out


class GeminiAssembler(NativeAssembler):
    """Chunks -> the GenerateContentResponse they add up to -> ``parse_response``.
    Terminal: the chunk whose candidates all carry a ``finishReason`` (or a blocked prompt);
    an ``{"error": ...}`` chunk is terminal too."""

    terminal = "a chunk with finishReason"

    def __init__(self, dialect: GeminiDialect):
        super().__init__(dialect)
        self.head: dict[str, Any] = {}
        self.usage: dict[str, Any] | None = None
        self.candidates: dict[int, _Candidate] = {}

    def fold(self, obj: dict[str, Any], event: SSEEvent) -> bool:
        if isinstance(obj.get("error"), dict):
            return self.fail(self.dialect.response_error(obj["error"].get("code"), obj))
        for key in ("modelVersion", "responseId", "promptFeedback"):
            if obj.get(key) is not None and key not in self.head:
                self.head[key] = obj[key]
        if obj.get("usageMetadata"):
            self.usage = obj["usageMetadata"]
        chunk = obj.get("candidates") or []
        for c in chunk:
            index = c.get("index", 0)
            state = self.candidates.get(index)
            if state is None:
                state = self.candidates[index] = _Candidate()
            for part in (c.get("content") or {}).get("parts") or []:
                state.add(part)
            if c.get("finishReason"):
                state.finish_reason = c["finishReason"]
        if not chunk and (obj.get("promptFeedback") or {}).get("blockReason"):
            return True
        return bool(self.candidates) and all(s.finish_reason for s in self.candidates.values())

    def native(self) -> dict[str, Any]:
        body: dict[str, Any] = {"candidates": [self.candidates[i].native(i) for i in sorted(self.candidates)],
                                **self.head}
        if self.usage is not None:
            body["usageMetadata"] = self.usage
        return body


GEMINI = GeminiDialect()

"""OpenAI Responses (``POST /v1/responses``, and Codex's WebSocket on ``GET /v1/responses``).

The input is a flat list of items, not messages. Consecutive assistant-side items (reasoning,
output messages, function and custom tool calls, server tool calls) form one canonical
assistant message, in requests and responses alike, so a reply and its restatement in the
next request hash equal. Item ids (``rs_…``, ``msg_…``, ``fc_…``) are storage handles, not
content, and some harnesses (Codex) do not send them back; they are not part of canonical
messages. Reasoning keeps its ``encrypted_content``, which is what the model gets back.

The assembler keeps every output item the events build (deltas in lists) and, at the
terminal ``response.completed`` / ``incomplete`` / ``failed``, takes that event's response
snapshot, filling ``output`` from the items when the snapshot omits it; then it is the
JSON path (``parse_response``) from there on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from interceptor.dialects.base import Mediation, Override, Slot
from interceptor.dialects.common import (
    REMOVED_PART,
    drop_key,
    mediate_tools,
    narrowed,
    notice_first_user,
    Knob,
    OpenAIDialect,
    error_from,
    NativeAssembler,
    inline_part,
    other_part,
    restorable_ref,
    Plan,
    reconcile_openai,
    url_part,
)
from interceptor.dialects.sse import SSEEvent
from interceptor.dialects.vllm import ResponsesTokens
from interceptor.trace.prefix import Listed
from interceptor.trace.messages import (
    FinishReason,
    Message,
    Part,
    Piece,
    Reasoning,
    Request,
    Response,
    Tool,
    ToolCall,
    Usage,
    piece_order,
)

KNOBS = (
    Knob("temperature", ("temperature",)),
    Knob("top_p", ("top_p",)),
    Knob("max_tokens", ("max_output_tokens",)),
    Knob("reasoning_effort", ("reasoning", "effort")),
    Knob("tool_choice", ("tool_choice",), owner="harness"),
    Knob("top_logprobs", ("top_logprobs",), owner="harness"),
)
_REQUEST_KEYS = {"input", "instructions", "tools", "model", "stream", "temperature", "top_p",
                 "max_output_tokens", "tool_choice", "top_logprobs"}
_INCOMPLETE: dict[str, FinishReason] = {"max_output_tokens": "length", "content_filter": "content_filter"}
_DIRECT = {"type": "direct"}
TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


# --------------------------------------------------------------------------------------
# native -> canonical


def _content(content: Any) -> str | list[Part]:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[Part] = []
    for block in content:
        kind = block.get("type")
        if kind in ("input_text", "output_text", "text"):
            parts.append(_text_part(block))
        elif kind == "input_image":
            if block.get("image_url"):
                parts.append(url_part("image", block["image_url"], detail=block.get("detail")))
            else:
                parts.append(Part(type="image", ref=block.get("file_id"),
                                  data={"detail": block["detail"]} if block.get("detail") else None))
        elif kind == "input_file":
            if block.get("file_data"):
                parts.append(inline_part("file", block["file_data"], filename=block.get("filename")))
            else:
                parts.append(Part(type="file", ref=block.get("file_url") or block.get("file_id"),
                                  data={"filename": block["filename"]} if block.get("filename") else None))
        else:
            parts.append(other_part(block))
    return parts


def _text_part(block: dict[str, Any]) -> Part:
    annotations = block.get("annotations")
    return Part(text=block.get("text", ""), data={"annotations": annotations} if annotations else None)


def _caller(item: dict[str, Any]) -> dict[str, Any] | None:
    caller = item.get("caller")
    return {"caller": caller} if caller and caller != _DIRECT else None


@dataclass(slots=True)
class _Turn:
    """Assistant-side items collected until a user, system or tool item ends the turn."""

    parts: list[Part] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    reasoning: list[Reasoning] = field(default_factory=list)
    refusal: list[str] = field(default_factory=list)
    logprobs: list[float] | None = None
    empty: bool = True
    tags: list[Piece] = field(default_factory=list)

    def add(self, item: dict[str, Any], kind: str) -> None:
        self.empty = False
        if kind in ("reasoning", "function_call", "custom_tool_call"):
            self.tags.append("reasoning" if kind == "reasoning" else "tool_call")
        if kind == "message" and isinstance(item.get("content"), str):
            if item["content"]:
                self.parts.append(Part(text=item["content"]))
                self.tags.append("content")
        elif kind == "message":
            for block in item.get("content") or []:
                if block.get("type") == "refusal":
                    self.refusal.append(block.get("refusal", ""))
                    continue
                part = _content([block])[0]
                self.parts.append(part)
                self.tags.append("content")
                if block.get("logprobs"):
                    self.logprobs = (self.logprobs or []) + [t["logprob"] for t in block["logprobs"]]
        elif kind == "reasoning":
            raw = item.get("content") or []
            texts = [c.get("text", "") for c in raw] or [s.get("text", "") for s in item.get("summary") or []]
            self.reasoning.append(Reasoning(text="\n\n".join(texts), encrypted=item.get("encrypted_content")))
        elif kind == "function_call":
            self.calls.append(ToolCall(id=item.get("call_id") or "", name=item.get("name", ""),
                                       arguments=item.get("arguments", ""), namespace=item.get("namespace"),
                                       extra=_caller(item)))
        elif kind == "custom_tool_call":
            self.calls.append(ToolCall(id=item.get("call_id") or "", name=item.get("name", ""),
                                       arguments=item.get("input", ""), type="custom",
                                       namespace=item.get("namespace"), extra=_caller(item)))
        elif kind not in ("reasoning", "function_call", "custom_tool_call"):
            # built-in tool calls, compaction, item references: kept whole
            self.parts.append(other_part(_without_status(item)))
            self.tags.append("content")

    def message(self) -> Message:
        return Message(role="assistant", content=self.parts or "", tool_calls=self.calls,
                       reasoning=self.reasoning, refusal="".join(self.refusal) if self.refusal else None,
                       order=piece_order(self.tags))


def _without_status(item: dict[str, Any]) -> dict[str, Any]:
    """``status`` says where the item was in its life when it was sent; not content."""
    return {k: v for k, v in item.items() if k != "status"}


def _output_content(output: Any) -> str | list[Part]:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _content(output)
    return [other_part(output)] if isinstance(output, dict) else ""


def _items(items: list[dict[str, Any]], marks: list[int] | None = None
           ) -> tuple[list[Message], list[Tool], list[float] | None]:
    """Input or output items -> canonical messages (and tools from ``additional_tools``).
    ``marks`` gets, per item, how many messages the items so far made (a run's assistant
    message counts at the item that closes it, or at the last item)."""
    messages: list[Message] = []
    tools: list[Tool] = []
    turn = _Turn()
    logprobs: list[float] | None = None

    def flush() -> None:
        nonlocal turn, logprobs
        if not turn.empty:
            messages.append(turn.message())
            if turn.logprobs is not None:
                logprobs = (logprobs or []) + turn.logprobs
            turn = _Turn()

    for item in items:
        kind = _kind(item)
        role = item.get("role")
        if kind == "message" and role != "assistant":
            flush()
            if role in ("system", "developer"):
                messages.append(Message(role="system", content=_content(item.get("content")),
                                        name="developer" if role == "developer" else None))
            else:
                messages.append(Message(role="user", content=_content(item.get("content"))))
        elif kind == "additional_tools":
            tools.extend(t for tool in item.get("tools") or [] for t in _tools(tool))
        elif kind == "configuration_update":
            # Codex's note of a setting it changed (it sends one after falling back from its
            # WebSocket): the harness's, not the model's, so it never joins the reply that
            # follows it, or that reply's restatement would not be the recorded one.
            flush()
            turn.add(item, kind)
            flush()
        elif kind.endswith("_output") and "call_id" in item:
            flush()
            messages.append(Message(role="tool", tool_call_id=item.get("call_id"),
                                    content=_output_content(item.get("output"))))
        else:
            turn.add(item, kind)
        if marks is not None:
            marks.append(len(messages))
    flush()
    if marks:
        marks[-1] = len(messages)
    return messages, tools, logprobs


def _kind(item: dict[str, Any]) -> str:
    """An input item's type; a bare ``{"role", "content"}`` is a message."""
    return item.get("type") or ("message" if "role" in item else "")


def _closes(item: Any) -> bool:
    """Whether ``_items`` has emitted every message of the items up to and including this
    one once it is read (it ends any run of assistant items): where a known prefix of the
    input can stop, since a run's message depends on the items after it."""
    kind = _kind(item)
    return ((kind == "message" and item.get("role") != "assistant") or kind == "configuration_update"
            or (kind.endswith("_output") and "call_id" in item))


def _tools(tool: dict[str, Any], namespace: str | None = None) -> list[Tool]:
    kind = tool.get("type", "function")
    if kind == "function":
        return [Tool(name=tool.get("name", ""), description=tool.get("description"),
                     parameters=tool.get("parameters"), namespace=namespace)]
    if kind == "custom":
        fmt = tool.get("format")
        return [Tool(name=tool.get("name", ""), description=tool.get("description"),
                     parameters={"format": fmt} if fmt else None, type="custom", namespace=namespace)]
    if kind == "namespace":
        name = tool.get("name", "")
        head = Tool(name=name, description=tool.get("description"), type="namespace")
        return [head, *(t for inner in tool.get("tools") or [] for t in _tools(inner, name))]
    rest = {k: v for k, v in tool.items() if k not in ("type", "name")}
    return [Tool(name=tool.get("name") or kind, type=kind, parameters=rest or None, namespace=namespace)]


def _raw_tokens(messages: Any) -> list[int] | None:
    """vLLM's ``input_messages`` / ``output_messages`` as one list of token ids: each a
    ``raw_message_tokens`` with its ``tokens`` (harmony-format messages carry none: None)."""
    if not isinstance(messages, list) or not messages:
        return None
    ids: list[int] = []
    for m in messages:
        tokens = m.get("tokens") if isinstance(m, dict) and m.get("type") == "raw_message_tokens" else None
        if not isinstance(tokens, list):
            return None
        ids += tokens
    return ids


def _usage(raw: dict[str, Any] | None) -> Usage | None:
    if not raw:
        return None
    return Usage(
        input_tokens=raw.get("input_tokens") or 0,
        output_tokens=raw.get("output_tokens") or 0,
        cached_input_tokens=(raw.get("input_tokens_details") or {}).get("cached_tokens") or 0,
        reasoning_tokens=(raw.get("output_tokens_details") or {}).get("reasoning_tokens") or 0,
    )


# --------------------------------------------------------------------------------------
# canonical -> native


def _native_output(response: Response) -> list[dict[str, Any]]:
    """The output items of a canonical response, in the order the model produced them."""
    message = response.message
    rid = (response.id or "resp").removeprefix("resp_")
    items: list[dict[str, Any]] = []
    current: list[dict[str, Any]] | None = None
    logprobs = list(response.logprobs or [])
    refusal = message.refusal

    def open_message() -> list[dict[str, Any]]:
        content: list[dict[str, Any]] = []
        items.append({"id": f"msg_{rid}_{len(items)}", "type": "message", "role": "assistant",
                      "status": "completed", "content": content})
        return content

    def add_refusal() -> None:
        nonlocal current, refusal
        if refusal is not None:
            if current is None:
                current = open_message()
            current.append({"type": "refusal", "refusal": refusal})
            refusal = None

    reasoning_index = 0
    for tag, piece in message.pieces():
        if tag == "reasoning":
            current = None
            item: dict[str, Any] = {"id": f"rs_{rid}_{reasoning_index}", "type": "reasoning",
                                    "summary": [{"type": "summary_text", "text": piece.text}] if piece.text else []}
            reasoning_index += 1
            if piece.encrypted is not None:
                item["encrypted_content"] = piece.encrypted
            items.append(item)
        elif tag == "content" and piece.type == "text":
            if current is None:
                current = open_message()
            current.append({"type": "output_text", "text": piece.text or "",
                            "annotations": (piece.data or {}).get("annotations") or [],
                            "logprobs": [{"token": "", "logprob": v, "bytes": [], "top_logprobs": []}
                                         for v in logprobs]})
            logprobs = []
        elif tag == "content":
            if piece.data is not None:
                current = None
                items.append(dict(piece.data))
        else:
            add_refusal()
            current = None
            if piece.type == "custom":
                item = {"id": f"ctc_{rid}_{len(items)}", "type": "custom_tool_call", "call_id": piece.id,
                        "name": piece.name, "input": piece.arguments, "status": "completed"}
            else:
                item = {"id": f"fc_{rid}_{len(items)}", "type": "function_call", "call_id": piece.id,
                        "name": piece.name, "arguments": piece.arguments, "status": "completed"}
            if piece.namespace is not None:
                item["namespace"] = piece.namespace
            item.update(piece.extra or {})
            items.append(item)
    add_refusal()
    return items


def _native_input(content: str | list[Part], where: str) -> str | list[dict[str, Any]]:
    """User, system and tool-output content as input blocks (what ``_content`` reads)."""
    if isinstance(content, str):
        return content
    blocks: list[dict[str, Any]] = []
    for k, part in enumerate(content):
        extra = dict(part.data or {})
        if part.type == "text":
            blocks.append({"type": "input_text", "text": part.text or "", **extra})
        elif part.type == "image":
            ref = restorable_ref(part, f"{where} part {k}")
            key = "image_url" if ref.startswith(("http://", "https://")) else "file_id"
            blocks.append({"type": "input_image", key: ref, **extra})
        elif part.type == "file":
            ref = restorable_ref(part, f"{where} part {k}")
            key = "file_url" if ref.startswith(("http://", "https://")) else "file_id"
            blocks.append({"type": "input_file", key: ref, **extra})
        else:
            blocks.append(extra)
    return blocks


def _native_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """Tools as a Responses ``tools`` list (what ``_tools`` reads): a namespace's own tools
    inside it."""
    out: list[dict[str, Any]] = []
    spaces: dict[str, dict[str, Any]] = {}
    for t in tools:
        if t.type == "function":
            item: dict[str, Any] = {"type": "function", "name": t.name, "description": t.description,
                                    "parameters": t.parameters}
        elif t.type == "custom":
            item = {"type": "custom", "name": t.name, "description": t.description, **(t.parameters or {})}
        elif t.type == "namespace":
            item = spaces[t.name] = {"type": "namespace", "name": t.name, "description": t.description, "tools": []}
        else:
            item = {"type": t.type, **({"name": t.name} if t.name != t.type else {}), **(t.parameters or {})}
        item = {k: v for k, v in item.items() if v is not None}
        if t.namespace is not None and t.namespace in spaces:
            spaces[t.namespace]["tools"].append(item)
        else:
            out.append(item)
    return out


def _native_request(request: Request) -> dict[str, Any]:
    """A canonical request as a Responses body (``ResponsesDialect.request_body``): a leading
    system message is ``instructions``; a reply is the output items a response would carry,
    as input (without their ids, status and logprobs); a tool result is the output item of
    its call's kind."""
    body: dict[str, Any] = {}
    items: list[dict[str, Any]] = []
    kinds: dict[str, str] = {}  # call id -> the call's type
    for k, m in enumerate(request.messages):
        where = f"message {k} ({m.role})"
        if m.role == "system" and k == 0 and m.name != "developer":
            body["instructions"] = _native_input(m.content, where)
        elif m.role in ("system", "user"):
            role = "user" if m.role == "user" else ("developer" if m.name == "developer" else "system")
            items.append({"type": "message", "role": role, "content": _native_input(m.content, where)})
        elif m.role == "assistant":
            for call in m.tool_calls:
                kinds[call.id] = call.type
            for item in _native_output(Response(message=m)):
                if item.get("type") in ("message", "function_call", "custom_tool_call"):
                    item = {key: v for key, v in item.items() if key not in ("id", "status")}
                if item.get("type") == "message":
                    item["content"] = [{key: v for key, v in c.items() if key != "logprobs"} for c in item["content"]]
                items.append(item)
        else:
            kind = "custom_tool_call_output" if kinds.get(m.tool_call_id or "") == "custom" else "function_call_output"
            items.append({"type": kind, "call_id": m.tool_call_id or "", "output": _native_input(m.content, where)})
    body["input"] = items
    if request.tools:
        body["tools"] = _native_tools(request.tools)
    return body


def _native_usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.input_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_input_tokens},
        "output_tokens": usage.output_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


# -- network policy: what the provider runs, holds or fetches itself -----------------------

_HOSTED_TOOLS = ("web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11",
                 "file_search", "code_interpreter", "image_generation", "mcp")
_FILTERED_SEARCH = ("web_search", "web_search_2025_08_26")


def _hosted_tool(tool: dict[str, Any]) -> str | None:
    kind = tool.get("type")
    return kind if kind in _HOSTED_TOOLS else None


def _tool_name(tool: dict[str, Any]) -> str:
    return str(tool.get("name") or tool.get("server_label") or tool.get("type"))


def _forced_tool(choice: Any) -> str | None:
    if choice == "required":
        return "*"
    if isinstance(choice, dict) and choice.get("type") != "allowed_tools":
        return str(choice.get("name") or choice.get("server_label") or choice.get("type"))
    return None


def _narrow_allowed_tools(body: dict[str, Any], changes: list[Override]) -> None:
    """``tool_choice: {"type": "allowed_tools", "tools": [...]}`` lists tools by type and
    name: the removed ones go from it (all of them: the choice goes)."""
    choice = body.get("tool_choice")
    if not isinstance(choice, dict) or choice.get("type") != "allowed_tools" or not isinstance(choice.get("tools"), list):
        return
    keep = [t for t in choice["tools"] if not (isinstance(t, dict) and _hosted_tool(t))]
    if len(keep) == len(choice["tools"]):
        return
    if keep:
        body["tool_choice"] = {**choice, "tools": keep}
        changes.append(Override("tool_choice.tools", "a removed provider tool", keep))
    else:
        del body["tool_choice"]
        changes.append(Override("tool_choice", "a removed provider tool", None))


def _remote_input(part: Any) -> str | None:
    if not isinstance(part, dict):
        return None
    if part.get("type") == "input_image":
        url = part.get("image_url")
        if part.get("file_id") or (isinstance(url, str) and not url.startswith("data:")):
            return "image URL or file"
    if part.get("type") == "input_file" and (part.get("file_id") or part.get("file_url")):
        return "uploaded or remote file"
    return None


class ResponsesDialect(OpenAIDialect):
    name = "responses"
    model_table = "openai"
    # chatgpt.com: Codex asks it for its model list with the key it holds (the session
    # secret); a host that receives a secret must be intercepted, so it is answered locally.
    hosts = ("api.openai.com", "chatgpt.com")
    key_variables = ("OPENAI_API_KEY", "CODEX_API_KEY")
    # After the instructions; known items are used up to the last that closes a run of
    # assistant items (parse_request), since such a run is one message.
    message_list = "input"
    # Codex CLI's ``client_metadata``: a map whose keys come in another order on every
    # attempt, and over the WebSocket the attempt's start time
    # (``x-codex-ws-stream-request-start-ms``); its resend after a cut is the same request.
    per_attempt = ("client_metadata",)
    # Codex asks chatgpt.com for its model list and its curated plugins at every start, and
    # logs an error for anything else.
    local_answers = {
        ("GET", "/backend-api/codex/models"): {"models": []},
        ("GET", "/backend-api/plugins/export/curated"): {"plugins": []},
    }
    # vLLM's own /v1/responses returns the prompt and the output as token ids when asked
    # (``enable_response_messages``: ``input_messages`` / ``output_messages`` of
    # ``raw_message_tokens``, ResponseRawMessageAndToken in
    # vllm/entrypoints/openai/responses/protocol.py; "if message / tokens diverge, tokens is
    # the source of truth"). Its logprobs cover output text only, so none are asked for.
    tokens = ResponsesTokens
    routes = {
        ("POST", "/v1/responses"): "model",
        # Codex's WebSocket transport: a GET upgrade on the same path, then response.* frames.
        ("GET", "/v1/responses"): "model",
        ("POST", "/v1/responses/input_tokens"): "side",
    }
    #: The frames that end an answer over the WebSocket (the assembler knows them too, but a
    #: warm-up's end must be seen without one).
    terminal_events = frozenset({"response.completed", "response.incomplete", "response.failed", "error"})
    knobs = KNOBS

    def stream_error(self, status: int, message: str, type: str | None = None) -> SSEEvent:
        # The stream's ``error`` event (platform.openai.com, Responses streaming events,
        # "error"): code, message, param, sequence number; nothing else was sent before it.
        err = self.error_body(status, message, type)["error"]
        return SSEEvent(event="error", data=json.dumps({"type": "error", "code": err["type"], "message": message,
                                                        "param": None, "sequence_number": 0}))

    def socket_error(self, status: int, message: str, type: str | None = None) -> dict[str, Any]:
        """An error as the API sends it over the WebSocket: the HTTP error body, typed."""
        return {"type": "error", "status": status, **self.error_body(status, message, type)}

    def request_body(self, request: Request) -> dict[str, Any]:
        return _native_request(request)

    def parse_request(self, body: dict[str, Any], listed: Listed | None = None) -> Request:
        messages: list[Message] = []
        if body.get("instructions"):
            messages.append(Message(role="system", content=_content(body["instructions"])))
        raw = body.get("input")
        items = [{"type": "message", "role": "user", "content": raw}] if isinstance(raw, str) else raw or []
        if listed is not None and (listed.items is not items or len(listed.marks) != listed.known):
            listed = None  # not this input's scan (as Dialect.list_messages)
        k = 0
        marks: list[int] | None = None
        if listed is not None:
            # The known items are used up to the last one that closes a run (``_closes``):
            # a run's one assistant message may go on in the items after it.
            k = listed.known
            while k and not _closes(items[k - 1]):
                k -= 1
            listed.keep(k)
            messages += listed.messages
            marks = []
        converted, more_tools, _ = _items(items[k:], marks)
        if k:  # the known items' tools, as _items would have read them
            more_tools[:0] = [t for item in items[:k] if item.get("type") == "additional_tools"
                              for tool in item.get("tools") or [] for t in _tools(tool)]
        if marks is not None:
            listed.marks += [len(listed.messages) + m for m in marks]
        messages += converted
        tools = [t for tool in body.get("tools") or [] for t in _tools(tool)]
        return Request(
            messages=messages,
            tools=tools + more_tools,
            model=body.get("model"),
            sampling=self.sampling(body),
            stream=bool(body.get("stream")),
            extra={k: v for k, v in body.items() if k not in _REQUEST_KEYS},
        )

    text_block = "input_text"

    def content_slots(self, body: dict[str, Any], chained: bool = False) -> list[Slot | None]:
        # As parse_request reads the body (_items): the instructions (not restated in a chain),
        # a user or system message per message item, a tool message per *_output item, and one
        # assistant message per run of the other items.
        slots: list[Slot | None] = [None] if body.get("instructions") and not chained else []
        raw = body.get("input")
        if isinstance(raw, str):
            return slots + [Slot(("input",))]
        pending = False
        for k, item in enumerate(raw or []):
            kind = _kind(item)
            if (kind == "message" and item.get("role") != "assistant") or (kind.endswith("_output") and "call_id" in item):
                if pending:
                    slots.append(None)
                    pending = False
                system = kind == "message" and item.get("role") in ("system", "developer")
                slots.append(None if system else Slot(("input", k, "content" if kind == "message" else "output")))
            elif kind == "configuration_update":  # a message of its own, after the run it ends
                slots += [None, None] if pending else [None]
                pending = False
            elif kind != "additional_tools":
                pending = True
        return slots + ([None] if pending else [])

    def content_parts(self, blocks: list[Any]) -> list[Part]:
        parts = _output_content(blocks)
        return parts if isinstance(parts, list) else [Part(text=parts)]

    def previous_response(self, body: dict[str, Any]) -> str | None:
        previous = body.get("previous_response_id")
        return previous if isinstance(previous, str) and previous else None

    def chained_request(self, body: dict[str, Any], prefix: list[Message]) -> Request:
        # The instructions of the chain's first request are in the prefix already (at its
        # root); a restatement of them is not a new system message.
        request = self.parse_request({k: v for k, v in body.items() if k != "instructions"})
        return request.model_copy(update={"messages": prefix + request.messages})

    def parse_response(self, body: dict[str, Any]) -> Response:
        if body.get("type") == "error" or ("error" in body and "output" not in body and "status" not in body):
            return Response(error=error_from(body, code_first=True), finish_reason="error")
        messages, _, logprobs = _items([i for i in body.get("output") or []])
        message = next((m for m in messages if m.role == "assistant"), Message(role="assistant"))
        status = body.get("status")
        finish: FinishReason | None = None
        native = status
        error = None
        if status == "completed":
            finish = "tool_calls" if message.tool_calls else "stop"
        elif status == "incomplete":
            native = (body.get("incomplete_details") or {}).get("reason") or status
            finish = _INCOMPLETE.get(native)
        elif status in ("failed", "cancelled"):
            finish = "error"
            error = error_from(body.get("error") or {"code": status, "message": f"response {status}"}, code_first=True)
        prompt_ids, token_ids = _raw_tokens(body.get("input_messages")), _raw_tokens(body.get("output_messages"))
        if token_ids is not None and logprobs is not None and len(logprobs) != len(token_ids):
            logprobs = None  # output text's alone: not aligned with every sampled token
        return Response(
            id=body.get("id"),
            model=body.get("model"),
            message=message,
            finish_reason=finish,
            native_finish_reason=native,
            usage=_usage(body.get("usage")),
            logprobs=logprobs,
            prompt_token_ids=prompt_ids,
            token_ids=token_ids if prompt_ids is not None else None,
            error=error,
        )

    def assembler(self) -> ResponsesAssembler:
        return ResponsesAssembler(self)

    def reconcile(self, body: dict[str, Any], plan: Plan) -> None:
        # A model that does not reason refuses the whole `reasoning` object, summary included.
        reconcile_openai(body, plan, effort=("reasoning",))

    # -- network policy ------------------------------------------------------------------

    def mediate_network(self, body: dict[str, Any], domains: list[str] | None, *,
                        keep_previous: bool = False) -> Mediation:
        """Hosted tools (web search, file search, code interpreter, image generation, remote
        MCP), conversation state the provider holds (``conversation``; a
        ``previous_response_id`` this session did not record), and input the provider
        fetches (an ``input_image`` URL or file, an ``input_file`` by id or URL). Under
        ``restrict`` the ``web_search`` tool keeps ``filters.allowed_domains`` narrowed
        (platform.openai.com: web search, domain filtering; the preview tool has no filter,
        so it goes)."""
        changes: list[Override] = []

        def narrow(tool: dict[str, Any]) -> dict[str, Any] | None:
            if domains is None or tool.get("type") not in _FILTERED_SEARCH:
                return None
            filters = tool.get("filters") if isinstance(tool.get("filters"), dict) else {}
            keep = narrowed(filters.get("allowed_domains"), domains)
            return {**tool, "filters": {**filters, "allowed_domains": keep}} if keep else None

        search_only = mediate_tools(body, changes, kind=_hosted_tool, name=_tool_name, narrow=narrow,
                                    forced=_forced_tool,
            search=lambda t: str(t.get("type")).startswith("web_search"))
        _narrow_allowed_tools(body, changes)
        drop_key(body, "conversation", "provider-held conversation", changes)
        if not keep_previous:
            drop_key(body, "previous_response_id", "provider-held conversation", changes)
        items = body.get("input")
        for i, item in enumerate(items if isinstance(items, list) else []):
            parts = item.get("content") if isinstance(item, dict) else None
            for j, part in enumerate(parts if isinstance(parts, list) else []):
                what = _remote_input(part)
                if what is not None:
                    parts[j] = {"type": "input_text", "text": REMOVED_PART.format(what=f"an {what}")}
                    changes.append(Override(f"input.{i}.content.{j}", what, "input_text"))
        return Mediation(changes, search_only)

    def append_notice(self, body: dict[str, Any], notice: str) -> Override | None:
        if body.get("previous_response_id"):
            return None  # the first user message is in the provider's copy, noticed when it was sent
        items = body.get("input")
        if isinstance(items, str):
            body["input"] = f"{items}\n\n{notice}" if items else notice
            return Override("input", "first user message", notice)
        return notice_first_user(items, "input", notice, lambda: {"type": "input_text", "text": notice})

    def json_body(self, response: Response) -> dict[str, Any]:
        """The non-streamed Response object for a canonical response."""
        status, incomplete = "completed", None
        if response.error is not None or response.finish_reason == "error":
            status = "failed"
        elif response.finish_reason in ("length", "content_filter"):
            status = "incomplete"
            reason = response.native_finish_reason
            if reason not in _INCOMPLETE:
                reason = "max_output_tokens" if response.finish_reason == "length" else "content_filter"
            incomplete = {"reason": reason}
        return {
            "id": response.id or "resp_interceptor",
            "object": "response",
            "created_at": 0,
            "status": status,
            "model": response.model or "",
            "output": _native_output(response),
            "usage": _native_usage(response.usage) if response.usage is not None else None,
            "error": {"code": response.error.type, "message": response.error.message}
            if response.error else None,
            "incomplete_details": incomplete,
            "instructions": None,
            "metadata": {},
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "temperature": None,
            "top_p": None,
        }

    def stream_events(self, response: Response) -> list[SSEEvent]:
        """``response.created`` / ``in_progress``, each output item added, its deltas and
        done events, then the terminal event carrying the whole response."""
        body = self.json_body(response)
        skeleton = {**body, "status": "in_progress", "output": [], "usage": None,
                    "error": None, "incomplete_details": None}
        events: list[dict[str, Any]] = [
            {"type": "response.created", "response": skeleton},
            {"type": "response.in_progress", "response": skeleton},
        ]
        for oi, item in enumerate(body["output"]):
            events += _item_events(oi, item)
        terminal = {"completed": "response.completed", "incomplete": "response.incomplete",
                    "failed": "response.failed"}[body["status"]]
        events.append({"type": terminal, "response": body})
        out = []
        for seq, e in enumerate(events):
            e["sequence_number"] = seq
            out.append(SSEEvent(event=e["type"], data=json.dumps(e, separators=(",", ":"), ensure_ascii=False)))
        return out


def _item_events(oi: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    kind = item.get("type")
    iid = item.get("id")
    if kind == "message":
        added = {**item, "status": "in_progress", "content": []}
    elif kind == "reasoning":
        added = {**item, "summary": []}
    elif kind == "function_call":
        added = {**item, "status": "in_progress", "arguments": ""}
    elif kind == "custom_tool_call":
        added = {**item, "input": ""}
    else:
        added = item
    events: list[dict[str, Any]] = [{"type": "response.output_item.added", "output_index": oi, "item": added}]
    where = {"item_id": iid, "output_index": oi}
    if kind == "message":
        for ci, part in enumerate(item["content"]):
            at = {**where, "content_index": ci}
            if part["type"] == "output_text":
                events.append({"type": "response.content_part.added", **at,
                               "part": {**part, "text": "", "logprobs": []}})
                events.append({"type": "response.output_text.delta", **at, "delta": part["text"],
                               "logprobs": part.get("logprobs") or []})
                events.append({"type": "response.output_text.done", **at, "text": part["text"],
                               "logprobs": part.get("logprobs") or []})
            elif part["type"] == "refusal":
                events.append({"type": "response.content_part.added", **at,
                               "part": {"type": "refusal", "refusal": ""}})
                events.append({"type": "response.refusal.delta", **at, "delta": part["refusal"]})
                events.append({"type": "response.refusal.done", **at, "refusal": part["refusal"]})
            events.append({"type": "response.content_part.done", **at, "part": part})
    elif kind == "reasoning":
        for si, summary in enumerate(item["summary"]):
            at = {**where, "summary_index": si}
            events.append({"type": "response.reasoning_summary_part.added", **at,
                           "part": {"type": "summary_text", "text": ""}})
            events.append({"type": "response.reasoning_summary_text.delta", **at, "delta": summary["text"]})
            events.append({"type": "response.reasoning_summary_text.done", **at, "text": summary["text"]})
            events.append({"type": "response.reasoning_summary_part.done", **at, "part": summary})
    elif kind == "function_call":
        events.append({"type": "response.function_call_arguments.delta", **where, "delta": item["arguments"]})
        events.append({"type": "response.function_call_arguments.done", **where,
                       "arguments": item["arguments"], "name": item["name"]})
    elif kind == "custom_tool_call":
        events.append({"type": "response.custom_tool_call_input.delta", **where, "delta": item["input"]})
        events.append({"type": "response.custom_tool_call_input.done", **where, "input": item["input"]})
    events.append({"type": "response.output_item.done", "output_index": oi, "item": item})
    return events


@dataclass(slots=True)
class _Item:
    """One output item being streamed: deltas are kept per part, joined once at the end."""

    item: dict[str, Any]
    parts: dict[int, dict[str, Any]] = field(default_factory=dict)
    texts: dict[int, list[str]] = field(default_factory=dict)
    logprobs: dict[int, list[Any]] = field(default_factory=dict)
    summaries: dict[int, list[str]] = field(default_factory=dict)
    reasoning: dict[int, list[str]] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    done: dict[str, Any] | None = None

    def native(self) -> dict[str, Any]:
        if self.done is not None:
            return self.done
        item = dict(self.item)
        kind = item.get("type")
        if kind == "message":
            content = []
            for ci in sorted(self.parts.keys() | self.texts.keys()):
                part = dict(self.parts.get(ci) or {"type": "output_text", "text": "", "annotations": []})
                key = "refusal" if part.get("type") == "refusal" else "text"
                part[key] = part.get(key, "") + "".join(self.texts.get(ci, []))
                if ci in self.logprobs:
                    part["logprobs"] = self.logprobs[ci]
                content.append(part)
            item["content"] = content
        elif kind == "reasoning":
            if self.summaries:
                item["summary"] = [{"type": "summary_text", "text": "".join(self.summaries[i])}
                                   for i in sorted(self.summaries)]
            if self.reasoning:
                item["content"] = [{"type": "reasoning_text", "text": "".join(self.reasoning[i])}
                                   for i in sorted(self.reasoning)]
        elif kind == "function_call" and self.args:
            item["arguments"] = item.get("arguments", "") + "".join(self.args)
        elif kind == "custom_tool_call" and self.args:
            item["input"] = item.get("input", "") + "".join(self.args)
        return item


class ResponsesAssembler(NativeAssembler):
    """``response.*`` events -> the Response object -> ``parse_response``. Terminal:
    ``response.completed`` / ``response.incomplete`` / ``response.failed`` / ``error``.
    Works on WebSocket messages too: feed each JSON message as an event's ``data``."""

    terminal = "response.completed"
    shapes = True  # a delta (``_learn``)
    shape_tries = 8  # a shape per item and part: reasoning, text, a call's arguments

    def __init__(self, dialect: ResponsesDialect):
        super().__init__(dialect)
        self.snapshot: dict[str, Any] = {}
        self.final: dict[str, Any] | None = None
        self.items: dict[int, _Item] = {}

    def _learn(self, obj: dict[str, Any], event: SSEEvent, pieces: list[str]) -> None:
        """A delta folded the full way: its shape, holes at its ``delta`` (appended to
        ``pieces`` as ``_delta`` does) and at what changes every event but is not recorded
        (``sequence_number``, OpenAI's ``obfuscation`` padding), for the next deltas of its
        item and part (``quick``). Not one with logprobs, which ``_delta`` records too."""
        if obj.get("logprobs") or not isinstance(obj.get("delta"), str):
            self._tries -= 1
            return
        holes = [(obj, "delta")] + [(obj, key) for key in ("sequence_number", "obfuscation") if key in obj]
        framing = "data: " if event.event is None else f"event: {event.event}\ndata: "
        self.learn(framing, event, obj, holes, pieces.append)

    def _item(self, obj: dict[str, Any]) -> _Item | None:
        return self.items.get(obj.get("output_index", -1))

    def fold(self, obj: dict[str, Any], event: SSEEvent) -> bool:
        kind = obj.get("type") or event.event or ""
        if kind.endswith(".delta"):
            self._delta(kind, obj, event)
        elif kind == "response.output_item.added":
            self.items[obj.get("output_index", len(self.items))] = _Item(dict(obj.get("item") or {}))
        elif kind == "response.output_item.done":
            item = self._item(obj)
            if item is None:
                item = self.items[obj.get("output_index", len(self.items))] = _Item(dict(obj.get("item") or {}))
            item.done = obj.get("item")
        elif kind == "response.content_part.added":
            item = self._item(obj)
            if item is not None:
                item.parts[obj.get("content_index", 0)] = dict(obj.get("part") or {})
        elif kind in TERMINAL:
            self.final = obj.get("response") or {}
            return True
        elif kind == "error":
            return self.fail(error_from(obj, code_first=True))
        elif kind.startswith("response.") and isinstance(obj.get("response"), dict):
            self.snapshot = obj["response"]  # created, in_progress, queued
        return False

    def _delta(self, kind: str, obj: dict[str, Any], event: SSEEvent) -> None:
        item = self._item(obj)
        if item is None:
            return
        delta = obj.get("delta", "")
        if kind in ("response.output_text.delta", "response.refusal.delta"):
            ci = obj.get("content_index", 0)
            pieces = item.texts.setdefault(ci, [])
            if kind == "response.output_text.delta" and obj.get("logprobs"):
                item.logprobs.setdefault(ci, []).extend(obj["logprobs"])
        elif kind in ("response.function_call_arguments.delta", "response.custom_tool_call_input.delta"):
            pieces = item.args
        elif kind == "response.reasoning_summary_text.delta":
            pieces = item.summaries.setdefault(obj.get("summary_index", 0), [])
        elif kind == "response.reasoning_text.delta":
            pieces = item.reasoning.setdefault(obj.get("content_index", 0), [])
        else:
            return
        pieces.append(delta)
        if self._tries:
            self._learn(obj, event, pieces)

    def native(self) -> dict[str, Any]:
        """The Response object the events add up to."""
        body = dict(self.final if self.final is not None else self.snapshot)
        if not body.get("output") and self.items:
            body["output"] = [self.items[i].native() for i in sorted(self.items)]
        return body


RESPONSES = ResponsesDialect()

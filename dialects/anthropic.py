"""Anthropic Messages (``POST /v1/messages``), including thinking, server tools and betas.

As in the other dialects, the stream assembler rebuilds the Message JSON the non-streamed
endpoint would have returned and hands it to ``parse_response``: one mapping, two paths.

Two normalisations make restated history hash equal to the reply it restates:
``cache_control`` is dropped (Claude Code moves it to the newest block every turn), and a
tool call's ``caller`` is kept only when it is not the default ``{"type": "direct"}``.
Canonical ``Usage.input_tokens`` is the whole prompt (Anthropic's ``input_tokens`` plus cache
reads and writes), as OpenAI counts it, with the cached share in ``cached_input_tokens``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from interceptor.dialects.base import Mediation, Override, RouteKind, Slot
from interceptor.dialects.common import (
    REMOVED_PART,
    drop_key,
    mediate_tools,
    narrowed,
    notice_first_user,
    Knob,
    KnobDialect,
    models_route,
    Plan,
    error_from,
    NativeAssembler,
    drop,
    dumps_arguments,
    inline_ref,
    loads_or_raw,
    other_part,
    replace,
    restorable_ref,
    stop_list,
    without,
)
from interceptor.dialects.sse import SSEEvent
from interceptor.trace.prefix import Listed
from interceptor.trace.messages import (
    FinishReason,
    Message,
    Part,
    Piece,
    Reasoning,
    Request,
    Response,
    ResponseError,
    Tool,
    ToolCall,
    Usage,
    piece_order,
)

FINISH: dict[str, FinishReason] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
_NATIVE_FINISH = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                  "content_filter": "refusal", "error": "end_turn"}
_DIRECT = {"type": "direct"}


def _tool_choice(value: Any) -> Any:
    """Canonical ``auto`` / ``required`` / ``none`` in Anthropic's object form."""
    if isinstance(value, str):
        return {"type": {"required": "any"}.get(value, value)}
    return value


KNOBS = (
    Knob("temperature", ("temperature",)),
    Knob("top_p", ("top_p",)),
    Knob("top_k", ("top_k",)),
    Knob("max_tokens", ("max_tokens",), required=True),
    Knob("reasoning_effort", ("output_config", "effort")),
    Knob("thinking", ("thinking",)),
    Knob("stop", ("stop_sequences",), owner="harness", from_native=stop_list),
    Knob("tool_choice", ("tool_choice",), owner="harness", to_native=_tool_choice),
)
_REQUEST_KEYS = {"messages", "system", "tools", "model", "stream", "temperature", "top_p",
                 "top_k", "max_tokens", "thinking", "stop_sequences", "tool_choice"}


# --------------------------------------------------------------------------------------
# native -> canonical


def _source_part(kind: str, block: dict[str, Any]) -> Part:
    source = block.get("source") or {}
    extra = {k: v for k, v in block.items() if k in ("title", "context", "citations") and v}
    stype = source.get("type")
    if stype == "base64":
        return Part(type=kind, ref=inline_ref(source.get("data", "")),
                    media_type=source.get("media_type"), data=extra or None)
    if stype == "url":
        return Part(type=kind, ref=source.get("url"), data=extra or None)
    if stype == "file":
        return Part(type=kind, ref=source.get("file_id"), data=extra or None)
    return other_part(block)


def _text_part(block: dict[str, Any]) -> Part:
    citations = block.get("citations")
    return Part(text=block.get("text", ""), data={"citations": citations} if citations else None)


def _content(content: Any) -> str | list[Part]:
    """User, system and tool-result content: text, images and documents as references."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        kind = block.get("type")
        if kind == "text":
            parts.append(_text_part(block))
        elif kind == "image":
            parts.append(_source_part("image", block))
        elif kind == "document":
            parts.append(_source_part("file", block))
        else:
            parts.append(other_part(block))
    return parts


def _assistant(content: Any) -> Message:
    """An assistant turn from its blocks, shared by requests (restated history) and responses,
    so a reply and its restatement are the same canonical message."""
    if content is None or isinstance(content, str):
        return Message(role="assistant", content=content or "")
    parts: list[Part] = []
    calls: list[ToolCall] = []
    reasoning: list[Reasoning] = []
    tags: list[Piece] = []
    for block in content:
        kind = block.get("type")
        tags.append("reasoning" if kind in ("thinking", "redacted_thinking") else
                    "tool_call" if kind == "tool_use" else "content")
        if kind == "text":
            parts.append(_text_part(block))
        elif kind == "thinking":
            reasoning.append(Reasoning(text=block.get("thinking", ""), signature=block.get("signature")))
        elif kind == "redacted_thinking":
            reasoning.append(Reasoning(encrypted=block.get("data"), redacted=True))
        elif kind == "tool_use":
            caller = block.get("caller")
            calls.append(ToolCall(
                id=block.get("id", ""),
                name=block.get("name", ""),
                arguments=dumps_arguments(block.get("input", {})),
                extra={"caller": caller} if caller and caller != _DIRECT else None,
            ))
        else:  # server_tool_use, web_search_tool_result, mcp_tool_use, ...: kept whole
            parts.append(other_part(block))
    return Message(role="assistant", content=parts or "", tool_calls=calls, reasoning=reasoning,
                   order=piece_order(tags))


def _user(content: Any) -> list[Message]:
    """A user turn: tool results become ``tool`` messages, in place; the rest stays user."""
    if content is None or isinstance(content, str):
        return [Message(role="user", content=content or "")]
    out: list[Message] = []
    run: list[dict[str, Any]] = []
    for block in content:
        if block.get("type") == "tool_result":
            if run:
                out.append(Message(role="user", content=_content(run)))
                run = []
            out.append(Message(role="tool", tool_call_id=block.get("tool_use_id"),
                               content=_content(block.get("content")),
                               is_error=bool(block.get("is_error"))))
        else:
            run.append(block)
    if run or not out:
        out.append(Message(role="user", content=_content(run)))
    return out


def _element(m: dict[str, Any], before: Any = None) -> list[Message]:
    """A ``messages`` element's canonical messages, read on its own (``Dialect.list_messages``)."""
    role = m.get("role")
    if role == "assistant":
        return [_assistant(m.get("content"))]
    if role == "system":
        # Claude Code's mid-conversation `# Environment` block: a system message, as sent.
        return [Message(role="system", content=_content(m.get("content")))]
    return _user(m.get("content"))


def _tool(tool: dict[str, Any]) -> Tool:
    kind = tool.get("type") or "custom"
    if kind == "custom" or "input_schema" in tool:
        return Tool(name=tool.get("name", ""), description=tool.get("description"),
                    parameters=tool.get("input_schema"))
    # Client tools (bash_*, text_editor_*, computer_*) and server tools (web_search_*, ...)
    # are defined by the provider: their type names them, the rest is configuration.
    rest = without(tool, {"type", "name", "cache_control"})
    return Tool(name=tool.get("name") or kind, type=kind, parameters=rest or None)


def _usage(raw: dict[str, Any] | None) -> Usage | None:
    if not raw:
        return None
    cache_read = raw.get("cache_read_input_tokens") or 0
    cache_write = raw.get("cache_creation_input_tokens") or 0
    details = raw.get("output_tokens_details") or {}
    return Usage(
        input_tokens=(raw.get("input_tokens") or 0) + cache_read + cache_write,
        output_tokens=raw.get("output_tokens") or 0,
        cached_input_tokens=cache_read,
        cache_creation_input_tokens=cache_write,
        reasoning_tokens=details.get("thinking_tokens") or 0,
    )


# --------------------------------------------------------------------------------------
# canonical -> native


def _native_blocks(message: Message) -> list[dict[str, Any]]:
    """The blocks of an assistant turn, in the order the model produced them."""
    blocks: list[dict[str, Any]] = []
    for tag, item in message.pieces():
        if tag == "reasoning":
            if item.redacted:
                blocks.append({"type": "redacted_thinking", "data": item.encrypted or ""})
            else:
                blocks.append({"type": "thinking", "thinking": item.text, "signature": item.signature or ""})
        elif tag == "tool_call":
            block = {"type": "tool_use", "id": item.id, "name": item.name, "input": loads_or_raw(item.arguments)}
            block.update(item.extra or {})
            blocks.append(block)
        elif item.type == "text":
            if item.text or not isinstance(message.content, str):
                block = {"type": "text", "text": item.text or ""}
                if item.data and item.data.get("citations"):
                    block["citations"] = item.data["citations"]
                blocks.append(block)
        elif item.data is not None:
            blocks.append(dict(item.data))
    return blocks


def _native_content(content: str | list[Part], where: str) -> str | list[dict[str, Any]]:
    """User, system and tool-result content as blocks (what ``_content`` reads)."""
    if isinstance(content, str):
        return content
    blocks: list[dict[str, Any]] = []
    for k, part in enumerate(content):
        if part.type == "text":
            block: dict[str, Any] = {"type": "text", "text": part.text or ""}
            block.update(part.data or {})
        elif part.type in ("image", "file"):
            ref = restorable_ref(part, f"{where} part {k}")
            source = ({"type": "url", "url": ref} if ref.startswith(("http://", "https://"))
                      else {"type": "file", "file_id": ref})
            block = {"type": "image" if part.type == "image" else "document", "source": source, **(part.data or {})}
        else:
            block = dict(part.data or {})
        blocks.append(block)
    return blocks


def _native_tool(tool: Tool) -> dict[str, Any]:
    if tool.type in ("function", "custom"):
        out: dict[str, Any] = {"name": tool.name, "input_schema": tool.parameters or {"type": "object"}}
        if tool.description is not None:
            out["description"] = tool.description
        return out
    return {"type": tool.type, "name": tool.name, **(tool.parameters or {})}


def _native_request(request: Request) -> dict[str, Any]:
    """A canonical request as a Messages body (``AnthropicDialect.request_body``): a leading
    system message is ``system``; a tool result joins the user turn before it when that turn
    is blocks (as ``_user`` splits one), and user blocks after tool results join them."""
    body: dict[str, Any] = {}
    messages: list[dict[str, Any]] = []
    for k, m in enumerate(request.messages):
        where = f"message {k} ({m.role})"
        last = messages[-1] if messages else None
        if m.role == "system":
            if k == 0:
                body["system"] = _native_content(m.content, where)
            else:
                messages.append({"role": "system", "content": _native_content(m.content, where)})
        elif m.role == "assistant":
            blocks = _native_blocks(m)
            plain = isinstance(m.content, str) and not m.tool_calls and not m.reasoning
            messages.append({"role": "assistant", "content": m.content if plain else blocks})
        elif m.role == "tool":
            block: dict[str, Any] = {"type": "tool_result", "tool_use_id": m.tool_call_id or "",
                                     "content": _native_content(m.content, where)}
            if m.is_error:
                block["is_error"] = True
            if last is not None and last["role"] == "user" and isinstance(last["content"], list):
                last["content"].append(block)
            else:
                messages.append({"role": "user", "content": [block]})
        else:
            content = _native_content(m.content, where)
            after_results = (last is not None and last["role"] == "user" and isinstance(last["content"], list)
                             and last["content"] and last["content"][-1].get("type") == "tool_result")
            if isinstance(content, list) and content and after_results:
                last["content"].extend(content)
            else:
                messages.append({"role": "user", "content": content})
    body["messages"] = messages
    if request.tools:
        body["tools"] = [_native_tool(t) for t in request.tools]
    return body


def _native_usage(usage: Usage | None) -> dict[str, Any]:
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    out = {
        "input_tokens": usage.input_tokens - usage.cached_input_tokens - usage.cache_creation_input_tokens,
        "cache_creation_input_tokens": usage.cache_creation_input_tokens,
        "cache_read_input_tokens": usage.cached_input_tokens,
        "output_tokens": usage.output_tokens,
    }
    if usage.reasoning_tokens:
        out["output_tokens_details"] = {"thinking_tokens": usage.reasoning_tokens}
    return out


def _without_billing_header(system: Any) -> Any:
    """Claude Code opens ``system`` with a text block ``x-anthropic-billing-header: cc_version=…;
    cch=<hash>;`` whose hash changes with every request. Anthropic's API lifts it out for
    billing before the model sees the prompt, so it is no part of the conversation; kept, it
    would make every turn's system message new and every turn a new root of the graph."""
    if isinstance(system, list):
        return [b for b in system if not (isinstance(b, dict) and b.get("type") == "text"
                                           and str(b.get("text", "")).startswith("x-anthropic-billing-header:"))]
    return system


def _thinking_enabled(body: dict[str, Any]) -> bool:
    thinking = body.get("thinking")
    return isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    502: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


_SAMPLING = ("temperature", "top_p", "top_k")
MAX_OUTPUT_TOKENS = 128_000  # the most any Claude model writes (models overview)
MIN_BUDGET = 1024  # thinking.budget_tokens' minimum (extended-thinking guide)
INTERLEAVED_BETA = "interleaved-thinking-"


def _conflicts_with_thinking(key: str, value: Any) -> bool:
    if value is None:
        return False
    if key == "temperature":
        return value != 1
    if key == "top_k":
        return True
    if key == "top_p":
        return isinstance(value, (int, float)) and not 0.95 <= value <= 1
    return isinstance(value, dict) and value.get("type") in ("any", "tool")


def _without_thinking(body: dict[str, Any], changes: list[Override]) -> None:
    """Thinking is off because of the proxy: what only works with it goes too. Anthropic
    answers ``clear_thinking_*`` context edits without thinking with 400 ("strategy requires
    `thinking` to be enabled or adaptive"; context-editing guide, thinking block clearing)."""
    cm = body.get("context_management")
    edits = cm.get("edits") if isinstance(cm, dict) else None
    if not isinstance(edits, list):
        return
    kept = [e for e in edits if not str((e or {}).get("type", "")).startswith("clear_thinking_")]
    if len(kept) == len(edits):
        return
    reason = "thinking is off: Anthropic refuses clear_thinking edits without it"
    rest = {k: v for k, v in cm.items() if k != "edits"}
    if kept or rest:
        replace(body, "context_management", {**rest, **({"edits": kept} if kept else {})}, reason, changes)
    else:
        drop(body, "context_management", reason, changes)


THINKING_BLOCKS = ("thinking", "redacted_thinking")


def _final_turn(messages: list[Any]) -> int:
    """Where the final assistant turn starts: after the last user message that is not the
    tool results of a tool-use loop (a tool-use loop is one assistant turn; a message of
    another role, Claude Code's mid-conversation ``system``, belongs to no turn)."""
    start = len(messages)
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if not isinstance(m, dict):
            break
        content = m.get("content")
        if m.get("role") == "user" and not (isinstance(content, list) and any(
                isinstance(b, dict) and b.get("type") == "tool_result" for b in content)):
            break
        start = i
    return start


def _without_final_turn_thinking(body: dict[str, Any], changes: list[Override]) -> None:
    """Thinking is off because of the proxy, and the harness's history was written with it
    on: the thinking blocks of the final assistant turn go. Anthropic keeps one thinking
    configuration per assistant turn (a tool-use loop is one turn: "Thinking in tool and
    multi-turn workflows", https://platform.claude.com/docs/build-with-claude/thinking-tool-workflows)
    and refuses thinking in an assistant message in the final position with thinking off
    ("messages.1.content.0: When thinking is disabled, an `assistant` message in the final
    position cannot contain `thinking`. To use thinking blocks, enable `thinking` in your
    request.", the live API as reported in https://github.com/tailcallhq/forgecode/issues/1853
    and https://github.com/microsoft/vscode/issues/282326). Earlier turns' blocks stay: the
    API drops those itself ("you do not need to strip the thinking blocks yourself",
    https://platform.claude.com/docs/en/build-with-claude/context-windows). An assistant
    message left with nothing goes whole. Each removed block is one override, keyed by its
    place in the harness's messages; ``old`` names its type only (its text is on the trace's
    request already, its signature is the provider's)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    reason = "thinking is off: Anthropic refuses thinking blocks in the final assistant turn without it"
    out: list[Any] | None = None
    for i in range(_final_turn(messages), len(messages)):
        m = messages[i]
        content = m.get("content") if isinstance(m, dict) and m.get("role") == "assistant" else None
        if not isinstance(content, list):
            continue
        thinking = [j for j, b in enumerate(content) if isinstance(b, dict) and b.get("type") in THINKING_BLOCKS]
        if not thinking:
            continue
        out = out if out is not None else list(messages)
        for j in thinking:
            changes.append(Override(f"messages.{i}.content.{j}", {"type": content[j]["type"]}, None, reason))
        kept = [b for j, b in enumerate(content) if j not in thinking]
        out[i] = {**m, "content": kept} if kept else None
    if out is not None:
        body["messages"] = [m for m in out if m is not None]


def _loop_without_thinking(messages: Any) -> bool:
    """With thinking on, Anthropic refuses a request whose last assistant turn, answered with
    tool results, does not start with a thinking block (extended-thinking guide, "Preserving
    thinking blocks"). Claude Code drops those blocks when the answer came from another model
    than it asked for, which is what a session's model does."""
    if not isinstance(messages, list) or len(messages) < 2:
        return False
    last, before = messages[-1], messages[-2]
    if not (isinstance(last, dict) and isinstance(before, dict) and before.get("role") == "assistant"):
        return False
    content, blocks = last.get("content"), before.get("content")
    results = isinstance(content, list) and any(isinstance(b, dict) and b.get("type") == "tool_result" for b in content)
    if not results or not isinstance(blocks, list) or not blocks or not isinstance(blocks[0], dict):
        return False
    return blocks[0].get("type") not in ("thinking", "redacted_thinking")


def beta_without_interleaved(value: str) -> str:
    """The ``anthropic-beta`` header without the interleaved-thinking beta (it only means
    something with thinking on)."""
    return ",".join(b for b in (v.strip() for v in value.split(",")) if b and not b.startswith(INTERLEAVED_BETA))


# -- network policy: what the API runs or fetches itself ------------------------------------

_PROVIDER_TOOLS = ("web_search_", "web_fetch_", "code_execution_", "mcp_toolset")
_SEARCH_TOOLS = ("web_search_", "web_fetch_")


def _provider_tool(tool: dict[str, Any]) -> str | None:
    kind = str(tool.get("type") or "")
    return kind if kind.startswith(_PROVIDER_TOOLS) else None


def _forced_tool(choice: Any) -> str | None:
    if isinstance(choice, dict):
        if choice.get("type") == "tool":
            return str(choice.get("name"))
        if choice.get("type") == "any":
            return "*"
    return None


def _strip_sources(blocks: list[Any], where: str, changes: list[Override]) -> None:
    """Image and document blocks the API would fetch (a URL source, a Files API file), and
    container uploads, replaced by a text block saying so; tool results too."""
    for j, block in enumerate(blocks):
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        source = block.get("source") if isinstance(block.get("source"), dict) else {}
        if kind in ("image", "document") and source.get("type") in ("url", "file"):
            what = f"{kind} {source['type']} source"
        elif kind == "container_upload":
            what = "container upload"
        else:
            if kind == "tool_result" and isinstance(block.get("content"), list):
                _strip_sources(block["content"], f"{where}.{j}.content", changes)
            continue
        blocks[j] = {"type": "text", "text": REMOVED_PART.format(what=f"a {what}")}
        changes.append(Override(f"{where}.{j}", what, "text"))


class AnthropicDialect(KnobDialect):
    name = "anthropic"
    model_table = "anthropic"
    hosts = ("api.anthropic.com",)
    key_variables = ("ANTHROPIC_API_KEY",)
    known_upstreams = {"anthropic": {"base_url": "https://api.anthropic.com/v1", "api_key_env": "ANTHROPIC_API_KEY"}}
    routes = {
        ("POST", "/v1/messages"): "model",
        ("POST", "/v1/messages/count_tokens"): "side",
    }
    knobs = KNOBS
    # After the system prompt, each element read on its own (_element): a tool result
    # carries its call's id, not its name, so no element depends on another.
    message_list = "messages"

    def route(self, method: str, path: str) -> RouteKind | None:
        return super().route(method, path) or models_route(method, path)

    def auth_headers(self, key: str) -> dict[str, str]:
        return {"x-api-key": key}

    def api_headers(self) -> dict[str, str]:
        # "The anthropic-version header is required" (https://docs.anthropic.com/en/api/versioning).
        return {"anthropic-version": "2023-06-01"}

    def error_body(self, status: int, message: str, type: str | None = None) -> dict[str, Any]:
        return {"type": "error", "error": {"type": type or _ERROR_TYPES.get(status, "api_error"), "message": message}}

    def stream_error(self, status: int, message: str, type: str | None = None) -> SSEEvent:
        # An ``error`` event with the error body (docs.anthropic.com, "Streaming Messages",
        # Error events); the SDK raises the status error it names.
        return SSEEvent(event="error", data=json.dumps(self.error_body(status, message, type)))

    def request_body(self, request: Request) -> dict[str, Any]:
        return _native_request(request)

    def parse_request(self, body: dict[str, Any], listed: Listed | None = None) -> Request:
        messages: list[Message] = []
        system = _without_billing_header(body.get("system"))
        if system:
            messages.append(Message(role="system", content=_content(system)))
        messages += self.list_messages(body.get("messages") or [], listed, _element)
        return Request(
            messages=messages,
            tools=[_tool(t) for t in body.get("tools") or []],
            model=body.get("model"),
            sampling=self.sampling(body),
            stream=bool(body.get("stream")),
            extra={k: v for k, v in body.items() if k not in _REQUEST_KEYS},
        )

    def content_slots(self, body: dict[str, Any], chained: bool = False) -> list[Slot | None]:
        # As parse_request reads the body: the system prompt, then per native message one
        # canonical message, except a user turn, which is one per tool_result block and one per
        # run of other blocks between them (_user).
        slots: list[Slot | None] = [None] if _without_billing_header(body.get("system")) else []
        for i in range(len(body.get("messages") or [])):
            slots += self.element_slots(body, i)
        return slots

    def element_slots(self, body: dict[str, Any], i: int) -> list[Slot | None]:
        m = body["messages"][i]
        content = m.get("content")
        if m.get("role") in ("assistant", "system"):
            return [None]
        if content is None or isinstance(content, str):
            return [Slot(("messages", i, "content"))]
        slots: list[Slot | None] = []
        start = None
        for j, block in enumerate(content):
            if block.get("type") == "tool_result":
                if start is not None:
                    slots.append(Slot(("messages", i, "content"), run=(start, j)))
                    start = None
                slots.append(Slot(("messages", i, "content", j, "content"),
                                  error_path=("messages", i, "content", j, "is_error")))
            elif start is None:
                start = j
        if start is not None:
            slots.append(Slot(("messages", i, "content"), run=(start, len(content))))
        elif not content:
            slots.append(None)  # an empty list: nothing to splice into
        return slots

    def content_parts(self, blocks: list[Any]) -> list[Part]:
        parts = _content(blocks)
        return parts if isinstance(parts, list) else [Part(text=parts)]

    def parse_response(self, body: dict[str, Any]) -> Response:
        if body.get("type") == "error":
            return Response(error=error_from(body), finish_reason="error")
        native = body.get("stop_reason")
        extra = {k: body[k] for k in ("stop_sequence", "stop_details", "container")
                 if body.get(k) is not None}
        return Response(
            id=body.get("id"),
            model=body.get("model"),
            message=_assistant(body.get("content") or []),
            finish_reason=FINISH.get(native) if native else None,
            native_finish_reason=native,
            usage=_usage(body.get("usage")),
            extra=extra,
        )

    def response_error(self, status: int, body: Any) -> ResponseError:
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return error_from(body, status)
        return super().response_error(status, body)

    def assembler(self) -> AnthropicAssembler:
        return AnthropicAssembler(self)

    def reconcile(self, body: dict[str, Any], plan: Plan) -> None:
        """What Anthropic refuses, fixed the least surprising way, following dependencies:
        the model's own rules first (sampling parameters, thinking modes, its output cap), then what thinking
        forbids, then what only works with thinking (its context edits). Where the session's
        key meets the harness's, the session's wins; where the session set both, the provider's
        constraint decides as documented. Nothing the proxy did not touch is changed."""
        caps, changes, model = plan.caps, plan.changes, body.get("model")
        if caps.sampling == "none":
            for key in _SAMPLING:
                if key in body and plan.touched(key):
                    drop(body, key, f"{model} refuses {key} ({caps.source})", changes)
        thinking = body.get("thinking")
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind and not caps.takes_thinking(kind) and plan.touched("thinking"):
            self._thinking_mode(body, plan, kind)
        if _thinking_enabled(body) and plan.touched("thinking") and caps.takes_thinking("disabled") \
                and _loop_without_thinking(body.get("messages")):
            drop(body, "thinking", "thinking is on but the last assistant turn of the tool-use loop has no thinking "
                                   "block (the harness dropped it), which Anthropic refuses: thinking is off for "
                                   "this request", changes)
        cap = caps.max_output or MAX_OUTPUT_TOKENS
        max_tokens = body.get("max_tokens")
        if isinstance(max_tokens, int) and max_tokens > cap and plan.touched("max_tokens"):
            replace(body, "max_tokens", cap, f"{model} writes at most {cap} output tokens ({caps.source})"
                    if caps.max_output else f"Anthropic accepts at most {cap} output tokens", changes)
        if _thinking_enabled(body):
            self._with_thinking(body, plan)
        if (caps.sampling == "exclusive" and body.get("temperature") is not None
                and body.get("top_p") is not None and plan.touched("temperature", "top_p")):
            keep = "top_p" if "top_p" in plan.session and "temperature" not in plan.session else "temperature"
            loser = "temperature" if keep == "top_p" else "top_p"
            drop(body, loser, f"{model} takes temperature or top_p, not both: kept {keep} ({caps.source})", changes)
        if not _thinking_enabled(body) and plan.touched("thinking"):
            _without_thinking(body, changes)
            _without_final_turn_thinking(body, changes)

    def header_changes(self, body: dict[str, Any] | None, overrides: list[Override],
                       headers: Any) -> list[Override]:
        """With thinking turned off by the proxy, the interleaved-thinking beta goes too."""
        beta = headers.get("anthropic-beta", "") if headers is not None else ""
        if body is None or _thinking_enabled(body) or INTERLEAVED_BETA not in beta:
            return []
        if not any(o.key == "thinking" for o in overrides):
            return []
        return [Override("header:anthropic-beta", beta, beta_without_interleaved(beta) or None,
                         "thinking is off: the interleaved-thinking beta only applies with it")]

    def _thinking_mode(self, body: dict[str, Any], plan: Plan, kind: str) -> None:
        """A thinking type the model does not take becomes the nearest one it does."""
        caps, model = plan.caps, body.get("model")
        if kind in ("enabled", "disabled") and caps.takes_thinking("adaptive"):
            replace(body, "thinking", {"type": "adaptive"},
                    f"{model} does not take thinking {kind}: adaptive instead ({caps.source})", plan.changes)
        elif kind == "adaptive" and caps.takes_thinking("enabled"):
            budget = max(MIN_BUDGET, min(body.get("max_tokens", 0) // 2, 16_000))
            replace(body, "thinking", {"type": "enabled", "budget_tokens": budget},
                    f"{model} does not take adaptive thinking: enabled with a budget instead ({caps.source})",
                    plan.changes)

    def _with_thinking(self, body: dict[str, Any], plan: Plan) -> None:
        """Extended thinking refuses temperature (but 1), top_k, top_p outside [0.95, 1], a
        forced tool choice, and a budget that is not below max_tokens (extended-thinking guide,
        "Feature compatibility"). A conflict between the session's key and the harness's
        thinking removes the harness's thinking (then its dependants go too)."""
        changes = plan.changes
        for key in ("temperature", "top_k", "top_p", "tool_choice"):
            if not _conflicts_with_thinking(key, body.get(key)) or not plan.touched(key, "thinking"):
                continue
            if key in plan.session and "thinking" not in plan.session and plan.caps.takes_thinking("disabled"):
                drop(body, "thinking", f"the session sets {key}={body[key]!r}, which Anthropic refuses with "
                                       "thinking: the harness's thinking is removed", changes)
                return
            if key == "temperature":
                drop(body, "temperature", "thinking is enabled: Anthropic accepts only temperature 1", changes)
            elif key == "top_k":
                drop(body, "top_k", "thinking is enabled: Anthropic rejects top_k", changes)
            elif key == "top_p":
                replace(body, "top_p", min(max(body["top_p"], 0.95), 1),
                        "thinking is enabled: Anthropic accepts top_p only in [0.95, 1]", changes)
            else:
                auto = {"type": "auto", **{k: v for k, v in body["tool_choice"].items()
                                           if k == "disable_parallel_tool_use"}}
                replace(body, "tool_choice", auto,
                        "thinking is enabled: Anthropic rejects a forced tool choice", changes)
        budget = body["thinking"].get("budget_tokens")
        max_tokens = body.get("max_tokens")
        if body["thinking"].get("type") != "enabled" or not plan.touched("thinking", "max_tokens"):
            return
        if isinstance(budget, int) and budget < MIN_BUDGET:
            replace(body, "thinking", {**body["thinking"], "budget_tokens": MIN_BUDGET},
                    f"thinking.budget_tokens must be at least {MIN_BUDGET}", changes)
            budget = MIN_BUDGET
        if isinstance(budget, int) and isinstance(max_tokens, int) and budget >= max_tokens:
            # max_tokens counts thinking too; read the requested max as the answer's length.
            cap = plan.caps.max_output or MAX_OUTPUT_TOKENS
            replace(body, "max_tokens", min(budget + max_tokens, cap),
                    "thinking.budget_tokens must be below max_tokens: raised to budget + answer",
                    changes)
            if budget >= body["max_tokens"]:  # the model's cap leaves no room: half of it thinks
                replace(body, "thinking", {**body["thinking"], "budget_tokens": max(MIN_BUDGET, cap // 2)},
                        f"thinking.budget_tokens must be below max_tokens, at most {cap} for {body.get('model')}",
                        changes)

    # -- network policy ------------------------------------------------------------------

    def mediate_network(self, body: dict[str, Any], domains: list[str] | None, *,
                        keep_previous: bool = False) -> Mediation:
        """Server tools (web search, web fetch, code execution, the MCP toolset), the MCP
        connector's ``mcp_servers``, a code execution ``container``, and image/document
        sources the API fetches itself (URL, Files API ``file_id``). Under ``restrict`` web
        search and fetch keep ``allowed_domains`` narrowed and ``allowed_callers: ["direct"]``
        (docs.claude.com: web search and web fetch tools; allowed and blocked domains cannot
        be combined, so the harness's ``blocked_domains`` goes)."""
        changes: list[Override] = []

        def narrow(tool: dict[str, Any]) -> dict[str, Any] | None:
            if domains is None or not str(tool.get("type", "")).startswith(_SEARCH_TOOLS):
                return None
            keep = narrowed(tool.get("allowed_domains"), domains)
            if not keep:
                return None
            new = {k: v for k, v in tool.items() if k != "blocked_domains"}
            new.update(allowed_domains=keep, allowed_callers=["direct"])
            return new

        search_only = mediate_tools(
            body, changes, kind=_provider_tool, name=lambda t: str(t.get("name") or t.get("type")),
            narrow=narrow, forced=_forced_tool,
            search=lambda t: str(t.get("type", "")).startswith(_SEARCH_TOOLS))
        drop_key(body, "mcp_servers", "mcp servers", changes)
        drop_key(body, "container", "code execution container", changes)
        for i, message in enumerate(body.get("messages") or []):
            if isinstance(message, dict) and isinstance(message.get("content"), list):
                _strip_sources(message["content"], f"messages.{i}.content", changes)
        return Mediation(changes, search_only)

    def append_notice(self, body: dict[str, Any], notice: str) -> Override | None:
        return notice_first_user(body.get("messages"), "messages", notice, lambda: {"type": "text", "text": notice})

    def json_body(self, response: Response) -> dict[str, Any]:
        """The non-streamed Message for a canonical response."""
        native = response.native_finish_reason or (
            _NATIVE_FINISH.get(response.finish_reason) if response.finish_reason else None)
        body: dict[str, Any] = {
            "id": response.id or "msg_interceptor",
            "type": "message",
            "role": "assistant",
            "model": response.model or "",
            "content": _native_blocks(response.message),
            "stop_reason": native,
            "stop_sequence": response.extra.get("stop_sequence"),
            "usage": _native_usage(response.usage),
        }
        for key in ("stop_details", "container"):
            if key in response.extra:
                body[key] = response.extra[key]
        return body

    def stream_events(self, response: Response) -> list[SSEEvent]:
        """The stream Anthropic would send: ``message_start``, one start/delta(s)/stop per
        block (thinking with its ``signature_delta``, tool input as ``input_json_delta``),
        ``message_delta`` with the stop reason and final usage, ``message_stop``."""
        body = self.json_body(response)
        usage = body["usage"]
        start = {**body, "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {**usage, "output_tokens": 0}}
        start.pop("stop_details", None)
        start.pop("container", None)
        events = [("message_start", {"type": "message_start", "message": start})]

        def delta(i: int, d: dict[str, Any]) -> None:
            events.append(("content_block_delta", {"type": "content_block_delta", "index": i, "delta": d}))

        for i, block in enumerate(body["content"]):
            kind = block["type"]
            if kind == "text":
                skeleton: dict[str, Any] = {"type": "text", "text": ""}
            elif kind == "thinking":
                skeleton = {"type": "thinking", "thinking": "", "signature": ""}
            elif kind == "tool_use":
                skeleton = {**block, "input": {}}
            else:
                skeleton = block
            events.append(("content_block_start",
                           {"type": "content_block_start", "index": i, "content_block": skeleton}))
            if kind == "text":
                if block["text"]:
                    delta(i, {"type": "text_delta", "text": block["text"]})
                for citation in block.get("citations") or []:
                    delta(i, {"type": "citations_delta", "citation": citation})
            elif kind == "thinking":
                if block["thinking"]:
                    delta(i, {"type": "thinking_delta", "thinking": block["thinking"]})
                delta(i, {"type": "signature_delta", "signature": block["signature"]})
            elif kind == "tool_use":
                delta(i, {"type": "input_json_delta", "partial_json": dumps_arguments(block["input"])})
            events.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
        message_delta: dict[str, Any] = {"stop_reason": body["stop_reason"],
                                         "stop_sequence": body["stop_sequence"]}
        for key in ("stop_details", "container"):
            if key in body:
                message_delta[key] = body[key]
        events.append(("message_delta", {"type": "message_delta", "delta": message_delta, "usage": usage}))
        events.append(("message_stop", {"type": "message_stop"}))
        return [SSEEvent(event=name, data=json.dumps(data, separators=(",", ":"), ensure_ascii=False))
                for name, data in events]


@dataclass(slots=True)
class _Block:
    block: dict[str, Any]
    text: list[str] = field(default_factory=list)
    json: list[str] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    citations: list[Any] = field(default_factory=list)
    signature: str | None = None

    def native(self) -> dict[str, Any]:
        block = dict(self.block)
        kind = block.get("type")
        if self.text and kind == "text":
            block["text"] = block.get("text", "") + "".join(self.text)
        if self.citations and kind == "text":
            block["citations"] = list(block.get("citations") or []) + self.citations
        if self.thinking and kind == "thinking":
            block["thinking"] = block.get("thinking", "") + "".join(self.thinking)
        if self.signature is not None and kind == "thinking":
            block["signature"] = self.signature
        if self.json and "input" in block:
            block["input"] = loads_or_raw("".join(self.json))
        return block


class AnthropicAssembler(NativeAssembler):
    """Events -> the Message JSON -> ``parse_response``. Terminal: ``message_stop`` or
    ``error`` (Anthropic sends ``event: error`` after a 200 when it is overloaded mid-way)."""

    terminal = "message_stop"
    shapes = True  # a block's delta (``_learn``)
    shape_tries = 8  # a shape per block: thinking, text, tool input, each learned again

    def __init__(self, dialect: AnthropicDialect):
        super().__init__(dialect)
        self.message: dict[str, Any] | None = None
        self.blocks: dict[int, _Block] = {}

    def _learn(self, obj: dict[str, Any], delta: dict[str, Any], key: str, pieces: list[str], event: SSEEvent) -> None:
        """A delta folded the full way: its shape, the string at ``key`` its hole, for the
        next deltas of its block (``quick`` appends them to ``pieces`` as ``fold`` does)."""
        if not isinstance(delta.get(key), str):
            self._tries -= 1
            return
        framing = "data: " if event.event is None else f"event: {event.event}\ndata: "
        self.learn(framing, event, obj, [(delta, key)], pieces.append)

    def fold(self, obj: dict[str, Any], event: SSEEvent) -> bool:
        kind = obj.get("type") or event.event
        if kind == "content_block_delta":
            block = self.blocks.get(obj.get("index", 0))
            d = obj.get("delta") or {}
            if block is not None:
                dtype = d.get("type")
                if dtype == "text_delta":
                    block.text.append(d.get("text", ""))
                    if self._tries:
                        self._learn(obj, d, "text", block.text, event)
                elif dtype == "input_json_delta":
                    block.json.append(d.get("partial_json", ""))
                    if self._tries:
                        self._learn(obj, d, "partial_json", block.json, event)
                elif dtype == "thinking_delta":
                    block.thinking.append(d.get("thinking", ""))
                    if self._tries:
                        self._learn(obj, d, "thinking", block.thinking, event)
                elif dtype == "signature_delta":
                    block.signature = d.get("signature", "")
                elif dtype == "citations_delta":
                    block.citations.append(d.get("citation"))
        elif kind == "content_block_start":
            self.blocks[obj.get("index", len(self.blocks))] = _Block(dict(obj.get("content_block") or {}))
        elif kind == "message_start":
            self.message = dict(obj.get("message") or {})
            self.message["usage"] = dict(self.message.get("usage") or {})
        elif kind == "message_delta":
            self._message_delta(obj)
        elif kind == "message_stop":
            return True
        elif kind == "error":
            return self.fail(error_from(obj))
        return False

    def _message_delta(self, obj: dict[str, Any]) -> None:
        if self.message is None:
            self.message = {"usage": {}}
        d = obj.get("delta") or {}
        for key in ("stop_reason", "stop_sequence", "stop_details"):
            if key in d:
                self.message[key] = d[key]
        if d.get("container") is not None:
            self.message["container"] = d["container"]
        # message_delta usage is cumulative: present counts replace, absent ones stand.
        for key, value in (obj.get("usage") or {}).items():
            if value is not None:
                self.message["usage"][key] = value

    def native(self) -> dict[str, Any]:
        """The Message the events add up to (what the JSON endpoint would have sent)."""
        message = dict(self.message or {})
        message["content"] = [self.blocks[i].native() for i in sorted(self.blocks)]
        return message


ANTHROPIC = AnthropicDialect()

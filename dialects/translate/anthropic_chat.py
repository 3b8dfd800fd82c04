"""Anthropic Messages (the harness: Claude Code, the anthropic SDK) on a Chat Completions
upstream (vLLM, SGLang, any OpenAI-compatible server).

Requests go Messages -> Chat, answers Chat -> Messages. The mapping, both ways:

- ``system`` (string or text blocks) -> a leading ``system`` message; ``role: "system"``
  messages inside ``messages`` (Claude Code's) stay system messages where they are. Claude
  Code's per-request billing header block is lifted out, as Anthropic's API does before the
  model sees the prompt (``anthropic._without_billing_header``), and recorded.
- text, base64/URL images (as ``image_url``, base64 as a ``data:`` URL), base64 PDFs (as a
  ``file`` part); ``tool_result`` blocks -> ``tool`` messages (text only: Chat tool messages
  take no images), ``tool_use`` -> ``tool_calls`` with the same ids, both ways, unchanged.
- ``thinking`` blocks -> ``reasoning_content`` (what vLLM's chat templates read back);
  ``reasoning_content`` / ``reasoning`` -> a ``thinking`` block with an empty signature (a
  Chat upstream signs nothing; a signature from elsewhere is dropped and recorded).
- tools (custom, JSON schema) -> functions; ``tool_choice`` auto/any/tool/none -> auto/
  required/function/none, ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``.
- ``max_tokens`` -> ``max_completion_tokens``, ``stop_sequences`` -> ``stop``,
  ``temperature``/``top_p``/``top_k`` as they are, ``output_config.effort`` low/medium/high ->
  ``reasoning_effort``; a stream asks for ``stream_options.include_usage`` (the usage
  Anthropic's ``message_delta`` carries).
- finish reasons: stop -> ``end_turn`` (``stop_sequence`` when vLLM's ``stop_reason`` names
  one of the request's stop strings), length -> ``max_tokens``, tool_calls -> ``tool_use``,
  content_filter -> ``refusal``; usage: prompt tokens minus cached -> ``input_tokens``,
  cached -> ``cache_read_input_tokens``, completion -> ``output_tokens``.
- errors: the upstream's status stays, its message goes into Anthropic's error shape with
  the type Anthropic gives that status (``rate_limit_error`` for 429, ...).

Everything else of the request (provider tools such as ``web_search_*``, ``thinking`` and its
budget, ``context_management``, ``metadata``, redacted thinking, ``is_error`` on a tool
result, images in a tool result, interleaved block order) has no Chat equivalent and is
recorded as an override with reason ``translation``; the README lists them.
"""

from __future__ import annotations

from typing import Any

from interceptor.dialects.anthropic import ANTHROPIC, _without_billing_header
from interceptor.dialects.base import Override
from interceptor.dialects.chat import CHAT
from interceptor.dialects.common import dumps_arguments, first, loads_or_raw
from interceptor.dialects.sse import SSEEvent
from interceptor.dialects.translate.base import (
    ChatEvents, Lost, Translation, chat_content, chat_request, chat_usage, content_text, first_choice, sse,
)

_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use",
         "content_filter": "refusal"}
_EFFORT = {"low": "low", "medium": "medium", "high": "high"}
# Request keys carried over by name or by their own rule below; any other key is recorded.
_SAME = ("model", "temperature", "top_p", "top_k")
_HANDLED = {"messages", "system", "tools", "tool_choice", "max_tokens", "stop_sequences", "stream",
            "output_config", *_SAME}


_TOOL_KEYS = {"type", "name", "description", "input_schema", "strict", "cache_control"}


# --------------------------------------------------------------------------------------
# request: Messages -> Chat


def _source_url(block: dict[str, Any]) -> str | None:
    source = block.get("source") or {}
    if source.get("type") == "base64":
        return f"data:{source.get('media_type') or ''};base64,{source.get('data', '')}"
    if source.get("type") == "url":
        return source.get("url")
    return None


def _part(block: dict[str, Any], where: str, lost: Lost) -> dict[str, Any] | None:
    """One user/system content block as a Chat content part, or None (recorded)."""
    kind = block.get("type")
    if kind == "text":
        return {"type": "text", "text": block.get("text", "")}
    url = _source_url(block)
    if kind == "image" and url:
        return {"type": "image_url", "image_url": {"url": url}}
    if kind == "document" and url and url.startswith("data:"):
        file: dict[str, Any] = {"file_data": url}
        if block.get("title"):
            file["filename"] = block["title"]
        return {"type": "file", "file": file}
    lost(where, block)
    return None


_TEXT = frozenset({"text"})


def _content(content: Any, where: str, lost: Lost, *, text_only: bool = False) -> str | list[dict[str, Any]]:
    return chat_content(content, where, lost, _part, text_only=_TEXT if text_only else None)


def _user(content: Any, i: int, lost: Lost) -> list[dict[str, Any]]:
    """A user turn: its tool results as ``tool`` messages, in place, the rest a user message."""
    if content is None or isinstance(content, str):
        return [{"role": "user", "content": content or ""}]
    out: list[dict[str, Any]] = []
    run: list[dict[str, Any]] | None = None  # the parts of the user message being built
    where = f"messages[{i}].content"
    for j, block in enumerate(content):
        if block.get("type") != "tool_result":
            if run is None:
                run = []
                out.append({"role": "user", "content": run})
            part = _part(block, f"{where}[{j}]", lost)
            if part is not None:
                run.append(part)
            continue
        run = None
        if block.get("is_error"):
            lost(f"{where}[{j}].is_error", True)
        out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                    "content": _content(block.get("content"), f"{where}[{j}].content", lost, text_only=True)})
    return out or [{"role": "user", "content": ""}]


def _assistant(content: Any, i: int, lost: Lost) -> dict[str, Any]:
    if content is None or isinstance(content, str):
        return {"role": "assistant", "content": content or ""}
    texts: list[dict[str, Any]] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    tags: list[str] = []
    for j, block in enumerate(content):
        kind = block.get("type")
        where = f"messages[{i}].content[{j}]"
        if kind == "text":
            texts.append({"type": "text", "text": block.get("text", "")})
            tags.append("content")
        elif kind == "thinking":
            thoughts.append(block.get("thinking", ""))
            tags.append("reasoning")
            if block.get("signature"):
                lost(f"{where}.signature", block["signature"])
        elif kind == "tool_use":
            calls.append({"id": block.get("id", ""), "type": "function",
                          "function": {"name": block.get("name", ""),
                                       "arguments": dumps_arguments(block.get("input", {}))}})
            tags.append("tool_call")
        else:  # redacted_thinking, server_tool_use, web_search_tool_result, ...
            lost(where, block)
    rank = {"reasoning": 0, "content": 1, "tool_call": 2}
    if any(rank[a] > rank[b] for a, b in zip(tags, tags[1:])) or len(thoughts) > 1:
        # Chat has one reasoning string and one content per message: the order the model
        # produced (think, call, think, call) is not expressible.
        lost(f"messages[{i}].content.order", tags)
    message: dict[str, Any] = {"role": "assistant"}
    if len(texts) == 1:
        message["content"] = texts[0]["text"]
    else:
        message["content"] = texts or None
    if thoughts:
        message["reasoning_content"] = "".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


def _messages(body: dict[str, Any], lost: Lost) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = body.get("system")
    kept = _without_billing_header(system)
    if isinstance(system, list) and len(kept) != len(system):
        lost("system.billing_header", [b for b in system if b not in kept])
    if kept:
        out.append({"role": "system", "content": _content(kept, "system", lost)})
    for i, m in enumerate(body.get("messages") or []):
        role = m.get("role")
        if role == "assistant":
            out.append(_assistant(m.get("content"), i, lost))
        elif role == "system":
            out.append({"role": "system", "content": _content(m.get("content"), f"messages[{i}].content", lost)})
        else:
            out.extend(_user(m.get("content"), i, lost))
    return out


def _tools(tools: list[dict[str, Any]], lost: Lost) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        if (tool.get("type") or "custom") == "custom" or "input_schema" in tool:
            fn: dict[str, Any] = {"name": tool.get("name", ""), "parameters": tool.get("input_schema") or {}}
            if tool.get("description") is not None:
                fn["description"] = tool["description"]
            if tool.get("strict") is not None:
                fn["strict"] = tool["strict"]
            out.append({"type": "function", "function": fn})
            for key in [k for k in tool if k not in _TOOL_KEYS]:  # allowed_callers, input_examples, defer_loading, ...
                lost(f"tools[{i}].{key}", tool[key])
        else:  # bash_*, text_editor_*, web_search_*: defined by Anthropic, not describable here
            lost(f"tools[{i}]", tool)
    return out


def _tool_choice(choice: Any, out: dict[str, Any], lost: Lost) -> None:
    if not isinstance(choice, dict):
        lost("tool_choice", choice)
        return
    kind = choice.get("type")
    if kind == "auto":
        out["tool_choice"] = "auto"
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "none":
        out["tool_choice"] = "none"
    elif kind == "tool":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name", "")}}
    else:
        lost("tool_choice", choice)
        return
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False


# --------------------------------------------------------------------------------------
# answers: Chat -> Messages


def _usage(raw: dict[str, Any] | None) -> dict[str, Any]:
    prompt, cached, completion, thinking = chat_usage(raw)
    usage: dict[str, Any] = {"input_tokens": max(0, prompt - cached), "cache_creation_input_tokens": 0,
                             "cache_read_input_tokens": cached, "output_tokens": completion}
    if thinking:
        usage["output_tokens_details"] = {"thinking_tokens": thinking}
    return usage


def _stop(finish: str | None, stop_reason: Any, refused: bool = False) -> tuple[str | None, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence``. vLLM names the stop string that
    ended the answer in the choice's ``stop_reason`` (an int there is a stop token id); a
    Chat refusal (its ``refusal`` text) is Anthropic's ``refusal`` stop, its text the answer."""
    if finish == "stop" and isinstance(stop_reason, str) and stop_reason:
        return "stop_sequence", stop_reason
    if finish == "stop" and refused:
        return "refusal", None
    if finish is None:
        return None, None
    return _STOP.get(finish, "end_turn"), None


def _input(arguments: str) -> Any:
    """Tool input as Anthropic sends it: the parsed object (text that does not parse stays
    text, as a cut call does in the Messages dialect)."""
    return loads_or_raw(arguments or "")


class ChatToMessages(ChatEvents):
    """Chat chunks -> Messages events, as they arrive. One block is open at a time: reasoning
    deltas open a ``thinking`` block, content a ``text`` block, each tool-call index a
    ``tool_use`` block; a change of kind closes the open one. ``[DONE]`` sends the final
    ``message_delta`` (stop reason, the usage chunk's counts) and ``message_stop``. Each event
    costs O(event)."""

    def __init__(self) -> None:
        super().__init__()
        self.index = -1  # the open block's index
        self.open: str | tuple[str, int] | None = None  # "thinking" | "text" | ("tool", call index)
        self.stop_reason: Any = None
        self.refused = False

    def start(self, chunk: dict[str, Any], out: list[SSEEvent]) -> None:
        out.append(sse("message_start", {"type": "message_start", "message": {
            "id": chunk.get("id") or "msg_interceptor", "type": "message", "role": "assistant",
            "model": chunk.get("model") or "", "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                      "output_tokens": 0}}}))

    def fail(self, error: dict[str, Any], out: list[SSEEvent]) -> None:
        out.append(sse("error", ANTHROPIC.error_body(500, str(error.get("message") or ""), "api_error")))

    def finish(self, choice: dict[str, Any], out: list[SSEEvent]) -> None:
        self.stop_reason = choice.get("stop_reason")
        self._close(out)

    def delta(self, delta: dict[str, Any], out: list[SSEEvent]) -> None:
        thought = first(delta.get("reasoning_content"), delta.get("reasoning"))
        if isinstance(thought, str) and thought:
            self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""}, out)
            out.append(self._block_delta({"type": "thinking_delta", "thinking": thought}))
        text = content_text(delta.get("content")) + (delta.get("refusal") or "")
        self.refused = self.refused or bool(delta.get("refusal"))
        if text:
            self._open("text", {"type": "text", "text": ""}, out)
            out.append(self._block_delta({"type": "text_delta", "text": text}))
        for frag in delta.get("tool_calls") or ():
            key = ("tool", frag.get("index", 0))
            fn = frag.get("function") or {}
            if self.open != key:
                self._open(key, {"type": "tool_use", "id": frag.get("id") or "", "name": fn.get("name") or "",
                                 "input": {}}, out)
            if fn.get("arguments"):
                out.append(self._block_delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))

    def _open(self, kind: str | tuple[str, int], block: dict[str, Any], out: list[SSEEvent]) -> None:
        if self.open == kind:
            return
        self._close(out)
        self.index += 1
        self.open = kind
        out.append(sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block}))

    def _block_delta(self, delta: dict[str, Any]) -> SSEEvent:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def _close(self, out: list[SSEEvent]) -> None:
        if self.open is None:
            return
        if self.open == "thinking":
            out.append(self._block_delta({"type": "signature_delta", "signature": ""}))
        out.append(sse("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.open = None

    def end(self, out: list[SSEEvent]) -> None:
        self._close(out)
        stop_reason, stop_sequence = _stop(self.finish_reason, self.stop_reason, self.refused)
        out.append(sse("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                         "usage": _usage(self.usage)}))
        out.append(sse("message_stop", {"type": "message_stop"}))


class MessagesOnChat(Translation):
    source = ANTHROPIC
    target = CHAT
    path = "/v1/chat/completions"
    source_headers = ("anthropic-version", "anthropic-beta", "anthropic-dangerous-direct-browser-access")

    def request(self, body: dict[str, Any]) -> tuple[dict[str, Any], list[Override]]:
        lost = Lost()
        out: dict[str, Any] = {k: body[k] for k in _SAME if k in body}
        out["messages"] = _messages(body, lost)
        if body.get("tools"):
            out["tools"] = _tools(body["tools"], lost)
            if not out["tools"]:
                del out["tools"]
        if "tool_choice" in body:
            _tool_choice(body["tool_choice"], out, lost)
        if body.get("max_tokens") is not None:
            out["max_completion_tokens"] = body["max_tokens"]
        if body.get("stop_sequences"):
            out["stop"] = list(body["stop_sequences"])
        config = body.get("output_config")
        if isinstance(config, dict):
            for key, value in config.items():
                if key == "effort" and value in _EFFORT:
                    out["reasoning_effort"] = _EFFORT[value]
                else:
                    lost(f"output_config.{key}", value)
        elif config is not None:
            lost("output_config", config)
        return chat_request(body, out, lost, _HANDLED)

    def response(self, body: dict[str, Any]) -> dict[str, Any]:
        choice, msg = first_choice(body)
        content: list[dict[str, Any]] = []
        thought = first(msg.get("reasoning_content"), msg.get("reasoning"))
        if isinstance(thought, str) and thought:
            content.append({"type": "thinking", "thinking": thought, "signature": ""})
        text = content_text(msg.get("content")) + (msg.get("refusal") or "")
        if text:
            content.append({"type": "text", "text": text})
        for call in msg.get("tool_calls") or ():
            fn = call.get("function") or {}
            content.append({"type": "tool_use", "id": call.get("id") or "", "name": fn.get("name") or "",
                            "input": _input(fn.get("arguments") or "")})
        stop_reason, stop_sequence = _stop(choice.get("finish_reason"), choice.get("stop_reason"),
                                           bool(msg.get("refusal")))
        return {"id": body.get("id") or "msg_interceptor", "type": "message", "role": "assistant",
                "model": body.get("model") or "", "content": content, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": _usage(body.get("usage"))}

    def events(self) -> ChatToMessages:
        return ChatToMessages()



ANTHROPIC_CHAT = MessagesOnChat()

"""OpenAI Responses (the harness: the openai SDK's ``responses``, Codex over HTTP) on a Chat
Completions upstream (vLLM, SGLang).

Requests go Responses -> Chat, answers Chat -> Responses:

- ``instructions`` -> a leading ``system`` message; ``system`` and ``developer`` input
  messages -> ``system`` messages (vLLM's chat templates know no ``developer``); user content
  ``input_text`` / ``input_image`` (URL or ``data:``) / ``input_file`` with ``file_data``.
- consecutive assistant-side items (``reasoning``, assistant ``message``, ``function_call``,
  ``custom_tool_call``) -> one assistant message: reasoning summaries (or reasoning text)
  joined as ``reasoning_content``, output text as content, calls as ``tool_calls`` with
  ``call_id`` as their id; ``function_call_output`` / ``custom_tool_call_output`` -> ``tool``
  messages with the same id; Codex's ``additional_tools`` item -> tools.
- tools: ``function`` -> functions; ``custom`` (freeform, Codex's ``exec`` and ``apply_patch``)
  -> a function taking ``{"input": string}`` (vLLM and SGLang serve function tools only), its
  calls back as ``custom_tool_call`` items (the input, decoded, sent whole when the call
  ends: a JSON string cannot be decoded while it streams); ``tool_choice``,
  ``parallel_tool_calls`` as they are (a named function in Chat's shape);
  ``max_output_tokens`` -> ``max_completion_tokens``; ``reasoning.effort`` ->
  ``reasoning_effort``; ``text.format`` -> ``response_format``; ``text.verbosity`` ->
  ``verbosity``; a stream asks for ``stream_options.include_usage``.
- ``previous_response_id``: the proxy resolves the chain (Chat has none): the recorded
  conversation up to that answer is rendered in front of the new input (``prefix``).
- answers: ``reasoning_content`` -> a ``reasoning`` item with one summary text, content -> an
  assistant ``message`` item with ``output_text`` (a refusal as a ``refusal`` part), each tool
  call a ``function_call`` (or ``custom_tool_call``) item, streamed with Responses' own events
  and ending in ``response.completed`` (``response.incomplete`` with ``max_output_tokens`` or
  ``content_filter`` for Chat's ``length`` / ``content_filter``); usage with cached and
  reasoning tokens; errors keep OpenAI's shape, which both APIs share.

Namespaces (Codex's ``functions``, ``clock``, ...) are flattened: ``functions``' tools keep
their names, another's are ``<namespace>__<name>``, and a call of one comes back with its
namespace. Not expressible in Chat, dropped and recorded (reason ``translation``):
``encrypted_content`` of reasoning items, built-in tools (``web_search``, ``file_search``,
``computer_use``, MCP) and their call items, ``include``, ``store``, ``truncation``, ``metadata``,
``prompt_cache_key``, ``reasoning.summary``, ``top_logprobs`` and any other key not listed.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from interceptor.dialects.base import Override
from interceptor.dialects.chat import CHAT
from interceptor.dialects.common import first
from interceptor.dialects.responses import RESPONSES
from interceptor.dialects.sse import SSEEvent
from interceptor.dialects.translate.base import (
    ChatEvents, Lost, Translation, chat_content, chat_messages, chat_request, chat_usage, content_text, first_choice,
    sse,
)
from interceptor.trace.messages import Message, Request

_SAME = ("model", "temperature", "top_p", "parallel_tool_calls")
_HANDLED = {"input", "instructions", "tools", "tool_choice", "max_output_tokens", "reasoning", "text", "stream",
            "previous_response_id", *_SAME}
_ASSISTANT_SIDE = ("reasoning", "function_call", "custom_tool_call")


# --------------------------------------------------------------------------------------
# request: Responses -> Chat


def _part(block: dict[str, Any], where: str, lost: Lost) -> dict[str, Any] | None:
    kind = block.get("type")
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": block.get("text", "")}
    if kind == "input_image" and block.get("image_url"):
        image: dict[str, Any] = {"url": block["image_url"]}
        if block.get("detail"):
            image["detail"] = block["detail"]
        return {"type": "image_url", "image_url": image}
    if kind == "input_file" and block.get("file_data"):
        file: dict[str, Any] = {"file_data": block["file_data"]}
        if block.get("filename"):
            file["filename"] = block["filename"]
        return {"type": "file", "file": file}
    lost(where, block)
    return None


_TEXT = frozenset({"input_text", "output_text", "text"})


def _content(content: Any, where: str, lost: Lost, *, text_only: bool = False) -> str | list[dict[str, Any]]:
    return chat_content(content, where, lost, _part, text_only=_TEXT if text_only else None)


class _Assistant:
    """Assistant-side items gathered into one Chat assistant message."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.thoughts: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.refusal: list[str] = []

    def add(self, item: dict[str, Any], kind: str, where: str, lost: Lost) -> None:
        if kind == "reasoning":
            raw = item.get("content") or []
            texts = [c.get("text", "") for c in raw] or [s.get("text", "") for s in item.get("summary") or []]
            self.thoughts.append("\n\n".join(texts))
            if item.get("encrypted_content"):
                lost(f"{where}.encrypted_content", item["encrypted_content"])
        elif kind == "function_call":
            self.calls.append({"id": item.get("call_id") or "", "type": "function",
                               "function": {"name": chat_name(item.get("namespace"), item.get("name", "")),
                                            "arguments": item.get("arguments", "")}})
        elif kind == "custom_tool_call":  # a freeform tool is a function of one string here (``_tool``)
            self.calls.append({"id": item.get("call_id") or "", "type": "function",
                               "function": {"name": chat_name(item.get("namespace"), item.get("name", "")),
                                            "arguments": json.dumps({"input": item.get("input", "")})}})
        else:  # an assistant message
            content = item.get("content")
            if isinstance(content, str):
                self.texts.append(content)
                return
            for j, block in enumerate(content or []):
                if block.get("type") == "refusal":
                    self.refusal.append(block.get("refusal", ""))
                elif block.get("type") in ("output_text", "input_text", "text"):
                    self.texts.append(block.get("text", ""))
                else:
                    lost(f"{where}.content[{j}]", block)

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.texts) if self.texts else None}
        if self.refusal:
            message["refusal"] = "".join(self.refusal)
        thought = "\n\n".join(t for t in self.thoughts if t)
        if thought:
            message["reasoning_content"] = thought
        if self.calls:
            message["tool_calls"] = self.calls
        return message


def chat_name(namespace: str | None, name: str) -> str:
    """A namespaced tool's function name in Chat, which has no namespaces: Codex's default
    namespace ``functions`` is left out (its tools are called by their own names)."""
    return name if namespace in (None, "functions") else f"{namespace}__{name}"


def _tools(tool: dict[str, Any], where: str, lost: Lost, namespace: str | None = None) -> list[dict[str, Any]]:
    """One Responses tool as Chat tools: a namespace's tools flattened (``chat_name``)."""
    if tool.get("type") == "namespace" and namespace is None:
        return [t for j, inner in enumerate(tool.get("tools") or [])
                for t in _tools(inner, f"{where}.tools[{j}]", lost, tool.get("name") or "")]
    one = _tool(tool, where, lost)
    if one is not None and namespace is not None:
        one["function"]["name"] = chat_name(namespace, one["function"]["name"])
    return [one] if one is not None else []


def _tool(tool: dict[str, Any], where: str, lost: Lost) -> dict[str, Any] | None:
    kind = tool.get("type", "function")
    if kind == "function":
        fn: dict[str, Any] = {"name": tool.get("name", ""), "parameters": tool.get("parameters") or {}}
        for key in ("description", "strict"):
            if tool.get(key) is not None:
                fn[key] = tool[key]
        return {"type": "function", "function": fn}
    if kind == "custom":
        # vLLM and SGLang serve function tools only: a freeform tool is a function taking its
        # input as one string, and its calls come back as the freeform calls they were.
        fmt = tool.get("format")
        if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
            lost(f"{where}.format", fmt)  # a grammar: Chat functions take a JSON schema only
        fn = {"name": tool.get("name", ""), "parameters": {
            "type": "object", "properties": {"input": {"type": "string", "description": "the tool's input, as text"}},
            "required": ["input"], "additionalProperties": False}}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        return {"type": "function", "function": fn}
    lost(where, tool)
    return None


def _input(body: dict[str, Any], lost: Lost, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if body.get("instructions"):
        out.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    turn: _Assistant | None = None

    def flush() -> None:
        nonlocal turn
        if turn is not None:
            out.append(turn.message())
            turn = None

    for i, item in enumerate(items or []):
        kind = item.get("type") or ("message" if "role" in item else "")
        role = item.get("role")
        where = f"input[{i}]"
        if kind == "message" and role != "assistant":
            flush()
            out.append({"role": "system" if role in ("system", "developer") else "user",
                        "content": _content(item.get("content"), f"{where}.content", lost)})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            flush()
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": _content(item.get("output"), f"{where}.output", lost, text_only=True)})
        elif kind == "additional_tools":
            for j, tool in enumerate(item.get("tools") or []):
                tools += _tools(tool, f"{where}.tools[{j}]", lost)
        elif kind == "message" or kind in _ASSISTANT_SIDE:
            turn = turn or _Assistant()
            turn.add(item, kind, where, lost)
        else:  # web_search_call, item_reference, compaction, ...
            lost(where, item)
    flush()
    return out


def _tool_choice(choice: Any, out: dict[str, Any], lost: Lost) -> None:
    if choice in ("auto", "required", "none"):
        out["tool_choice"] = choice
    elif isinstance(choice, dict) and choice.get("type") == "function":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name", "")}}
    elif isinstance(choice, dict) and choice.get("type") == "custom":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name", "")}}
    else:
        lost("tool_choice", choice)


def _text_config(config: Any, out: dict[str, Any], lost: Lost) -> None:
    if not isinstance(config, dict):
        lost("text", config)
        return
    for key, value in config.items():
        if key == "verbosity":
            out["verbosity"] = value
        elif key == "format" and isinstance(value, dict) and value.get("type") == "json_schema":
            schema = {k: value[k] for k in ("name", "schema", "strict", "description") if k in value}
            out["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif key == "format" and isinstance(value, dict) and value.get("type") in ("text", "json_object"):
            if value["type"] == "json_object":
                out["response_format"] = {"type": "json_object"}
        else:
            lost(f"text.{key}", value)


# --------------------------------------------------------------------------------------
# answers: Chat -> Responses


def response_id(chat_id: str | None) -> str:
    """The Responses id of a Chat answer: stable, so the JSON and the streamed translation
    (and the record a chain is resolved from) agree."""
    return "resp_" + (chat_id or "interceptor").removeprefix("chatcmpl-")


def _usage(raw: dict[str, Any] | None) -> dict[str, Any] | None:
    if not raw:
        return None
    prompt, cached, completion, reasoning = chat_usage(raw)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def _envelope(rid: str, model: str, created: int, status: str, output: list[dict[str, Any]],
              usage: dict[str, Any] | None, finish: str | None) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": _INCOMPLETE[finish]} if finish in _INCOMPLETE else None,
            "instructions": None, "metadata": {}, "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": [], "temperature": None, "top_p": None}


def custom_input(arguments: str) -> str:
    """A freeform tool's input from the function call it was sent as: ``{"input": ...}``
    (anything else the model wrote stays as it came)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value["input"] if isinstance(value, dict) and isinstance(value.get("input"), str) else arguments


def _call_item(rid: str, k: int, call: dict[str, Any], arguments: str, status: str,
               names: dict[str, tuple[str, str]] | None = None) -> dict[str, Any]:
    """A Chat call as a Responses call item; ``names`` maps a flattened name back to its
    namespace and own name."""
    custom = call.get("type") == "custom"
    name = (call.get("custom" if custom else "function") or {}).get("name") or ""
    namespace, name = (names or {}).get(name, (None, name))
    if custom:
        item = {"id": f"ctc_{rid}_{k}", "type": "custom_tool_call", "call_id": call.get("id") or "",
                "name": name, "input": arguments, "status": status}
    else:
        item = {"id": f"fc_{rid}_{k}", "type": "function_call", "call_id": call.get("id") or "",
                "name": name, "arguments": arguments, "status": status}
    if namespace is not None:
        item["namespace"] = namespace
    return item


def _message_item(rid: str, k: int, text: str | None, refusal: str | None, status: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if text is not None:
        content.append({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
    if refusal is not None:
        content.append({"type": "refusal", "refusal": refusal})
    return {"id": f"msg_{rid}_{k}", "type": "message", "role": "assistant", "status": status, "content": content}


def _reasoning_item(rid: str, k: int, text: str) -> dict[str, Any]:
    return {"id": f"rs_{rid}_{k}", "type": "reasoning", "summary": [{"type": "summary_text", "text": text}]}


def _status(finish: str | None) -> str:
    return "incomplete" if finish in _INCOMPLETE else "completed"


class ChatToResponses(ChatEvents):
    """Chat chunks -> Responses events, as they arrive: one output item open at a time
    (reasoning, the message, each tool call), its deltas forwarded as they come, closed with
    its ``done`` events when another kind starts; ``[DONE]`` sends the terminal event with the
    whole response (Responses restates every item there, so the items are kept)."""

    def __init__(self, custom: frozenset[str] = frozenset(), names: dict[str, tuple[str, str]] | None = None) -> None:
        super().__init__()
        self.custom = custom  # the request's freeform tools, sent as functions
        self.names = names or {}  # flattened namespaced names
        self.seq = 0
        self.rid = response_id(None)
        self.model = ""
        self.created = 0
        self.items: list[dict[str, Any]] = []
        self.open: str | tuple[str, int] | None = None
        self.text: list[str] = []  # the open item's text so far
        self.refusal: list[str] = []
        self.call: dict[str, Any] = {}

    def start(self, chunk: dict[str, Any], out: list[SSEEvent]) -> None:
        self.rid = response_id(chunk.get("id"))
        self.model = chunk.get("model") or ""
        self.created = chunk.get("created") or 0
        skeleton = _envelope(self.rid, self.model, self.created, "in_progress", [], None, None)
        out.append(self._event("response.created", {"response": skeleton}))
        out.append(self._event("response.in_progress", {"response": skeleton}))

    def fail(self, error: dict[str, Any], out: list[SSEEvent]) -> None:
        out.append(self._event("error", {"code": error.get("code") or error.get("type") or "server_error",
                                         "message": str(error.get("message") or ""), "param": error.get("param")}))

    def finish(self, choice: dict[str, Any], out: list[SSEEvent]) -> None:
        self._close(out)

    def _event(self, kind: str, data: dict[str, Any]) -> SSEEvent:
        event = sse(kind, {"type": kind, **data, "sequence_number": self.seq})
        self.seq += 1
        return event

    @property
    def _at(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def delta(self, delta: dict[str, Any], out: list[SSEEvent]) -> None:
        thought = first(delta.get("reasoning_content"), delta.get("reasoning"))
        if isinstance(thought, str) and thought:
            if self._open("reasoning", {**_reasoning_item(self.rid, len(self.items), ""), "summary": []}, out):
                out.append(self._event("response.reasoning_summary_part.added", {
                    **self._at, "summary_index": 0, "part": {"type": "summary_text", "text": ""}}))
            self.text.append(thought)
            out.append(self._event("response.reasoning_summary_text.delta",
                                   {**self._at, "summary_index": 0, "delta": thought}))
        text, refusal = content_text(delta.get("content")), delta.get("refusal")
        if text or refusal:
            if self._open("message", {**_message_item(self.rid, len(self.items), None, None, "in_progress")}, out):
                self.refusal = []
            if text:
                if not self.text:
                    out.append(self._event("response.content_part.added", {
                        **self._at, "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}))
                self.text.append(text)
                out.append(self._event("response.output_text.delta",
                                       {**self._at, "content_index": 0, "delta": text, "logprobs": []}))
            if refusal:
                self.refusal.append(refusal)  # sent whole when the message closes
        for frag in delta.get("tool_calls") or ():
            key = ("call", frag.get("index", 0))
            if self.open != key:
                self._close(out)  # before self.call names the next one
                name = (frag.get("function") or {}).get("name") or ""
                kind = "custom" if name in self.custom else "function"
                self.call = {"id": frag.get("id") or "", "type": kind, kind: {"name": name}}
                self._open(key, _call_item(self.rid, len(self.items), self.call, "", "in_progress", self.names), out)
            piece = (frag.get("function") or {}).get("arguments")
            if piece:
                self.text.append(piece)
                if self.call.get("type") != "custom":
                    out.append(self._event("response.function_call_arguments.delta", {**self._at, "delta": piece}))
                # a freeform call's input is the decoded {"input": ...}: sent whole when it closes

    def _open(self, kind: str | tuple[str, int], item: dict[str, Any], out: list[SSEEvent]) -> bool:
        """Open an item of ``kind`` unless it is the open one; True when it was opened."""
        if self.open == kind:
            return False
        self._close(out)
        self.open, self.text = kind, []
        self.items.append(item)
        out.append(self._event("response.output_item.added", {"output_index": len(self.items) - 1, "item": item}))
        return True

    def _close(self, out: list[SSEEvent]) -> None:
        if self.open is None:
            return
        at, k, text = self._at, len(self.items) - 1, "".join(self.text)
        if self.open == "reasoning":
            item = _reasoning_item(self.rid, k, text)
            out.append(self._event("response.reasoning_summary_text.done", {**at, "summary_index": 0, "text": text}))
            out.append(self._event("response.reasoning_summary_part.done",
                                   {**at, "summary_index": 0, "part": item["summary"][0]}))
        elif self.open == "message":
            refusal = "".join(self.refusal) if self.refusal else None
            item = _message_item(self.rid, k, text if self.text else None, refusal, "completed")
            if self.text:
                part = item["content"][0]
                out.append(self._event("response.output_text.done",
                                       {**at, "content_index": 0, "text": text, "logprobs": []}))
                out.append(self._event("response.content_part.done", {**at, "content_index": 0, "part": part}))
            if refusal is not None:
                ci = len(item["content"]) - 1
                out.append(self._event("response.content_part.added", {
                    **at, "content_index": ci, "part": {"type": "refusal", "refusal": ""}}))
                out.append(self._event("response.refusal.delta", {**at, "content_index": ci, "delta": refusal}))
                out.append(self._event("response.refusal.done", {**at, "content_index": ci, "refusal": refusal}))
                out.append(self._event("response.content_part.done",
                                       {**at, "content_index": ci, "part": item["content"][ci]}))
        else:
            custom = self.call.get("type") == "custom"
            item = _call_item(self.rid, k, self.call, custom_input(text) if custom else text, "completed", self.names)
            if custom:
                out.append(self._event("response.custom_tool_call_input.delta", {**at, "delta": item["input"]}))
                out.append(self._event("response.custom_tool_call_input.done", {**at, "input": item["input"]}))
            else:
                out.append(self._event("response.function_call_arguments.done",
                                       {**at, "arguments": text, "name": item["name"]}))
        self.items[-1] = item
        out.append(self._event("response.output_item.done", {"output_index": k, "item": item}))
        self.open, self.text = None, []

    def end(self, out: list[SSEEvent]) -> None:
        self._close(out)
        status = _status(self.finish_reason)
        body = _envelope(self.rid, self.model, self.created, status, self.items, _usage(self.usage),
                         self.finish_reason)
        out.append(self._event(f"response.{status}", {"response": body}))


class ResponsesOnChat(Translation):
    source = RESPONSES
    target = CHAT
    path = "/v1/chat/completions"
    source_headers = ("openai-beta",)
    custom: frozenset[str] = frozenset()  # the request's freeform tools (``bind``)
    names: dict[str, tuple[str, str]] = {}  # flattened namespaced tool -> (namespace, name) (``bind``)

    def request(self, body: dict[str, Any]) -> tuple[dict[str, Any], list[Override]]:
        lost = Lost()
        out: dict[str, Any] = {k: body[k] for k in _SAME if k in body}
        tools: list[dict[str, Any]] = []
        out["messages"] = _input(body, lost, tools)
        for i, tool in enumerate(body.get("tools") or []):
            tools += _tools(tool, f"tools[{i}]", lost)
        if tools:
            out["tools"] = tools
        if "tool_choice" in body:
            _tool_choice(body["tool_choice"], out, lost)
        if body.get("max_output_tokens") is not None:
            out["max_completion_tokens"] = body["max_output_tokens"]
        reasoning = body.get("reasoning")
        if isinstance(reasoning, dict):
            for key, value in reasoning.items():
                if key == "effort" and value is not None:
                    out["reasoning_effort"] = value
                elif value is not None:
                    lost(f"reasoning.{key}", value)
        if "text" in body:
            _text_config(body["text"], out, lost)
        return chat_request(body, out, lost, _HANDLED)

    def prefix(self, target: dict[str, Any], conversation: list[Message]) -> bool:
        own = target["messages"]
        if own and own[0].get("role") == "system" and conversation and conversation[0].role == "system":
            own = own[1:]  # the chained request restates its instructions: the chain has them
        target["messages"] = chat_messages(conversation) + own
        return True

    def response(self, body: dict[str, Any]) -> dict[str, Any]:
        choice, msg = first_choice(body)
        rid = response_id(body.get("id"))
        output: list[dict[str, Any]] = []
        thought = first(msg.get("reasoning_content"), msg.get("reasoning"))
        if isinstance(thought, str) and thought:
            output.append(_reasoning_item(rid, len(output), thought))
        text = content_text(msg.get("content"))
        if text or msg.get("refusal"):
            output.append(_message_item(rid, len(output), text or None, msg.get("refusal") or None, "completed"))
        for call in msg.get("tool_calls") or ():
            fn = call.get("function") or {}
            arguments = fn.get("arguments") or ""
            if fn.get("name") in self.custom:
                call = {"id": call.get("id"), "type": "custom", "custom": {"name": fn["name"]}}
                arguments = custom_input(arguments)
            output.append(_call_item(rid, len(output), call, arguments, "completed", self.names))
        finish = choice.get("finish_reason")
        return _envelope(rid, body.get("model") or "", body.get("created") or 0, _status(finish), output,
                         _usage(body.get("usage")), finish)

    def events(self) -> ChatToResponses:
        return ChatToResponses(self.custom, self.names)

    def bind(self, request: Request) -> ResponsesOnChat:
        custom = frozenset(chat_name(t.namespace, t.name) for t in request.tools if t.type == "custom")
        names = {chat_name(t.namespace, t.name): (t.namespace, t.name) for t in request.tools
                 if t.namespace not in (None, "functions")}
        if not custom and not names:
            return self
        bound = copy.copy(self)
        bound.custom, bound.names = custom, names
        return bound

    def error(self, status: int, body: Any) -> dict[str, Any]:
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict):  # OpenAI's shape: the same in both APIs
            return {"error": {"message": str(err.get("message") or ""), "type": err.get("type"),
                              "param": err.get("param"), "code": err.get("code")}}
        return super().error(status, body)

    def stream_error(self, message: str) -> bytes:
        return sse("error", {"type": "error", "code": "server_error", "message": message, "param": None}).encode()


RESPONSES_CHAT = ResponsesOnChat()

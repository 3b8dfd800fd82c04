"""Gemini (the harness: Gemini CLI, the genai SDKs) on a Chat Completions upstream.

Gemini has no tool-call ids: the Gemini dialect derives a call's id from the call itself and
pairs each ``functionResponse`` with its call (``dialects/gemini.py``). So the request is
translated from its canonical reading: the conversation (``systemInstruction`` a system
message, ``model`` turns assistant messages with their reasoning and calls under the derived
ids, ``functionResponse`` parts ``tool`` messages answering them) rendered as Chat messages,
which keeps the ids stable across turns without any state. Besides:

- ``tools[].functionDeclarations`` -> functions; ``toolConfig.functionCallingConfig.mode``
  AUTO / ANY / NONE -> auto / required / none (ANY with one allowed name -> that function);
- ``generationConfig``: ``temperature``, ``topP``, ``topK``, ``seed``, ``presencePenalty``,
  ``frequencyPenalty`` as they are, ``maxOutputTokens`` -> ``max_completion_tokens``,
  ``stopSequences`` -> ``stop``, ``responseMimeType: application/json`` (with
  ``responseJsonSchema`` / ``responseSchema``) -> ``response_format``; the model is the
  path's; ``:streamGenerateContent`` is a stream (Rewrite says so: the path decides).
- answers: ``reasoning_content`` -> ``thought`` parts, content -> text parts, as they stream;
  a tool call -> a ``functionCall`` part with its ``args`` (sent whole when the answer ends:
  Gemini has no partial calls), finish reasons stop / tool_calls -> STOP, length ->
  MAX_TOKENS, content_filter -> SAFETY, usage -> ``usageMetadata`` with ``thoughtsTokenCount``
  and ``cachedContentTokenCount``; the last chunk carries the finish reason and the usage.
- errors: the status stays, the message goes into Google's error shape.

Dropped and recorded (reason ``translation``): inline data parts (images and files: canonical
holds their hash, not their bytes, and this translation works from the canonical reading),
non-image file parts, thought signatures, Google's own tools (``googleSearch``,
``codeExecution``, ...), ``thinkingConfig``, ``safetySettings``, ``cachedContent``,
``candidateCount`` and any other key not listed. Only ``alt=sse`` streams are translated.
"""

from __future__ import annotations

import json
from typing import Any

from interceptor.dialects.base import Override
from interceptor.dialects.chat import CHAT
from interceptor.dialects.common import first
from interceptor.dialects.gemini import GEMINI, PLACEHOLDER_SIGNATURE
from interceptor.dialects.sse import SSEEvent
from interceptor.dialects.translate.base import (
    ChatEvents, Lost, Translation, chat_messages, chat_request, chat_usage, compact, content_text, first_choice,
)
from interceptor.trace import export

_GC = "generationConfig"
_SAME = {"temperature": "temperature", "topP": "top_p", "topK": "top_k", "seed": "seed",
         "presencePenalty": "presence_penalty", "frequencyPenalty": "frequency_penalty",
         "maxOutputTokens": "max_completion_tokens", "stopSequences": "stop"}
_HANDLED = {"contents", "systemInstruction", "system_instruction", "tools", "toolConfig", _GC, "model"}
_FINISH = {"stop": "STOP", "tool_calls": "STOP", "function_call": "STOP", "length": "MAX_TOKENS",
           "content_filter": "SAFETY"}
_MODES = {"AUTO": "auto", "ANY": "required", "NONE": "none", "VALIDATED": "auto"}


def _lost_parts(body: dict[str, Any], lost: Lost) -> None:
    for i, content in enumerate(body.get("contents") or []):
        for j, part in enumerate(content.get("parts") or []):
            where = f"contents[{i}].parts[{j}]"
            signature = part.get("thoughtSignature")
            if signature and signature != PLACEHOLDER_SIGNATURE:
                lost(f"{where}.thoughtSignature", signature)
            if any(k in part for k in ("text", "functionCall", "functionResponse")):
                continue
            file = part.get("fileData")
            if isinstance(file, dict) and str(file.get("mimeType", "")).startswith("image/"):
                continue  # an image by URL goes as its URL
            lost(where, part)


def _generation(config: Any, out: dict[str, Any], lost: Lost) -> None:
    if not isinstance(config, dict):
        return
    mime = config.get("responseMimeType")
    for key, value in config.items():
        if key in _SAME:
            out[_SAME[key]] = value
        elif key == "responseMimeType" and value in ("application/json", "text/plain"):
            if value == "application/json" and not ({"responseJsonSchema", "responseSchema"} & config.keys()):
                out["response_format"] = {"type": "json_object"}
        elif key in ("responseJsonSchema", "responseSchema") and mime == "application/json":
            out["response_format"] = {"type": "json_schema", "json_schema": {"name": "response", "schema": value}}
        else:  # thinkingConfig, candidateCount, responseModalities, ...
            lost(f"{_GC}.{key}", value)


def _tool_config(config: Any, out: dict[str, Any], lost: Lost) -> None:
    calling = config.get("functionCallingConfig") if isinstance(config, dict) else None
    mode = calling.get("mode") if isinstance(calling, dict) else None
    if mode not in _MODES:
        lost("toolConfig", config)
        return
    names = calling.get("allowedFunctionNames") or []
    if mode == "ANY" and len(names) == 1:
        out["tool_choice"] = {"type": "function", "function": {"name": names[0]}}
    else:
        out["tool_choice"] = _MODES[mode]


def _usage(raw: dict[str, Any] | None) -> dict[str, Any] | None:
    if not raw:
        return None
    prompt, cached, completion, thoughts = chat_usage(raw)
    usage = {"promptTokenCount": prompt, "candidatesTokenCount": max(0, completion - thoughts),
             "totalTokenCount": prompt + completion}
    if thoughts:
        usage["thoughtsTokenCount"] = thoughts
    if cached:
        usage["cachedContentTokenCount"] = cached
    return usage


def _args(arguments: str) -> dict[str, Any]:
    """A call's ``args``: Gemini takes an object; text that is not one (a cut call) is kept
    under ``arguments`` rather than lost."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def _chunk(parts: list[dict[str, Any]], head: dict[str, Any], **candidate: Any) -> dict[str, Any]:
    return {"candidates": [{"content": {"role": "model", "parts": parts}, **candidate, "index": 0}], **head}


class ChatToGemini(ChatEvents):
    """Chat chunks -> Gemini chunks: each reasoning or content delta is a chunk with one
    ``thought`` or text part as it arrives; tool calls are gathered (Gemini sends a call
    whole) and go, with the finish reason and the usage, in the last chunk at ``[DONE]``."""

    def __init__(self) -> None:
        super().__init__()
        self.head: dict[str, Any] = {}
        self.calls: dict[int, dict[str, Any]] = {}

    def start(self, chunk: dict[str, Any], out: list[SSEEvent]) -> None:
        self.head = {"modelVersion": chunk.get("model") or "", "responseId": chunk.get("id") or ""}

    def delta(self, delta: dict[str, Any], out: list[SSEEvent]) -> None:
        thought = first(delta.get("reasoning_content"), delta.get("reasoning"))
        if isinstance(thought, str) and thought:
            out.append(self._data(_chunk([{"text": thought, "thought": True}], self.head)))
        text = content_text(delta.get("content")) + (delta.get("refusal") or "")
        if text:
            out.append(self._data(_chunk([{"text": text}], self.head)))
        for frag in delta.get("tool_calls") or ():
            call = self.calls.setdefault(frag.get("index", 0), {"name": [], "args": []})
            fn = frag.get("function") or {}
            if fn.get("name"):
                call["name"].append(fn["name"])
            if fn.get("arguments"):
                call["args"].append(fn["arguments"])

    def finish(self, choice: dict[str, Any], out: list[SSEEvent]) -> None:
        pass  # the last chunk goes at [DONE], with the usage that follows the finish

    def fail(self, error: dict[str, Any], out: list[SSEEvent]) -> None:
        out.append(self._data(GEMINI.error_body(500, str(error.get("message") or ""), "INTERNAL")))

    def end(self, out: list[SSEEvent]) -> None:
        parts = [{"functionCall": {"name": "".join(c["name"]), "args": _args("".join(c["args"]))}}
                 for _, c in sorted(self.calls.items())]
        last = _chunk(parts, self.head, finishReason=_FINISH.get(self.finish_reason or "stop", "STOP"))
        usage = _usage(self.usage)
        if usage is not None:
            last["usageMetadata"] = usage
        out.append(self._data(last))

    @staticmethod
    def _data(obj: dict[str, Any]) -> SSEEvent:
        return SSEEvent(data=compact(obj))


class GeminiOnChat(Translation):
    source = GEMINI
    target = CHAT
    path = "/v1/chat/completions"
    source_headers = ("x-goog-api-client",)

    def request(self, body: dict[str, Any]) -> tuple[dict[str, Any], list[Override]]:
        lost = Lost()
        canonical = GEMINI.parse_request(body)
        _lost_parts(body, lost)
        out: dict[str, Any] = {"messages": chat_messages(canonical.messages)}
        if body.get("model"):
            out["model"] = body["model"]
        functions = [t for t in canonical.tools if t.type == "function"]
        if functions:
            out["tools"] = export.chat_tools(functions)
        for i, tool in enumerate(body.get("tools") or []):
            for key, value in tool.items():
                if key not in ("functionDeclarations", "function_declarations"):
                    lost(f"tools[{i}].{key}", value)
        if "toolConfig" in body:
            _tool_config(body["toolConfig"], out, lost)
        _generation(body.get(_GC), out, lost)
        return chat_request(body, out, lost, _HANDLED)

    def response(self, body: dict[str, Any]) -> dict[str, Any]:
        choice, msg = first_choice(body)
        parts: list[dict[str, Any]] = []
        thought = first(msg.get("reasoning_content"), msg.get("reasoning"))
        if isinstance(thought, str) and thought:
            parts.append({"text": thought, "thought": True})
        text = content_text(msg.get("content")) + (msg.get("refusal") or "")
        if text:
            parts.append({"text": text})
        for call in msg.get("tool_calls") or ():
            fn = call.get("function") or {}
            parts.append({"functionCall": {"name": fn.get("name") or "", "args": _args(fn.get("arguments") or "")}})
        out = _chunk(parts, {"modelVersion": body.get("model") or "", "responseId": body.get("id") or ""},
                     finishReason=_FINISH.get(choice.get("finish_reason") or "stop", "STOP"))
        usage = _usage(body.get("usage"))
        if usage is not None:
            out["usageMetadata"] = usage
        return out

    def events(self) -> ChatToGemini:
        return ChatToGemini()


    def stream_error(self, message: str) -> bytes:
        return ChatToGemini._data(GEMINI.error_body(502, message)).encode()


GEMINI_CHAT = GeminiOnChat()

"""OpenAI Chat Completions (``POST /v1/chat/completions``), as OpenAI and vLLM speak it.

The stream assembler rebuilds the non-streamed JSON body from the chunks and hands it to
``parse_response``, so the two paths cannot drift apart: there is one mapping from native to
canonical, and the assembler's only job is to put fragments back together (in lists, joined
once at the end, so a long answer costs O(event) per chunk).

vLLM extras are understood: ``prompt_token_ids`` on the response (or on the first chunk),
``token_ids`` per choice (or per chunk, concatenated), and ``reasoning_content`` /
``reasoning`` on messages and deltas.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any

from interceptor.dialects import prompt_ids
from interceptor.dialects.base import Mediation, Override, RouteKind, Slot
from interceptor.dialects.prompt_ids import Prior, PromptRead
from interceptor.trace.graph import KnownIds
from interceptor.dialects.common import (
    REMOVED_PART,
    drop_key,
    mediate_tools,
    notice_first_user,
    Knob,
    OpenAIDialect,
    models_route,
    error_from,
    NativeAssembler,
    first,
    inline_part,
    inline_ref,
    other_part,
    Plan,
    reconcile_openai,
    replace,
    stop_list,
    url_part,
)
from interceptor.dialects.sse import SSEEvent
from interceptor.dialects.vllm import ChatTokens
from interceptor.trace import export
from interceptor.trace.prefix import Listed
from interceptor.trace.messages import (
    Choice,
    FinishReason,
    Message,
    Part,
    Reasoning,
    Request,
    Response,
    Tool,
    ToolCall,
    Usage,
)

FINISH: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
    "content_filter": "content_filter",
}
_NATIVE_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls",
                  "content_filter": "content_filter", "error": "stop"}

KNOBS = (
    Knob("temperature", ("temperature",)),
    Knob("top_p", ("top_p",)),
    Knob("top_k", ("top_k",)),  # vLLM / SGLang extension
    Knob("max_tokens", ("max_completion_tokens",), aliases=(("max_tokens",),)),
    Knob("seed", ("seed",)),
    Knob("presence_penalty", ("presence_penalty",)),
    Knob("frequency_penalty", ("frequency_penalty",)),
    Knob("reasoning_effort", ("reasoning_effort",)),
    Knob("stop", ("stop",), owner="harness", from_native=stop_list),
    Knob("tool_choice", ("tool_choice",), owner="harness"),
    Knob("n", ("n",), owner="harness"),
    Knob("logprobs", ("logprobs",), owner="harness"),
    Knob("top_logprobs", ("top_logprobs",), owner="harness"),
)
_REQUEST_KEYS = {"messages", "tools", "functions", "model", "stream"} | {
    k.path[0] for k in KNOBS
} | {"max_tokens"}


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
        if kind == "text":
            parts.append(Part(text=block.get("text", "")))
        elif kind == "image_url":
            image = block.get("image_url") or {}
            if isinstance(image, str):  # the early shorthand, still accepted by OpenAI
                image = {"url": image}
            parts.append(url_part("image", image.get("url", ""), detail=image.get("detail")))
        elif kind == "input_audio":
            audio = block.get("input_audio") or {}
            parts.append(Part(type="file", ref=inline_ref(audio.get("data", "")),
                              media_type=f"audio/{audio.get('format', 'wav')}"))
        elif kind == "file":
            f = block.get("file") or {}
            if f.get("file_data"):
                part = inline_part("file", f["file_data"], filename=f.get("filename"))
            else:
                part = Part(type="file", ref=f.get("file_id"),
                            data={"filename": f["filename"]} if f.get("filename") else None)
            parts.append(part)
        else:
            parts.append(other_part(block))
    return parts


def _tool_call(call: dict[str, Any]) -> ToolCall:
    if call.get("type") == "custom":
        custom = call.get("custom") or {}
        return ToolCall(id=call.get("id") or "", name=custom.get("name") or "",
                        arguments=custom.get("input") or "", type="custom")
    fn = call.get("function") or {}
    return ToolCall(id=call.get("id") or "", name=fn.get("name") or "",
                    arguments=fn.get("arguments") or "")


def _assistant(msg: dict[str, Any]) -> Message:
    content = _content(msg.get("content"))
    refusal = msg.get("refusal") or None
    if isinstance(content, list):
        # A refusal restated as a content part belongs in ``refusal``, as in the response.
        is_refusal = [p.type == "other" and (p.data or {}).get("type") == "refusal" for p in content]
        if any(is_refusal):
            refusal = (refusal or "") + "".join(
                p.data.get("refusal", "") for p, r in zip(content, is_refusal) if r and p.data)
            content = [p for p, r in zip(content, is_refusal) if not r]
    calls = [_tool_call(c) for c in msg.get("tool_calls") or []]
    if msg.get("function_call"):
        fc = msg["function_call"]
        calls.append(ToolCall(id="", name=fc.get("name") or "", arguments=fc.get("arguments") or ""))
    thought = first(msg.get("reasoning_content"), msg.get("reasoning"))
    return Message(
        role="assistant",
        content=content,
        refusal=refusal,
        tool_calls=calls,
        reasoning=[Reasoning(text=thought)] if isinstance(thought, str) and thought else [],
        name=msg.get("name"),
    )


def _element(m: Any, before: Any = None) -> list[Message]:
    """A ``messages`` element's canonical messages: always the one (``Dialect.list_messages``)."""
    return [_message(m)]


def _message(msg: dict[str, Any]) -> Message:
    role = msg.get("role")
    if role in ("system", "developer"):
        return Message(role="system", content=_content(msg.get("content")),
                       name="developer" if role == "developer" else msg.get("name"))
    if role == "assistant":
        return _assistant(msg)
    if role == "tool":
        return Message(role="tool", content=_content(msg.get("content")),
                       tool_call_id=msg.get("tool_call_id"))
    if role == "function":  # the pre-tools API
        return Message(role="tool", content=_content(msg.get("content")), name=msg.get("name"))
    return Message(role="user", content=_content(msg.get("content")), name=msg.get("name"))


def _tool(tool: dict[str, Any]) -> Tool:
    kind = tool.get("type", "function")
    if kind == "function":
        fn = tool.get("function") or {}
        return Tool(name=fn.get("name", ""), description=fn.get("description"),
                    parameters=fn.get("parameters"))
    if kind == "custom":
        custom = tool.get("custom") or {}
        fmt = custom.get("format")
        return Tool(name=custom.get("name", ""), description=custom.get("description"),
                    parameters={"format": fmt} if fmt else None, type="custom")
    rest = {k: v for k, v in tool.items() if k not in ("type", "name")}
    return Tool(name=tool.get("name") or kind, type=kind, parameters=rest or None)


def _usage(raw: dict[str, Any] | None) -> Usage | None:
    if not raw:
        return None
    prompt = raw.get("prompt_tokens_details") or {}
    completion = raw.get("completion_tokens_details") or {}
    return Usage(
        input_tokens=raw.get("prompt_tokens") or 0,
        output_tokens=raw.get("completion_tokens") or 0,
        cached_input_tokens=prompt.get("cached_tokens") or 0,
        reasoning_tokens=completion.get("reasoning_tokens") or 0,
    )


def _logprobs(raw: dict[str, Any] | None) -> list[float] | None:
    """Sampled-token logprobs: content tokens, then refusal tokens (only one is ever set)."""
    if not raw:
        return None
    values = [t["logprob"] for t in raw.get("content") or []]
    values += [t["logprob"] for t in raw.get("refusal") or []]
    return values if raw.get("content") is not None or raw.get("refusal") is not None else None


def _choice(raw: dict[str, Any]) -> Choice:
    native = raw.get("finish_reason")
    return Choice(
        index=raw.get("index", 0),
        message=_assistant(raw.get("message") or {}),
        finish_reason=FINISH.get(native) if native else None,
        native_finish_reason=native,
        token_ids=raw.get("token_ids"),
        logprobs=_logprobs(raw.get("logprobs")),
    )


# --------------------------------------------------------------------------------------
# canonical -> native


def _native_message(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": message.text() or None,
                           "refusal": message.refusal}
    if message.tool_calls:
        out["tool_calls"] = [_native_call(c) for c in message.tool_calls]
    thought = "".join(r.text for r in message.reasoning)
    if thought:
        out["reasoning_content"] = thought
    return out


def _native_call(call: ToolCall) -> dict[str, Any]:
    if call.type == "custom":
        return {"id": call.id, "type": "custom", "custom": {"name": call.name, "input": call.arguments}}
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _native_logprobs(values: list[float] | None) -> dict[str, Any] | None:
    if values is None:
        return None
    # The canonical record keeps the numbers only; the token text is not recoverable.
    return {"content": [{"token": "", "logprob": v, "bytes": None, "top_logprobs": []} for v in values],
            "refusal": None}


def _native_usage(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_input_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


def _all_choices(response: Response) -> list[Choice]:
    head = Choice(index=0, message=response.message, finish_reason=response.finish_reason,
                  native_finish_reason=response.native_finish_reason,
                  token_ids=response.token_ids, logprobs=response.logprobs)
    return [head, *response.choices]


def _native_finish(choice: Choice) -> str | None:
    if choice.native_finish_reason:
        return choice.native_finish_reason
    return _NATIVE_FINISH.get(choice.finish_reason) if choice.finish_reason else None


# --------------------------------------------------------------------------------------


# -- network policy: what the provider runs or fetches itself -------------------------------

def _hosted_tool(tool: dict[str, Any]) -> str | None:
    kind = tool.get("type", "function")
    return None if kind in ("function", "custom") else str(kind)


def _tool_name(tool: dict[str, Any]) -> str:
    kind = str(tool.get("type") or "function")
    inner = tool.get(kind) if isinstance(tool.get(kind), dict) else {}
    return str(inner.get("name") or tool.get("name") or kind)


def _forced_tool(choice: Any) -> str | None:
    if choice == "required":
        return "*"
    if isinstance(choice, dict):
        kind = str(choice.get("type") or "")
        inner = choice.get(kind) if isinstance(choice.get(kind), dict) else {}
        return str(inner.get("name") or choice.get("name") or kind)
    return None


def _remote_part(part: Any) -> str | None:
    if not isinstance(part, dict):
        return None
    if part.get("type") == "image_url":
        url = (part.get("image_url") or {}).get("url") if isinstance(part.get("image_url"), dict) else part.get("image_url")
        if isinstance(url, str) and not url.startswith("data:"):
            return "image URL"
    if part.get("type") == "file" and isinstance(part.get("file"), dict) and part["file"].get("file_id"):
        return "uploaded file"
    return None


class ChatDialect(OpenAIDialect):
    name = "chat"
    model_table = "openai"
    routes = {("POST", "/v1/chat/completions"): "model"}
    knobs = KNOBS
    message_list = "messages"  # one element, one message (_element)
    tokens = ChatTokens  # vLLM >= 0.10.2 and SGLang return token ids on this route

    def route(self, method: str, path: str) -> RouteKind | None:
        return super().route(method, path) or models_route(method, path)

    def request_body(self, request: Request) -> dict[str, Any]:
        body: dict[str, Any] = {"messages": export.chat_messages(request.messages)}
        if request.tools:
            body["tools"] = export.chat_tools(request.tools)
        return body

    def parse_request(self, body: dict[str, Any], listed: Listed | None = None) -> Request:
        tools = [_tool(t) for t in body.get("tools") or []]
        tools += [Tool(name=f.get("name", ""), description=f.get("description"),
                       parameters=f.get("parameters")) for f in body.get("functions") or []]
        return Request(
            messages=self.list_messages(body.get("messages") or [], listed, _element),
            tools=tools,
            model=body.get("model"),
            sampling=self.sampling(body),
            stream=bool(body.get("stream")),
            extra={k: v for k, v in body.items() if k not in _REQUEST_KEYS},
        )

    def content_slots(self, body: dict[str, Any], chained: bool = False) -> list[Slot | None]:
        # One canonical message per native one (parse_request); user, tool and function
        # messages carry their content in "content" (a string is valid for each).
        return [slot for j in range(len(body.get("messages") or [])) for slot in self.element_slots(body, j)]

    def element_slots(self, body: dict[str, Any], j: int) -> list[Slot | None]:
        m = body["messages"][j]
        return [Slot(("messages", j, "content")) if m.get("role") not in ("system", "developer", "assistant") else None]

    def content_parts(self, blocks: list[Any]) -> list[Part]:
        parts = _content(blocks)
        return parts if isinstance(parts, list) else [Part(text=parts)]

    def load_response(self, raw: bytes, priors: Sequence[Prior] = ()) -> tuple[Any, PromptRead | None]:
        return prompt_ids.load(raw, priors)

    def parse_response(self, body: dict[str, Any]) -> Response:
        choices = sorted((_choice(c) for c in body.get("choices") or []), key=lambda c: c.index)
        head = choices[0] if choices else Choice(index=0, message=Message(role="assistant"))
        extra = {k: body[k] for k in ("created", "system_fingerprint", "service_tier")
                 if body.get(k) is not None}
        error = body.get("error")
        # Ids the reader already knows are ints (dialects/prompt_ids.py) skip pydantic's
        # check of each (a whole conversation's tokens, every turn).
        ids = body.get("prompt_token_ids")
        checked = type(ids) is KnownIds
        response = Response(
            id=body.get("id"),
            model=body.get("model"),
            message=head.message,
            finish_reason="error" if error else head.finish_reason,
            native_finish_reason=head.native_finish_reason,
            usage=_usage(body.get("usage")),
            choices=choices[1:],
            prompt_token_ids=None if checked else ids,
            token_ids=head.token_ids,
            logprobs=head.logprobs,
            error=error_from(error) if error else None,
            extra=extra,
        )
        if checked:
            response.prompt_token_ids = ids
        return response

    def assembler(self) -> ChatAssembler:
        return ChatAssembler(self)

    def reconcile(self, body: dict[str, Any], plan: Plan) -> None:
        if plan.caps.reasoning and "max_tokens" in body and plan.touched("max_tokens"):
            # Reasoning models refuse max_tokens: "Use 'max_completion_tokens' instead."
            value = body.pop("max_tokens")
            plan.changes.append(Override("max_tokens", value, None, f"{body.get('model')} is a reasoning model: "
                                         "it refuses max_tokens, sent as max_completion_tokens"))
            if "max_completion_tokens" not in body:
                replace(body, "max_completion_tokens", value, "renamed from max_tokens", plan.changes)
        reconcile_openai(body, plan, effort=("reasoning_effort",), refused_by_reasoning=(
            "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "logit_bias"))

    # -- network policy ------------------------------------------------------------------

    def mediate_network(self, body: dict[str, Any], domains: list[str] | None, *,
                        keep_previous: bool = False) -> Mediation:
        """``web_search_options`` (the search models search with it; it has no domain filter,
        so ``restrict`` strips it too), any tool that is not a function or a custom tool (the
        harness runs those; anything else, an OpenAI-compatible provider's hosted tool, the
        provider runs), and content parts the provider fetches: an ``image_url`` that is a
        URL (not ``data:``) and a ``file`` by ``file_id``."""
        changes: list[Override] = []
        search_only = mediate_tools(
            body, changes, kind=_hosted_tool, name=_tool_name, narrow=lambda tool: None, forced=_forced_tool,
            search=lambda t: "search" in str(t.get("type")))
        drop_key(body, "web_search_options", "web search options", changes)
        for i, message in enumerate(body.get("messages") or []):
            if not isinstance(message, dict) or not isinstance(message.get("content"), list):
                continue
            for j, part in enumerate(message["content"]):
                what = _remote_part(part)
                if what is not None:
                    message["content"][j] = {"type": "text", "text": REMOVED_PART.format(what=f"an {what}")}
                    changes.append(Override(f"messages.{i}.content.{j}", what, "text"))
        return Mediation(changes, search_only)

    def append_notice(self, body: dict[str, Any], notice: str) -> Override | None:
        return notice_first_user(body.get("messages"), "messages", notice, lambda: {"type": "text", "text": notice})

    def json_body(self, response: Response) -> dict[str, Any]:
        """The non-streamed ChatCompletion for a canonical response."""
        body: dict[str, Any] = {
            "id": response.id or "chatcmpl-interceptor",
            "object": "chat.completion",
            "created": response.extra.get("created", 0),
            "model": response.model or "",
            "choices": [
                {
                    "index": c.index,
                    "message": _native_message(c.message),
                    "finish_reason": _native_finish(c),
                    "logprobs": _native_logprobs(c.logprobs),
                    **({"token_ids": c.token_ids} if c.token_ids is not None else {}),
                }
                for c in _all_choices(response)
            ],
        }
        for key in ("system_fingerprint", "service_tier"):
            if key in response.extra:
                body[key] = response.extra[key]
        if response.usage is not None:
            body["usage"] = _native_usage(response.usage)
        if response.prompt_token_ids is not None:
            body["prompt_token_ids"] = response.prompt_token_ids
        return body

    def synthetic(self, response: Response, sse: bool, asked: dict[str, Any] | None) -> bytes:
        # The usage chunk only when the request asked for it (stream_options.include_usage).
        options = (asked or {}).get("stream_options")
        if sse and not (isinstance(options, dict) and options.get("include_usage")):
            response = response.model_copy(update={"usage": None})
        return super().synthetic(response, sse, asked)

    def stream_events(self, response: Response) -> list[SSEEvent]:
        """Chunks as OpenAI sends them: a role chunk, one delta per kind of content, a
        finish chunk per choice, the ``include_usage`` chunk, then ``[DONE]``."""
        body = self.json_body(response)
        base = {k: body[k] for k in ("id", "created", "model")}
        base["object"] = "chat.completion.chunk"
        for key in ("system_fingerprint", "service_tier"):
            if key in body:
                base[key] = body[key]
        chunks: list[dict[str, Any]] = []

        def chunk(index: int, delta: dict[str, Any], **more: Any) -> None:
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
            choice.update(more)
            chunks.append({**base, "choices": [choice]})

        for c in body["choices"]:
            i, msg = c["index"], c["message"]
            chunk(i, {"role": "assistant", "content": "", "refusal": None})
            if msg.get("reasoning_content"):
                chunk(i, {"reasoning_content": msg["reasoning_content"]})
            if msg["content"] is not None or c["logprobs"] or c.get("token_ids") is not None:
                more: dict[str, Any] = {"logprobs": c["logprobs"]}
                if c.get("token_ids") is not None:
                    more["token_ids"] = c["token_ids"]
                chunk(i, {"content": msg["content"] or ""}, **more)
            if msg["refusal"] is not None:
                chunk(i, {"refusal": msg["refusal"]})
            for j, call in enumerate(msg.get("tool_calls") or []):
                chunk(i, {"tool_calls": [{"index": j, **call}]})
            chunk(i, {}, finish_reason=c["finish_reason"])
        if "prompt_token_ids" in body:
            chunks[0]["prompt_token_ids"] = body["prompt_token_ids"]
        if "usage" in body:
            chunks.append({**base, "choices": [], "usage": body["usage"]})
        events = [SSEEvent(data=json.dumps(c, separators=(",", ":"), ensure_ascii=False)) for c in chunks]
        events.append(SSEEvent(data="[DONE]"))
        return events


@dataclass(slots=True)
class _ChoiceState:
    content: list[str] = field(default_factory=list)
    has_content: bool = False
    refusal: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    logprobs: list[Any] | None = None
    refusal_logprobs: list[Any] | None = None
    token_ids: list[int] | None = None

    def add_text(self, text: str) -> None:
        self.has_content = True
        if text:
            self.content.append(text)

    def add_call(self, position: int, frag: dict[str, Any]) -> None:
        slot = self.calls.get(frag.get("index", position))
        if slot is None:
            slot = self.calls[frag.get("index", position)] = {
                "id": None, "type": frag.get("type") or "function", "name": [], "args": []}
        if frag.get("id") and not slot["id"]:
            slot["id"] = frag["id"]
        if frag.get("type"):
            slot["type"] = frag["type"]
        inner = frag.get("custom") if slot["type"] == "custom" else frag.get("function")
        if inner:
            if inner.get("name"):
                slot["name"].append(inner["name"])
            piece = inner.get("input") if slot["type"] == "custom" else inner.get("arguments")
            if piece:
                slot["args"].append(piece)

    def native(self, index: int) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self.content) if self.has_content else None,
            "refusal": "".join(self.refusal) if self.refusal else None,
        }
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = [self._native_call(self.calls[k]) for k in sorted(self.calls)]
        logprobs = None
        if self.logprobs is not None or self.refusal_logprobs is not None:
            logprobs = {"content": self.logprobs, "refusal": self.refusal_logprobs}
        out = {"index": index, "message": message, "finish_reason": self.finish_reason, "logprobs": logprobs}
        if self.token_ids is not None:
            out["token_ids"] = self.token_ids
        return out

    @staticmethod
    def _native_call(slot: dict[str, Any]) -> dict[str, Any]:
        name, args = "".join(slot["name"]), "".join(slot["args"])
        if slot["type"] == "custom":
            return {"id": slot["id"], "type": "custom", "custom": {"name": name, "input": args}}
        return {"id": slot["id"], "type": "function", "function": {"name": name, "arguments": args}}


_HEAD = ("id", "model", "created", "system_fingerprint", "service_tier")
_PLAIN = frozenset(("index", "delta", "logprobs", "finish_reason"))  # a choice with nothing more
# What a text chunk may hold besides its one choice for its shape to be learned: the head, and
# OpenAI's obfuscation padding (stream_options.include_obfuscation, on by default), a hole.
_SHAPED = frozenset((*_HEAD, "object", "choices", "obfuscation"))
# A choice with its tokens (``_learn_tokens``); vLLM's ``stop_reason`` (null but on the last) is
# not read by ``fold``, so it is fixed text like the rest.
_TOKENS = _PLAIN | {"token_ids", "stop_reason"}


class ChatAssembler(NativeAssembler):
    """Chunks -> the ChatCompletion JSON -> ``parse_response``. Terminal: ``[DONE]`` (or an
    ``{"error": ...}`` event, after which OpenAI closes the stream)."""

    terminal = "data: [DONE]"
    shapes = True  # a text chunk (``_learn``)

    def __init__(self, dialect: ChatDialect):
        super().__init__(dialect)
        self.head: dict[str, Any] = {}
        self.usage: dict[str, Any] | None = None
        self.prompt_token_ids: list[int] | prompt_ids.Pending | None = None
        self.priors: Sequence[Prior] = ()  # the session's last prompt ids (``expect``)
        self.choices: dict[int, _ChoiceState] = {}
        self._open = list(_HEAD)  # head keys no chunk has given yet

    def _learn(self, obj: dict[str, Any], ch: dict[str, Any], state: _ChoiceState, event: SSEEvent) -> None:
        """A text chunk folded the full way: its shape, if it is nothing but the head, one
        choice's text and the padding (``quick`` then reads the next ones)."""
        if event.event is not None or len(obj["choices"]) != 1 or not obj.keys() <= _SHAPED:
            self._tries -= 1
            return
        holes = [(ch["delta"], "content")]
        if "obfuscation" in obj:
            if not isinstance(obj["obfuscation"], str):
                self._tries -= 1
                return
            holes.append((obj, "obfuscation"))
        # The sink appends the text as the full path does: this chunk set has_content, and an
        # empty string appended changes nothing the record joins.
        self.learn("data: ", event, obj, holes, state.content.append)

    def _learn_tokens(self, obj: dict[str, Any], ch: dict[str, Any], state: _ChoiceState, event: SSEEvent) -> None:
        """A text chunk with its tokens (vLLM's ``token_ids``, its ``logprobs`` entries),
        folded the full way: its shape, holes at the text, the ids and the list of entries
        (however many tokens the chunk holds, with or without alternatives), so the next
        ones are read from their bytes too (``quick``): what a session that collects tokens
        asks for, and every chunk of its stream carries."""
        lp = ch.get("logprobs")
        holes: list[tuple[dict[str, Any], str]] = [(ch["delta"], "content")]
        if event.event is not None or len(obj["choices"]) != 1 or not obj.keys() <= _SHAPED \
                or not ch.keys() <= _TOKENS:
            self._tries -= 1
            return
        ids = ch.get("token_ids") is not None
        if ids:
            holes.append((ch, "token_ids"))
        if lp is not None:
            # Not from a chunk without entries: an empty list would be learned as a list of ints.
            if type(lp) is not dict or not lp.keys() <= {"content", "refusal"} or lp.get("refusal") is not None \
                    or type(lp.get("content")) is not list or not lp["content"]:
                self._tries -= 1
                return
            holes.append((lp, "content"))
        logprobs = len(holes) - 1 if lp is not None else 0  # where the entries are among the values
        if "obfuscation" in obj:  # OpenAI's padding, with a harness's own logprobs: only checked
            holes.append((obj, "obfuscation"))

        def sink(values: list[Any]) -> None:
            state.add_text(values[0])
            if ids:
                state.token_ids.extend(values[1])
            if logprobs:
                state.logprobs.extend(values[logprobs])

        self.learn("data: ", event, obj, holes, sink, every=True)

    def feed(self, event: SSEEvent) -> bool:
        data = event.data
        if not self.done and (data == "[DONE]" or (len(data) < 64 and data.strip() == "[DONE]")):
            self.done = True
        return super().feed(event)

    def expect(self, priors: Sequence[Prior]) -> None:
        self.priors = priors

    def load(self, event: SSEEvent) -> dict[str, Any] | None:
        """vLLM's first chunk carries the prompt's ids: read past the ones the session's last
        answer carried (``dialects/prompt_ids.py``)."""
        data = event.data
        if self.prompt_token_ids is None and prompt_ids.KEY_TEXT in data:
            try:
                obj, self.prompt_read = prompt_ids.load(data.encode("utf-8", "surrogatepass"), self.priors, later=True)
            except ValueError:
                return super().load(event)  # no JSON: the full path says so
            return obj if isinstance(obj, dict) else None
        return super().load(event)

    def fold(self, obj: dict[str, Any], event: SSEEvent) -> bool:
        get = obj.get
        if get("error"):
            return self.fail(error_from(obj["error"]))
        if self._open:  # the head keys not seen yet (most streams never send some)
            head = self.head
            for key in self._open:
                if get(key) is not None:
                    head[key] = obj[key]
            self._open = [k for k in self._open if k not in head]
        if get("usage"):
            self.usage = obj["usage"]
        if get("prompt_token_ids") is not None:
            self.prompt_token_ids = obj["prompt_token_ids"]
        for ch in get("choices") or ():
            delta = ch.get("delta")
            if ch.keys() <= _PLAIN and type(delta) is dict and len(delta) == 1 and ch.get("finish_reason") is None \
                    and ch.get("logprobs") is None and type(delta.get("content")) is str:
                # The usual chunk: one piece of text and nothing else.
                state = self.choices.get(ch.get("index", 0))
                if state is not None:
                    state.add_text(delta["content"])
                    if self._tries:  # no shape yet, or this one did not match it (a new head)
                        self._learn(obj, ch, state, event)
                    continue
            state = self.choices.get(ch.get("index", 0))
            if state is None:
                state = self.choices[ch.get("index", 0)] = _ChoiceState()
            delta = ch.get("delta") or {}
            text = delta.get("content")
            if text is not None:
                state.has_content = True
                if text:
                    state.content.append(text)
            if delta.get("refusal"):
                state.refusal.append(delta["refusal"])
            thought = first(delta.get("reasoning_content"), delta.get("reasoning"))
            if isinstance(thought, str) and thought:
                state.reasoning.append(thought)
            for pos, frag in enumerate(delta.get("tool_calls") or []):
                state.add_call(pos, frag)
            lp = ch.get("logprobs")
            if lp:
                if lp.get("content") is not None:
                    state.logprobs = state.logprobs if state.logprobs is not None else []
                    state.logprobs.extend(lp["content"])
                if lp.get("refusal") is not None:
                    state.refusal_logprobs = state.refusal_logprobs if state.refusal_logprobs is not None else []
                    state.refusal_logprobs.extend(lp["refusal"])
            if ch.get("token_ids") is not None:
                state.token_ids = state.token_ids or []
                state.token_ids.extend(ch["token_ids"])
            if ch.get("finish_reason"):
                state.finish_reason = ch["finish_reason"]
            elif self._tries and (lp or ch.get("token_ids") is not None) and type(delta) is dict \
                    and len(delta) == 1 and type(text) is str:
                self._learn_tokens(obj, ch, state, event)
        return False

    def native(self) -> dict[str, Any]:
        """The ChatCompletion the chunks add up to (what the JSON endpoint would have sent)."""
        body: dict[str, Any] = {**self.head, "object": "chat.completion",
                                "choices": [self.choices[i].native(i) for i in sorted(self.choices)]}
        if self.usage is not None:
            body["usage"] = self.usage
        if self.prompt_token_ids is not None:  # joined to the record's only now (``prompt_ids.Pending``)
            body["prompt_token_ids"] = self.prompt_token_ids = prompt_ids.joined(self.prompt_token_ids)
        return body



CHAT = ChatDialect()

"""Canonical messages, requests and responses: the one vocabulary every dialect speaks.

Three wire formats (Chat Completions, Responses, Anthropic Messages) say the same things in
different shapes. Each dialect translates its shape into these models and back, so the graph,
the store and the retry logic never look at a wire format. Anything a dialect cannot map is
kept in ``extra`` rather than dropped: the trace must say exactly what the model saw.

These models cross the boundary to disk and to trainers, hence pydantic. Hashing is defined
here too because "the same message" must mean the same thing to every dialect.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any, Literal

import xxhash
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from interceptor.trace.escape import utf8

Role = Literal["system", "user", "assistant", "tool"]
Piece = Literal["reasoning", "content", "tool_call"]
FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "error"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class Part(_Model):
    """One piece of message content.

    Images and files are kept as references (a URL, or ``sha256:<hex>`` of inline data plus
    its media type), never as the base64 payload: the trace is read by trainers that need to
    know an image was there, and a screenshot's payload restated every turn would swamp the file.
    """

    type: Literal["text", "image", "file", "other"] = "text"
    text: str | None = None
    ref: str | None = None
    media_type: str | None = None
    data: dict[str, Any] | None = None  # the native block, for types we do not model


class ToolCall(_Model):
    """A call the model asked for. ``arguments`` is the raw string the model produced.

    For hashing the arguments are canonicalised (parsed and re-dumped with sorted keys) so the
    same call restated with different whitespace by another SDK still matches.
    """

    id: str
    name: str
    arguments: str = ""
    type: Literal["function", "custom"] = "function"
    namespace: str | None = None
    #: Native fields of the call that are not modelled but must travel back with it (the
    #: ``caller`` of a programmatic tool call, Anthropic or Responses). None when absent.
    extra: dict[str, Any] | None = None


class Reasoning(_Model):
    """Model reasoning and the opaque provider state that must travel back with it.

    Anthropic ``thinking`` carries ``signature``; ``redacted_thinking`` carries only
    ``encrypted``; Responses ``reasoning`` items carry ``summary`` text and
    ``encrypted_content``. The harness must send these back unchanged, so the graph hashes
    them: a harness that drops them has changed the conversation.
    """

    text: str = ""
    signature: str | None = None
    encrypted: str | None = None
    redacted: bool = False
    id: str | None = None


class Message(_Model):
    role: Role
    content: str | list[Part] = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning: list[Reasoning] = Field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None
    refusal: str | None = None
    is_error: bool = False  # a tool result the harness flagged as an error
    #: The order the pieces of an assistant turn came in, when it is not the canonical one
    #: (all reasoning, then the content, then the tool calls): one tag per piece, each taking
    #: the next item of its list. Interleaved thinking (think, call, think, call) needs it: a
    #: trainer's chat template renders the order the model produced. None when canonical.
    order: list[Piece] | None = None
    # message_hash's result: the graph asks for it several times per turn, and for a huge
    # message each hash is a pass over all of it. Reset on assignment and on copy. Read and
    # written through ``__pydantic_private__`` (a slot) by ``cached_hash``/``message_hash``:
    # ``message._hash`` goes through pydantic's ``__getattr__``, and a turn reads it several
    # times.
    _hash: str | None = PrivateAttr(default=None)
    # A read-only copy's index in the request it was handed with (``read_only``), for its
    # error and for the hook copies kept across calls; None on any other message.
    _at: int | None = PrivateAttr(default=None)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if not name.startswith("_"):
            self.__pydantic_private__["_hash"] = None

    def __eq__(self, other: object) -> bool:
        # The cached hash is not part of a message's value.
        if not isinstance(other, Message):
            return NotImplemented
        return self.__dict__ == other.__dict__

    __hash__ = None  # mutable, like every non-frozen pydantic model

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> Message:
        copy = super().model_copy(update=update, deep=deep)
        copy.__pydantic_private__["_hash"] = None
        return copy

    def pieces(self) -> list[tuple[Piece, Any]]:
        """Reasoning, content parts and tool calls in the order the model produced them."""
        content = [Part(text=self.content)] if isinstance(self.content, str) and self.content else (
            list(self.content) if isinstance(self.content, list) else [])
        lists: dict[str, list[Any]] = {"reasoning": list(self.reasoning), "content": content,
                                       "tool_call": list(self.tool_calls)}
        order = self.order or [k for k in ("reasoning", "content", "tool_call") for _ in lists[k]]
        out: list[tuple[Piece, Any]] = []
        for tag in order:
            if lists[tag]:
                out.append((tag, lists[tag].pop(0)))
        for tag in ("reasoning", "content", "tool_call"):  # anything an order left out, last
            out.extend((tag, item) for item in lists[tag])  # type: ignore[misc]
        return out

    def text(self) -> str:
        """The message's plain text (text parts joined), for transcripts and token estimates."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")


def piece_order(tags: list[Piece]) -> list[Piece] | None:
    """``tags`` as a ``Message.order``: None when it is the canonical order anyway."""
    rank = {"reasoning": 0, "content": 1, "tool_call": 2}
    return None if all(rank[a] <= rank[b] for a, b in zip(tags, tags[1:])) else list(tags)


class Tool(_Model):
    """A tool the harness advertised: a JSON-schema function, a freeform tool, or a client
    tool of the provider's (Anthropic ``bash_20250124`` etc., kept by ``type``)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    type: str = "function"
    namespace: str | None = None


class Sampling(_Model):
    """Effective decoding settings of one exchange, in canonical names.

    Canonical names are the dialect-neutral ones; each dialect maps them to its own
    (``max_tokens`` is Chat ``max_completion_tokens``, Responses ``max_output_tokens``,
    Anthropic ``max_tokens``; ``reasoning_effort`` is Responses ``reasoning.effort`` and
    Anthropic ``output_config.effort``).
    """

    model_config = ConfigDict(extra="forbid")

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    stop: list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    reasoning_effort: str | None = None
    thinking: dict[str, Any] | None = None
    tool_choice: Any = None
    n: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def set_fields(self) -> dict[str, Any]:
        """Only the settings that were given, for records and override diffs."""
        return self.model_dump(exclude_none=True)


class Usage(_Model):
    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    cache_creation_input_tokens: int = 0
    reasoning_tokens: int = 0
    estimated: bool = False  # counted locally (tiktoken) because the provider said nothing

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


class Request(_Model):
    """What the harness asked, canonical. ``model`` and ``sampling`` are as sent."""

    messages: list[Message] = Field(default_factory=list)
    tools: list[Tool] = Field(default_factory=list)
    model: str | None = None
    sampling: Sampling = Field(default_factory=Sampling)
    stream: bool = False
    extra: dict[str, Any] = Field(default_factory=dict)


_ATOMS = (str, int, float, bool, type(None))
# Fields typed as lists of numbers (a Response's tokens and log-probabilities, up to the whole
# prompt's): copied as one list, not number by number.
_NUMBERS = frozenset({"prompt_token_ids", "token_ids", "logprobs"})


def copied(value: Any) -> Any:
    """A deep copy of a value made of these models, lists, dicts and JSON atoms, without
    ``model_copy(deep=True)``'s cost (it goes through ``copy.deepcopy`` and its memo for
    every field). Strings are shared: they cannot change. Anything else is deep-copied.
    A model is rebuilt with pydantic's ``model_construct`` (its fields as they were set, its
    private values kept), as a plain class when it was a ``read_only`` one; one of atoms
    only is its own ``model_copy()``, the cheaper of the two, and deep for it."""
    if isinstance(value, _ATOMS):
        return value
    if isinstance(value, list):
        return [copied(v) for v in value]
    if isinstance(value, dict):
        return {k: copied(v) for k, v in value.items()}
    if isinstance(value, _Model):
        thawed = _THAWED.get(type(value))
        if thawed is None:
            for v in value.__dict__.values():
                if not isinstance(v, _ATOMS):
                    break
            else:
                return value.model_copy()
        private = value.__pydantic_private__ or {}
        if thawed is not None and "_at" in private:  # a read-only copy's index goes with it
            private = {k: v for k, v in private.items() if k != "_at"}
        return (thawed or type(value)).model_construct(
            set(value.model_fields_set),
            **{k: list(v) if k in _NUMBERS and isinstance(v, list) else copied(v) for k, v in value.__dict__.items()},
            **private)
    return copy.deepcopy(value)


class ReadOnly(TypeError):
    """A request hook changed a message the conversation already holds, or the request's
    tools: raised where the change is made. A hook may change only the request's new user
    and tool messages; the others, and the tools, are handed as ``read_only`` copies."""


_NESTED = ("this is part of a message in the conversation already, or of the request's tools, which a "
           "request hook may not change; it may change only the new user and tool messages")


def _unchanged(base: type, name: str) -> Any:
    """``base``'s method ``name`` for a read-only container: tried on a plain copy, and
    refused (``ReadOnly``) only if that changed it. A hook that sets what is there already
    (a redaction run over every message, the stored ones redacted before) changes nothing,
    as before read-only copies, when it was compared after the call."""
    method = getattr(base, name)

    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        trial = base(self)
        result = method(trial, *args, **kwargs)
        if trial != self:
            raise ReadOnly(_NESTED)
        return self if result is trial else result

    guarded.__name__ = name
    return guarded


def _read_only_container(base: type) -> type:
    """``base`` (list or dict) whose every changing method is ``_unchanged``'s; its copies,
    deep copies and pickles are plain ``base``."""
    changing = {list: ("append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse",
                       "__setitem__", "__delitem__", "__iadd__", "__imul__"),
                dict: ("__setitem__", "__delitem__", "__ior__", "clear", "pop", "popitem", "setdefault",
                       "update")}[base]
    return type(f"read_only_{base.__name__}", (base,), {
        "__slots__": (), "__module__": __name__, "__doc__": f"A {base.__name__} no method changes.",
        **{name: _unchanged(base, name) for name in changing},
        "__copy__": lambda self: base(self),
        "__deepcopy__": lambda self, memo: copy.deepcopy(base(self), memo),
        "__reduce__": lambda self: (base, (base(self),)),
    })


_List = _read_only_container(list)
_Dict = _read_only_container(dict)


def _refuse_field(self: Any, name: str, *value: Any) -> None:
    """A read-only model's ``__setattr__`` (and ``__delattr__``): setting a field to what it
    holds already changes nothing and passes (see ``_unchanged``); anything else is refused."""
    if value and name in self.__dict__ and self.__dict__[name] == value[0]:
        return
    if isinstance(self, Message):
        at = (self.__pydantic_private__ or {}).get("_at")
        raise ReadOnly(f"message {at} ({self.role}) is in the conversation already; a request hook may change "
                       "only the new user and tool messages")
    if isinstance(self, Tool):
        raise ReadOnly(f"tool {self.name!r}: a request hook may not change the request's tools")
    raise ReadOnly(_NESTED)


def _read_only_class(cls: type[_Model]) -> type[_Model]:
    """``cls`` whose fields cannot be set. It equals a ``cls`` of the same fields (pydantic's
    own equality wants the same class); ``copy``, ``deepcopy``, ``model_copy`` and pickling
    of one give a plain ``cls`` (``copied``), free to change."""

    def __eq__(self: Any, other: object) -> bool:
        if not isinstance(other, cls):
            return NotImplemented
        return self.__dict__ == other.__dict__

    return type(cls.__name__, (cls,), {
        "__module__": __name__, "__qualname__": f"read_only.{cls.__name__}",
        "__setattr__": _refuse_field, "__delattr__": _refuse_field, "__eq__": __eq__, "__hash__": None,
        "__copy__": lambda self: copied(self), "__deepcopy__": lambda self, memo=None: copied(self),
        "__reduce_ex__": lambda self, protocol: (copied, (copied(self),)),
        "model_copy": lambda self, *, update=None, deep=False: _thawed_copy(self, update),
    })


def _thawed_copy(value: _Model, update: dict[str, Any] | None) -> _Model:
    new = copied(value)
    for key, v in (update or {}).items():
        setattr(new, key, v)
    return new


def read_only(value: Any, at: int | None = None) -> Any:
    """A deep copy, as ``copied``, that cannot be changed: its models' fields cannot be set
    and its lists and dicts have no method that changes them (``ReadOnly``). What a request
    hook is handed of the messages the conversation already holds: a change to one is the
    hook's error where it is made, so the proxy need not compare every copy with its
    message after each call (a pass over the whole history, every turn). ``at``: a message's index in the request, for the error."""
    if isinstance(value, _ATOMS):
        return value
    if isinstance(value, list):
        return _List([read_only(v) for v in value])
    if isinstance(value, dict):
        return _Dict({k: read_only(v) for k, v in value.items()})
    if isinstance(value, _Model):
        cls = _READ_ONLY.get(type(value)) or (type(value) if type(value) in _THAWED else None)
        if cls is None:
            return copied(value)
        private = value.__pydantic_private__ or {}
        if isinstance(value, Message):
            private = {**private, "_at": at}
        return cls.model_construct(set(value.model_fields_set),
                                   **{k: read_only(v) for k, v in value.__dict__.items()}, **private)
    return copy.deepcopy(value)


_READ_ONLY: dict[type, type] = {cls: _read_only_class(cls) for cls in (Message, Part, ToolCall, Reasoning, Tool)}
_THAWED: dict[type, type] = {ro: cls for cls, ro in _READ_ONLY.items()}


class Choice(_Model):
    """One sampled alternative (Chat ``n > 1``); the first is ``Response.message``."""

    index: int
    message: Message
    finish_reason: FinishReason | None = None
    native_finish_reason: str | None = None
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None


class ResponseError(_Model):
    type: str
    message: str
    status: int | None = None


class Response(_Model):
    """What the model answered, canonical; the JSON path and the stream assembler of a
    dialect must produce equal instances for the same answer."""

    id: str | None = None
    model: str | None = None
    message: Message = Field(default_factory=lambda: Message(role="assistant"))
    finish_reason: FinishReason | None = None
    native_finish_reason: str | None = None
    usage: Usage | None = None
    choices: list[Choice] = Field(default_factory=list)  # extra choices beyond the first
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    error: ResponseError | None = None
    extra: dict[str, Any] = Field(default_factory=dict)


def canonical_json(value: Any) -> str:
    """Stable JSON: sorted keys, no whitespace, non-ASCII kept. The basis of every hash."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_arguments(arguments: str) -> str:
    """Tool-call arguments in canonical JSON when they parse, else the raw string."""
    try:
        return canonical_json(json.loads(arguments))
    except (ValueError, TypeError):
        return arguments


def cached_hash(message: Message) -> str | None:
    """``message_hash(message)`` if it was computed since the message last changed, else None."""
    return message.__pydantic_private__["_hash"]


def message_hash(message: Message) -> str:
    """A stable identity for a message: equal for the same content however it was restated.

    Covers role, content, tool calls (canonical arguments), tool call id, reasoning and opaque
    provider state; excludes nothing the model saw. Used by the graph to reuse a prefix.
    """
    private = message.__pydantic_private__  # set by every constructor, copy and validation
    h = private["_hash"]
    if h is not None:
        return h
    if _plain(message):
        # What model_dump(exclude_defaults=True) gives for a role and a text, without calling it.
        data: dict[str, Any] = {"role": message.role}
        if message.content:
            data["content"] = message.content
    else:
        data = _dumped(message)
    # utf8: a lone surrogate (valid JSON) must not make the hash raise (trace/escape.py).
    h = private["_hash"] = hashlib.sha256(utf8(canonical_json(_digest_long_strings(data)))).hexdigest()
    return h


def _plain(message: Message) -> bool:
    """A message of a role and text alone: every other field at its default."""
    return (isinstance(message.content, str) and not message.tool_calls and not message.reasoning
            and message.tool_call_id is None and message.name is None and message.refusal is None
            and message.is_error is False and message.order is None)


def _dumped(message: Message) -> dict[str, Any]:
    """The message's fields for its hash: defaults left out, tool-call arguments canonical,
    an all-text content list as the one string it is to the model."""
    data = message.model_dump(exclude_defaults=True)
    for call in data.get("tool_calls", []):
        call["arguments"] = canonical_arguments(call.get("arguments", ""))
    if isinstance(data.get("content"), list) and all(
        p.get("type", "text") == "text" for p in data["content"]
    ):
        # A single text block and a plain string are the same message to the model.
        data["content"] = "".join(p.get("text") or "" for p in data["content"])
    if data.get("content") == "":
        data.pop("content")
    return data


# Strings longer than this stand in the hash as their own digest. Low: Python's JSON encoder
# escapes a string character by character, many times slower than a digest reads it. The
# hash lives in memory only (the graph's index, a trace's reader): no file holds it, so the
# threshold and the digest may change between versions.
_LONG = 1 << 10


def _digest_long_strings(value: Any) -> Any:
    """Long strings (a pasted file, a huge tool output) stand in the hash as their own
    XXH3-128 digest, so hashing a huge message is one pass over its bytes instead of a
    JSON dump of it on the event loop. Equal strings still hash equal.

    XXH3-128, not sha256: many times faster, for the one string every turn of a long
    conversation hashes new. It stands for the string inside the message's sha256, in
    memory only, and the graph's index prefers a stored message that is equal,
    not just equal in hash (``Graph._match``); Retry's body digest makes the same choice."""
    if isinstance(value, str):
        if len(value) > _LONG:
            return "xxh3:" + xxhash.xxh3_128_hexdigest(value.encode("utf-8", "surrogatepass"))
        return value
    if isinstance(value, dict):
        return {k: _digest_long_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_digest_long_strings(v) for v in value]
    return value


def restated_hash(message: Message) -> str | None:
    """The hash a harness's restatement of a sampled ``message`` has when it sends the
    reply back without its reasoning (a Chat harness that never returns vLLM's
    ``reasoning_content``, a client that omits past thinking blocks); None for a message
    without reasoning, whose restatement is just ``message_hash``."""
    if not message.reasoning:
        return None
    return message_hash(message.model_copy(update={"reasoning": []}))

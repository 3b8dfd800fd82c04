"""What every translation shares: the ``Translation`` and ``EventTranslator`` interfaces, the
assembler that records a translated stream, and the helpers for Chat bodies and overrides.

The pair modules (``anthropic_chat``, ``gemini_chat``, ``responses_chat``) import these, and
the package's ``__init__`` imports the pairs for its registry: kept in the package's
``__init__``, they made every pair import the package that imports it.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from interceptor.dialects.base import Dialect, Override, StreamAssembler
from interceptor.dialects.common import NativeAssembler
from interceptor.dialects.prompt_ids import Prior, PromptRead
from interceptor.dialects.sse import SSEEvent
from interceptor.trace import export
from interceptor.trace.messages import Message, Request, Response

#: The reason every override of a translation carries.
TRANSLATION = "translation"


class Lost:
    """What a translation could not carry, as overrides (reason ``translation``): call it
    with the key (dotted, with indices: ``messages[2].content[0]``) and the value dropped."""

    def __init__(self) -> None:
        self.overrides: list[Override] = []

    def __call__(self, key: str, old: Any) -> None:
        self.overrides.append(Override(key, old, None, TRANSLATION))


Part = Callable[[dict[str, Any], str, Lost], "dict[str, Any] | None"]


def chat_content(content: Any, where: str, lost: Lost, part: Part, *,
                 text_only: frozenset[str] | None = None) -> str | list[dict[str, Any]]:
    """A harness's content (a string or blocks) as Chat content: each block through ``part``
    (None: not expressible, recorded by ``part``); with ``text_only`` (the block types that
    are text), any other block is recorded as lost (Chat's tool messages take text only)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, block in enumerate(content):
        if text_only is not None and block.get("type") not in text_only:
            lost(f"{where}[{j}]", block)
            continue
        out = part(block, f"{where}[{j}]", lost)
        if out is not None:
            parts.append(out)
    return parts


def chat_request(body: dict[str, Any], out: dict[str, Any], lost: Lost,
                 handled: set[str]) -> tuple[dict[str, Any], list[Override]]:
    """The end of every translation into Chat: a stream asks for the usage chunk (what the
    other dialects' final events carry), every key of the harness's body not ``handled`` is
    recorded as lost."""
    if body.get("stream"):
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    for key, value in body.items():
        if key not in handled:
            lost(key, value)
    return out, lost.overrides


def chat_messages(conversation: list[Message]) -> list[dict[str, Any]]:
    """Canonical messages as Chat messages (the trace's own export), for a conversation the
    proxy sends from the record (a chain it resolves) or from a canonical parse. Inline
    images and files are canonical as hashes, not bytes: those parts cannot be sent and are
    left out (an image by URL goes as its URL); the caller records what that loses."""
    kept = [m.model_copy(update={"content": [p for p in m.content if p.type == "text" or (
        p.type == "image" and p.ref and not p.ref.startswith("sha256:"))]}) if isinstance(m.content, list) else m
        for m in conversation]
    return export.chat_messages(kept)


def upstream_message(status: int, body: Any) -> str:
    """The message of an upstream's error body: OpenAI's ``{"error": {...}}``, vLLM's older
    flat ``{"message": ...}``, else the status."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message") or "")
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return body["message"]
    return f"the upstream answered HTTP {status}"


def content_text(content: Any) -> str:
    """Chat content (a string, text parts or None) as its text."""
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return content or ""


def first_choice(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Chat answer's choice 0 (the other dialects have no ``n``) and its message."""
    choices = [c for c in body.get("choices") or () if isinstance(c, dict)]
    choice = next((c for c in choices if c.get("index", 0) == 0), choices[0] if choices else {})
    return choice, choice.get("message") or {}


# One encoder for every event: ``json.dumps`` with arguments builds a new one per call, a
# few µs of each translated event's budget.
compact = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def sse(name: str, data: dict[str, Any]) -> SSEEvent:
    """One named SSE event with compact JSON data, as Anthropic and Responses frame theirs."""
    return SSEEvent(event=name, data=compact(data))


def chat_usage(raw: dict[str, Any] | None) -> tuple[int, int, int, int]:
    """A Chat usage object as ``(prompt, cached, completion, reasoning)`` token counts."""
    raw = raw or {}
    return (raw.get("prompt_tokens") or 0, (raw.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            raw.get("completion_tokens") or 0, (raw.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0)


class EventTranslator(ABC):
    """One answer's stream, translated event by event. ``feed`` returns the source dialect's
    events for one target event (often none, sometimes several), O(event)."""

    @abstractmethod
    def feed(self, event: SSEEvent) -> list[SSEEvent]: ...


class ChatEvents(EventTranslator):
    """Reads a Chat Completions stream for a translator into another dialect: ``start`` on
    the first chunk, ``delta`` for each delta of choice 0 (the other dialects have no ``n``),
    ``finish`` at its finish reason, ``fail`` for an error chunk, ``end`` at ``[DONE]``; the
    usage chunk is kept in ``usage``. Each hook appends the events it makes to ``out``."""

    def __init__(self) -> None:
        self.started = False
        self.ended = False
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None

    def feed(self, event: SSEEvent) -> list[SSEEvent]:
        if self.ended:
            return []
        out: list[SSEEvent] = []
        if event.data.strip() == "[DONE]":
            self.ended = True
            self.end(out)
            return out
        try:
            obj = json.loads(event.data)
        except ValueError:
            return out
        if not isinstance(obj, dict):
            return out
        if obj.get("error"):
            self.ended = True
            err = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
            self.fail(err, out)
            return out
        if not self.started:
            self.started = True
            self.start(obj, out)
        if obj.get("usage"):
            self.usage = obj["usage"]
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            self.delta(choice.get("delta") or {}, out)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.finish(choice, out)
        return out

    @abstractmethod
    def start(self, chunk: dict[str, Any], out: list[SSEEvent]) -> None: ...

    @abstractmethod
    def delta(self, delta: dict[str, Any], out: list[SSEEvent]) -> None: ...

    @abstractmethod
    def finish(self, choice: dict[str, Any], out: list[SSEEvent]) -> None: ...

    @abstractmethod
    def fail(self, error: dict[str, Any], out: list[SSEEvent]) -> None: ...

    @abstractmethod
    def end(self, out: list[SSEEvent]) -> None: ...


class Translation(ABC):
    source: ClassVar[Dialect]  # what the harness speaks
    target: ClassVar[Dialect]  # what the upstream speaks
    #: The target's model route the translated request is sent to (before the base URL).
    path: ClassVar[str]
    #: Request headers of the harness's API that mean nothing to the upstream (removed).
    source_headers: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def request(self, body: dict[str, Any]) -> tuple[dict[str, Any], list[Override]]:
        """The harness's body as a target body, and what could not be carried over."""

    def bind(self, request: Request) -> Translation:
        """This translation for one exchange, when its answer depends on the request (the
        canonical one, as the harness sent it); stateless translations are their own."""
        return self

    def prefix(self, target: dict[str, Any], conversation: list[Any]) -> bool:
        """Put the recorded ``conversation`` (canonical messages) a chained request continues
        (Responses' ``previous_response_id``) in front of the translated body ``target``, in
        place; False when this translation has no chains."""
        return False

    @abstractmethod
    def response(self, body: dict[str, Any]) -> dict[str, Any]:
        """A target JSON answer as the source's JSON answer."""

    @abstractmethod
    def events(self) -> EventTranslator:
        """A fresh translator for one streamed answer."""

    def error(self, status: int, body: Any) -> dict[str, Any]:
        """The target's error body as the source's, for the same status."""
        return self.source.error_body(status, upstream_message(status, body))

    def stream_error(self, message: str) -> bytes:
        """The bytes that end a stream the proxy could not translate, in the source's shape."""
        return SSEEvent(event="error", data=json.dumps(self.source.error_body(502, message))).encode()

    def recorded(self, native: dict[str, Any], upstream: Response) -> Response:
        """The turn as the harness receives it (``native``: the target's whole JSON answer,
        assembled or read), with what only the upstream knows: token ids and logprobs."""
        response = self.source.parse_response(self.response(native))
        response.prompt_token_ids = upstream.prompt_token_ids
        response.token_ids = upstream.token_ids
        response.logprobs = upstream.logprobs
        return response

    def assembler(self) -> StreamAssembler:
        return TranslatedAssembler(self)


class TranslatedAssembler(StreamAssembler):
    """The target's own assembler over the upstream's events (its terminal event, its
    errors, its token ids), whose result is given as the harness received it."""

    def __init__(self, translation: Translation) -> None:
        self.translation = translation
        self.inner = translation.target.assembler()
        assert isinstance(self.inner, NativeAssembler)
        # The upstream's usual events, read from their bytes (the Tee's shortcut).
        self.shapes, self.quick = self.inner.shapes, self.inner.quick

    @property
    def done(self) -> bool:  # type: ignore[override]
        return self.inner.done

    def feed(self, event: SSEEvent) -> bool:
        return self.inner.feed(event)

    def expect(self, priors: Sequence[Prior]) -> None:
        self.inner.expect(priors)

    @property
    def prompt_read(self) -> PromptRead | None:  # type: ignore[override]
        return self.inner.prompt_read

    @property
    def matched(self) -> re.Match[str] | None:  # type: ignore[override]
        return self.inner.matched

    def result(self) -> Response:
        upstream = self.inner.result()
        if upstream.error is not None:
            return upstream
        return self.translation.recorded(self.inner.native(), upstream)

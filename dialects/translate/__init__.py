"""Translation between wire formats: a harness on one API, an upstream that serves another.

The people who train inside harnesses serve their policy with vLLM or SGLang, which speak
Chat Completions; Claude Code speaks Messages. A ``Translation`` carries one harness dialect
(``source``) to one upstream dialect (``target``) and back: the request body, the answer as
JSON, the answer as a stream one event at a time (``events``: no buffering beyond the event
in flight), and the upstream's error re-shaped into the harness's (status and headers stay
the flow's). What one side cannot express is returned as an ``Override`` with reason
``translation`` and goes on the call's record; nothing is dropped without saying so.

The record of a translated turn is the answer as the harness received it (``recorded``), so
the harness's restatement next turn hashes equal to it, with the upstream's token ids,
prompt ids and logprobs, which are what the model produced for exactly the translated
request.

This package depends on the dialects only (and, through them, on ``trace``).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from interceptor.dialects.base import Dialect, Override, StreamAssembler
from interceptor.dialects.common import NativeAssembler
from interceptor.dialects.sse import SSEEvent
from interceptor.trace.messages import Response

#: The reason every override of a translation carries.
TRANSLATION = "translation"


class EventTranslator(ABC):
    """One answer's stream, translated event by event. ``feed`` returns the source dialect's
    events for one target event (often none, sometimes several), O(event)."""

    @abstractmethod
    def feed(self, event: SSEEvent) -> list[SSEEvent]: ...


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

    @abstractmethod
    def response(self, body: dict[str, Any]) -> dict[str, Any]:
        """A target JSON answer as the source's JSON answer."""

    @abstractmethod
    def events(self) -> EventTranslator:
        """A fresh translator for one streamed answer."""

    @abstractmethod
    def error(self, status: int, body: Any) -> dict[str, Any]:
        """The target's error body as the source's, for the same status."""

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

    @property
    def done(self) -> bool:  # type: ignore[override]
        return self.inner.done

    def feed(self, event: SSEEvent) -> bool:
        return self.inner.feed(event)

    def result(self) -> Response:
        upstream = self.inner.result()
        if upstream.error is not None:
            return upstream
        return self.translation.recorded(self.inner.native(), upstream)


def _pairs() -> dict[tuple[str, str], Translation]:
    from interceptor.dialects.translate.anthropic_chat import ANTHROPIC_CHAT

    return {(t.source.name, t.target.name): t for t in (ANTHROPIC_CHAT,)}


_PAIRS: dict[tuple[str, str], Translation] | None = None


def translation(source: str, target: str) -> Translation | None:
    """The translation from the harness's dialect ``source`` to the upstream's ``target``,
    or None when there is none (the request is then refused, never forwarded)."""
    global _PAIRS
    if _PAIRS is None:
        _PAIRS = _pairs()
    return _PAIRS.get((source, target))


def pairs() -> list[tuple[str, str]]:
    """Every ``(harness dialect, upstream dialect)`` the proxy translates."""
    translation("", "")
    return sorted(_PAIRS or {})

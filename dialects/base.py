"""One interface, three wire formats.

The addons never branch on a format: they ask the flow's dialect to parse, to impose the
session's settings, to assemble a stream, to write an error. Each dialect is stateless (one
shared instance per format); per-exchange state lives in the ``StreamAssembler`` it makes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from interceptor.dialects.sse import SSEEvent
from interceptor.trace.messages import Request, Response, ResponseError, Sampling


@dataclass(slots=True)
class Override:
    """One change the proxy made to a request body: which key, what it was, what it is now,
    and why (``session`` for the session's settings, a sentence for a provider constraint).
    ``new`` is ``None`` when the key was removed. Never holds a credential."""

    key: str
    old: Any
    new: Any
    reason: str = "session"

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "old": self.old, "new": self.new, "reason": self.reason}


class StreamAssembler(ABC):
    """Builds a ``Response`` from a stream one event at a time, O(event) per call.

    ``feed`` returns True when the event is the format's terminal event (after it has been
    folded in), so the tee can commit the turn before forwarding the bytes that carry it.
    A stream that ends without a terminal event is an error, not a turn: ``result()`` then
    carries ``error``.
    """

    done: bool = False

    @abstractmethod
    def feed(self, event: SSEEvent) -> bool: ...

    @abstractmethod
    def result(self) -> Response: ...


class Dialect(ABC):
    name: ClassVar[str]
    #: Appended to an upstream ``base_url`` (which includes the version prefix, like SDKs).
    endpoint: ClassVar[str]
    #: The provider's own error shape when the proxy answers itself.
    provider: ClassVar[Literal["openai", "anthropic"]]

    @abstractmethod
    def parse_request(self, body: dict[str, Any]) -> Request: ...

    @abstractmethod
    def parse_response(self, body: dict[str, Any]) -> Response: ...

    @abstractmethod
    def assembler(self) -> StreamAssembler: ...

    @abstractmethod
    def apply_overrides(
        self, body: dict[str, Any], model: str | None, sampling: Sampling
    ) -> list[Override]:
        """Make the session authoritative, in place: set ``model`` when given, drop every
        decoding key the harness sent (temperature, top_p/top_k, budgets, seed, penalties,
        reasoning effort, thinking), apply the session's in this dialect's names, then
        reconcile what the provider would reject. Keys that are the harness's contract with
        its own code (tool choice, stop sequences, ``n``, logprobs) are replaced only when the
        session sets them; a required key (Anthropic ``max_tokens``) stays when the session
        gives none. Returns every change; an empty list means the body is untouched (and the
        proxy forwards the original bytes)."""

    @abstractmethod
    def stream_events(self, response: Response) -> list[SSEEvent]:
        """A canonical response as this format's native SSE events, terminal event last."""

    @abstractmethod
    def json_body(self, response: Response) -> dict[str, Any]:
        """A canonical response as this format's non-streamed JSON body. With
        ``stream_events`` this is how a rewritten or synthesised answer reaches a harness;
        ``parse_response(json_body(r)) == r`` for a response in this dialect's normal form."""

    def is_stream(self, body: dict[str, Any]) -> bool:
        return bool(body.get("stream"))

    def error_body(self, status: int, message: str, type: str | None = None) -> dict[str, Any]:
        """The format's own error JSON for an answer the proxy gives itself."""
        return error_body(self.provider, status, message, type)

    def response_error(self, status: int, body: Any) -> ResponseError:
        """An upstream error answer as a record: the provider's type and message if the body
        has its shape, else the status alone."""
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict):
            return ResponseError(
                type=str(err.get("type") or err.get("code") or "error"),
                message=str(err.get("message") or ""),
                status=status,
            )
        return ResponseError(type="http_error", message=f"HTTP {status}", status=status)

    def auth_headers(self, key: str) -> dict[str, str]:
        if self.provider == "anthropic":
            return {"x-api-key": key}
        return {"authorization": f"Bearer {key}"}


_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",  # a body over intercept_max_body (the proxy's own answer)
    429: "rate_limit_error",
    502: "api_error",
    503: "api_error",
}
_ANTHROPIC_TYPES = {
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


def error_body(
    provider: str, status: int, message: str, type: str | None = None
) -> dict[str, Any]:
    if provider == "anthropic":
        return {
            "type": "error",
            "error": {"type": type or _ANTHROPIC_TYPES.get(status, "api_error"), "message": message},
        }
    code = {401: "invalid_api_key"}.get(status)
    return {
        "error": {
            "message": message,
            "type": type or _OPENAI_TYPES.get(status, "server_error"),
            "param": None,
            "code": code,
        }
    }

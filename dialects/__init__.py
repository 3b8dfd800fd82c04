"""The wire formats the proxy understands, and which one a request speaks.

``resolve`` is the only place that maps a method and path to a dialect: the claim addon asks
it for every request to a provider host, and anything it does not know is answered locally
(404) rather than forwarded with a key. Model routes are recorded as turns; side routes
(token counting, model lists) are claimed and relayed but never become turns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from interceptor.dialects.anthropic import ANTHROPIC, AnthropicDialect
from interceptor.dialects.base import Dialect, Override, StreamAssembler, error_body
from interceptor.dialects.chat import CHAT, ChatDialect
from interceptor.dialects.responses import RESPONSES, ResponsesDialect

__all__ = [
    "ANTHROPIC",
    "CHAT",
    "DIALECTS",
    "RESPONSES",
    "AnthropicDialect",
    "ChatDialect",
    "Dialect",
    "Override",
    "ResponsesDialect",
    "Route",
    "StreamAssembler",
    "error_body",
    "resolve",
]

DIALECTS: dict[str, Dialect] = {d.name: d for d in (CHAT, RESPONSES, ANTHROPIC)}


@dataclass(frozen=True, slots=True)
class Route:
    """What a request is: its dialect, and whether it is a model call (``model``: recorded as
    a turn) or a side call (``side``: claimed, given the session's model, relayed, not
    recorded)."""

    dialect: Dialect
    kind: Literal["model", "side"]


_ROUTES: dict[tuple[str, str], Route] = {
    ("POST", "/v1/chat/completions"): Route(CHAT, "model"),
    ("POST", "/v1/responses"): Route(RESPONSES, "model"),
    # Codex's WebSocket transport: a GET upgrade on the same path, then response.* events.
    ("GET", "/v1/responses"): Route(RESPONSES, "model"),
    ("POST", "/v1/messages"): Route(ANTHROPIC, "model"),
    ("POST", "/v1/messages/count_tokens"): Route(ANTHROPIC, "side"),
    ("POST", "/v1/responses/input_tokens"): Route(RESPONSES, "side"),
}


def resolve(method: str, path: str, provider: str | None = None) -> Route | None:
    """The route for ``method path`` (query string allowed, e.g. ``/v1/messages?beta=true``),
    or None when the proxy should answer locally with 404.

    ``provider`` (``"anthropic"`` or ``"openai"``, from the host) only decides the dialect of
    ``GET /v1/models``, which both providers serve in their own shapes.
    """
    path = path.split("?", 1)[0].split("#", 1)[0]
    if len(path) > 1:
        path = path.rstrip("/")
    method = method.upper()
    route = _ROUTES.get((method, path))
    if route is not None:
        return route
    if method == "GET" and (path == "/v1/models" or (path.startswith("/v1/models/") and len(path) > 11)):
        return Route(ANTHROPIC if provider == "anthropic" else CHAT, "side")
    return None

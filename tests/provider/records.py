"""What the simulator saw: one `RequestRecord` per request, in arrival order.

Tests of the proxy assert on what reached the provider (the imposed model, the swapped
key, the stripped sampling keys), so headers are kept as sent and looked up without
regard to case, and the body is kept as bytes next to its parsed JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping
from urllib.parse import parse_qs, urlsplit


class Headers(Mapping[str, str]):
    """Case-insensitive, read-only; repeated headers are joined with ", "."""

    def __init__(self, items: Iterable[tuple[str, str]] = ()) -> None:
        self._items = list(items)
        self._lookup: dict[str, str] = {}
        for name, value in self._items:
            key = name.lower()
            self._lookup[key] = f"{self._lookup[key]}, {value}" if key in self._lookup else value

    def __getitem__(self, name: str) -> str:
        return self._lookup[name.lower()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._lookup

    def __iter__(self) -> Iterator[str]:
        seen = set()
        for name, _ in self._items:
            if name.lower() not in seen:
                seen.add(name.lower())
                yield name

    def __len__(self) -> int:
        return len(self._lookup)

    def get_all(self, name: str) -> list[str]:
        return [v for k, v in self._items if k.lower() == name.lower()]

    def items_raw(self) -> list[tuple[str, str]]:
        """As received: original case, order and repeats."""
        return list(self._items)

    def __repr__(self) -> str:
        return f"Headers({self._items!r})"


# Routes that generate a model answer and consume a scripted reply.
MODEL_ROUTES = ("chat", "responses", "messages", "gemini")


@dataclass
class RequestRecord:
    method: str
    path: str  # with the query string
    headers: Headers
    body: bytes
    time: float
    route: str | None = None  # "chat" | "responses" | "messages" | "count_tokens" | ...
    key: str | None = None  # what keyed scripts match: x-sim-key, else the API key
    reply: Any = None  # the Reply that answered it (model routes)
    json: Any = field(default=None)
    # "websocket": a Responses WebSocket upgrade (route "websocket") or one of its
    # `response.create` frames (route "responses", or "responses_warmup" for generate=false).
    transport: str = "http"
    # Strict mode: the rule this request broke (a `strict.Refusal`), answered instead of a reply.
    refusal: Any = None

    def __post_init__(self) -> None:
        if self.json is None and self.body:
            try:
                self.json = json.loads(self.body)
            except ValueError:
                self.json = None

    @property
    def query(self) -> dict[str, list[str]]:
        return parse_qs(urlsplit(self.path).query, keep_blank_values=True)

    @property
    def route_path(self) -> str:
        return urlsplit(self.path).path

    @property
    def is_model_request(self) -> bool:
        return self.route in MODEL_ROUTES

    @property
    def stream(self) -> bool:
        if self.transport == "websocket":
            return True  # every WebSocket answer is a stream of events
        if self.route == "gemini":
            return ":streamGenerateContent" in self.route_path  # Gemini says so in the path
        return isinstance(self.json, dict) and self.json.get("stream") is True

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (the standalone server's `GET /_sim/requests`)."""
        return {
            "method": self.method,
            "path": self.path,
            "headers": self.headers.items_raw(),
            "body": self.body.decode("utf-8", "replace"),
            "json": self.json,
            "time": self.time,
            "route": self.route,
            "key": self.key,
            "transport": self.transport,
        }

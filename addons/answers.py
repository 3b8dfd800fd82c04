"""Answers the proxy gives itself, in the shape the harness's SDK expects.

Every such answer that a retry cannot fix carries ``x-should-retry: false``: the Anthropic
and OpenAI SDKs honour it, and Claude Code otherwise retries a 401 for minutes.
"""

from __future__ import annotations

import json
from typing import Any

from mitmproxy import http

from interceptor.dialects.base import Dialect


def json_response(status: int, body: Any, *, retry: bool = False, headers: dict[str, str] | None = None) -> http.Response:
    h = {"content-type": "application/json", "x-should-retry": "true" if retry else "false"}
    if headers:
        h.update(headers)
    return http.Response.make(status, json.dumps(body).encode(), h)


def error_response(dialect: Dialect, status: int, message: str, *, type: str | None = None, retry: bool = False) -> http.Response:
    """An error in the dialect's own shape, so the harness's SDK reads it as the provider's.
    ``message`` must never contain a secret or key."""
    return json_response(status, dialect.error_body(status, message, type), retry=retry)


def refuse(flow: http.HTTPFlow, response: http.Response) -> None:
    """Answer a request the proxy will not forward. It never becomes an exchange: bad input
    leaves no record, so the flow's exchange (if Claim made one) is dropped."""
    flow.response = response
    flow.metadata.pop("interceptor", None)


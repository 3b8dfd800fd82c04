"""Answers the proxy gives itself, in the shape the harness's SDK expects.

Every such answer that a retry cannot fix carries ``x-should-retry: false``: the Anthropic
and OpenAI SDKs honour it, and Claude Code otherwise retries a 401 for minutes.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from mitmproxy import http
from pydantic import BaseModel, ValidationError

from interceptor.dialects.base import Dialect


def json_response(status: int, body: Any, *, retry: bool = False, headers: dict[str, str] | None = None) -> http.Response:
    h = {"content-type": "application/json", "x-should-retry": "true" if retry else "false"}
    if headers:
        h.update(headers)
    return http.Response.make(status, json.dumps(body).encode(), h)


def api_error(status: int, message: str, **more: Any) -> http.Response:
    """An error of the proxy's own API (``/_interceptor/``): plain JSON, no dialect's shape."""
    return json_response(status, {"error": {"message": message, "status": status}, **more})


M = TypeVar("M", bound=BaseModel)


def read_body(model: type[M], content: bytes | None, what: str, empty: bytes = b"") -> M | http.Response:
    """A control API body as ``model``, or the 400 naming each bad field (``what``: whose
    body, for the message)."""
    from interceptor.addons.gateway.sessions.upstream import format_validation_error

    try:
        return model.model_validate(json.loads(content or empty))
    except ValidationError as e:
        return api_error(400, f"bad {what}: {format_validation_error(e)}")
    except ValueError as e:
        return api_error(400, f"{what} is not JSON: {e}")


def error_response(dialect: Dialect, status: int, message: str, *, type: str | None = None, retry: bool = False) -> http.Response:
    """An error in the dialect's own shape, so the harness's SDK reads it as the provider's.
    ``message`` must never contain a secret or key."""
    return json_response(status, dialect.error_body(status, message, type), retry=retry)


def refuse(flow: http.HTTPFlow, response: http.Response) -> None:
    """Answer a request the proxy will not forward. It never becomes an exchange: bad input
    leaves no record, so the flow's exchange (if Claim made one) is dropped."""
    flow.response = response
    flow.metadata.pop("interceptor", None)


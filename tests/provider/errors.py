"""Error answers in each provider family's own shape.

OpenAI: `{"error": {"message", "type", "param", "code"}}` (pretty-printed like its other
bodies). Anthropic: `{"type": "error", "error": {"type", "message"}, "request_id"}`
(compact; matches the captured 429 and 400 byte for byte in length). The SDKs pick the
exception class from the status, and the proxy's retry logic from `x-should-retry`.
"""

from __future__ import annotations

import json
from typing import Any

from . import wire
from .reply import Reply

_OPENAI = {
    400: ("invalid_request_error", None, "Invalid request."),
    401: ("invalid_request_error", "invalid_api_key", "Incorrect API key provided."),
    403: ("invalid_request_error", "unsupported_country_region_territory", "Country, region, or territory not supported"),
    404: ("invalid_request_error", "model_not_found", "The model does not exist or you do not have access to it."),
    409: ("invalid_request_error", None, "Conflict."),
    422: ("invalid_request_error", None, "Unprocessable entity."),
    429: ("requests", "rate_limit_exceeded", "Rate limit reached for requests. Please try again later."),
    500: ("server_error", None, "The server had an error while processing your request. Sorry about that!"),
    502: ("server_error", None, "Bad gateway."),
    503: ("server_error", None, "The engine is currently overloaded, please try again later."),
}

_ANTHROPIC = {
    400: ("invalid_request_error", "Invalid request."),
    401: ("authentication_error", "invalid x-api-key"),
    403: ("permission_error", "Your API key does not have permission to use the specified resource."),
    404: ("not_found_error", "Not found."),
    413: ("request_too_large", "Request exceeds the maximum allowed number of bytes."),
    429: ("rate_limit_error", "This request would exceed your organization's rate limit. Please try again later."),
    500: ("api_error", "Internal server error"),
    504: ("timeout_error", "Request timed out"),
    529: ("overloaded_error", "Overloaded"),
}


def openai_error(status: int, reply: Reply) -> dict[str, Any]:
    kind, code, message = _OPENAI.get(status, _OPENAI[500] if status >= 500 else _OPENAI[400])
    return {
        "error": {
            "message": reply.error_message or message,
            "type": reply.error_type or kind,
            "param": reply.error_param,
            "code": reply.error_code if reply.error_code is not None else code,
        }
    }


def anthropic_error(status: int, reply: Reply, request_id: str) -> dict[str, Any]:
    kind, message = _ANTHROPIC.get(status, _ANTHROPIC[500] if status >= 500 else _ANTHROPIC[400])
    return {
        "type": "error",
        "error": {"type": reply.error_type or kind, "message": reply.error_message or message},
        "request_id": request_id,
    }


def body(family: str, status: int, reply: Reply, request_id: str) -> bytes:
    """The whole error body; `reply.error_body` (dict, str or bytes) replaces it."""
    custom = reply.error_body
    if isinstance(custom, bytes):
        return custom
    if isinstance(custom, str):
        return custom.encode()
    if family == "anthropic":
        return wire.compact(custom if custom is not None else anthropic_error(status, reply, request_id)).encode()
    return wire.pretty(custom if custom is not None else openai_error(status, reply))


def headers(family: str, status: int, reply: Reply) -> dict[str, str]:
    out: dict[str, str] = {}
    should_retry = reply.should_retry
    if should_retry is None and family == "anthropic":
        # The real API sends it on every error (captures: 429 -> true, 400 -> false).
        should_retry = status in (408, 409, 429) or status >= 500
    if should_retry is not None:
        out["x-should-retry"] = json.dumps(bool(should_retry))
    if reply.retry_after is not None:
        out["retry-after"] = str(reply.retry_after)
    return out

"""What the client raises: one exception per control-API answer an evaluator handles
differently, each carrying the server's own message.

A refused session config is a ``BadRequest`` whether the client caught it before sending
(the same pydantic model the proxy validates with, the same message) or the proxy did; a
duplicate id is a ``Conflict``; a proxy that cannot be reached or started is a
``ProxyUnavailable``. Every control-API error is a ``ControlError`` with ``status`` and
``message``.
"""

from __future__ import annotations

from typing import Any


class InterceptorError(Exception):
    """Anything the client raises on purpose."""


class ProxyUnavailable(InterceptorError):
    """The proxy did not start, exited, or does not answer at its URL."""


class ControlError(InterceptorError):
    """The control API answered with an error: ``status``, the server's ``message`` and the
    whole JSON ``body``."""

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.body = body


class BadRequest(ControlError, ValueError):
    """400: a session config or seal the proxy refuses (or would refuse: checked client-side)."""


class Unauthorized(ControlError):
    """401: no admin token, or the wrong one."""


class NotFound(ControlError):
    """404: no such session (or endpoint)."""


class Conflict(ControlError):
    """409: a session with that id exists already."""


class Gone(ControlError):
    """410: the session is sealed and its secrets are no longer handed out."""


class Unavailable(ControlError):
    """503: the proxy is up but cannot finish the request now (its trace writer is behind)."""


_BY_STATUS = {400: BadRequest, 401: Unauthorized, 404: NotFound, 409: Conflict, 410: Gone, 503: Unavailable}


def error_for(status: int, body: Any) -> ControlError:
    """The typed exception for a control-API error answer."""
    message = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        message = body["error"].get("message")
    if not message:
        message = body if isinstance(body, str) and body else f"HTTP {status} without an error message"
    return _BY_STATUS.get(status, ControlError)(status, str(message), body)

"""The orchestrator's routes for an upstream's weights (admin token): its version, and a pause
for the moment its weights are swapped.

    GET  /_interceptor/upstreams                  every declared upstream, with its version and pause
    GET  /_interceptor/upstreams/<name>           one
    PUT  /_interceptor/upstreams/<name>/version   {"version": 7}: the weights it serves from now on
    POST /_interceptor/upstreams/<name>/pause     {"timeout": 60}: hold new requests, wait for the sent ones
    POST /_interceptor/upstreams/<name>/resume    release the held requests, in arrival order

A declared version is a ``version`` record in every live session of that upstream, at once
(calls sent after it carry it). ``pause`` answers when every request already sent has
finished, or after ``timeout`` seconds with the ones still running listed (``drained``
false): the orchestrator decides whether to swap anyway. Pausing twice, or resuming an
upstream that is not paused, changes nothing. The state lives in
``addons/gateway/sessions/weights.py``; these routes only read and change it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mitmproxy import http
from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, field_validator

from interceptor.addons.gateway.answers import api_error, json_response, read_body
from interceptor.addons.gateway.sessions.upstream import DEFAULT
from interceptor.addons.gateway.sessions.weights import parse_version
from interceptor.trace.model import Version

if TYPE_CHECKING:
    from interceptor.addons.gateway.sessions.session import Registry

VERSION_MAX = 200  # characters of a named version


class VersionBody(BaseModel):
    """The body of ``PUT /_interceptor/upstreams/<name>/version``: a number, or a name (a
    checkpoint's); a name of digits is the number."""

    model_config = ConfigDict(extra="forbid")

    version: Version

    @field_validator("version")
    @classmethod
    def _version(cls, v: Version) -> Version:
        if isinstance(v, str):
            if not v.strip() or len(v) > VERSION_MAX:
                raise ValueError(f"a version is a number or a name of 1-{VERSION_MAX} characters")
            return parse_version(v)
        if isinstance(v, bool) or v < 0:
            raise ValueError("a version number is a whole number, 0 or more")
        return v


class PauseBody(BaseModel):
    """The body of ``POST /_interceptor/upstreams/<name>/pause`` (optional): how long the call
    waits for the requests already sent to finish."""

    model_config = ConfigDict(extra="forbid")

    timeout: FiniteFloat = Field(default=60.0, ge=0, le=3600)


class UpstreamRoutes:
    def __init__(self, registry: Registry, settings) -> None:
        self.registry = registry
        self.settings = settings

    async def handle(self, req: http.Request, parts: list[str]) -> http.Response:
        """``parts``: the path after ``/_interceptor/``, split (its first is ``upstreams``)."""
        if len(parts) == 1:
            if req.method != "GET":
                return api_error(405, "use GET to list the upstreams")
            return json_response(200, {"upstreams": [self._state(n) for n in self._names()]})
        name = parts[1]
        if name not in self._names():
            return api_error(404, f"no upstream {name!r} is declared (declared: {', '.join(self._names()) or 'none'})")
        weights = self.registry.weights.of(name)
        if len(parts) == 2:
            if req.method != "GET":
                return api_error(405, "use GET on an upstream")
            return json_response(200, self._state(name))
        action = parts[2] if len(parts) == 3 else None
        if action == "version":
            if req.method != "PUT":
                return api_error(405, "use PUT on an upstream's version")
            body = read_body(VersionBody, req.content, "version body")
            if isinstance(body, http.Response):
                return body
            weights.declare(body.version)
            for session in self.registry.all():
                if session.weights is weights and not session.sealed:
                    session.recorder.record_version(name, body.version, weights.declared_at)
            return json_response(200, self._state(name))
        if action == "pause":
            if req.method != "POST":
                return api_error(405, "use POST to pause an upstream")
            body = read_body(PauseBody, req.content, "pause body", b"{}")
            if isinstance(body, http.Response):
                return body
            weights.pause()
            running = await weights.drained(body.timeout)
            return json_response(200, {**self._state(name), "drained": not running, "running": running})
        if action == "resume":
            if req.method != "POST":
                return api_error(405, "use POST to resume an upstream")
            released = weights.resume()
            return json_response(200, {**self._state(name), "released": released})
        return api_error(404, f"no such endpoint: {req.method} {req.path}")

    def _names(self) -> list[str]:
        """The declared upstreams, and ``default``: the one the default session's options
        declare, or else where a session without a declared upstream goes (the provider host
        its harness addressed), whose weights it shares."""
        names = list(self.settings.upstreams)
        return names if DEFAULT in names else [*names, DEFAULT]

    def _state(self, name: str) -> dict:
        declared = self.settings.upstreams.get(name)
        return {**(declared.public() if declared is not None else {"name": name}),
                **self.registry.weights.of(name).public()}

"""Claim: every request to a provider host belongs to a session, or it never leaves the proxy.

The secret is where the harness puts its API key (the dialect knows: ``x-api-key``,
``Authorization: Bearer``, ``x-goog-api-key``, a ``key`` query parameter) or in the proxy URL (``HTTPS_PROXY=http://rollout:<secret>@host:port``, which arrives as the
CONNECT's ``Proxy-Authorization``). Paths on a provider host that are not model routes
(telemetry, settings, plugin lists) are answered locally: no egress, no key.
"""

from __future__ import annotations

import logging

from mitmproxy import connection, http

from interceptor.addons.gateway.answers import error_response, json_response
from interceptor.addons.gateway.exchange import KEY, Exchange
from interceptor.addons.mitm.proxyauth import proxy_auth_secret
from interceptor.addons.gateway.sessions.session import Registry
from interceptor.addons.mitm.settings import Settings
from interceptor.dialects import host_dialect, local_answer, resolve
from interceptor.dialects.base import header

log = logging.getLogger(__name__)


class Claim:
    def __init__(self, registry: Registry, settings: Settings) -> None:
        self.registry = registry
        self.settings = settings
        self._tunnel_secrets: dict[str, str] = {}

    def http_connect(self, flow: http.HTTPFlow) -> None:
        value = flow.request.headers.pop("proxy-authorization", None)
        if value:
            secret = proxy_auth_secret(value)
            if secret:
                self._tunnel_secrets[flow.client_conn.id] = secret

    def client_disconnected(self, client: connection.Client) -> None:
        self._tunnel_secrets.pop(client.id, None)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live or flow.metadata.get("interceptor_control"):
            return
        host = flow.request.host.lower()
        if host not in self.settings.hosts:
            return  # not a provider: pass through untouched
        route = resolve(flow.request.method, flow.request.path, host=host)
        if route is None and (answer := local_answer(flow.request.method, flow.request.path, host)) is not None:
            flow.response = json_response(200, answer)
            flow.metadata["interceptor_local"] = True
            return
        if route is None:
            flow.response = error_response(
                host_dialect(host), 404,
                f"{flow.request.method} {flow.request.path.split('?')[0]} is not a model route; "
                "the interceptor answers it locally and forwards nothing",
            )
            flow.metadata["interceptor_local"] = True
            return
        dialect = route.dialect
        secret = (
            self._tunnel_secrets.get(flow.client_conn.id)
            or proxy_auth_secret(header(flow.request.headers, "proxy-authorization", ""))
            or dialect.secret(flow.request.headers, flow.request.query)
        )
        if not secret:
            flow.response = error_response(
                dialect, 401,
                "no session secret: set the harness's API key variable to the session's model secret",
            )
            return
        session = self.registry.by_model_secret(secret)
        if session is None:
            if self.registry.by_state_secret(secret) is not None:
                message = "a state secret cannot be used on a model route; use the session's model secret"
            else:
                message = "unknown session secret: it matches no session of this proxy"
            flow.response = error_response(dialect, 401, message)
            return
        if session.sealed:
            flow.response = error_response(dialect, 401, f"session {session.id!r} is sealed; start a new one")
            return
        flow.metadata[KEY] = Exchange(session=session, route=route)

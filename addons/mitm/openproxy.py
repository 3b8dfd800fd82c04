"""OpenProxyGuard: a proxy reachable beyond loopback relays only for its sessions.

Only model routes ask for a session secret; everything else a harness reaches (package
indexes, git, any host) is relayed untouched. On 127.0.0.1 that is the harness's own network
access. Listening on another address, it would be an open relay for anyone who can reach the
port. So then every connection must present a live session's secret in
``Proxy-Authorization`` (``HTTPS_PROXY=http://session:<secret>@host:port``, which the env
handed to a harness says): a CONNECT, or a plain proxied request outside a tunnel, without
one is answered 407 and goes nowhere. ``intercept_open_proxy=true`` is the operator saying
an open relay is what they want; the banner says which of the two it is.

The control API is exempt (its own admin token guards it). Listed before TlsGuard and Claim,
which read the same header (Claim removes it).
"""

from __future__ import annotations

import logging

from mitmproxy import connection, ctx, http

from interceptor.addons.mitm.claim import proxy_auth_secret
from interceptor.addons.gateway.sessions.session import Registry
from interceptor.addons.mitm.settings import exposed_hosts
from interceptor.dialects.base import header

log = logging.getLogger(__name__)

class OpenProxyGuard:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._authorized: set[str] = set()  # client connections that presented a secret
        self._open = False  # intercept_open_proxy (``configure``)
        self._exposed = False  # listening beyond loopback (``configure``)

    def configure(self, updated: set[str]) -> None:
        # Read when they change, not per request (``regular_mode``): parsing the modes is not free.
        if updated & {"mode", "listen_host", "intercept_open_proxy"}:
            self._open = ctx.options.intercept_open_proxy
            self._exposed = bool(exposed_hosts())

    @property
    def enforcing(self) -> bool:
        # Behind a front (intercept_worker) every connection comes from loopback, whoever
        # opened it: the worker cannot tell, so it asks for the secret as if exposed.
        return not self._open and (self._exposed or self.registry.worker is not None)

    def client_disconnected(self, client: connection.Client) -> None:
        self._authorized.discard(client.id)

    def http_connect(self, flow: http.HTTPFlow) -> None:
        if self.enforcing and not self._admit(flow):
            flow.response = _refusal()

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live or flow.metadata.get("interceptor_control"):
            return
        if self.enforcing and flow.client_conn.id not in self._authorized and not self._admit(flow):
            flow.response = _refusal()

    def _admit(self, flow: http.HTTPFlow) -> bool:
        secret = proxy_auth_secret(header(flow.request.headers, "proxy-authorization", ""))
        session = self.registry.by_model_secret(secret) if secret else None
        if session is None or session.sealed:
            log.info(f"interceptor: refused {flow.request.method} {flow.request.host}:{flow.request.port} from "
                     f"{flow.client_conn.peername[0] if flow.client_conn.peername else '?'}: no live session secret "
                     "in Proxy-Authorization (the proxy listens beyond loopback)")
            return False
        self._authorized.add(flow.client_conn.id)
        return True


def _refusal() -> http.Response:
    return http.Response.make(
        407,
        b"This proxy listens beyond loopback and relays only for its sessions: put the session's model "
        b"secret in the proxy URL, HTTPS_PROXY=http://session:<secret>@host:port\n",
        {"content-type": "text/plain", "proxy-authenticate": 'Basic realm="llm-interceptor"'},
    )

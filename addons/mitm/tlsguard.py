"""TlsGuard: a harness that does not trust the proxy's CA is named, not left to hang.

A client that rejects the certificate mitmproxy forges for a provider host aborts the
handshake, and most harnesses then retry quietly forever (Claude Code does): from the
outside the rollout just hangs, and no request ever reaches the addons that would record
something. The only trace of it is mitmproxy's ``tls_failed_client`` hook, so this addon
turns that into a warning that says what to do and a count on the session's summary
(``tls_rejections``), which ``scripts/run_harness.py`` watches.

The session is known only when the harness put its secret in the proxy URL
(``HTTPS_PROXY=http://rollout:<secret>@host:port``, as run_harness does): the CONNECT's
``Proxy-Authorization`` arrives before the handshake, a request's key header never does.
Listed before Claim, which removes that header.
"""

from __future__ import annotations

import logging

from mitmproxy import connection, http, tls

from interceptor.addons.mitm.claim import proxy_auth_secret
from interceptor.addons.gateway.sessions.session import Registry
from interceptor.addons.mitm.settings import Settings

log = logging.getLogger(__name__)

ADVICE = (
    "point the harness at the CA bundle the session's env names: NODE_EXTRA_CA_CERTS (Node: "
    "Claude Code), CODEX_CA_CERTIFICATE (Codex), SSL_CERT_FILE / REQUESTS_CA_BUNDLE (Python)"
)


class TlsGuard:
    def __init__(self, registry: Registry, settings: Settings) -> None:
        self.registry = registry
        self.settings = settings
        # client connection id -> (host of its CONNECT, secret in its Proxy-Authorization)
        self._tunnels: dict[str, tuple[str, str | None]] = {}

    def http_connect(self, flow: http.HTTPFlow) -> None:
        secret = proxy_auth_secret(flow.request.headers.get("proxy-authorization", ""))
        self._tunnels[flow.client_conn.id] = (flow.request.host.lower(), secret)

    def client_disconnected(self, client: connection.Client) -> None:
        self._tunnels.pop(client.id, None)

    def tls_failed_client(self, data: tls.TlsData) -> None:
        client = data.context.client
        connect_host, secret = self._tunnels.get(client.id, ("", None))
        host = (client.sni or connect_host).lower()
        if host not in self.settings.hosts:
            return  # only provider hosts are intercepted; anything else is not ours
        session = self.registry.by_model_secret(secret) if secret else None
        whose = f"session {session.id!r}" if session else "a client (no session secret in its proxy URL)"
        if session is not None:
            session.tls_rejections += 1
        log.warning(
            f"interceptor: {whose} rejected the proxy's certificate for {host} "
            f"({client.error or 'handshake failed'}); it does not trust the mitmproxy CA: {ADVICE}"
        )

"""Egress: a rollout whose network policy sets ``egress`` reaches no host outside its allow
list through the proxy (the policy itself, ``NetworkPolicy``, is in ``network.py``).

An addon above the session (it finds sessions in the Registry by the secret a connection
showed); the policy it applies sits below the session, which holds it in its config.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from mitmproxy import http

from interceptor.addons.gateway.policy.network import canonical_host
from interceptor.addons.mitm.proxyauth import proxy_auth_secret

if TYPE_CHECKING:
    from interceptor.addons.gateway.sessions.session import Registry
    from interceptor.addons.mitm.settings import Settings

log = logging.getLogger(__name__)

# A session secret's or admin token's shape (as a host name folds it): never in a record.
_SECRET_SHAPED = re.compile(r"sk-ic-|ic-admin-")


class Egress:
    """``network.egress``: every way a request can leave the proxy for a host that is no
    provider's, outside the allow list of a session whose secret the connection carried in
    its proxy credentials, is refused (403) and recorded: one ``egress`` record per refusal
    with the count so far for its host.

    Two hooks see every way out, and both decide by ``_check``: ``http_connect`` for a
    CONNECT, ``requestheaders`` for every other request, where mitmproxy has already chosen
    the destination it will connect to (``flow.request.host``/``port``) from whatever form
    the request took: an absolute-form target, an origin-form ``Host``, HTTP/2's
    ``:authority``, a WebSocket upgrade, or a tunnel's own address. The host is compared in
    its canonical spelling (``canonical_host``). A connection that showed a session's secret
    once is that session's for every later request on it, with or without the header.
    Listed before Claim, which takes the CONNECT's ``Proxy-Authorization``; the proxy's own
    API (answered here, never forwarded) is not a way out."""

    def __init__(self, registry: Registry, settings: Settings) -> None:
        self.registry = registry
        self.settings = settings
        self._bound: dict[str, set[str]] = {}  # client connection -> ids of the sessions it showed

    def client_disconnected(self, client) -> None:
        self._bound.pop(client.id, None)

    def http_connect(self, flow: http.HTTPFlow) -> None:
        self._check(flow)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live or flow.metadata.get("interceptor_control"):
            return
        self._check(flow)

    def _sessions(self, flow: http.HTTPFlow) -> list:
        bound = self._bound.get(flow.client_conn.id)
        value = flow.request.headers.get("proxy-authorization", "")
        secret = proxy_auth_secret(value) if value else None
        session = self.registry.by_model_secret(secret) if secret else None
        if session is not None and session.config.network is not None and session.config.network.egress:
            if bound is None:
                bound = self._bound[flow.client_conn.id] = set()
            bound.add(session.id)
        if not bound:
            return []
        return [s for sid in bound if (s := self.registry.get(sid)) is not None and not s.sealed]

    def _check(self, flow: http.HTTPFlow) -> None:
        sessions = self._sessions(flow)
        if not sessions:
            return
        host, port = canonical_host(flow.request.host), flow.request.port
        if host is not None and host in self.settings.hosts:  # claimed: the model routes' own rules apply
            return
        for session in sessions:
            if session.config.network.allows(flow.request.host):
                continue
            shown = host or "(not a host name)"
            if _SECRET_SHAPED.search(shown):  # a rollout cannot write a secret into its trace this way
                shown = "(withheld: shaped like a secret of the proxy)"
            count = session.egress.get(shown, 0) + 1
            session.egress[shown] = count
            session.recorder.record_egress(shown, port, count)
            flow.response = http.Response.make(
                403, f"interceptor: {shown} is outside this rollout's network allow list\n".encode(),
                {"content-type": "text/plain"})
            log.info(f"interceptor: session {session.id!r}: egress to {shown}:{port} refused (network policy)")
            return

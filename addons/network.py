"""Network policy: what a rollout may reach, through the provider and around it.

A task whose network is restricted must not let the model fetch the answer through the
provider: hosted web search and fetch, code execution, remote files, MCP servers the
provider calls, and conversation state the provider holds are all ways out. The session's
``network`` config says what to do with them (``provider_tools``):

- ``allow``: nothing is changed (the default);
- ``strip``: every capability the provider executes for the model is removed from the
  request, per dialect (each dialect knows its own: ``Dialect.mediate_network``), over HTTP,
  side routes and WebSocket frames alike. Each removal is an override with reason
  ``network_policy`` whose old value names the kind, never the content;
- ``restrict``: web search and fetch stay when every ``allow`` rule is ``*.domain``, narrowed
  to the intersection of the policy's domains and what the harness asked (never wider);
  everything else is stripped.

A request that exists only to search (its only tools were removed provider tools and its
tool choice forced one, as Claude Code's WebSearch call does) is answered here, in the
dialect's shape, with a search-unavailable reply: nothing goes upstream, the call is on the
record. ``notice`` appends a fixed sentence to the first user message of every restricted
request. ``egress`` refuses (403) and records every way out of the proxy to a non-provider
host outside the allow list, on a connection that carried the session's secret (``Egress``):
this covers what honours ``HTTPS_PROXY``; it is not a sandbox.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import uuid
from typing import TYPE_CHECKING, Literal

from mitmproxy import http
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from interceptor.addons.proxyauth import proxy_auth_secret
from interceptor.dialects.base import Dialect, Mediation
from interceptor.dialects.common import NETWORK_POLICY
from interceptor.trace.messages import Message, Response, Usage

if TYPE_CHECKING:
    from interceptor.addons.exchange import Exchange
    from interceptor.addons.session import Registry
    from interceptor.addons.settings import Settings

log = logging.getLogger(__name__)

REASON = NETWORK_POLICY  # never undone by Feedback: a provider's 400 does not reopen the network
NOTICE = ("Note: this environment's network is restricted. Web search, web fetch, code execution "
          "and remote files of the model provider are not available; work with what is here.")
SEARCH_UNAVAILABLE = ("Web search is not available: this environment's network policy does not allow "
                      "the provider's search tools. Answer without searching.")


def _rule(value: str) -> str:
    value = value.strip().lower()
    if not value:
        raise ValueError("an empty host rule")
    body = value[2:] if value.startswith("*.") else value
    if value != "*" and (not body or "*" in body or "/" in body or ":" in body):
        raise ValueError(f"{value!r} is not a host rule: use '*', '*.example.com' or 'host.example.com'")
    return value


class NetworkPolicy(BaseModel):
    """The session's ``network`` config. Host rules: ``*`` (every host), ``*.example.com``
    (example.com and every name under it), ``host.example.com`` (that host only)."""

    model_config = ConfigDict(extra="forbid")

    allow: list[str] = Field(default_factory=lambda: ["*"])
    block: list[str] = Field(default_factory=list)
    provider_tools: Literal["allow", "strip", "restrict"] = "allow"
    notice: bool = False
    egress: bool = False

    @field_validator("allow", "block")
    @classmethod
    def _rules(cls, rules: list[str]) -> list[str]:
        return [_rule(r) for r in rules]

    @model_validator(mode="after")
    def _one_list(self) -> NetworkPolicy:
        if self.block and self.allow != ["*"]:
            raise ValueError("network: give an allow list or a block list, not both (a block list "
                             'applies to allow ["*"])')
        return self

    @property
    def restricted(self) -> bool:
        """Anything at all is held back (what ``notice`` announces)."""
        return self.provider_tools != "allow" or self.allow != ["*"] or bool(self.block)

    def search_domains(self) -> list[str] | None:
        """The domains web search may keep under ``restrict``: every allow rule is
        ``*.domain`` (else None: strip it). ``*`` is no restriction to keep it under."""
        if self.provider_tools != "restrict" or self.block or not self.allow:
            return None
        if not all(r.startswith("*.") for r in self.allow):
            return None
        return [r[2:] for r in self.allow]

    def allows(self, host: str) -> bool:
        """``host`` in any spelling (``canonical_host``); one that is no host name at all
        is never allowed."""
        host = canonical_host(host)
        if host is None:
            return False
        if any(_matches(r, host) for r in self.block):
            return False
        return any(_matches(r, host) for r in self.allow)


_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")
# A session secret's or admin token's shape (as a host name folds it): never in a record.
_SECRET_SHAPED = re.compile(r"sk-ic-|ic-admin-")


def canonical_host(host: str) -> str | None:
    """The host a connection would reach, in the one spelling the policy compares: what the
    resolver does to a name done here first, so no spelling of a host matches a rule the
    host itself does not. IDNA to ASCII (which also folds case and width), no trailing dot;
    an IP literal in any notation the resolver takes (``127.1``, ``2130706433``,
    ``0x7f000001``, ``0177.0.0.1``, ``::ffff:127.0.0.1``) as its plain address. None: not a
    host name (fail closed: refused)."""
    host = (host or "").strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        mapped = getattr(ip, "ipv4_mapped", None)
        return str(mapped or ip)
    try:
        name = host.encode("idna").decode("ascii").lower()
    except UnicodeError:
        return None
    name = name[:-1] if name.endswith(".") else name
    try:  # getaddrinfo reads these as IPv4 numbers, not names (inet_aton's forms)
        return socket.inet_ntoa(socket.inet_aton(name))
    except OSError:
        pass
    return name if _NAME.fullmatch(name) else None


def _matches(rule: str, host: str) -> bool:
    if rule == "*":
        return True
    if rule.startswith("*."):
        return host == rule[2:] or host.endswith(rule[1:])
    return host == rule


def mediate(dialect: Dialect, body: dict, policy: NetworkPolicy | None, *, known_previous: bool = False) -> Mediation:
    """The policy applied to one request body in place (a model request, a side route's body
    or a WebSocket frame): the provider's own capabilities stripped or narrowed, the notice
    appended. ``known_previous``: the body's provider-held conversation
    (``previous_response_id``) is one this session recorded, so it holds nothing from outside."""
    if policy is None or not policy.restricted:
        return Mediation()
    out = Mediation()
    if policy.provider_tools != "allow":
        out = dialect.mediate_network(body, policy.search_domains(), keep_previous=known_previous)
    if policy.notice and not out.search_only:
        change = dialect.append_notice(body, NOTICE)
        if change is not None:
            out.overrides.append(change)
    for o in out.overrides:
        o.reason = REASON
    return out


def answer_search_only(flow: http.HTTPFlow, ex: Exchange) -> None:
    """Answer a search-only request here, in the dialect's shape (its stream when it asked
    for one), and put the call on the record; nothing goes upstream."""
    from interceptor.addons.answers import json_response
    from interceptor.addons.record import make_call

    dialect = ex.dialect
    model = ex.dialect.requested_model(ex.body, flow.request.path)
    response = Response(id=f"interceptor-{uuid.uuid4().hex[:24]}", model=model,
                        message=Message(role="assistant", content=SEARCH_UNAVAILABLE),
                        finish_reason="stop", usage=Usage(input_tokens=0, output_tokens=0))
    if ex.stream:
        data = b"".join(e.encode() for e in dialect.stream_events(response))
        flow.response = http.Response.make(200, data, {"content-type": "text/event-stream",
                                                       "cache-control": "no-cache"})
    else:
        flow.response = json_response(200, dialect.json_body(response))
    flow.response.headers["x-interceptor-local"] = "search_unavailable"
    ex.committed = True
    call = make_call(ex, flow, response, None, status=200)
    ex.session.recorder.record_call(call)
    log.info(f"interceptor: session {ex.session.id!r}: a search-only request was answered locally "
             "(network policy); nothing was forwarded")


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

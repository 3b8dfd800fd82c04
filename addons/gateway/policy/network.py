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
host outside the allow list, on a connection that carried the session's secret (``Egress``,
in ``egress.py``): this covers what honours ``HTTPS_PROXY``; it is not a sandbox.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from interceptor.dialects.base import Dialect, Mediation
from interceptor.dialects.common import NETWORK_POLICY

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

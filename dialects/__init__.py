"""The wire formats the proxy understands, and which one a request speaks.

``REGISTRY`` is the one list of dialects: adding an API is its module and one line there.
Everything the addons need to know about a provider they ask a dialect (``base.Dialect``);
the functions here only search the registry:

- ``resolve`` maps a method and path (and the host, when known) to a dialect and a kind.
  The host's own dialects are asked first, then the others, so a path keeps meaning what it
  means wherever it is sent (``/v1/messages`` is Anthropic's on any host the operator
  intercepts). Model routes are recorded as turns; side routes (token counting, model lists)
  are claimed and relayed but never become turns; anything else is answered locally (404)
  rather than forwarded with a key.
- ``host_dialect`` is whose error shape a host's local answers take.
- ``default_hosts`` and ``key_variables`` are what the settings intercept and what a
  session's environment sets; ``credential_headers`` and ``secret_places`` where a
  credential can arrive (what Redact hides; where the tool route and the worker front read
  a model secret), all gathered from every dialect.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from interceptor.dialects.anthropic import ANTHROPIC, AnthropicDialect
from interceptor.dialects.base import Dialect, Override, RouteKind, StreamAssembler
from interceptor.dialects.chat import CHAT, ChatDialect
from interceptor.dialects.gemini import GEMINI, GeminiDialect
from interceptor.dialects.responses import RESPONSES, ResponsesDialect

__all__ = [
    "ANTHROPIC",
    "CHAT",
    "DIALECTS",
    "GEMINI",
    "REGISTRY",
    "RESPONSES",
    "AnthropicDialect",
    "ChatDialect",
    "Dialect",
    "GeminiDialect",
    "Override",
    "ResponsesDialect",
    "Route",
    "StreamAssembler",
    "default_hosts",
    "host_dialect",
    "credential_headers",
    "key_variables",
    "known_upstreams",
    "local_answer",
    "resolve",
    "secret_of",
    "secret_places",
]

#: Every dialect, in the order a shared host or path is resolved. One line per API.
REGISTRY: tuple[Dialect, ...] = (
    CHAT,
    RESPONSES,
    ANTHROPIC,
    GEMINI,
)

DIALECTS: dict[str, Dialect] = {d.name: d for d in REGISTRY}


@dataclass(frozen=True, slots=True)
class Route:
    """What a request is: its dialect, and whether it is a model call (``model``: recorded as
    a turn) or a side call (``side``: claimed, given the session's model, relayed, not
    recorded)."""

    dialect: Dialect
    kind: RouteKind


def _label(host: str) -> str:
    """The name under the public suffix: ``anthropic`` of ``api.anthropic.com``."""
    parts = host.split(".")
    return parts[-2] if len(parts) >= 2 else host


def _owners(host: str | None) -> tuple[Dialect, ...]:
    """The dialects whose hosts include ``host``; for a host no dialect lists (one the
    operator added), those whose provider's name it carries (``anthropic.internal``)."""
    if not host:
        return ()
    host = host.lower()
    owners = tuple(d for d in REGISTRY if host in d.hosts)
    if owners:
        return owners
    return tuple(d for d in REGISTRY if any(_label(h) in host for h in d.hosts))


def _candidates(host: str | None) -> tuple[Dialect, ...]:
    owners = _owners(host)
    return owners + tuple(d for d in REGISTRY if d not in owners)


@functools.lru_cache(maxsize=1024)
def resolve(method: str, path: str, host: str | None = None) -> Route | None:
    """The route for ``method path`` (query string allowed, e.g. ``/v1/messages?beta=true``),
    or None when the proxy should answer locally with 404. ``host`` decides between
    dialects that share a path (``GET /v1/models`` is OpenAI's on its hosts, Anthropic's on
    Anthropic's). Remembered (a Route is frozen, the registry fixed): a harness asks the
    same few routes every turn, and finding one walks every dialect's route patterns."""
    path = path.split("?", 1)[0].split("#", 1)[0]
    if len(path) > 1:
        path = path.rstrip("/")
    method = method.upper()
    for dialect in _candidates(host):
        kind = dialect.route(method, path)
        if kind is not None:
            return Route(dialect, kind)
    return None


def host_dialect(host: str) -> Dialect:
    """The dialect whose shape the proxy's own answers on ``host`` take (a local 404, a
    refused claim before the route is known)."""
    return _candidates(host)[0]


def default_hosts() -> list[str]:
    """Every dialect's hosts, each once, in registry order."""
    return list(dict.fromkeys(h for d in REGISTRY for h in d.hosts))


def key_variables() -> tuple[str, ...]:
    """Every environment variable a dialect's harnesses read their key from, each once."""
    return tuple(dict.fromkeys(v for d in REGISTRY for v in d.key_variables))


def known_upstreams() -> dict[str, dict[str, str]]:
    """Every dialect's ``known_upstreams``, the first dialect's where two name the same."""
    out: dict[str, dict[str, str]] = {}
    for dialect in REGISTRY:
        for name, spec in dialect.known_upstreams.items():
            out.setdefault(name, dict(spec))
    return out


def credential_headers() -> tuple[str, ...]:
    """Every request header a dialect says can carry a credential, lowercase, each once:
    what Redact hides and a recorder never writes, whatever the route."""
    return tuple(dict.fromkeys(h.lower() for d in REGISTRY for h in d.credential_headers))


def secret_places() -> tuple[str, ...]:
    """Every place a dialect reads a harness's key from (``Dialect.secret_places``), each
    once, in registry order: where the proxy's own routes and the worker front look for a
    model secret."""
    return tuple(dict.fromkeys(p for d in REGISTRY for p in d.secret_places))


def secret_of(headers: Any, query: Any) -> str | None:
    """The key a request carries in any dialect's place, the first dialect that finds one."""
    for dialect in REGISTRY:
        found = dialect.secret(headers, query)
        if found:
            return found
    return None


def local_answer(method: str, path: str, host: str | None = None) -> dict | None:
    """The JSON body to answer ``method path`` with locally (200), or None: the first
    dialect's ``local_answers`` that has it, the host's own dialects first."""
    key = (method.upper(), path.split("?", 1)[0].rstrip("/"))
    for dialect in _candidates(host):
        if key in dialect.local_answers:
            return dialect.local_answers[key]
    return None

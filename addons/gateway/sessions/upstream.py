"""Upstreams are the operator's: declared at start, picked by name, never described by a session.

A session that could name a base URL and an environment variable could make the proxy send any
variable of its environment (a provider key, ``PATH``, ``HOME``) as a bearer token to any host.
So the operator declares every upstream once, when the proxy starts (``intercept_upstreams``,
plus the one the default session's options describe), each with the variable that holds its
key; a session refers to one by name, or by a ``base_url`` equal to a declared one, and anything
else is refused naming the field. A key is read from the proxy's environment at each use and
never copied anywhere.

``Upstream`` is the one description of where a claimed request goes; what a later kind of
upstream needs (a ``dialect`` the proxy translates into, a replay source) is another field here
and another branch where Rewrite routes, not a second model.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from interceptor.dialects import known_upstreams

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
HEADER = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,128}$")  # an HTTP field name (RFC 9110 5.1, a token)
DEFAULT = "default"  # the upstream the default session's options declare


class Upstream(BaseModel):
    """One declared upstream. ``base_url`` None: the provider host the harness addressed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = DEFAULT
    base_url: str | None = None
    api_key_env: str | None = None
    # The wire format the upstream speaks; None: whatever the harness speaks. A request in
    # another dialect is translated into it (interceptor.dialects.translate) or, for a pair
    # the proxy does not translate, refused (see Rewrite).
    dialect: str | None = None
    # A replay source: the trace file whose recorded turns answer (``addons/gateway/replay.py``);
    # ``on_miss`` says what a request no turn matches gets: an error in the dialect's shape,
    # or the upstream the other fields describe (and a new turn). ``pace``: answer after the
    # recorded call's duration instead of at once.
    replay: str | None = None
    # A Responses upstream that serves no WebSocket (``/v1/responses`` over HTTP only, as
    # vLLM's): Codex's socket is served by the proxy itself (addons/gateway/transport/wsserve.py) from the
    # first upgrade, not after the upstream refused one.
    websocket: bool = True
    on_miss: Literal["error", "upstream"] = "error"
    pace: bool = False
    # The response header in which the upstream says which weights version answered (e.g. a
    # vLLM behind a router that sets ``x-weights-version``): recorded on each call beside the
    # declared version, and a call where they differ is marked (addons/gateway/sessions/weights.py).
    version_header: str | None = None

    @field_validator("version_header")
    @classmethod
    def _header(cls, v: str | None) -> str | None:
        if v is not None and not HEADER.match(v):
            raise ValueError(f"version_header must be a header name such as x-weights-version, got {v!r}")
        return v.lower() if v is not None else v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME.match(v):
            raise ValueError(f"an upstream name is 1-64 letters, digits, '.', '_' or '-'; got {v!r}")
        return v

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {v!r}")
        return v.rstrip("/")

    @field_validator("api_key_env")
    @classmethod
    def _env(cls, v: str | None) -> str | None:
        if v is not None and not ENV_NAME.match(v):
            raise ValueError(f"api_key_env must be an environment variable name, got {v!r}")
        return v

    @field_validator("replay")
    @classmethod
    def _replay(cls, v: str | None) -> str | None:
        if v is None:
            return v
        path = Path(os.path.expanduser(v))
        if not path.is_file():
            raise ValueError(f"replay: no trace file at {str(path)!r}")
        return str(path.resolve())

    @property
    def local(self) -> bool:
        """Every request is answered by the proxy itself: nothing is ever forwarded."""
        return self.replay is not None and self.on_miss == "error"

    @field_validator("dialect")
    @classmethod
    def _dialect(cls, v: str | None) -> str | None:
        from interceptor.dialects import DIALECTS

        if v is not None and v not in DIALECTS:
            raise ValueError(f"dialect must be one of {', '.join(sorted(DIALECTS))}, got {v!r}")
        return v

    @model_validator(mode="after")
    def _dialect_needs_url(self) -> "Upstream":
        if self.dialect is not None and self.base_url is None:
            raise ValueError("an upstream with a dialect needs its base_url: a harness's own provider host "
                             "speaks the harness's dialect")
        return self

    def key(self) -> str | None:
        """The real key, from the proxy's environment, at the moment it is sent."""
        return os.environ.get(self.api_key_env) if self.api_key_env else None

    def public(self) -> dict[str, Any]:
        """What the control API and the trace header may say about it: never the key."""
        out = {"name": self.name, "base_url": self.base_url, "api_key_env": self.api_key_env,
               "dialect": self.dialect, "key_set": bool(self.key())}
        if not self.websocket:
            out["websocket"] = False
        if self.version_header is not None:
            out["version_header"] = self.version_header
        if self.replay is not None:
            out.update(replay=self.replay, on_miss=self.on_miss, pace=self.pace)
        return out


# The real providers, declarable by name with their usual key variables (each dialect's
# ``known_upstreams``): intercept_upstreams='["openai", "anthropic"]' or '{"openai": {}}'.
KNOWN: dict[str, dict[str, str]] = known_upstreams()


def parse_upstreams(value: str) -> dict[str, Upstream]:
    """``intercept_upstreams``: inline JSON or the path of a JSON file holding either an object
    ``name -> {base_url, api_key_env, dialect}`` or ``name -> {replay, on_miss, pace}`` (plus
    the fields of the upstream a miss goes to, for ``on_miss: upstream``) (an empty object or null for a known provider
    takes its defaults) or a list of known provider names. Raises ValueError saying what is wrong."""
    text = value.strip()
    if not text.startswith(("{", "[")) and not text[:1].isdigit():
        path = Path(os.path.expanduser(text))
        try:
            text = path.read_text()
        except OSError as e:
            raise ValueError(f"cannot read {path}: {e.strerror or e}") from e
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from e
    if isinstance(raw, list):
        if not all(isinstance(n, str) for n in raw):
            raise ValueError(f"a list names known providers ({', '.join(KNOWN)}); give an object to declare others")
        raw = {n: None for n in raw}
    if not isinstance(raw, dict):
        raise ValueError("must be a JSON object name -> {base_url, api_key_env, dialect}, or a list of known names")
    out: dict[str, Upstream] = {}
    for name, spec in raw.items():
        if spec is None or spec == {}:
            if name not in KNOWN:
                raise ValueError(f"{name}: not a known provider ({', '.join(KNOWN)}); give its base_url and api_key_env")
            spec = KNOWN[name]
        if not isinstance(spec, dict):
            raise ValueError(f"{name}: must be an object {{base_url, api_key_env, dialect}}")
        try:
            out[name] = Upstream.model_validate({**spec, "name": name})
        except ValidationError as e:
            raise ValueError(f"{name}.{format_validation_error(e)}") from e
    return out


class UpstreamRef(BaseModel):
    """How a session names its upstream: ``"name"``, ``{"name": ...}`` or ``{"base_url": ...}``
    equal to a declared one. ``api_key_env`` is accepted only to be refused with the reason."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = None
    base_url: str | None = None
    api_key_env: str | None = None

    @field_validator("api_key_env")
    @classmethod
    def _no_env(cls, v: str | None) -> None:
        if v is not None:
            raise ValueError("a session cannot name an environment variable: the operator declares each upstream "
                             "with its key variable (intercept_upstreams); pick one by name")
        return None

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, v: Any) -> Any:
        return {"name": v} if isinstance(v, str) else v


def pick(ref: UpstreamRef | None, declared: dict[str, Upstream]) -> Upstream | None:
    """The declared upstream a session's reference names. No reference: the default upstream,
    if the operator declared one. Raises ValueError naming the field otherwise."""
    if ref is None or (ref.name is None and ref.base_url is None):
        return declared.get(DEFAULT)
    if ref.name is not None:
        found = declared.get(ref.name)
        if found is None:
            raise ValueError(f"upstream.name: no upstream {ref.name!r} is declared (declared: "
                             f"{', '.join(sorted(declared)) or 'none'})")
        if ref.base_url is not None and ref.base_url.rstrip("/") != found.base_url:
            raise ValueError(f"upstream.base_url: {ref.base_url!r} is not the base_url of upstream {ref.name!r}")
        return found
    url = ref.base_url.rstrip("/")
    for up in declared.values():
        if up.base_url == url:
            return up
    raise ValueError(f"upstream.base_url: {ref.base_url!r} is not a declared upstream; the operator declares "
                     "upstreams at start (intercept_upstreams) and a session picks one by name")


def format_validation_error(err: ValidationError) -> str:
    """One line per problem, naming the field, e.g. ``upstream.bogus: Extra inputs ...``."""
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(root)"
        lines.append(f"{where}: {e['msg']}")
    return "; ".join(lines)


"""Task state: what a rollout's tool servers read and write through the proxy.

A tool server (an MCP server in the sandbox) reads the task it serves (``GET
/_interceptor/task``) and keeps the rollout's shared state (``GET/PUT/PATCH
/_interceptor/state``), authorised by the session's **state secret**. The model's harness
holds only the model secret, which opens model routes and nothing here: the model cannot
write its own score. The orchestrator reads and seeds the same state with the admin token
(``/_interceptor/sessions/<id>/state``).

The state is one JSON object with a version: 0 at start (the session's ``state``, or ``{}``),
one more per accepted write. A write names the version it read in ``If-Match`` (the
``ETag`` of its GET) to be refused with 412 instead of overwriting a newer one; without it,
the last write wins. Every accepted write is a ``state`` record (trace/model.py
``StateWrite``); the footer holds the final version and digest.

The value is held as plain data on the session and handed out as copies: a hook or a
response never aliases what the next write changes.

A write is all or nothing: everything that could fail about a new state (its JSON, its
nesting, numbers JSON cannot hold, text that is no UTF-8, its size, a secret in it, the
schema, its record) is checked on the candidate before anything changes; only then is the
record written and the value swapped. A value nested deeper than ``MAX_DEPTH`` is refused
whole: every reader (a hook's copy, the record, the trace reader) walks it recursively, and
one that could be written but not read would fail every later read and hooked request.
"""

from __future__ import annotations

import copy
import hashlib
import hmac
import json
import math
import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

from mitmproxy import http

from interceptor.addons.gateway.answers import api_error
from interceptor.trace.messages import canonical_json
from interceptor.trace.model import STATE_VALUE_MAX, StateWrite

DEFAULT_MAX_BYTES = 1 << 20  # intercept_state_max_bytes
MERGE_PATCH = "application/merge-patch+json"
MAX_DEPTH = 100  # objects and arrays nested in a state (see the module docstring)
STOP_REASON_MAX = 200  # characters of a tool server's stop reason (README: POST /_interceptor/stop)
HoldsSecret = Callable[[str], bool]  # any secret of the proxy in a text (addons/mitm/control.py)
TOOL_SERVER_ROUTES = ("task", "state", "stop")


error = api_error


class StateRefused(Exception):
    """A write the state does not take; ``status`` and the message are the answer."""

    def __init__(self, status: int, message: str, version: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.version = version


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def encoded(value: Any) -> bytes:
    """The state's canonical JSON: what its size and digest are of."""
    return canonical_json(value).encode()


def parse(content: bytes | None) -> Any:
    """A request body as JSON, or StateRefused(400) naming why not: not UTF-8 (RFC 8259
    section 8.1), not JSON, NaN or Infinity (not JSON numbers: section 6), nested too deep."""
    try:
        text = (content or b"").decode("utf-8")
    except UnicodeDecodeError as e:
        raise StateRefused(400, f"the body is not UTF-8: {e.reason} at byte {e.start}") from None
    try:
        return json.loads(text, parse_constant=_not_a_number)
    except RecursionError:
        raise StateRefused(400, f"the body is nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:
        raise StateRefused(400, f"the body is not JSON: {e}") from None


def _not_a_number(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (RFC 8259 section 6)")


def unreadable(value: Any) -> str | None:
    """Why ``value`` could be taken but not read back (nesting deeper than ``MAX_DEPTH``, a
    number that is not finite, a string that is no UTF-8), or None. Iterative: the check
    itself never recurses."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > MAX_DEPTH:
                return f"it is nested deeper than {MAX_DEPTH} levels"
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
            if isinstance(item, dict):
                stack.extend((key, depth) for key in item)
        elif isinstance(item, float) and not math.isfinite(item):
            return "it holds a number JSON cannot carry (an overflow to infinity)"
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return "it holds a string that is not UTF-8 (a lone surrogate escape)"
    return None


def checked_text(name: str, text: str, holds_secret: HoldsSecret, max_chars: int) -> str:
    """A text a rollout writes into its trace that may also go back in a header (a stop
    reason, ``x-interceptor-stop``): one line of UTF-8 within ``max_chars``, holding no
    secret of the proxy. Else StateRefused(400) naming the field, never echoing it: a cut
    would record something the writer did not say, and a secret in a trace or a header is a
    leak to whoever reads them."""
    if len(text) > max_chars:
        raise StateRefused(400, f"{name} is {len(text)} characters, above its limit of {max_chars}")
    if not text.isprintable():
        raise StateRefused(400, f"{name} must be one line of printable text (no control characters)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise StateRefused(400, f"{name} is not UTF-8 text (a lone surrogate escape)") from None
    if holds_secret(text):
        raise StateRefused(400, f"{name} holds a secret of this proxy (a session secret, the admin token or "
                                "an upstream's key): it is not written into the trace")
    return text


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7396 section 2: an object patch merges key by key (null removes the key), anything
    else replaces the target whole. ``target`` is not changed."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def schema_validator(schema: dict[str, Any]):
    """A validator for ``state_schema`` (the draft its ``$schema`` names, else 2020-12);
    ``ValueError`` naming what is wrong when the schema itself is not valid."""
    import jsonschema  # imported only by sessions that declare a schema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ValueError(f"state_schema is not a valid JSON Schema: {e.message} "
                         f"(at {'/'.join(map(str, e.path)) or 'its top'})") from None
    return cls(schema)


def schema_failure(validator, value: Any) -> str | None:
    """Why ``value`` fails the schema, with the failing path (``$.a.b``), or None."""
    import jsonschema

    err = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if err is None:
        return None
    return f"the state does not satisfy state_schema at {err.json_path}: {err.message}"


@dataclass(eq=False)
class TaskState:
    """One session's state: the value, its version, and the rules a write must pass."""

    value: dict[str, Any]
    version: int = 0
    validator: Any = None  # a jsonschema validator, or None
    size: int = 2
    digest: str = digest(b"{}")

    @classmethod
    def initial(cls, value: dict[str, Any] | None, schema: dict[str, Any] | None) -> TaskState:
        """The state a session starts with; ``ValueError`` if the schema is not one, or the
        initial value fails it (a bad session config: 400 at creation)."""
        if (why := unreadable(value)) is not None:
            raise ValueError(f"state: {why}")
        value = copy.deepcopy(value or {})
        validator = schema_validator(schema) if schema is not None else None
        if validator is not None and (why := schema_failure(validator, value)):
            raise ValueError(f"state: {why}")
        data = encoded(value)
        return cls(value, 0, validator, len(data), digest(data))

    def etag(self) -> str:
        return f'"{self.version}"'

    def snapshot(self) -> dict[str, Any]:
        """A copy for a reader (a hook, a GET): never the object the next write changes."""
        return copy.deepcopy(self.value)

    def check_precondition(self, if_match: str | None) -> None:
        """RFC 9110 13.1.1: ``*`` or a list of entity tags, one of which must be the current."""
        if if_match is None:
            return
        tags = [t.strip().removeprefix("W/").strip('"') for t in if_match.split(",")]
        if "*" in tags or str(self.version) in tags:
            return
        raise StateRefused(412, f"the state is at version {self.version}, not {if_match.strip()}: read it "
                                "again (GET), apply the change to that, and send its ETag in If-Match",
                           version=self.version)

    def write(self, new: Any, *, max_bytes: int, holds_secret: HoldsSecret) -> bytes:
        """Check a whole new state; its canonical JSON if it is taken. Nothing changes here."""
        if not isinstance(new, dict):
            raise StateRefused(400, f"the state must be a JSON object, not {type(new).__name__}")
        if (why := unreadable(new)) is not None:
            raise StateRefused(400, f"the state is not taken: {why}")
        data = encoded(new)
        if max_bytes and len(data) > max_bytes:
            raise StateRefused(413, f"the state would be {len(data)} bytes, above intercept_state_max_bytes "
                                    f"({max_bytes})")
        if holds_secret(data.decode()):
            raise StateRefused(400, "the state must not hold a secret of this proxy (a session secret, the admin "
                                    "token or an upstream's key): it is written into the trace")
        if self.validator is not None and (why := schema_failure(self.validator, new)):
            raise StateRefused(400, why)
        return data

    def commit(self, new: dict[str, Any], data: bytes) -> None:
        """Plain assignments only: nothing here can fail halfway."""
        self.value, self.size, self.digest = new, len(data), digest(data)
        self.version += 1

    def record(self, by: str, op: str) -> StateWrite:
        """The ``state`` record of the state as it now is."""
        return self.record_of(self.value, encoded(self.value), self.version, by, op)

    @staticmethod
    def record_of(value: dict[str, Any], data: bytes, version: int, by: str, op: str) -> StateWrite:
        """The ``state`` record of ``value`` at ``version`` (made before the value is taken)."""
        small = len(data) <= STATE_VALUE_MAX
        return StateWrite(version=version, by=by, op=op, size=len(data), digest=digest(data),
                          value=copy.deepcopy(value) if small else None, value_omitted=not small, at=time.time())


def bearer(req: http.Request) -> str:
    auth = req.headers.get("authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else ""


def same_secret(a: str, b: str | None) -> bool:
    return bool(a) and bool(b) and hmac.compare_digest(a.encode(), b.encode())

"""One interface over every wire format.

The addons never branch on a format: they ask the flow's dialect to parse, to impose the
session's settings, to assemble a stream, to write an error. Each dialect is stateless (one
shared instance per format); per-exchange state lives in the ``StreamAssembler`` it makes.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any, ClassVar, Literal, Protocol

from interceptor.dialects.body import Edit
from interceptor.dialects.prompt_ids import Prior, PromptRead
from interceptor.dialects.sse import SSEDecoder, SSEEvent
from interceptor.dialects.tokens import TokenFields
from interceptor.trace.messages import Message, Part, Request, Response, ResponseError, Sampling
from interceptor.trace.prefix import Listed

# A parameter an error message names: `temperature`, 'top_p', "reasoning.effort"; or opens with.
_QUOTED = re.compile(r"[`'\"]([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)[`'\"]")
_LEADING = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*): ")


def header(headers: Any, name: str, default: str | None = None) -> str | None:
    """``headers.get(name, default)``, for mitmproxy's ``Headers`` read from their raw fields.

    mitmproxy's lookup lowercases every field name at each call (and goes through three
    layers of mapping code), and a model request makes a dozen lookups. This compares
    lengths first and lowercases only the names that could match. Same answer: the values
    of every field with that name (case-insensitive), decoded as mitmproxy does (UTF-8,
    surrogateescape), joined by ``", "``. Anything without ``fields`` (a plain dict in a
    test) is asked its ``get``."""
    fields = getattr(headers, "fields", None)
    if fields is None:
        return headers.get(name, default)
    key = name.encode()
    n = len(key)
    found = None
    for k, v in fields:
        if len(k) == n and k.lower() == key:
            v = v.decode("utf-8", "surrogateescape")
            found = v if found is None else f"{found}, {v}"
    return default if found is None else found


def drop(headers: Any, names: Sequence[str]) -> None:
    """Remove every field named one of ``names`` (lowercase), as ``headers.pop(name, None)``
    for each would, in one pass over mitmproxy's raw fields (a pop is two lookups, each
    lowering every name, and a ``KeyError`` when absent, the usual case). Anything without
    ``fields`` is popped name by name."""
    fields = getattr(headers, "fields", None)
    if fields is None:
        for name in names:
            headers.pop(name, None)
        return
    keys = {name.encode() for name in names}
    sizes = {len(k) for k in keys}
    if any(len(k) in sizes and k.lower() in keys for k, _ in fields):  # usually none: no copy
        headers.fields = tuple(f for f in fields if f[0].lower() not in keys)


def place_of(place: str) -> tuple[str, str | None]:
    """A ``Dialect.secret_places`` entry as (header name lowercased or ``?param``, scheme
    lowercased or None): ``"authorization: Bearer"`` is ``("authorization", "bearer")``."""
    name, _, scheme = place.partition(":")
    name = name.strip()
    return (name if name.startswith("?") else name.lower()), (scheme.strip().lower() or None)


@dataclass(slots=True)
class Override:
    """One change the proxy made to a request body: which key, what it was, what it is now,
    and why (``session`` for the session's settings, a sentence for a provider constraint).
    ``new`` is ``None`` when the key was removed. Never holds a credential."""

    key: str
    old: Any
    new: Any
    reason: str = "session"

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "old": self.old, "new": self.new, "reason": self.reason}


@dataclass(slots=True)
class Mediation:
    """What a network policy changed in one request (``Dialect.mediate_network``), and whether
    the request existed only to use what was removed (then it is answered locally)."""

    overrides: list[Override] = field(default_factory=list)
    search_only: bool = False


@dataclass(slots=True)
class Slot:
    """Where one canonical request message's content lives in the native body, for a hook
    that rewrites it: the value at ``path`` (with ``run``, the items ``run[0]:run[1]`` of the
    list there: an Anthropic user turn made of several blocks), and where its ``is_error``
    goes (None: the format cannot say it)."""

    path: tuple[str | int, ...]
    run: tuple[int, int] | None = None
    error_path: tuple[str | int, ...] | None = None


class RewriteError(ValueError):
    """A rewritten message the format cannot carry (an image part a hook made up, an error
    flag where the format has none); the message says which."""


class StreamAssembler(ABC):
    """Builds a ``Response`` from a stream one event at a time, O(event) per call.

    ``feed`` returns True when the event is the format's terminal event (after it has been
    folded in), so the tee can commit the turn before forwarding the bytes that carry it.
    A stream that ends without a terminal event is an error, not a turn: ``result()`` then
    carries ``error``.
    """

    done: bool = False
    #: How vLLM's prompt ids read (dialects/prompt_ids.py), once the event carrying them has.
    prompt_read: PromptRead | None = None
    #: The last event the shortcut (``NativeAssembler.quick``) read by a shape's pattern.
    matched: re.Match[str] | None = None

    def expect(self, priors: Sequence[Prior]) -> None:
        """The prompt ids the session's last answers carried (``dialects/prompt_ids.py``), so
        the ones this stream carries are parsed only past them. Only Chat's reads them."""

    @abstractmethod
    def feed(self, event: SSEEvent) -> bool: ...

    @abstractmethod
    def result(self) -> Response: ...


RouteKind = Literal["model", "side"]


class Frames(Protocol):
    """Cuts a response body into events as bytes arrive (``SSEDecoder`` is one): ``feed``
    returns the events a chunk completes, ``flush`` what the end of the body completes."""

    def feed(self, chunk: bytes) -> list[SSEEvent]: ...

    def flush(self) -> list[SSEEvent]: ...


#: What ``Dialect.list_messages`` tells an element of the one before it: that element and the
#: canonical messages it made.
Before = tuple[Any, list[Message]]


class Dialect(ABC):
    """One wire format, whole: where it is spoken (hosts, routes), how a harness
    authenticates and how the real key is sent, where the model lives, how it streams and
    ends a stream, how it answers an error, and how a request and a response read. The
    addons ask; none of them knows a provider by name."""

    name: ClassVar[str]
    #: Hosts whose traffic speaks this dialect, intercepted by default. A host may be
    #: shared (Chat and Responses on api.openai.com); its first dialect in the registry
    #: answers the host's non-model paths.
    hosts: ClassVar[tuple[str, ...]] = ()
    #: Exact ``(method, path)`` routes and their kind: ``model`` (a turn) or ``side``
    #: (claimed, given the session's model, relayed, never a turn). Every other path on the
    #: dialect's hosts is local: answered by the proxy, forwarded nowhere.
    routes: ClassVar[dict[tuple[str, str], RouteKind]] = {}
    #: ``(method, path)`` of a harness's side calls to its provider's own backend, answered
    #: locally (200) with this JSON, what the harness takes for "nothing here": no egress,
    #: no key, and no error the harness would log.
    local_answers: ClassVar[dict[tuple[str, str], Any]] = {}
    #: Environment variables the dialect's harnesses read their API key from: a session's
    #: environment sets each to the session's model secret.
    key_variables: ClassVar[tuple[str, ...]] = ()
    #: The provider's own upstreams, which an operator may declare by name alone
    #: (``intercept_upstreams='["openai"]'``): name -> ``{"base_url", "api_key_env"}``.
    known_upstreams: ClassVar[dict[str, dict[str, str]]] = {}
    #: Where the harness's key (its session secret) arrives, read in this order by ``secret``:
    #: ``"x-api-key"`` a header's whole value, ``"authorization: Bearer"`` a header's value
    #: after that scheme, ``"?key"`` a query parameter. The tool route and the worker front
    #: read a model secret from the same places (``interceptor.dialects.secret_places``).
    secret_places: ClassVar[tuple[str, ...]] = ("x-api-key", "authorization: Bearer")
    #: Request headers that can carry a credential: all are removed before forwarding, and
    #: Redact hides them in anything the proxy shows or saves. The one list of them.
    credential_headers: ClassVar[tuple[str, ...]] = ("authorization", "x-api-key", "api-key")
    #: Training tokens an upstream of this dialect returns when asked (vLLM/SGLang's
    #: ``return_token_ids``): which keys ask, where the answer carries them, how they are
    #: taken out of what the harness receives (``tokens.TokenFields``). None: it has none.
    tokens: ClassVar[type[TokenFields] | None] = None
    #: The body key of the message list, whose elements make the canonical messages in order,
    #: after any from elsewhere in the body (a system prompt): the history a request restates
    #: is then recognised from its text and not parsed again (trace/prefix.py), and
    #: ``parse_request`` gets the scan. An element is read on its own or with the one before
    #: it (``list_messages``); a dialect whose elements' messages depend on later ones stops
    #: the known part where they cannot (``Listed.keep``). None: every request parsed whole.
    message_list: ClassVar[str | None] = None
    #: Top-level body keys a harness sends anew with every attempt of the same request
    #: (metadata of the attempt, not part of what the model is asked): left out of what
    #: identifies a request (``identity``), so a resent request is still known as the same.
    per_attempt: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A header a dialect reads a key from is one it removes before forwarding (and one
        Redact hides): checked when the dialect is defined, not found in a leaked request."""
        super().__init_subclass__(**kwargs)
        read = {place_of(p)[0] for p in cls.secret_places if not p.startswith("?")}
        if missing := read - {h.lower() for h in cls.credential_headers}:
            raise TypeError(f"{cls.__name__} reads a key from {sorted(missing)} but does not list it in "
                            "credential_headers (removed before forwarding, redacted in output)")

    # -- where it is spoken ------------------------------------------------------------

    def route(self, method: str, path: str) -> RouteKind | None:
        """The kind of ``method path`` (path without query, no trailing slash), or None
        when it is not one of this dialect's routes."""
        return self.routes.get((method, path))

    def upstream_path(self, base_path: str, path: str) -> str:
        """Join an SDK-style base URL path (``/v1``) with the harness's path (``/v1/messages?x``):
        the harness's version prefix is replaced by the base URL's, as an SDK would build it."""
        rest = path
        if rest.startswith("/v1/") or rest == "/v1":
            rest = rest[3:]
        return base_path.rstrip("/") + rest

    # -- credentials ---------------------------------------------------------------------

    def secret(self, headers: Mapping[str, str], query: Mapping[str, str]) -> str | None:
        """The key the harness sent (its session secret), where this dialect's SDKs put it:
        the first of ``secret_places`` that holds one."""
        for place in self.secret_places:
            name, scheme = place_of(place)
            if name.startswith("?"):
                value = (query.get(name[1:]) or "").strip()
            else:
                value = header(headers, name, "").strip()
                if scheme:
                    lead = scheme + " "
                    value = value[len(lead):].strip() if value[:len(lead)].lower() == lead else ""
            if value:
                return value
        return None

    def put_key(self, headers: MutableMapping[str, str], query: MutableMapping[str, str], key: str | None) -> None:
        """Remove every credential the harness sent (its headers, and a key in the query) and,
        given one, set the real key the way the provider expects it. Never logs either."""
        drop(headers, self.credential_headers)
        for place in self.secret_places:
            if place.startswith("?"):
                query.pop(place[1:], None)
        if key:
            headers.update(self.auth_headers(key))

    def auth_headers(self, key: str) -> dict[str, str]:
        return {"authorization": f"Bearer {key}"}

    # -- where the model lives -----------------------------------------------------------

    def requested_model(self, body: dict[str, Any] | None, path: str) -> str | None:
        model = (body or {}).get("model")
        return model if isinstance(model, str) else None

    def json_path(self, path: str, model: str | None) -> str:
        """``path``, a model route of this dialect, asking ``model`` for a JSON answer (a
        dialect that names the model and the streaming in the path changes them there)."""
        return path

    def api_headers(self) -> dict[str, str]:
        """Headers the API requires of every request besides the key: a harness's SDK sends
        them; ``replay_trace.py resend``, which has no SDK, adds them."""
        return {}

    def path_with_model(self, path: str, model: str | None) -> tuple[str, Override | None]:
        """The path with the session's model in it, for a dialect that names the model in
        the path; the model in the body is ``apply_overrides``'s."""
        return path, None

    def side_overrides(self, body: dict[str, Any], model: str | None) -> list[Override]:
        """A side route (token counting) gets the session's model, nothing else."""
        if model and body.get("model") != model:
            old = body.get("model")
            body["model"] = model
            return [Override("model", old, model)]
        return []

    # -- bodies ----------------------------------------------------------------------------

    @abstractmethod
    def parse_request(self, body: dict[str, Any], listed: Listed | None = None) -> Request:
        """The canonical request. ``listed`` (only with ``message_list``) is the list as
        scanned from the body: the canonical messages of its first ``listed.known`` elements
        were parsed from the very same text and are used as they are (``list_messages``)."""

    @staticmethod
    def list_messages(items: list[Any], listed: Listed | None,
                      element: Callable[[Any, Before | None], list[Message]]) -> list[Message]:
        """The canonical messages of a ``message_list``'s ``items``: the known leading
        elements' from ``listed``, each other one's from ``element(item, before)`` (its
        messages, read from it and, for Gemini, which pairs a function response with the
        model turn before it, from ``before``: the element before it and the messages that
        one made; None for the first). Counts them into ``listed.marks`` (trace/prefix.py), so
        the list can be remembered. A ``listed`` that is not these items' scan is ignored."""
        out: list[Message] = []
        usable = listed is not None and listed.items is items and len(listed.marks) == listed.known
        k = listed.known if usable else 0
        made: list[Message] = []
        if k:
            out += listed.messages
            made = listed.messages[listed.marks[k - 2] if k > 1 else 0:]  # the last known element's
        for j in range(k, len(items)):
            made = element(items[j], (items[j - 1], made) if j else None)
            out += made
            if usable:
                listed.marks.append(len(out))
        return out

    def request_body(self, request: Request) -> dict[str, Any]:
        """A canonical request as this dialect's request body, without model or sampling (the
        caller lays those on with ``apply_overrides``): the conversation and the tools, so that
        ``parse_request`` reads the body back to the same messages. ``replay_trace.py resend``
        asks a recorded prompt again with it. ValueError for what the record cannot restore
        (inline images and files are kept as digests, not as their bytes)."""
        raise ValueError(f"the {self.name} dialect cannot render a recorded prompt")

    def sampling(self, body: dict[str, Any]) -> Sampling:
        """The decoding settings ``body`` asks for: what the record says the upstream received
        (read back from the rewritten body) and what a request hook sees."""
        return self.parse_request(body).sampling

    @abstractmethod
    def parse_response(self, body: dict[str, Any]) -> Response: ...

    def load_response(self, raw: bytes, priors: Sequence[Prior] = ()) -> tuple[Any, PromptRead | None]:
        """A JSON answer's bytes, parsed (``ValueError`` if they are no JSON), and how its
        prompt ids read: Chat reads vLLM's past the ones ``priors`` say the session's last
        answers carried (``dialects/prompt_ids.py``)."""
        return json.loads(raw), None

    @abstractmethod
    def assembler(self) -> StreamAssembler: ...

    @abstractmethod
    def apply_overrides(
        self, body: dict[str, Any], model: str | None, sampling: Sampling,
        mode: Literal["overlay", "exact"] = "overlay", refused: frozenset[str] = frozenset(),
        requested: str | None = None,
    ) -> list[Override]:
        """Impose the session, in place: set ``model`` when given; lay the session's sampling
        over the harness's (``overlay``: a key it sets replaces, one it leaves unset stays, an
        explicit null removes) or, in ``exact`` mode, drop every decoding key the harness sent
        and apply only the session's; drop ``refused`` (what the provider refused earlier for
        this model); then reconcile what the provider would reject, following dependencies.
        Keys that are the harness's contract with its own code (tool choice, stop sequences,
        ``n``, logprobs) are replaced only when the session sets them; a required key
        (Anthropic ``max_tokens``) stays. ``requested`` is the model the harness asked for,
        for a dialect that names it outside the body (Gemini's path). Returns every change; an
        empty list means the body is untouched (and the proxy forwards the original bytes)."""

    def header_changes(self, body: dict[str, Any] | None, overrides: list[Override],
                       headers: Any) -> list[Override]:
        """Request headers that must change with the body's overrides (keys ``header:<name>``,
        ``new`` None to remove); applied by Rewrite."""
        return []

    @abstractmethod
    def stream_events(self, response: Response) -> list[SSEEvent]:
        """A canonical response as this format's native SSE events, terminal event last."""

    @abstractmethod
    def json_body(self, response: Response) -> dict[str, Any]:
        """A canonical response as this format's non-streamed JSON body. With
        ``stream_events`` this is how a rewritten or synthesised answer reaches a harness;
        ``parse_response(json_body(r)) == r`` for a response in this dialect's normal form."""

    def synthetic(self, response: Response, sse: bool, asked: dict[str, Any] | None) -> bytes:
        """The bytes of an answer the proxy writes itself (a response hook's replacement):
        this format's JSON body, or its stream from the first event to the terminal one, as
        the real SDKs parse it. ``asked`` is the harness's request body, for what it asked
        the stream to carry."""
        if sse:
            return b"".join(e.encode() for e in self.stream_events(response))
        return json.dumps(self.json_body(response), ensure_ascii=False).encode()

    def stream_error(self, status: int, message: str, type: str | None = None) -> SSEEvent:
        """An error inside a stream whose 200 and headers went out already: the event the
        format's SDKs raise on (OpenAI's read an ``error`` key in the data)."""
        return SSEEvent(data=json.dumps(self.error_body(status, message, type)))

    # -- request hooks ---------------------------------------------------------------------

    #: The type of a text block in this format's user and tool content.
    text_block: ClassVar[str] = "text"

    def content_slots(self, body: dict[str, Any], chained: bool = False) -> list[Slot | None] | None:
        """One entry per message ``parse_request(body)`` gives (``chained``: as
        ``chained_request`` gives them, after the prefix), the user and tool messages a hook
        may rewrite a ``Slot``, the others None. None: this dialect cannot splice rewrites."""
        return None

    def element_slots(self, body: dict[str, Any], j: int) -> list[Slot | None] | None:
        """``content_slots`` of the messages element ``j`` of the message list makes alone
        (as many as ``Listed.marks`` counts for it), for a dialect whose elements' slots do
        not depend on each other; None: ask ``content_slots`` for the whole body. A request
        hook's session reads a few slots a turn, not every message's."""
        return None

    def content_parts(self, blocks: list[Any]) -> list[Part]:
        """Native content blocks as canonical parts (the dialect's own reading)."""
        raise NotImplementedError

    def content_edits(self, slot: Slot, body: dict[str, Any], content: str | list[Part],
                      is_error: bool | None) -> list[Edit]:
        """The edits that put ``content`` (and ``is_error``, when not None) at ``slot``:
        text parts written anew, every other part the harness's own native block, found
        unchanged in what the slot held. Raises RewriteError for what cannot be written."""
        holder: Any = body
        for step in slot.path[:-1]:
            holder = holder[step]
        missing = slot.run is None and isinstance(holder, dict) and slot.path[-1] not in holder
        original: Any = None if missing else holder[slot.path[-1]]
        if slot.run is not None:
            original = original[slot.run[0]:slot.run[1]]
        blocks = original if isinstance(original, list) else []
        if isinstance(content, str):
            value: Any = [{"type": self.text_block, "text": content}] if slot.run is not None else content
        else:
            known = [(self.content_parts([b]), b) for b in blocks]
            value = []
            for part in content:
                same = next((b for parts, b in known if parts == [part]), None)
                if same is not None:
                    value.append(same)
                elif part.type == "text" and part.data is None:
                    value.append({"type": self.text_block, "text": part.text or ""})
                else:
                    raise RewriteError(f"a {part.type} part that was not in the original cannot be written "
                                       f"in {self.name} (a hook may change text, and keep or remove other parts)")
            if slot.run is not None and not value:
                raise RewriteError("this message cannot be emptied: give it a text part")
        if is_error is not None and (slot.error_path is None or slot.error_path[:-1] != slot.path[:-1]):
            raise RewriteError(f"{self.name} has no error flag for this message: a hook may not change is_error")
        if is_error is None and not missing:
            return [Edit(slot.path, value, slot.run)]
        # A flag or a content key the block may not have: the block (content and flag) anew.
        block = {**holder, slot.path[-1]: value}
        if is_error is not None:
            block[slot.error_path[-1]] = is_error
        return [Edit(slot.path[:-1], block)]

    def identity(self, raw: bytes) -> bytes:
        """What identifies a request among a session's attempts (Retry's digest is of it):
        the body's bytes as the harness sent them, or, when they carry a ``per_attempt`` key,
        the body without those keys, serialised one fixed way (a per-attempt value may also
        reorder its own keys, so the bytes around it cannot be trusted either). Parsed here,
        from the harness's own bytes: the body the proxy sends may be a translation."""
        if not self.per_attempt or not any(b'"%s"' % k.encode() in raw for k in self.per_attempt):
            return raw
        try:
            body = json.loads(raw)
        except ValueError:
            return raw
        if not isinstance(body, dict):
            return raw
        kept = {k: v for k, v in body.items() if k not in self.per_attempt}
        return json.dumps(kept, ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode()

    def previous_response(self, body: dict[str, Any]) -> str | None:
        """The id of the stored answer this request continues (Responses'
        ``previous_response_id``): its conversation is that one's plus its own input."""
        return None

    def chained_request(self, body: dict[str, Any], prefix: list[Any]) -> Request:
        """The request over the whole conversation when it continues ``prefix`` (the stored
        conversation up to the previous answer)."""
        request = self.parse_request(body)
        return request.model_copy(update={"messages": prefix + request.messages})

    # -- network policy (addons/gateway/policy/network.py) ------------------------------------------------

    def mediate_network(self, body: dict[str, Any], domains: list[str] | None, *,
                        keep_previous: bool = False) -> Mediation:
        """Remove, in place, every capability the provider executes for the model (hosted
        search and fetch, code execution, provider-called MCP servers, remote files,
        provider-held conversation state), each removal an ``Override`` whose ``old`` names
        the kind, never the content. ``domains``: web search may stay, narrowed to these
        (the ``restrict`` policy), where the API can narrow it. ``keep_previous``: the
        request's provider-held conversation is one this session recorded."""
        return Mediation()

    def append_notice(self, body: dict[str, Any], notice: str) -> Override | None:
        """``notice`` appended to the first user message, in place; its override, or None."""
        return None

    # -- streams -----------------------------------------------------------------------------

    def is_stream(self, body: dict[str, Any], path: str = "") -> bool:
        return bool(body.get("stream"))

    def frames(self, status: int, content_type: str, stream: bool) -> Frames | None:
        """How to cut this answer into events, or None when it is one JSON body. The
        assembler's ``feed`` says which event is terminal."""
        if status == 200 and content_type.startswith("text/event-stream"):
            return SSEDecoder()
        return None

    # -- errors ------------------------------------------------------------------------------

    @abstractmethod
    def error_body(self, status: int, message: str, type: str | None = None) -> dict[str, Any]:
        """The format's own error JSON for an answer the proxy gives itself."""

    def refused_parameters(self, body: Any) -> list[str]:
        """The request parameters an error answer blames, as dotted body paths, most certain
        first: OpenAI's ``error.param``, then every name the message quotes (Anthropic's
        "`temperature` is not supported", OpenAI's "Unsupported parameter: 'top_p'") or opens
        with ("max_tokens: Field required"). Provider feedback (``addons/gateway/feedback.py``) acts
        only on one the proxy itself changed."""
        err = body.get("error") if isinstance(body, dict) else None
        if not isinstance(err, dict):
            return []
        names: list[str] = []
        if isinstance(err.get("param"), str) and err["param"]:
            names.append(err["param"])
        message = str(err.get("message") or "")
        lead = _LEADING.match(message)
        names += [lead.group(1)] if lead else []
        names += _QUOTED.findall(message)
        return list(dict.fromkeys(names))

    def response_error(self, status: int, body: Any) -> ResponseError:
        """An upstream error answer as a record: the provider's type and message if the body
        has its shape, else the status alone."""
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict):
            return classified(ResponseError(
                type=str(err.get("type") or err.get("code") or "error"),
                message=str(err.get("message") or ""),
                status=status,
            ), err.get("code"))
        if isinstance(body, dict) and isinstance(body.get("message"), str):
            # vLLM's older error shape: {"object": "error", "message", "type", "code": 400}
            return classified(ResponseError(type=str(body.get("type") or "error"), message=body["message"],
                                            status=status), body.get("code"))
        return ResponseError(type="http_error", message=f"HTTP {status}", status=status)

    def clamp_max_tokens(self, body: dict[str, Any], cap: int) -> list[Override]:
        """Lower the request's max output tokens to ``cap`` (a rollout's budget left), in
        place, each change an override with reason ``limit``. A dialect without the setting
        changes nothing."""
        return []


CONTEXT_LENGTH = "context_length"
# What each upstream answers when the prompt does not fit the model's context:
# - OpenAI (Chat and Responses): error code "context_length_exceeded", message "This model's
#   maximum context length is N tokens..." (platform.openai.com/docs/guides/error-codes);
# - Anthropic: 400 invalid_request_error "prompt is too long: N tokens > M maximum"
#   (docs.anthropic.com/en/api/errors);
# - vLLM: 400 "This model's maximum context length is N tokens. However, you requested ..."
#   or "The prompt (total length N) is too long to fit into the model (context length M)"
#   (vllm/entrypoints/openai/serving_engine.py);
# - SGLang: "The input (N tokens) is longer than the model's context length (M tokens)."
_CONTEXT_CODES = frozenset({"context_length_exceeded"})
_CONTEXT_PHRASES = ("maximum context length", "prompt is too long", "too long to fit into the model",
                    "longer than the model's context length", "context_length_exceeded")


def classified(error: ResponseError, code: Any = None) -> ResponseError:
    """``error`` with type ``context_length`` when it says the prompt does not fit (the
    provider's message is kept), else unchanged."""
    text = error.message.lower()
    if error.type in _CONTEXT_CODES or code in _CONTEXT_CODES or any(p in text for p in _CONTEXT_PHRASES):
        return error.model_copy(update={"type": CONTEXT_LENGTH})
    return error

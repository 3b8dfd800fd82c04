"""One interface over every wire format.

The addons never branch on a format: they ask the flow's dialect to parse, to impose the
session's settings, to assemble a stream, to write an error. Each dialect is stateless (one
shared instance per format); per-exchange state lives in the ``StreamAssembler`` it makes.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, ClassVar, Literal, Protocol

from interceptor.dialects.sse import SSEDecoder, SSEEvent
from interceptor.trace.messages import Message, Request, Response, ResponseError, Sampling

# A parameter an error message names: `temperature`, 'top_p', "reasoning.effort"; or opens with.
_QUOTED = re.compile(r"[`'\"]([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)[`'\"]")
_LEADING = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*): ")


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


class StreamAssembler(ABC):
    """Builds a ``Response`` from a stream one event at a time, O(event) per call.

    ``feed`` returns True when the event is the format's terminal event (after it has been
    folded in), so the tee can commit the turn before forwarding the bytes that carry it.
    A stream that ends without a terminal event is an error, not a turn: ``result()`` then
    carries ``error``.
    """

    done: bool = False

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
    #: Environment variables the dialect's harnesses read their API key from: a session's
    #: environment sets each to the session's model secret.
    key_variables: ClassVar[tuple[str, ...]] = ()
    #: Request headers that can carry a credential; all are removed before forwarding.
    credential_headers: ClassVar[tuple[str, ...]] = ("authorization", "x-api-key", "api-key")
    #: The dialect can return training tokens (vLLM/SGLang ``return_token_ids``).
    collects_tokens: ClassVar[bool] = False
    #: The body key of a message list whose elements are one canonical message each, parsed
    #: on their own and in order (Chat's ``messages``): the history a request restates is then
    #: recognised from its text and not parsed again (trace/prefix.py), and ``parse_request``
    #: gets the known leading messages. None where one element can make several messages or
    #: depends on another (a tool result named by an earlier call).
    message_list: ClassVar[str | None] = None

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
        """The key the harness sent (its session secret), where this dialect's SDKs put it."""
        key = headers.get("x-api-key", "").strip()
        if key:
            return key
        auth = headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            return auth[7:].strip() or None
        return None

    def put_key(self, headers: MutableMapping[str, str], query: MutableMapping[str, str], key: str | None) -> None:
        """Remove every credential the harness sent and, given one, set the real key the way
        the provider expects it. Never logs either."""
        for name in self.credential_headers:
            headers.pop(name, None)
        if key:
            headers.update(self.auth_headers(key))

    def auth_headers(self, key: str) -> dict[str, str]:
        return {"authorization": f"Bearer {key}"}

    # -- where the model lives -----------------------------------------------------------

    def requested_model(self, body: dict[str, Any] | None, path: str) -> str | None:
        model = (body or {}).get("model")
        return model if isinstance(model, str) else None

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
    def parse_request(self, body: dict[str, Any], known: Sequence[Message] = ()) -> Request:
        """The canonical request. ``known`` (only with ``message_list``) are the canonical
        messages of the list's first ``len(known)`` elements, already parsed from the very
        same text: used as they are."""

    @abstractmethod
    def parse_response(self, body: dict[str, Any]) -> Response: ...

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

    def previous_response(self, body: dict[str, Any]) -> str | None:
        """The id of the stored answer this request continues (Responses'
        ``previous_response_id``): its conversation is that one's plus its own input."""
        return None

    def chained_request(self, body: dict[str, Any], prefix: list[Any]) -> Request:
        """The request over the whole conversation when it continues ``prefix`` (the stored
        conversation up to the previous answer)."""
        request = self.parse_request(body)
        return request.model_copy(update={"messages": prefix + request.messages})

    # -- network policy (addons/network.py) ------------------------------------------------

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
        with ("max_tokens: Field required"). Provider feedback (``addons/feedback.py``) acts
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

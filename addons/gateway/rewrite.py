"""Rewrite: the session's model, sampling, credential and upstream, imposed on a claimed flow.

The body is parsed once here and kept on the exchange; the session's settings are laid over
the harness's (or, in ``exact`` mode, replace them) and reconciled with what the provider
accepts. A body that needs no change is forwarded byte for byte. The harness's
credential (its session secret) is removed and the real key, read from the proxy's own
environment, is set; neither ever reaches a record or a log.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from mitmproxy import http

from interceptor.addons.gateway.answers import error_response, json_response, refuse
from interceptor.addons.gateway.exchange import Exchange, Step, exchange_of
from interceptor.addons.gateway.feedback import Refused
from interceptor.addons.gateway.answer.hold import holds
from interceptor.addons.gateway.transport.wsrelay import is_upgrade
from interceptor.addons.gateway.policy.network import SEARCH_UNAVAILABLE, mediate
from interceptor.addons.gateway.record import make_call
from interceptor.addons.gateway.policy.limits import output_cap
from interceptor.addons.gateway.sessions.session import SessionConfig
from interceptor.dialects.base import Dialect, Override, drop
from interceptor.dialects.body import Body, parse_body
from interceptor.dialects.translate import TRANSLATION, Translation, translation
from interceptor.trace.messages import Message, Request, Response, Usage
from interceptor.trace.prefix import Listed, Prefixes, touches

log = logging.getLogger(__name__)

# What the tee can decode incrementally; anything else the harness offers is dropped so the
# provider never answers in an encoding the assembler cannot read.
DECODABLE = ("gzip", "deflate", "br", "zstd", "identity")


def accept_encoding(value: str) -> str:
    keep = []
    for token in value.split(","):
        name = token.split(";")[0].strip().lower()
        if name in DECODABLE:
            keep.append(token.strip())
    return ", ".join(keep) or "identity"


OFF_LOOP = 1 << 20  # bodies above this many bytes are parsed in a worker thread


@dataclass(slots=True)
class Prepared:
    """The outcome of reading a body: what to forward, or why not (``refusal``)."""

    body: dict[str, Any] | None = None
    request: Request | None = None
    overrides: list[Override] = field(default_factory=list)
    content: bytes | None = None  # the new body, when something changed
    requested_model: str | None = None  # as the harness sent it
    refusal: str | None = None
    search_only: bool = False  # it exists only to use removed provider tools (network policy)
    stream: bool = False  # the harness asked for a stream
    source: dict[str, Any] | None = None  # the harness's body, when ``body`` is its translation
    listed: Listed | None = None  # the message list element by element (trace/prefix.py)
    parsed: Body | None = None  # with its spans: a request hook's rewrite splices into it


# No model API takes JSON nested this deep, and deeper values break recursive code further on
# (pydantic, copying, hashing: a RecursionError there would skip the rest of an addon's hook).
# Checked on the small top-level values, where it is cheap; a large one nested this deep fails
# parsing first (Python's JSON decoder stops at its recursion limit).
MAX_DEPTH = 128
SMALL = 4096
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_BRACKETS = re.compile(r"[\[\]{}]")


def _depth(text: str) -> int:
    depth = deepest = 0
    for b in _BRACKETS.findall(_STRING.sub("", text)):
        depth += 1 if b in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def prepare(raw: bytes, dialect: Dialect, kind: str, config: SessionConfig, path: str = "",
            translated: Translation | None = None, refused: Refused | None = None,
            prefixes: Prefixes | None = None, recorded: Callable[[str], bool] | None = None,
            cap: int | None = None, write: bool = True) -> Prepared:
    """Parse, understand and rewrite one request body. Pure, so that a large body can be
    handled in a worker thread while the event loop keeps serving other sessions. A changed
    body is spliced: only the top-level keys an override names are written anew, the
    history is copied as the harness wrote it (``dialects.body``). That relies on every
    dialect step recording each change it makes as an Override (the record must say what
    changed anyway); tests/test_rewrite.py holds every dialect to it.

    A body nested deeper than Python's recursion limit (a body of a few thousand brackets can be) or one that is
    not UTF-8 (JSON text must be, RFC 8259 section 8.1; Python's decoder lets lone surrogate
    bytes through, and they cannot be written again) is bad input, refused as such; any other
    exception is the Gate's to answer (addons/mitm/gate.py).

    With ``translated`` the canonical request is read from the harness's body, which is then
    translated into the upstream's dialect (what cannot be carried over is an override with
    reason ``translation``) and the session's settings are imposed on the translation, by the
    upstream's rules: ``body`` and ``content`` are what the upstream gets.

    ``prefixes`` are the session's remembered message lists: the history a request restates
    as the very same text is taken from them, not parsed again (trace/prefix.py).

    The session's network policy is applied first, in the harness's dialect (before any
    translation): ``recorded`` says whether a provider-held answer id is one this session
    recorded (such a chain is kept).

    ``write`` False: a model request's changed body is left to its caller to write
    (``Exchange.unwritten``); ``content`` is then None, ``parsed`` and ``overrides`` say it."""
    try:
        return _prepare(raw, dialect, kind, config, path, translated, refused, prefixes, recorded, cap, write)
    except RecursionError:
        return Prepared(refusal="request body is nested too deeply to be read; no model API "
                                "accepts JSON nested hundreds of levels deep")
    except UnicodeError as e:
        return Prepared(refusal=f"request body is not valid UTF-8 JSON: {e.reason} at byte {e.start}")


def _prepare(raw: bytes, dialect: Dialect, kind: str, config: SessionConfig, path: str,
             translated: Translation | None, refused: Refused | None, prefixes: Prefixes | None,
             recorded: Callable[[str], bool] | None, cap: int | None, write: bool) -> Prepared:
    listed = dialect.message_list if kind == "model" else None
    try:
        parsed = parse_body(raw, listed, prefixes if listed else None)
    except ValueError as e:
        return Prepared(refusal=f"request body is not valid JSON: {e}")
    body = parsed.data
    if not isinstance(body, dict):
        return Prepared(refusal="request body must be a JSON object")
    if parsed.text is not None and any(b - a <= SMALL and _depth(parsed.text[a:b]) > MAX_DEPTH
                                       for a, b in parsed.spans.values()):
        raise RecursionError  # answered by prepare, as a body too deep to parse is
    out = Prepared(body=body, requested_model=dialect.requested_model(body, path), parsed=parsed)
    out.stream = dialect.is_stream(body, path)
    if kind == "model":
        try:
            listing = parsed.listed
            out.request = dialect.parse_request(body, listing)
            if listing is not None and listing.complete:  # the messages before the list's
                listing.lead = len(out.request.messages) - listing.marks[-1]
            if out.request.model is None and out.requested_model:  # a dialect with the model in the path
                out.request.model = out.requested_model
        except Exception as e:  # a shape the dialect does not know: refuse rather than record wrong
            log.warning(f"interceptor: {dialect.name} request not understood: {type(e).__name__}: {e}")
            return Prepared(refusal=f"request not understood by the {dialect.name} dialect: {e}")
        network = _network(out, dialect, body, config, recorded)
        if translated is not None:
            out = _translate(out, translated, config, cap)
            out.overrides[:0] = network
            return out
        learned = refused.get(dialect.name, config.model or out.requested_model) if refused else frozenset()
        out.overrides = network + dialect.apply_overrides(body, config.model, config.sampling, config.sampling_mode,
                                                          learned, requested=out.requested_model)
        out.listed = listing
        if cap is not None:  # the rollout's output budget left (limits.clamp_max_tokens)
            out.overrides += dialect.clamp_max_tokens(body, cap)
    else:
        out.overrides = _network(out, dialect, body, config, recorded) + dialect.side_overrides(body, config.model)
    if out.overrides and (write or out.request is None):
        out.content = parsed.encode({o.key.split(".", 1)[0] for o in out.overrides})
    return out


def _network(out: Prepared, dialect: Dialect, body: dict[str, Any], config: SessionConfig,
             recorded: Callable[[str], bool] | None) -> list[Override]:
    """The network policy's changes (addons/gateway/policy/network.py), and whether the request is then
    one to answer here (model routes only: a side route's body is never answered)."""
    if config.network is None:
        return []
    previous = dialect.previous_response(body)
    mediation = mediate(dialect, body, config.network,
                        known_previous=bool(previous and recorded is not None and recorded(previous)))
    out.search_only = mediation.search_only and out.request is not None
    return mediation.overrides


def _translate(out: Prepared, translated: Translation, config: SessionConfig, cap: int | None) -> Prepared:
    source = out.body
    try:
        target, lost = translated.request(source)
    except Exception as e:  # a shape the translation does not know: refuse, forward nothing
        log.warning(f"interceptor: {translated.source.name} request not translatable: {type(e).__name__}: {e}")
        return Prepared(refusal=f"request could not be translated into {translated.target.name}: {e}")
    if "model" not in target and out.requested_model:  # a dialect with the model in its path
        target["model"] = out.requested_model
    if out.stream and not target.get("stream"):  # ... and its stream too
        target["stream"] = True
        target["stream_options"] = {"include_usage": True}
    out.source, out.body = source, target
    out.overrides = lost + translated.target.apply_overrides(target, config.model, config.sampling,
                                                              config.sampling_mode)
    if cap is not None:  # the rollout's output budget left (limits.clamp_max_tokens)
        out.overrides += translated.target.clamp_max_tokens(target, cap)
    out.content = json.dumps(target, ensure_ascii=False, separators=(",", ":")).encode()
    return out


@functools.lru_cache(maxsize=256)
def _split(base: str) -> tuple[str, str, int, str, str]:
    """An upstream's base URL as the request takes it: scheme, host, port, path, and the
    Host header's value (the port only when it is not the scheme's own). Parsed once per
    base URL, not per request."""
    u = urlsplit(base)
    scheme = u.scheme
    port = u.port or (443 if scheme == "https" else 80)
    default_port = (scheme == "https" and port == 443) or (scheme == "http" and port == 80)
    return scheme, u.hostname, port, u.path, u.hostname if default_port else f"{u.hostname}:{port}"


class Rewrite:
    def __init__(self, refused: Refused | None = None) -> None:
        # What the provider refused per model earlier (Feedback): the proxy's change to it
        # is not made again.
        self.refused = refused

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        ex = exchange_of(flow)
        if ex is None:
            return
        upstream = ex.session.upstream
        if upstream and upstream.dialect and upstream.dialect != ex.dialect.name:
            ex.translation = translation(ex.dialect.name, upstream.dialect)
            if ex.translation is None or ex.route.kind != "model" or flow.request.method != "POST":
                # Forwarding would send a body the upstream cannot read, with the key. (Codex's
                # WebSocket upgrade is served by WsServe before this; where it cannot be,
                # Codex falls back to POST, which is translated.)
                what = ("the proxy does not translate between them" if ex.translation is None
                        else "only model calls over HTTP POST are translated")
                refuse(flow, error_response(ex.dialect, 400 if ex.translation is None else 404,
                                            f"the session's upstream {upstream.name!r} speaks {upstream.dialect}, "
                                            f"this request is {ex.dialect.name} and {what}; nothing was forwarded"))
                return
        if flow.request.method == "GET" and is_upgrade(flow.request) and holds(ex):
            # Response hooks hold answers over HTTP only (addons/gateway/answer/hold.py). Codex's Responses
            # socket is served by WsServe (each frame a held POST) before this; an upgrade that
            # reaches here (another mode, WsServe not running) is refused, and Codex falls
            # back to POST, whose answers are held.
            refuse(flow, error_response(ex.dialect, 404, "the session's response hooks hold answers over HTTP only; "
                                                         "use POST (nothing was forwarded)"))
            return
        path, override = ex.dialect.path_with_model(flow.request.path, ex.session.config.model)
        if flow.request.method == "POST" and not await self._rewrite_body(flow, ex):
            return
        if override is not None and ex.translation is None:  # translated: the model is in the body
            flow.request.path = path
            ex.overrides.insert(0, override)
        self._swap_credential(flow, ex)
        self._route(flow, ex)
        if "accept-encoding" in flow.request.headers:
            flow.request.headers["accept-encoding"] = accept_encoding(flow.request.headers["accept-encoding"])
        ex.done |= Step.REWRITTEN

    async def _rewrite_body(self, flow: http.HTTPFlow, ex: Exchange) -> bool:
        raw = flow.request.get_content(strict=False) or b""
        ex.raw_body = raw
        hooked = ex.session.hooks is not None and bool(ex.session.hooks.request)
        recorder = ex.session.recorder
        prefixes = recorder.prefixes
        config = ex.session.config
        # A hooked model request's body is written once, by Stops, with the hooks' edits.
        write = not (hooked and ex.translation is None)
        args = (raw, ex.dialect, ex.route.kind, config, flow.request.path, ex.translation, self.refused,
                prefixes, lambda rid: recorder.conversation(rid) is not None,
                output_cap(config.limits, recorder.trace), write)
        prepared = await asyncio.to_thread(prepare, *args) if len(raw) > OFF_LOOP else prepare(*args)
        if prepared.refusal is not None:
            refuse(flow, error_response(ex.dialect, 400, prepared.refusal))
            return False
        ex.request = prepared.request
        source = prepared.source if prepared.source is not None else prepared.body
        previous = ex.dialect.previous_response(source) if prepared.request is not None else None
        if previous is not None:
            self._chain(ex, source, previous)
        ex.overrides = prepared.overrides
        ex.listed = prepared.listed
        if ex.listed is not None and touches(ex.overrides, ex.listed.key):
            recorder.prefixes.clear()  # its elements may have been changed in place: share none
            ex.listed = None
        if hooked and ex.listed is not None:
            # A request hook may deliver other content than the bytes say (a remembered
            # rewrite, a hook's change): the list is remembered as parsed (Listed.sent).
            ex.listed.sent = prepared.request.messages
        ex.body = prepared.body
        if hooked and prepared.request is not None and prepared.source is None:
            ex.parsed = prepared.parsed  # kept only where a hook may splice into it (not a translation)
            ex.unwritten = not write
        ex.stream = prepared.stream
        ex.requested_model = prepared.requested_model
        if prepared.search_only:
            answer_search_only(flow, ex)  # nothing goes upstream
            return False
        if prepared.content is not None:
            flow.request.content = prepared.content
        if ex.translation is not None:
            self._translated(flow, ex)
            return True
        for change in ex.dialect.header_changes(prepared.body, ex.overrides, flow.request.headers):
            name = change.key.removeprefix("header:")
            if change.new is None:
                flow.request.headers.pop(name, None)
            else:
                flow.request.headers[name] = change.new
            ex.overrides.append(change)
        return True

    def _translated(self, flow: http.HTTPFlow, ex: Exchange) -> None:
        """The translated body goes to the upstream's own route, with its headers."""
        tr = ex.translation = ex.translation.bind(ex.request)
        if ex.previous_response_id is not None:
            # Chat has no stored answers: the proxy sends the conversation the id ends.
            known = None if ex.previous_response_unknown else ex.session.recorder.conversation(ex.previous_response_id)
            if known is not None and tr.prefix(ex.body, known):
                flow.request.content = json.dumps(ex.body, ensure_ascii=False, separators=(",", ":")).encode()
            else:
                ex.overrides.append(Override("previous_response_id", ex.previous_response_id, None, TRANSLATION))
        ex.translated_digest = hashlib.sha256(flow.request.content or b"").hexdigest()
        flow.request.path = tr.path
        for name in tr.source_headers:
            flow.request.headers.pop(name, None)
        flow.request.headers["content-type"] = "application/json"
        # Plain bytes back: the answer is cut into events and translated as it passes.
        flow.request.headers["accept-encoding"] = "identity"

    def _chain(self, ex: Exchange, body: dict[str, Any], previous: str) -> None:
        """A Responses request continuing a stored answer sends only its new input: its
        conversation is the recorded one up to that answer plus the input, so the graph
        extends the branch. An id this session never recorded starts a new root, and the
        call says so."""
        ex.previous_response_id = previous
        prefix = ex.session.recorder.conversation(previous)
        if prefix is None:
            ex.previous_response_unknown = True
            log.info(f"interceptor: session {ex.session.id!r}: previous_response_id {previous!r} is unknown "
                     "to this proxy; the turn is recorded from its own input")
            return
        chained = ex.dialect.chained_request(body, prefix)
        ex.request = ex.request.model_copy(update={"messages": chained.messages})
        ex.prefix_len = len(prefix)

    def _swap_credential(self, flow: http.HTTPFlow, ex: Exchange) -> None:
        drop(flow.request.headers, ("proxy-authorization",))
        if ex.wire is not ex.dialect:  # the harness's credential headers go too
            ex.dialect.put_key(flow.request.headers, flow.request.query, None)
        ex.wire.put_key(flow.request.headers, flow.request.query, ex.session.upstream_key())

    def _route(self, flow: http.HTTPFlow, ex: Exchange) -> None:
        base = ex.session.upstream.base_url if ex.session.upstream else None
        if not base:
            return
        scheme, host, port, path, hostport = _split(base)
        req = flow.request
        req.scheme = scheme
        # What the host and port setters leave, set once: each setter rewrites the Host
        # header and the authority it finds (a header scan, a rebuild), and host_header below
        # sets the header again anyway.
        req.data.host, req.data.port = host, port
        if req.data.authority:
            req.authority = hostport
        req.path = ex.wire.upstream_path(path, req.path)
        req.host_header = hostport


def answer_search_only(flow: http.HTTPFlow, ex: Exchange) -> None:
    """Answer a search-only request here, in the dialect's shape (its stream when it asked
    for one), and put the call on the record; nothing goes upstream."""
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

"""What the dialects share: content references, the assembler shape, sampling knobs.

``NativeAssembler`` makes "the stream equals the JSON" structural: every assembler rebuilds
the non-streamed body and hands it to ``parse_response``. The knob table makes "the session
is authoritative" one algorithm instead of three: each dialect lists where each canonical
setting lives in its body and who owns it, and ``apply_knobs`` drops, sets and reports in the
same way for all of them.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from abc import abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal


from interceptor.dialects.base import Dialect, Override, RouteKind, StreamAssembler, classified
from interceptor.dialects.body import scan_value
from interceptor.dialects.models import Capabilities, capabilities
from interceptor.dialects.sse import SSEEvent
from interceptor.trace.messages import Part, Response, ResponseError, Sampling

#: Keys that are transport hints, not content: Claude Code moves ``cache_control`` to the
#: newest message every turn, so keeping it would make every restated message "new".
VOLATILE_KEYS = frozenset({"cache_control"})


def without(block: dict[str, Any], keys: Iterable[str] = VOLATILE_KEYS) -> dict[str, Any]:
    """A shallow copy of ``block`` without ``keys`` (the original is never mutated)."""
    return {k: v for k, v in block.items() if k not in keys}


def inline_ref(data: str) -> str:
    """``sha256:<hex>`` of base64 inline data, hashed as the base64 text: standard base64 is
    unique for given bytes, so the same image sent as a Chat data URL and as an Anthropic
    source gets the same reference, without decoding megabytes on every restated turn."""
    if "\n" in data or " " in data or "\r" in data:  # MIME-style wrapped base64
        data = "".join(data.split())
    return "sha256:" + hashlib.sha256(data.encode("ascii", "replace")).hexdigest()


def url_part(kind: Literal["image", "file"], url: str, **extra: Any) -> Part:
    """A part for a URL, turning ``data:`` URLs into a hash reference and a media type."""
    data = {k: v for k, v in extra.items() if v is not None} or None
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        media = header[5:].split(";")[0] or None
        if ";base64" not in header:  # percent-encoded text: hash it as base64 would be
            payload = base64.b64encode(payload.encode()).decode()
        return Part(type=kind, ref=inline_ref(payload), media_type=media, data=data)
    return Part(type=kind, ref=url, data=data)


def inline_part(kind: Literal["image", "file"], data: str, **extra: Any) -> Part:
    """A part for inline file data sent either as a ``data:`` URL or as bare base64."""
    return url_part(kind, data if data.startswith("data:") else "data:;base64," + data, **extra)


def restorable_ref(part: Part, where: str) -> str:
    """The reference an image or file part can be sent again with; ValueError for inline data,
    which the record keeps as a digest only (``inline_ref``)."""
    if not part.ref or part.ref.startswith("sha256:"):
        raise ValueError(f"{where} is inline {part.type} data, kept on the record as its digest only: "
                         f"it cannot be sent again")
    return part.ref


def other_part(block: dict[str, Any]) -> Part:
    """A native block we do not model, kept whole (minus volatile keys) so nothing is lost."""
    return Part(type="other", data=without(block))


def loads_or_raw(text: str) -> Any:
    """Parsed JSON, or the text itself when it does not parse (a tool call cut by max_tokens)."""
    if not text:
        return {}
    try:
        return json.loads(text)
    except ValueError:
        return text


def dumps_arguments(value: Any) -> str:
    """Tool input as the arguments string, in the spacing Anthropic itself streams
    (``{"a": 1}``), so the JSON and the streamed path produce the same string."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def json_data(event_data: str) -> dict[str, Any] | None:
    """An SSE data payload as a JSON object, or None when it is not one (keep-alives,
    ``[DONE]``, a malformed line). An object that fills the payload exactly (what providers
    send) is read by the JSON module's C scanner directly, without ``json.loads``' layers
    around it; anything else goes through ``json.loads`` and its rules."""
    if event_data[:1] == "{":
        try:
            value, end = scan_value(event_data, 0)
        except (StopIteration, ValueError):
            value, end = None, -1
        if end == len(event_data):
            return value
    try:
        value = json.loads(event_data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


_SCANSTRING = json.decoder.scanstring


class Shape:
    """One streamed event's exact bytes with holes where values go: what a dialect's usual
    event (a text delta; vLLM's, with its token ids and logprobs) looks like on the wire,
    learned from the first one it parsed (``shape_of``). An event that is the shape's fixed
    text with a value of the hole's kind in each hole (and any run of spaces before its last
    brace, as Anthropic pads its events) parses to the learned event with other values in
    them: ``match`` reads them without parsing the event or cutting it into lines, exactly
    as ``json.loads`` would have read them (strict: a raw control character, a bad escape, a
    number JSON does not allow is no match, and the event takes the full path). A hole's kind
    is its learned value's: a string, a number (an int or a float, as the text says), a flat
    list of ints written compactly (vLLM's ``token_ids``), or any other list (a chunk's
    logprobs entries, however many; only in a shape that gives every value). A shape
    that gives its first string only (a text delta; ``every`` false) compares its fixed texts
    where they must start, reads each string with the JSON module's C string scanner and
    checks each number or list by its JSON grammar; one that gives every value (vLLM's) compares
    its head (the fixed text before the first hole) where the event starts, then matches one
    regular expression (each hole's JSON grammar, the fixed text after it; ``_pattern``) and
    reads the holes' texts together by the JSON module's C scanner, which decides what the
    grammar lets through."""

    __slots__ = ("first", "rest", "keep", "checks", "pattern", "wire", "last")

    def __init__(self, fixed: list[str], kinds: tuple[str, ...], order: tuple[int, ...], every: bool) -> None:
        # After each hole, the fixed text that follows it; the last one without the closing
        # brace and blank line, found at the end after any spaces. ``order``: each hole's
        # index in ``shape_of``'s ``holes``, in wire order.
        self.first = fixed[0]
        self.rest = tuple(fixed[1:])
        # The first hole's string only (a text delta): each fixed text compared where it must
        # start, each string read by the scanner, each number or list checked by its grammar,
        # cheaper than a pattern for a few holes; ``match`` gives that string (``keep``: where
        # it is in wire order), the others (OpenAI's ``obfuscation`` padding, Responses'
        # ``sequence_number``) are only checked. ``every``: one pattern for the event, then
        # its holes' texts parsed together, and ``match`` gives every value.
        self.keep = -1 if every else order.index(0)
        checks = tuple(_CHECK.get(kind) for kind in kinds)
        self.checks = checks if any(checks) else None  # None: strings only, the plain loop
        self.pattern = None if not every else _pattern(kinds, self.rest)
        # Where each hole's value is in wire order, when that is not the holes' own order.
        self.wire = None if order == tuple(sorted(order)) else tuple(order.index(i) for i in range(len(order)))
        #: The last match by the pattern: each hole's text is its group, in wire order (what
        #: collect.py's strip reuses).
        self.last: re.Match[str] | None = None

    def match(self, text: str) -> Any:
        """A shape of strings: the first hole's string. Any other: the values of every hole,
        in ``shape_of``'s order. None when ``text`` is not of the shape."""
        if self.pattern is not None:
            return self._match_pattern(text)
        if not text.startswith(self.first):
            return None
        pos, kept = len(self.first), None
        try:
            if self.checks is None:  # strings only: the usual text delta, the loop kept short
                for i, fixed in enumerate(self.rest):
                    if text[pos] != '"':
                        return None
                    value, pos = _SCANSTRING(text, pos + 1)
                    if not text.startswith(fixed, pos):
                        return None
                    if i == self.keep:
                        kept = value
                    pos += len(fixed)
            else:
                for i, (fixed, check) in enumerate(zip(self.rest, self.checks)):
                    if check is not None:  # a number or a list, only checked
                        m = check(text, pos)
                        if m is None:
                            return None
                        pos = m.end()
                    else:
                        if text[pos] != '"':
                            return None
                        value, pos = _SCANSTRING(text, pos + 1)
                        if i == self.keep:
                            kept = value
                    if not text.startswith(fixed, pos):
                        return None
                    pos += len(fixed)
        except (ValueError, IndexError):
            return None
        end = len(text) - 3
        if pos > end or not text.endswith("}\n\n") or text.count(" ", pos, end) != end - pos:
            return None
        return kept

    def _match_pattern(self, text: str) -> list[Any] | None:
        first = self.first
        if not text.startswith(first):
            return None
        m = self.pattern.fullmatch(text, len(first))
        if m is None:
            return None
        groups = m.groups()
        try:  # the holes' texts as one JSON array: the escapes checked, the numbers read
            values = scan_value("[%s]" % ",".join(groups), 0)[0]
        except (ValueError, StopIteration):
            return None
        if len(values) != len(groups):
            return None  # a "v" hole's text was more than one value
        self.last = m
        return values if self.wire is None else [values[k] for k in self.wire]


#: Compiled patterns by their holes' kinds and fixed texts (``_pattern``): bounded, emptied
#: when full.
_PATTERNS: dict[tuple[tuple[str, ...], tuple[str, ...]], re.Pattern[str]] = {}
_PATTERNS_KEPT = 64


def _pattern(kinds: tuple[str, ...], rest: tuple[str, ...]) -> re.Pattern[str]:
    """The pattern of a shape that gives every value, from its first hole on: each hole's
    grammar and the fixed text after it. Not the fixed text before the first hole, which
    ``match`` compares where the event starts: that head holds what changes with every
    stream (the completion's ``id``, ``created``), so a pattern with it would be compiled anew
    for every stream, on the event loop (``re``'s parser is Python, per character), where the
    rest is the same from stream to stream and compiled once."""
    key = (kinds, rest)
    pattern = _PATTERNS.get(key)
    if pattern is None:
        if len(_PATTERNS) >= _PATTERNS_KEPT:
            _PATTERNS.clear()
        text = "".join(g + re.escape(f) for g, f in zip(map(_GRAMMAR.get, kinds), rest)) + r" *\}\n\n"
        pattern = _PATTERNS[key] = re.compile(text, re.DOTALL)
    return pattern


_INT = r"-?(?:0|[1-9][0-9]*)"
#: Each kind of hole's JSON text (RFC 8259 section 6 and 7; compact lists), as one group.
_GRAMMAR = {
    "s": r'("[^"\\\x00-\x1f]*(?:\\.[^"\\\x00-\x1f]*)*")',  # any escape here; the scanner checks them
    "n": rf"({_INT}(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)",
    "a": rf"(\[(?:{_INT}(?:,{_INT})*)?\])",
    # Any other list (vLLM's logprobs entries, as many as the chunk has): up to the first
    # ``]`` the fixed text follows, which its scan must then read as exactly one list.
    "v": r"(\[.*?\])",
}
#: The same, for a hole only checked: the pattern's ``match`` at an offset. Not "v", which
#: only a scan proves to be JSON: a shape with such a hole gives every value.
_CHECK = {kind: re.compile(grammar).match for kind, grammar in _GRAMMAR.items() if kind in "na"}


_HOLE = "\x00interceptor-hole-{}\x00"


def _kind(value: Any) -> str | None:
    if type(value) is str:
        return "s"
    if type(value) is int or type(value) is float:
        return "n"
    if type(value) is list:
        return "a" if all(type(x) is int for x in value) else "v"
    return None


def shape_of(framing: str, data: str, obj: dict[str, Any], holes: list[tuple[dict[str, Any], str]],
             every: bool = False) -> Shape | None:
    """The shape of one event (``framing`` + ``data`` + a blank line; ``obj`` parsed from
    ``data``) with a hole at each ``(container, key)`` of ``holes`` (values inside ``obj``,
    each a string, a number or a list of ints; ``match`` returns them in this order if
    ``every``, else the first one, which must be a string), or
    None when the event is not written the way ``json.dumps`` writes it compactly (then
    there is no shape, and every event takes the full path). The shape is checked against
    the event it was learned from: it must read back the very values it was learned with."""
    saved = [c[k] for c, k in holes]
    kinds = [_kind(v) for v in saved]
    if None in kinds or (not every and (kinds[0] != "s" or "v" in kinds)):
        return None
    try:
        for i, (c, k) in enumerate(holes):
            c[k] = _HOLE.format(i)
        dumped = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    finally:
        for (c, k), v in zip(holes, saved):
            c[k] = v
    spans = []
    for i in range(len(holes)):
        marker = json.dumps(_HOLE.format(i))
        at = dumped.find(marker)
        if at < 0 or dumped.find(marker, at + 1) >= 0:
            return None
        spans.append((at, at + len(marker), i))
    spans.sort()
    fixed, pos = [], 0
    for at, after, _ in spans:
        fixed.append(dumped[pos:at])
        pos = after
    fixed.append(dumped[pos:-1])  # the closing brace is matched at the end (``match``)
    fixed[0] = framing + fixed[0]
    shape = Shape(fixed, tuple(kinds[i] for _, _, i in spans), tuple(i for _, _, i in spans), every)
    return shape if shape.match(framing + data + "\n\n") == (saved if every else saved[0]) else None


def error_from(raw: Any, status: int | None = None, *, code_first: bool = False) -> ResponseError:
    """A provider error object (bare, or wrapped as ``{"error": {...}}``) as a record.
    Responses names the kind in ``code`` (``server_error``), the others in ``type``."""
    if isinstance(raw, dict) and isinstance(raw.get("error"), dict):
        raw = raw["error"]
    if not isinstance(raw, dict):
        return ResponseError(type="error", message=str(raw), status=status)
    keys = ("code", "type") if code_first else ("type", "code")
    kind = next((raw[k] for k in keys if raw.get(k)), "error")
    return classified(ResponseError(type=str(kind), message=str(raw.get("message") or ""), status=status),
                      raw.get("code"))


class NativeAssembler(StreamAssembler):
    """The assembler shape all three dialects share: fold each event into native state
    (``fold``), rebuild the body the non-streamed endpoint would have sent (``native``), and
    let ``parse_response`` map it, so the JSON and the streamed path cannot disagree.

    An unparseable or damaged event is remembered (the first one wins) so the record says
    the stream was not clean; a stream without its terminal event is an error on the record.
    """

    terminal: ClassVar[str]
    #: Learns its usual event's shape (``learn``), so the Tee may hand it such a chunk whole
    #: (``quick``); how many events per stream may try (``json.dumps`` each).
    shapes: ClassVar[bool] = False
    shape_tries: ClassVar[int] = 3

    def __init__(self, dialect: Dialect):
        self.dialect = dialect
        self.done = False
        self.error: ResponseError | None = None
        self._shape: Shape | None = None
        self._sink: Callable[[Any], Any] | None = None  # where what a matching event holds goes
        self._spare: tuple[Shape, Callable[[Any], Any]] | None = None  # the shape before
        self._tries = self.shape_tries if self.shapes else 0
        #: The last event ``quick`` read by a shape's pattern (``Shape.last``): collect.py's
        #: strip takes the same event's token fields out by it (``addons/gateway/answer/tee.py``).
        self.matched: re.Match[str] | None = None

    def quick(self, chunk: bytes) -> bool:
        """Fold ``chunk`` if it is one whole event of the learned shape (``Shape``): its values
        go where ``fold`` would have put them, without parsing the rest. False for anything
        else (it then takes the full path). The Tee asks only between events (``SSEDecoder.idle``)."""
        shape = self._shape
        if shape is None or self.done:
            return False
        try:
            text = chunk.decode()
        except UnicodeDecodeError:
            return False
        values = shape.match(text)  # the kept string, or every value
        if values is None:
            # The shape before it, if any: a stream whose odd event taught a shape of its own
            # (a token without bytes, a block of another kind) goes on with the usual one.
            spare = self._spare
            if spare is None or (values := spare[0].match(text)) is None:
                return False
            self._spare, (shape, self._sink) = (shape, self._sink), spare
            self._shape = shape
        self._sink(values)
        self.matched = shape.last
        return True

    def learn(self, framing: str, event: SSEEvent, obj: dict[str, Any], holes: list[tuple[dict[str, Any], str]],
              sink: Callable[[Any], Any], every: bool = False) -> None:
        """``fold`` just took ``event`` in the full way, and folding it again with other
        values at ``holes`` would only hand ``sink`` what ``Shape.match`` gives (the first
        string, or with ``every`` each value in that order):
        its shape, so the next events like it are read from their bytes (``quick``). A new
        shape replaces the old (a stream whose head changed, another block), which is kept
        as the spare: ``quick`` tries it when the new one does not fit, and swaps them.
        An event a known shape reads teaches nothing (it took the full path because a read
        cut it, not for its shape) and costs no try."""
        text = framing + event.data + "\n\n"
        spare = self._spare
        if (self._shape is not None and self._shape.match(text) is not None) or \
                (spare is not None and spare[0].match(text) is not None):
            return
        self._tries -= 1
        shape = shape_of(framing, event.data, obj, holes, every)
        if shape is not None:
            if self._shape is not None:
                self._spare = (self._shape, self._sink)
            self._shape, self._sink = shape, sink

    def feed(self, event: SSEEvent) -> bool:
        if self.done:
            return True
        obj = self.load(event)
        if (obj is None or event.malformed) and self.error is None:
            self.error = ResponseError(type="malformed_event",
                                       message=f"unparseable stream event: {event.data[:200]!r}")
        if obj is None:
            return False
        if self.fold(obj, event):
            self.done = True
        return self.done

    def load(self, event: SSEEvent) -> dict[str, Any] | None:
        """The event's JSON object, or None (``json_data``)."""
        return json_data(event.data)

    def fail(self, error: ResponseError) -> bool:
        """An error event: terminal, and what the record shows."""
        self.error = error
        return True

    @abstractmethod
    def fold(self, obj: dict[str, Any], event: SSEEvent) -> bool:
        """Fold one event's JSON in; True when it is the terminal event."""

    @abstractmethod
    def native(self) -> dict[str, Any]:
        """The non-streamed body the events so far add up to."""

    def result(self) -> Response:
        response = self.dialect.parse_response(self.native())
        error = self.error
        if not self.done:  # a cut stream; a damaged last fragment is only its symptom
            error = ResponseError(type="incomplete_stream", message=f"the stream ended before {self.terminal}")
        if error is not None:
            response.error = error
            response.finish_reason = "error"
        return response


def first(*values: Any) -> Any:
    for v in values:
        if v is not None:
            return v
    return None


# --------------------------------------------------------------------------------------
# Sampling knobs


Owner = Literal["session", "harness"]


@dataclass(frozen=True, slots=True)
class Knob:
    """Where one canonical ``Sampling`` field lives in a dialect's body.

    ``owner="session"``: a decoding knob; the harness's value is always dropped and the
    session's (if any) applied. ``owner="harness"``: part of the harness's contract with its
    own code (tool choice, stops, number of choices, logprobs); replaced only when the
    session sets it, because dropping it would break the harness, not just change sampling.
    ``required``: the provider rejects a body without it (Anthropic ``max_tokens``), so a
    harness value survives when the session gives none. ``aliases`` are older names for the
    same setting, removed whenever the canonical one is written.
    """

    field: str
    path: tuple[str, ...]
    owner: Owner = "session"
    required: bool = False
    aliases: tuple[tuple[str, ...], ...] = ()
    to_native: Callable[[Any], Any] | None = None
    from_native: Callable[[Any], Any] | None = None

    @property
    def key(self) -> str:
        return ".".join(self.path)


_MISSING = object()


def get_path(body: dict[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = body
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return _MISSING
        node = node[key]
    return node


def set_path(body: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = body
    for key in path[:-1]:
        child = node.get(key)
        if not isinstance(child, dict):
            child = node[key] = {}
        node = child
    node[path[-1]] = value


def del_path(body: dict[str, Any], path: tuple[str, ...]) -> None:
    """Remove a nested key and any parent object it leaves empty (``reasoning: {}`` is not
    the same request as no ``reasoning`` to every provider)."""
    parents = []
    node: Any = body
    for key in path[:-1]:
        parents.append((node, key))
        node = node[key]
    del node[path[-1]]
    for parent, key in reversed(parents):
        if parent[key]:
            break
        del parent[key]


def parse_knobs(body: dict[str, Any], knobs: Iterable[Knob]) -> Sampling:
    """The harness's settings in canonical names, for the record."""
    values: dict[str, Any] = {}
    for knob in knobs:
        for path in (knob.path, *knob.aliases):
            value = get_path(body, path)
            if value is not _MISSING and value is not None:
                values[knob.field] = knob.from_native(value) if knob.from_native else value
                break
    return Sampling.model_validate(values)


Mode = Literal["overlay", "exact"]


def apply_knobs(body: dict[str, Any], knobs: Iterable[Knob], sampling: Sampling,
                mode: Mode = "overlay") -> tuple[list[Override], set[str]]:
    """The session half of ``apply_overrides``; returns the changes and the top-level keys
    that now hold the session's values (reconciliation lets those win over the harness's).

    ``overlay`` (the default): a setting the session gives replaces the harness's, one it
    leaves unset keeps the harness's value, one it sets to ``null`` removes the harness's key
    (a required key, Anthropic ``max_tokens``, stays). ``exact``: every decoding key the
    harness sent is dropped and only the session's applied, for runs that must sample from
    exactly the configured distribution; keys owned by the harness (tool choice, stops, ``n``,
    logprobs) are still replaced only when the session sets them. A key already equal to the
    session's is not touched, so a conforming body yields no overrides."""
    changes: list[Override] = []
    mine: set[str] = set()
    given = sampling.model_fields_set
    for knob in knobs:
        wanted = getattr(sampling, knob.field)
        if wanted is None:
            explicit_null = knob.field in given and mode == "overlay"
            dropping = explicit_null or (mode == "exact" and knob.owner == "session")
            if not dropping or knob.required:
                continue
            for path in (knob.path, *knob.aliases):
                old = get_path(body, path)
                if old is not _MISSING:
                    del_path(body, path)
                    changes.append(Override(".".join(path), old, None, "session"))
            continue
        mine.add(knob.path[0])
        write_knob(body, knob, knob.to_native(wanted) if knob.to_native else wanted, "session", changes)
    return changes, mine


@dataclass(slots=True)
class Plan:
    """What reconciliation needs to know about one rewrite: the model's row of the table, the
    changes so far, which top-level keys hold the session's values, and the parameters the
    provider refused for this model earlier (provider feedback).

    A conflict is the proxy's to fix only when the proxy caused it (``touched``): a request
    the harness sent as it is, in overlay mode, reaches the provider unchanged, and so does
    the provider's answer to it."""

    caps: Capabilities
    changes: list[Override]
    session: set[str]
    refused: frozenset[str] = frozenset()

    def touched(self, *keys: str) -> bool:
        changed = {o.key.split(".", 1)[0] for o in self.changes}
        return any(k in changed or k in self.session for k in (*keys, "model"))

    def drop_refused(self, body: dict[str, Any]) -> None:
        """Parameters the provider answered 400 for, for this model, earlier in this proxy's
        life (``addons/gateway/feedback.py``): the proxy's change to each is undone before it is
        sent, as the second attempt undid it then. A key the harness sent itself, untouched
        by the proxy, stays: the provider's answer to it is the harness's to read."""
        for key in sorted(self.refused):
            self.changes += undo(body, key, self.changes)


PROVIDER_REJECTED = "provider_rejected"
# The network policy's removals (addons/gateway/policy/network.py): policy, never undone for a provider's 400.
NETWORK_POLICY = "network_policy"


def related(key: str, param: str) -> bool:
    """Whether an override of ``key`` changed the parameter ``param`` (dotted paths: one is
    the other, or contains it)."""
    return key == param or key.startswith(param + ".") or param.startswith(key + ".")


def undo(body: dict[str, Any], param: str, changes: list[Override]) -> list[Override]:
    """Undo, in ``body``, every change in ``changes`` that touched ``param``: each path gets
    back the value the harness sent (its first change's ``old``), or is removed when the
    harness had not sent it. Returns the undoing changes (reason ``provider_rejected``);
    none when the proxy never touched the parameter. The model is the session's and never
    undone; headers are not the body's."""
    original: dict[str, Any] = {}
    for change in changes:
        if (change.key == "model" or change.key.startswith("header:") or change.reason == NETWORK_POLICY
                or not related(change.key, param)):
            continue
        original.setdefault(change.key, change.old)
    out: list[Override] = []
    for key in reversed(list(original)):  # a later-touched path first, its parent after
        path = tuple(key.split("."))
        if any(part.isdigit() for part in path):
            continue  # a place in a list (a history block the proxy removed): not a parameter
        now = get_path(body, path)
        now = None if now is _MISSING else now
        if original[key] is None:
            if get_path(body, path) is not _MISSING:
                del_path(body, path)
        else:
            set_path(body, path, original[key])
        if now != original[key]:
            out.append(Override(key, now, original[key], PROVIDER_REJECTED))
    return out


def write_knob(body: dict[str, Any], knob: Knob, native: Any, reason: str, changes: list[Override]) -> None:
    """Set ``native`` at the knob's path and remove its older names, each change on the
    record with ``reason``; a key already equal to ``native`` is not touched."""
    for path in knob.aliases:
        old = get_path(body, path)
        if old is not _MISSING:
            del_path(body, path)
            changes.append(Override(".".join(path), old, None, reason))
    old = get_path(body, knob.path)
    if old is _MISSING or old != native:
        set_path(body, knob.path, native)
        changes.append(Override(knob.key, None if old is _MISSING else old, native, reason))


def drop(body: dict[str, Any], key: str, reason: str, changes: list[Override]) -> None:
    """Remove a top-level key for a provider constraint, saying why."""
    if key in body:
        changes.append(Override(key, body.pop(key), None, reason))


def replace(body: dict[str, Any], key: str, value: Any, reason: str, changes: list[Override]) -> None:
    old = body.get(key)
    if old != value:
        body[key] = value
        changes.append(Override(key, old, value, reason))


def set_model(body: dict[str, Any], model: str | None) -> list[Override]:
    if model and body.get("model") != model:
        old = body.get("model")
        body["model"] = model
        return [Override("model", old, model, "session")]
    return []


def stop_list(value: Any) -> list[str] | None:
    if value is None:
        return None
    return [value] if isinstance(value, str) else list(value)


def reconcile_openai(body: dict[str, Any], plan: Plan, *, effort: tuple[str, ...],
                     refused_by_reasoning: tuple[str, ...] = ()) -> None:
    """OpenAI's model rules, from the table: a reasoning model takes temperature and top_p
    only at their default 1 (and refuses ``refused_by_reasoning``); a model that does not
    reason refuses a reasoning effort (``effort``: where the dialect keeps it). Unknown models
    keep what they were sent."""
    model = body.get("model")
    if plan.caps.reasoning:
        for key in ("temperature", "top_p"):
            if key in body and body[key] != 1 and plan.touched(key):
                drop(body, key, f"{model} is a reasoning model: it only accepts {key}=1 ({plan.caps.source})",
                     plan.changes)
        for key in refused_by_reasoning:
            if key in body and plan.touched(key):
                drop(body, key, f"{model} is a reasoning model: it refuses {key} ({plan.caps.source})", plan.changes)
    elif plan.caps.reasoning is False and get_path(body, effort) is not _MISSING and plan.touched(effort[0]):
        old = get_path(body, effort)
        del_path(body, effort)
        plan.changes.append(Override(".".join(effort), old, None,
                                     f"{model} is not a reasoning model: it refuses a reasoning effort "
                                     f"({plan.caps.source})"))


class KnobDialect(Dialect):
    """A dialect whose settings are described by a ``Knob`` table: the session-authority
    half of ``apply_overrides`` is the same for all three, only ``reconcile`` differs."""

    knobs: ClassVar[tuple[Knob, ...]] = ()
    #: Whose rows of the model table (dialects/models.json) apply; "" for none.
    model_table: ClassVar[str] = ""

    def apply_overrides(self, body: dict[str, Any], model: str | None, sampling: Sampling,
                        mode: Mode = "overlay", refused: frozenset[str] = frozenset(),
                        requested: str | None = None) -> list[Override]:
        changes = set_model(body, model)
        knob_changes, mine = apply_knobs(body, self.knobs, sampling, mode)
        changes += knob_changes
        plan = Plan(capabilities(self.model_table, body.get("model")), changes, mine, refused)
        plan.drop_refused(body)
        self.reconcile(body, plan)
        return changes

    def reconcile(self, body: dict[str, Any], plan: Plan) -> None:
        """Fix, in place and on the record (``plan.changes``), what the provider would reject
        once the session's settings are in, following what depends on what."""

    def sampling(self, body: dict[str, Any]) -> Sampling:
        """The body's settings in canonical names."""
        return parse_knobs(body, self.knobs)

    def clamp_max_tokens(self, body: dict[str, Any], cap: int) -> list[Override]:
        knob = next((k for k in self.knobs if k.field == "max_tokens"), None)
        if knob is None:
            return []
        current = parse_knobs(body, (knob,)).max_tokens
        if current is not None and current <= cap:
            return []
        changes: list[Override] = []
        write_knob(body, knob, knob.to_native(cap) if knob.to_native else cap, "limit", changes)
        return changes

def models_route(method: str, path: str) -> RouteKind | None:
    """``GET /v1/models`` and ``GET /v1/models/<id>``: a side route (both OpenAI and
    Anthropic serve it, each in its own shape, so the host decides whose)."""
    if method == "GET" and (path == "/v1/models" or (path.startswith("/v1/models/") and len(path) > 11)):
        return "side"
    return None


_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",  # a body over intercept_max_body (the proxy's own answer)
    429: "rate_limit_error",
    502: "api_error",
    503: "api_error",
}


class OpenAIDialect(KnobDialect):
    """What Chat Completions and Responses share: OpenAI's host, key, and error shape."""

    hosts: ClassVar[tuple[str, ...]] = ("api.openai.com",)
    key_variables: ClassVar[tuple[str, ...]] = ("OPENAI_API_KEY",)
    known_upstreams: ClassVar[dict[str, dict[str, str]]] = {
        "openai": {"base_url": "https://api.openai.com/v1", "api_key_env": "OPENAI_API_KEY"}}

    def error_body(self, status: int, message: str, type: str | None = None) -> dict[str, Any]:
        return {
            "error": {
                "message": message,
                "type": type or _OPENAI_TYPES.get(status, "server_error"),
                "param": None,
                "code": {401: "invalid_api_key"}.get(status),
            }
        }


# -- network policy (addons/gateway/policy/network.py): the provider's own capabilities --------------------

def within(domain: str, base: str) -> bool:
    """``domain`` is ``base`` or a name under it (a path after the host is ignored)."""
    host = domain.lower().split("/", 1)[0].strip(".")
    return host == base or host.endswith("." + base)


def narrowed(asked: Any, allowed: list[str]) -> list[str]:
    """The domains a hosted search may keep: what the harness asked, each within one the
    policy allows, or the policy's own when it asked none; where the policy's is inside a
    wider one the harness asked, the policy's. Never wider than either; [] means none."""
    if not isinstance(asked, list) or not asked:
        return list(allowed)
    out: list[str] = []
    for a in asked:
        if not isinstance(a, str):
            continue
        if any(within(a, b) for b in allowed):
            out.append(a)
        else:
            out.extend(b for b in allowed if within(b, a.lower().split("/", 1)[0]))
    return list(dict.fromkeys(out))


REMOVED_PART = "[{what} removed: this environment's network policy does not let the provider fetch it]"


def mediate_tools(body: dict[str, Any], changes: list[Override], *,
                  kind: Callable[[dict[str, Any]], str | None],
                  name: Callable[[dict[str, Any]], str],
                  narrow: Callable[[dict[str, Any]], dict[str, Any] | None],
                  forced: Callable[[Any], str | None],
                  search: Callable[[dict[str, Any]], bool]) -> bool:
    """Strip (or narrow) the provider's tools in ``body["tools"]``; drop a ``tool_choice``
    that names a removed one (``forced`` gives the tool a choice forces, ``"*"`` for any), or
    that is left with no tool to choose (the APIs refuse a choice without tools). True when
    the request existed only to search: every tool it had was a removed provider tool, one
    of them a search (``search``), and its choice was not ``none``. Claude Code's WebSearch
    call is such a request; 2.1.332 sends it with ``tool_choice: auto``, not a forced one."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return False
    kept: list[Any] = []
    removed: set[str] = set()
    for tool in tools:
        what = kind(tool) if isinstance(tool, dict) else None
        if what is None:
            kept.append(tool)
            continue
        new = narrow(tool)
        if new is not None:
            kept.append(new)
            changes.append(Override(f"tools.{name(tool)}", what, {k: v for k, v in new.items() if tool.get(k) != v}))
        else:
            removed.add(name(tool))
            changes.append(Override(f"tools.{name(tool)}", what, None))
    if not removed and len(kept) == len(tools) and all(a is b for a, b in zip(kept, tools)):
        return False
    only_provider = not any(kind(t) is None for t in tools if isinstance(t, dict))
    searched = any(isinstance(t, dict) and kind(t) and name(t) in removed and search(t) for t in tools)
    if kept:
        body["tools"] = kept
    else:
        del body["tools"]
    choice = body.get("tool_choice")
    target = forced(choice)
    if "tool_choice" in body and (not kept or (target is not None and target in removed)):
        named = target is not None and target in removed
        changes.append(Override("tool_choice", "a removed provider tool" if named else "a choice with no tool left", None))
        del body["tool_choice"]
    none = choice == "none" or (isinstance(choice, dict) and choice.get("type") == "none")
    return only_provider and not kept and searched and not none


def drop_key(body: dict[str, Any], key: str, what: str, changes: list[Override]) -> None:
    if key in body:
        del body[key]
        changes.append(Override(key, what, None))


def notice_first_user(messages: Any, where: str, notice: str, part: Callable[[], dict[str, Any]], *,
                      content: str = "content") -> Override | None:
    """``notice`` appended to the first user message (its text, or a part after its parts):
    the same place every turn, so the prompt stays a prefix of the next one."""
    if not isinstance(messages, list):
        return None
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role", "user") != "user":
            continue
        value = message.get(content)
        if isinstance(value, str):
            message[content] = f"{value}\n\n{notice}" if value else notice
        elif isinstance(value, list):
            value.append(part())
        else:
            return None
        return Override(f"{where}.{i}.{content}", "first user message", notice)
    return None

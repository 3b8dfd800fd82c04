"""A request body as top-level keys with their byte spans, so a rewrite costs what it changes.

Every turn of an agent restates its whole history; the session's settings change a handful
of small top-level keys (``model``, ``temperature``, ``max_tokens``, ``reasoning``...).
Re-serialising the whole body to change them costs the event loop work in proportion to the
history, every turn, and reformats bytes the harness chose. Instead the body is read once with the JSON
module's own C scanner, one top-level value at a time, which yields both the parsed values
and where each one stands in the text; the rewritten body is the untouched spans copied as
they were plus the changed keys serialised anew.
"""

from __future__ import annotations

import json
import json.scanner
from dataclasses import dataclass, field
from typing import Any

from interceptor.trace.prefix import Listed, Prefixes

_DECODER = json.JSONDecoder()
_SCAN = json.scanner.make_scanner(_DECODER)
#: ``scan_value(text, i)``: the JSON value that starts at ``text[i]`` and the index after it,
#: by the JSON module's C scanner (``StopIteration`` or ``ValueError`` if there is none).
scan_value = _SCAN
_SCANSTRING = json.decoder.scanstring
_WS = " \t\n\r"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@dataclass(slots=True)
class Edit:
    """A value inside a body to replace: ``path`` from the top (keys and list indices);
    with ``run`` set, the value at ``path`` is a list whose items ``run[0]:run[1]`` are
    replaced by the items of ``value`` (a run of content blocks that forms one message)."""

    path: tuple[str | int, ...]
    value: Any
    run: tuple[int, int] | None = None
    # The message list's element this edit was last the only one in, as it was and as written:
    # a remembered rewrite's edits are handed to every later request that restates the
    # original (addons/gateway/policy/intercept.py), whose element is then the same text, written the same.
    made: tuple[str, str] | None = field(default=None, compare=False, repr=False)

    def apply(self, data: Any, fresh: set[int] | None = None) -> None:
        """Make the same change in the parsed ``data`` (a dict of the body's keys). Every
        list and object on the way is copied, not changed: the message list's elements are
        shared with the session's remembered lists (trace/prefix.py), which must keep what
        the harness sent. A copy costs the containers on one path, not the body; ``fresh``
        (the ids of the copies made so far, for a batch of edits) keeps a container from
        being copied once per edit (the message list, the whole history, per rewrite)."""
        fresh = set() if fresh is None else fresh
        for step in self.path[:-1]:
            child = data[step]
            if id(child) not in fresh:
                data[step] = child = dict(child) if isinstance(child, dict) else list(child)
                fresh.add(id(child))
            data = child
        last = self.path[-1]
        if self.run is None:
            data[last] = self.value
        else:
            data[last] = [*data[last][:self.run[0]], *self.value, *data[last][self.run[1]:]]


def _splice(text: str, i: int, edits: list[tuple[tuple, Edit]]) -> tuple[str, int]:
    """The JSON value starting at ``text[i]`` with ``edits`` (each a path relative to that
    value) applied, and the index just past the original value. Values no edit reaches are
    copied as they were; the scanner still reads them to find where they end."""
    for rest, edit in edits:
        if not rest and edit.run is None:
            try:
                _, end = _SCAN(text, i)
            except StopIteration as e:
                raise json.JSONDecodeError("Expecting value", text, e.value) from None
            return _dumps(edit.value), end
    if text[i] == "{":
        return _splice_object(text, i, edits)
    if text[i] == "[":
        return _splice_array(text, i, edits)
    raise ValueError(f"an edit reaches into a JSON {text[i]!r} value, not an object or a list")


def _splice_object(text: str, i: int, edits: list[tuple[tuple, Edit]]) -> tuple[str, int]:
    out: list[str] = []
    j = _skip(text, i + 1)
    copied = i
    while text[j] != "}":
        key, k = _SCANSTRING(text, j + 1, True)
        k = _skip(text, _skip(text, k) + 1)  # past the ':'
        mine = [(rest[1:], e) for rest, e in edits if rest and rest[0] == key]
        if mine:
            out.append(text[copied:k])
            value, end = _splice(text, k, mine)
            out.append(value)
            copied = end
        else:
            _, end = _SCAN(text, k)
        j = _skip(text, end)
        if text[j] == ",":
            j = _skip(text, j + 1)
    out.append(text[copied:j + 1])
    return "".join(out), j + 1


def _splice_array(text: str, i: int, edits: list[tuple[tuple, Edit]]) -> tuple[str, int]:
    run = next((e for rest, e in edits if not rest and e.run is not None), None)
    if run is not None and run.run[1] <= run.run[0]:
        raise ValueError("an empty run of list items cannot be replaced")
    out: list[str] = []
    j = _skip(text, i + 1)
    copied = i
    index = 0
    while text[j] != "]":
        mine = [(rest[1:], e) for rest, e in edits if rest and rest[0] == index]
        if run is not None and index == run.run[0]:
            if not run.value:
                raise ValueError("a run of list items cannot be replaced by nothing")
            out.append(text[copied:j])
            out.append(",".join(_dumps(v) for v in run.value))
            for _ in range(run.run[1] - run.run[0]):  # skip the run's original items
                _, end = _SCAN(text, j)
                k = _skip(text, end)
                last = end
                j = _skip(text, k + 1) if text[k] == "," else k
                index += 1
            copied = last
            continue
        if mine:
            out.append(text[copied:j])
            value, end = _splice(text, j, mine)
            out.append(value)
            copied = end
        else:
            _, end = _SCAN(text, j)
        j = _skip(text, end)
        if text[j] == ",":
            j = _skip(text, j + 1)
        index += 1
    out.append(text[copied:j + 1])
    return "".join(out), j + 1


def _splice_listed(text: str, start: int, ends: list[int], edits: list[tuple[tuple, Edit]],
                   out: list[tuple[int, int] | str]) -> None:
    """``_splice_array`` for the message list, whose elements' ends are known (``Listed``):
    only the edited elements are read; the text between them is not scanned (scanning every
    element of the history to find one would be O(history) a turn), nor copied: it goes
    to ``out`` as its span of ``text``, the new values as strings (``Body._joined``)."""
    run = next((e for rest, e in edits if not rest and e.run is not None), None)
    if run is not None and (run.run[1] <= run.run[0] or run.run[1] > len(ends)):
        raise ValueError("an empty run of list items cannot be replaced")
    if run is not None and not run.value:
        raise ValueError("a run of list items cannot be replaced by nothing")

    def at(k: int) -> int:  # where element k begins
        return _skip(text, start) if k == 0 else _skip(text, _skip(text, start + ends[k - 1]) + 1)

    by_index: dict[int, list[tuple[tuple, Edit]]] = {}
    for rest, e in edits:
        if rest:
            if not isinstance(rest[0], int) or not 0 <= rest[0] < len(ends):
                raise ValueError(f"an edit reaches list item {rest[0]!r} of {len(ends)}")
            by_index.setdefault(rest[0], []).append((rest[1:], e))
    ops = [(k, by_index[k]) for k in by_index if run is None or not run.run[0] <= k < run.run[1]]
    if run is not None:
        ops.append((run.run[0], None))  # the run's items are replaced, edits inside them dropped
    copied = start - 1  # the '['
    for k, mine in sorted(ops, key=lambda op: op[0]):
        begin = at(k)
        out.append((copied, begin))
        if mine is None:
            out.append(",".join(_dumps(v) for v in run.value))
            copied = start + ends[run.run[1] - 1]
            continue
        end = start + ends[k]
        made = mine[0][1].made if len(mine) == 1 else None
        if made is not None and len(made[0]) == end - begin and text.startswith(made[0], begin):
            out.append(made[1])  # the same element with the same edit: the same text, not made again
            copied = end
            continue
        value, copied = _splice(text, begin, mine)
        out.append(value)
        if len(mine) == 1 and copied == end:
            mine[0][1].made = (text[begin:end], value)
    close = _skip(text, start + ends[-1])
    out.append((copied, close + 1))


@dataclass(slots=True)
class Body:
    """A parsed JSON object and, when it came from UTF-8 text, each key's span in it."""

    data: dict[str, Any]
    text: str | None = None
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> (start of key, end of value)
    listed: Listed | None = None  # the message list, element by element (``parse_body(listed=...)``)
    raw: bytes | None = None  # the UTF-8 bytes ``text`` was decoded from

    def encode(self, changed: set[str], edits: list[Edit] = ()) -> bytes:
        """The body with the top-level keys in ``changed`` written from ``data`` (or left
        out, if no longer there) and every other key copied byte for byte, in order.
        ``edits`` replace values deeper inside a key that is not in ``changed`` (a hook's
        new tool result): only the edited values are written anew, every byte around them is
        the harness's. ``data`` must already hold the edited values (``Edit.apply``).

        Without ``edits`` the untouched spans are copied from the harness's bytes, not from
        the text: one copy of the history into the new body instead of four (slice, join,
        concatenation, UTF-8 encoding), each a fresh allocation the size of the body."""
        if self.text is None:
            return _dumps(self.data).encode()
        if not edits and self.raw is not None:
            return self._encode_bytes(changed)
        nested: dict[str, list[Edit]] = {}
        for edit in edits:
            nested.setdefault(edit.path[0], []).append(edit)
        # Each key's member as pieces: spans of ``text`` (copied once, at the end) and new text.
        out: list[list[tuple[int, int] | str]] = []
        for key, (start, end) in self.spans.items():
            if key in changed:
                if key in self.data:
                    out.append([f"{_dumps(key)}:{_dumps(self.data[key])}"])
            elif key in nested:
                value_at = _skip(self.text, _SCANSTRING(self.text, start + 1, True)[1])
                value_at = _skip(self.text, value_at + 1)  # past the ':'
                mine = [(e.path[1:], e) for e in nested[key]]
                listed = self.listed
                member: list[tuple[int, int] | str] = [(start, value_at)]
                if listed is not None and key == listed.key and value_at + 1 == listed.start and listed.ends:
                    _splice_listed(self.text, listed.start, listed.ends, mine, member)
                else:
                    member.append(_splice(self.text, value_at, mine)[0])
                out.append(member)
            else:
                out.append([(start, end)])
        pieces: list[tuple[int, int] | str] = []
        if self.spans and self.data.keys() == self.spans.keys():
            # The same keys in the same places: the harness's whitespace between them stays too.
            bounds = list(self.spans.values())
            gaps = [(0, bounds[0][0])] + [(a[1], b[0]) for a, b in zip(bounds, bounds[1:])]
            for gap, member in zip(gaps, out):
                pieces.append(gap)
                pieces += member
            pieces.append((bounds[-1][1], len(self.text)))
            return self._joined(pieces)
        for key in self.data:
            if key not in self.spans:
                out.append([f"{_dumps(key)}:{_dumps(self.data[key])}"])
        pieces.append("{")
        for k, member in enumerate(out):
            if k:
                pieces.append(",")
            pieces += member
        pieces.append("}")
        return self._joined(pieces)

    def _joined(self, pieces: list[tuple[int, int] | str]) -> bytes:
        """The body's bytes from spans of ``text`` and new text, in one join: from views into
        ``raw`` when the text is ASCII (a span's characters are its bytes), else from the
        text. Every slice, concatenation and encoding of the history would be a fresh
        allocation the size of the body (page faults and a copy each)."""
        if self.raw is not None and len(self.raw) == len(self.text):
            raw = memoryview(self.raw)
            return b"".join([raw[p[0]:p[1]] if type(p) is tuple else p.encode() for p in pieces])
        text = self.text
        return "".join([text[p[0]:p[1]] if type(p) is tuple else p for p in pieces]).encode()

    def _encode_bytes(self, changed: set[str]) -> bytes:
        """``encode`` without edits, as one join of views into ``raw`` and the new keys."""
        at = self._byte_offsets()
        raw = memoryview(self.raw)
        out: list[Any] = []
        for key, (start, end) in self.spans.items():
            if key in changed:
                if key in self.data:
                    out.append(f"{_dumps(key)}:{_dumps(self.data[key])}".encode())
            else:
                out.append(raw[at[start]:at[end]])
        if self.spans and self.data.keys() == self.spans.keys():
            # The same keys in the same places: the harness's whitespace between them stays too.
            bounds = list(self.spans.values())
            pieces = [raw[:at[bounds[0][0]]]]
            for k, piece in enumerate(out):
                if k:
                    pieces.append(raw[at[bounds[k - 1][1]]:at[bounds[k][0]]])
                pieces.append(piece)
            pieces.append(raw[at[bounds[-1][1]]:])
            return b"".join(pieces)
        for key in self.data:
            if key not in self.spans:
                out.append(f"{_dumps(key)}:{_dumps(self.data[key])}".encode())
        return b"{" + b",".join(out) + b"}"

    def _byte_offsets(self) -> dict[int, int]:
        """Where each span's start and end (indices into ``text``) stand in ``raw``. ASCII
        text: the same. Otherwise the UTF-8 length of every segment between them is measured
        except the longest (the history, as a rule), which is what remains of ``raw``; ``raw``
        is exactly ``text`` encoded (strict UTF-8 decodes one way only)."""
        points = sorted({0, len(self.text), *(i for span in self.spans.values() for i in span)})
        if len(self.raw) == len(self.text):
            return {i: i for i in points}
        lengths = [b - a for a, b in zip(points, points[1:])]
        longest = max(range(len(lengths)), key=lengths.__getitem__)
        sizes = [0 if k == longest else len(self.text[a:b].encode()) for k, (a, b) in enumerate(zip(points, points[1:]))]
        sizes[longest] = len(self.raw) - sum(sizes)
        at = {0: 0}
        total = 0
        for p, size in zip(points[1:], sizes):
            total += size
            at[p] = total
        return at


def parse_body(raw: bytes, listed: str | None = None, prefixes: Prefixes | None = None) -> Body:
    """Parse a JSON request body; raises ``ValueError`` (as ``json.loads``) when it is not
    JSON. A top-level value that is not an object is returned as ``data`` unchanged for the
    caller to refuse. Text that is not UTF-8 is parsed by ``json.loads`` (which detects
    UTF-16/32) and is re-serialised whole when changed.

    ``listed`` names the key of the message list: its array is scanned element by element
    (``Body.listed`` says where each ends), and the leading elements an earlier request of
    the session sent as the very same text (``prefixes``, trace/prefix.py) are taken as
    they were parsed then instead of being parsed again."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return Body(json.loads(raw))
    if text.startswith("\ufeff"):
        return Body(json.loads(raw))
    n = len(text)
    same = raw if type(raw) is bytes and len(raw) == n else None  # its bytes are its characters (ASCII)
    i = _skip(text, 0)
    if i >= n or text[i] != "{":
        return Body(json.loads(text))  # not an object: json.loads gives the value or the error
    data: dict[str, Any] = {}
    spans: dict[str, tuple[int, int]] = {}
    listing: Listed | None = None
    i = _skip(text, i + 1)
    if i < n and text[i] == "}":
        _end(text, i + 1)
        return Body(data, text, spans, raw=raw)
    while True:
        if i >= n or text[i] != '"':
            raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, i)
        start = i
        key, i = _SCANSTRING(text, i + 1, True)
        i = _skip(text, i)
        if i >= n or text[i] != ":":
            raise json.JSONDecodeError("Expecting ':' delimiter", text, i)
        i = _skip(text, i + 1)
        scanned = _scan_list(text, i, key, prefixes, same) if key == listed else None
        if scanned is not None:
            value, i = scanned
            listing = value
            value = value.items
        else:
            try:
                value, i = _SCAN(text, i)
            except StopIteration as e:
                raise json.JSONDecodeError("Expecting value", text, e.value) from None
            if key == listed:
                listing = None  # a repeated key that is not a list: the last one wins
        if key in spans:  # a repeated key: the last one wins, as in json.loads
            del spans[key]
        data[key] = value
        spans[key] = (start, i)
        i = _skip(text, i)
        if i < n and text[i] == ",":
            i = _skip(text, i + 1)
            continue
        if i < n and text[i] == "}":
            _end(text, i + 1)
            return Body(data, text, spans, listing, raw)
        raise json.JSONDecodeError("Expecting ',' delimiter", text, i)


def _scan_list(text: str, i: int, key: str, prefixes: Prefixes | None,
               raw: bytes | None = None) -> tuple[Listed, int] | None:
    """The array at ``i`` element by element: a ``Listed`` and the index after the array, or
    None when it is not an array or anything in it is irregular (the caller's plain scan
    then parses it, or raises the error ``json.loads`` would). ``raw``: the body's bytes,
    if they are ``text`` byte for character."""
    n = len(text)
    if i >= n or text[i] != "[":
        return None
    start = i + 1
    listing = Listed(key=key, text=text, start=start, raw=raw)
    j = start
    if prefixes is not None:
        entry, k = prefixes.match(text, start, raw)
        if entry is not None:
            after = _skip(text, start + entry.ends[k - 1])
            if after >= n or text[after] not in ",]":
                # The last element goes on past the known text (a number: [12 of [123]); the
                # ones before it are followed by a comma inside the matched text.
                k -= 1
            if k:
                j = start + entry.ends[k - 1]
                listing.ends = entry.ends[:k]
                listing.items = entry.items[:k]
                listing.marks = entry.marks[:k]
                listing.messages = entry.messages[:entry.marks[k - 1]]
                listing.nodes = entry.nodes[:len(entry.lead) + entry.marks[k - 1]]
                listing.known = k
                listing.generation = prefixes.generation
                listing.source = entry
    ends, items = listing.ends, listing.items
    j = _skip(text, j)
    if not items:
        if j < n and text[j] == "]":
            return listing, j + 1
    while True:
        if items:
            if j < n and text[j] == "]":
                return listing, j + 1
            if j >= n or text[j] != ",":
                return None
            j = _skip(text, j + 1)
        try:
            value, j = _SCAN(text, j)
        except StopIteration:
            return None
        items.append(value)
        ends.append(j - start)
        j = _skip(text, j)


def _skip(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


def _end(text: str, i: int) -> None:
    if _skip(text, i) != len(text):
        raise json.JSONDecodeError("Extra data", text, i)

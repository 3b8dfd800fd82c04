"""A request body as top-level keys with their byte spans, so a rewrite costs what it changes.

Every turn of an agent restates its whole history; the session's settings change a handful
of small top-level keys (``model``, ``temperature``, ``max_tokens``, ``reasoning``...).
Re-serialising the whole body to change them costs ~3 ms per MB on the event loop, every
turn, and reformats bytes the harness chose. Instead the body is read once with the JSON
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
_SCANSTRING = json.decoder.scanstring
_WS = " \t\n\r"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@dataclass(slots=True)
class Body:
    """A parsed JSON object and, when it came from UTF-8 text, each key's span in it."""

    data: dict[str, Any]
    text: str | None = None
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> (start of key, end of value)
    listed: Listed | None = None  # the message list, element by element (``parse_body(listed=...)``)

    def encode(self, changed: set[str]) -> bytes:
        """The body with the top-level keys in ``changed`` written from ``data`` (or left
        out, if no longer there) and every other key copied byte for byte, in order."""
        if self.text is None:
            return _dumps(self.data).encode()
        out: list[str] = []
        for key, (start, end) in self.spans.items():
            if key not in changed:
                out.append(self.text[start:end])
            elif key in self.data:
                out.append(f"{_dumps(key)}:{_dumps(self.data[key])}")
        for key in self.data:
            if key not in self.spans:
                out.append(f"{_dumps(key)}:{_dumps(self.data[key])}")
        return ("{" + ",".join(out) + "}").encode()


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
    i = _skip(text, 0)
    if i >= n or text[i] != "{":
        return Body(json.loads(text))  # not an object: json.loads gives the value or the error
    data: dict[str, Any] = {}
    spans: dict[str, tuple[int, int]] = {}
    listing: Listed | None = None
    i = _skip(text, i + 1)
    if i < n and text[i] == "}":
        _end(text, i + 1)
        return Body(data, text, spans)
    while True:
        if i >= n or text[i] != '"':
            raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, i)
        start = i
        key, i = _SCANSTRING(text, i + 1, True)
        i = _skip(text, i)
        if i >= n or text[i] != ":":
            raise json.JSONDecodeError("Expecting ':' delimiter", text, i)
        i = _skip(text, i + 1)
        scanned = _scan_list(text, i, key, prefixes) if key == listed else None
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
            return Body(data, text, spans, listing)
        raise json.JSONDecodeError("Expecting ',' delimiter", text, i)


def _scan_list(text: str, i: int, key: str, prefixes: Prefixes | None) -> tuple[Listed, int] | None:
    """The array at ``i`` element by element: a ``Listed`` and the index after the array, or
    None when it is not an array or anything in it is irregular (the caller's plain scan
    then parses it, or raises the error ``json.loads`` would)."""
    n = len(text)
    if i >= n or text[i] != "[":
        return None
    start = i + 1
    listing = Listed(key=key, text=text, start=start)
    j = start
    if prefixes is not None:
        entry, k = prefixes.match(text, start)
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
                listing.messages = entry.messages[:k]
                listing.nodes = entry.nodes[:k]
                listing.known = k
                listing.generation = prefixes.generation
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

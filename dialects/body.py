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


def parse_body(raw: bytes) -> Body:
    """Parse a JSON request body; raises ``ValueError`` (as ``json.loads``) when it is not
    JSON. A top-level value that is not an object is returned as ``data`` unchanged for the
    caller to refuse. Text that is not UTF-8 is parsed by ``json.loads`` (which detects
    UTF-16/32) and is re-serialised whole when changed."""
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
        try:
            value, i = _SCAN(text, i)
        except StopIteration as e:
            raise json.JSONDecodeError("Expecting value", text, e.value) from None
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
            return Body(data, text, spans)
        raise json.JSONDecodeError("Expecting ',' delimiter", text, i)


def _skip(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


def _end(text: str, i: int) -> None:
    if _skip(text, i) != len(text):
        raise json.JSONDecodeError("Extra data", text, i)

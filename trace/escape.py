"""A reversible escape for text UTF-8 cannot carry: lone surrogates.

JSON allows ``"\\ud800"`` (an escaped half of a surrogate pair with no other half), Python's
``json`` decodes it to a str holding U+D800, and UTF-8 (hence msgpack's str type) cannot
encode that code point. A harness that sends one must not end the record of its rollout, and
the trace must stay valid msgpack with str strings. So, only where such a character occurs:

- a lone surrogate U+D800+k (k < 0x800) is written as ``ESCAPE`` followed by U+10F000+k;
- ``ESCAPE`` itself (U+10FFFD, the last private-use code point) is written twice.

Both replacements are plain private-use code points, so the text stays valid UTF-8, and
``unescape`` gives the original str back exactly. Text without either character (all real
text, in practice) is unchanged. Recorded traces keep the escaped form (it can be printed,
exported as JSON and hashed); call ``unescape`` for the exact characters the harness sent.
"""

from __future__ import annotations

import re
from typing import Any

ESCAPE = "\U0010fffd"
_BASE = 0x10F000
_NEEDS = re.compile("[\ud800-\udfff\U0010fffd]")
_ESCAPED = re.compile("\U0010fffd(.)", re.DOTALL)
ESCAPE_UTF8 = ESCAPE.encode()


def _one(m: re.Match) -> str:
    c = m.group()
    return ESCAPE + ESCAPE if c == ESCAPE else ESCAPE + chr(_BASE + ord(c) - 0xD800)


def _back(m: re.Match) -> str:
    c = m.group(1)
    return ESCAPE if c == ESCAPE else chr(0xD800 + ord(c) - _BASE)


def escape_text(text: str) -> str:
    return _NEEDS.sub(_one, text)


def unescape(text: str) -> str:
    """The exact str ``escape_text`` was given."""
    return _ESCAPED.sub(_back, text) if ESCAPE in text else text


def escape(value: Any) -> Any:
    """``value`` with every str in it (dict keys too) escaped."""
    if isinstance(value, str):
        return escape_text(value)
    if isinstance(value, dict):
        return {escape(k): escape(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [escape(v) for v in value]
    return value


def utf8(text: str) -> bytes:
    """``text`` as UTF-8, escaped first if it needs it: the same bytes for a str with lone
    surrogates and for its escaped form read back from a trace."""
    try:
        return text.encode()
    except UnicodeEncodeError:
        return escape_text(text).encode()

"""A deterministic stand-in tokenizer.

The simulator has no model vocabulary, but tests of the trace need token ids, logprobs
and usage numbers that agree with each other and come out the same on every run. One
"token" here is a word with its leading space, or a run of punctuation: it is also the
unit the simulator streams in, so the number of deltas, the number of token ids and
`output_tokens` line up, as they do with vLLM.
"""

from __future__ import annotations

import re
import zlib
from typing import Any, Iterable

_PIECE = re.compile(r"\s*\w+|\s*[^\w\s]+|\s+")


def split(text: str) -> list[str]:
    """`"Hello there!"` -> `["Hello", " there", "!"]` (as in the captured streams)."""
    return _PIECE.findall(text)


def token_id(piece: str) -> int:
    """A stable id in a plausible vocabulary range (never 0, which some code treats as pad)."""
    return zlib.crc32(piece.encode()) % 150_000 + 1


def logprob(piece: str) -> float:
    """A stable, plausible log-probability in (-2, 0]."""
    return -round(((zlib.crc32(piece.encode()) >> 8) % 2000) / 1000.0, 6)


def ids(pieces: Iterable[str]) -> list[int]:
    return [token_id(p) for p in pieces]


# Request keys whose strings make up the prompt, for the three dialects.
_PROMPT_KEYS = ("system", "instructions", "messages", "input", "tools", "functions")


def prompt_pieces(request: Any) -> list[str]:
    """Every string in the prompt-bearing parts of a request body, split into pieces."""
    if not isinstance(request, dict):
        return []
    pieces: list[str] = []
    for key in _PROMPT_KEYS:
        for text in _strings(request.get(key)):
            pieces.extend(split(text))
    return pieces


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def last_user_text(request: Any) -> str | None:
    """The text of the last user turn of any of the three request shapes, or None."""
    if not isinstance(request, dict):
        return None
    turns = request.get("messages")
    if turns is None:
        turns = request.get("input")
        if isinstance(turns, str):
            return turns
    if not isinstance(turns, list):
        return None
    for turn in reversed(turns):
        if isinstance(turn, dict) and turn.get("role") == "user":
            return _text_of(turn.get("content"))
    return None


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict):
                text = part.get("text")
                if text is None and part.get("type") == "tool_result":
                    text = _text_of(part.get("content"))
                if isinstance(text, str):
                    parts.append(text)
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    return ""

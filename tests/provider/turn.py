"""A `Reply` resolved against the request it answers: the plan all three dialects render.

Splitting text into pieces, numbering tokens and counting usage happen once here, so the
Chat, Responses and Messages renderers cannot disagree about what was "generated".
"""

from __future__ import annotations

import secrets
import string
import time
from dataclasses import dataclass
from typing import Any, Sequence

from . import tokens
from .reply import Reply

_ALNUM = string.ascii_letters + string.digits


def random_id(prefix: str, length: int = 24) -> str:
    """Ids in the providers' style (`chatcmpl-…`, `msg_01…`, `toolu_01…`, `resp_…`)."""
    return prefix + "".join(secrets.choice(_ALNUM) for _ in range(length))


@dataclass
class Piece:
    """One streamed delta, which is also one token."""

    text: str
    token_id: int
    logprob: float


@dataclass
class Call:
    id: str | None
    name: str
    type: str
    arguments: str
    arguments_object: Any
    fragments: list[Piece]


class Turn:
    """Everything a renderer needs; dialect modules read it, never the raw Reply fields
    that it already resolved (pieces, usage, ids)."""

    def __init__(self, request: Any, reply: Reply, *, default_model: str) -> None:
        self.request: dict[str, Any] = request if isinstance(request, dict) else {}
        self.reply = reply
        self.model: str = reply.model or str(self.request.get("model") or default_model)
        self.created = int(time.time())

        self.reasoning = _pieces(reply.reasoning)
        self.text = _pieces(reply.text)
        self.refusal = _pieces(reply.refusal)
        self.calls = [
            Call(
                id=tc.id,
                name=tc.name,
                type=tc.type,
                arguments=tc.arguments_text(),
                arguments_object=tc.arguments_object(),
                fragments=[_piece(f) for f in tc.fragments()],
            )
            for tc in reply.tool_calls
        ]
        every = self.all_pieces()
        if reply.token_ids is not None:
            _check_aligned("token_ids", reply.token_ids, every)
            for piece, tid in zip(every, reply.token_ids):
                piece.token_id = int(tid)
        if reply.logprobs is not None:
            _check_aligned("logprobs", reply.logprobs, every)
            for piece, lp in zip(every, reply.logprobs):
                piece.logprob = float(lp)

        prompt = tokens.prompt_pieces(self.request)
        self.prompt_token_ids = (
            list(reply.prompt_token_ids) if reply.prompt_token_ids is not None else tokens.ids(prompt)
        )
        self.input_tokens = (
            reply.input_tokens if reply.input_tokens is not None else max(1, len(self.prompt_token_ids))
        )
        self.output_tokens = (
            reply.output_tokens if reply.output_tokens is not None else max(1, len(every))
        )
        self.reasoning_tokens = (
            reply.reasoning_tokens if reply.reasoning_tokens is not None else len(self.reasoning)
        )
        self.cached_tokens = reply.cached_tokens
        self.cache_creation_tokens = reply.cache_creation_tokens

    def all_pieces(self) -> list[Piece]:
        """Generation order: reasoning, text, refusal, then each call's fragments."""
        out = [*self.reasoning, *self.text, *self.refusal]
        for call in self.calls:
            out.extend(call.fragments)
        return out

    @property
    def text_str(self) -> str:
        return "".join(p.text for p in self.text)

    @property
    def reasoning_str(self) -> str:
        return "".join(p.text for p in self.reasoning)

    @property
    def refusal_str(self) -> str:
        return "".join(p.text for p in self.refusal)

    def finish(self) -> str:
        """The dialect-neutral finish reason (or a native one the test passed)."""
        if self.reply.finish_reason:
            return self.reply.finish_reason
        if self.calls:
            return "tool_calls"
        if self.refusal:
            return "refusal"
        return "stop"


def _piece(text: str) -> Piece:
    return Piece(text, tokens.token_id(text), tokens.logprob(text))


def _pieces(value: str | Sequence[str] | None) -> list[Piece]:
    if value is None:
        return []
    parts = tokens.split(value) if isinstance(value, str) else list(value)
    return [_piece(p) for p in parts]


def _check_aligned(name: str, values: Sequence[Any], pieces: list[Piece]) -> None:
    if len(values) != len(pieces):
        raise ValueError(
            f"Reply.{name} has {len(values)} entries but the reply streams {len(pieces)} "
            f"pieces {[p.text for p in pieces]!r}; give one per piece (pass text as a list "
            f"of deltas to control the split)"
        )

"""Recognise the history a request restates from its bytes, without parsing it again.

Every turn of an agent restates its whole history, and all but the newest messages are ones
the session's graph already holds. Parsing them again (JSON, then the canonical messages)
made every turn cost what the whole conversation costs: at turn 300 that was most of the
proxy's CPU. Instead each session remembers, for its last few requests, the text of the
message list exactly as it was sent, where each element ended, the element as parsed, its
canonical message and its graph node. A new request whose list text starts with one of
those (one ``str.startswith``: a memory compare, not a parse) takes the known elements as
they are and parses only what follows.

Equal text parses to equal values (the parse is a pure function of the text), so the
request, its body and the graph come out as a full parse would make them. What would break
it, and is guarded against: a known element mutated in place (Rewrite forgets every entry
when an override touches the list, and an entry is remembered only from a list no override
touched), and nodes that no longer exist (a rolled-back turn, a released graph: ``clear``
bumps ``generation``, and a scan from an older generation gives no nodes).

Used only for dialects whose list elements are one canonical message each, parsed on their
own (``Dialect.message_list``); imports nothing else of ours.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import Any

from interceptor.trace.messages import Message

#: Requests remembered per session: the main conversation plus a few interleaved sub-agents.
ENTRIES = 4


@dataclass(slots=True)
class Listed:
    """A request's message list as scanned from its body.

    ``ends[j]`` is where element ``j`` ends, counted from ``start`` (just after the ``[``) in
    ``text`` (the body's text); ``items`` are the elements as parsed. The first ``known``
    elements were recognised from an earlier request: their canonical ``messages`` and, when
    ``generation`` is still current, their graph ``nodes`` come from it.
    """

    key: str
    text: str
    start: int
    ends: list[int] = field(default_factory=list)
    items: list[Any] = field(default_factory=list)
    known: int = 0
    messages: list[Message] = field(default_factory=list)
    nodes: list[int] = field(default_factory=list)
    generation: int = 0


@dataclass(slots=True, frozen=True)
class _Entry:
    text: str  # the list's text from just after '[' to the end of its last element
    ends: list[int]
    items: list[Any]
    messages: list[Message]
    nodes: list[int]


class Prefixes:
    """One session's remembered message lists, newest last."""

    def __init__(self) -> None:
        self._entries: tuple[_Entry, ...] = ()
        self.generation = 0

    def match(self, text: str, start: int) -> tuple[_Entry | None, int]:
        """The entry sharing the most leading elements with the list starting at
        ``start`` in ``text``, and how many it shares (0: none)."""
        best: _Entry | None = None
        best_k = 0
        for entry in reversed(self._entries):  # tuple: safe against a concurrent replacement
            if len(entry.ends) > best_k and text.startswith(entry.text, start):
                best, best_k = entry, len(entry.ends)
        if best is not None or not self._entries:
            return best, best_k
        # No entry is a whole prefix (a compaction, an edited message): the newest one's
        # longest prefix of whole elements, by bisection (each probe is one compare).
        entry = self._entries[-1]
        lo, hi = 0, len(entry.ends) - 1  # the answer is in [lo, hi]: all of it did not match
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if text.startswith(entry.text[:entry.ends[mid - 1]], start):
                lo = mid
            else:
                hi = mid - 1
        return (entry, lo) if lo else (None, 0)

    def remember(self, listed: Listed, messages: list[Message], nodes: list[int]) -> None:
        """Remember a committed request's list: ``messages`` and ``nodes`` are its elements'
        canonical messages and graph nodes, one per element."""
        if not listed.ends or len(messages) != len(listed.ends) or len(nodes) != len(listed.ends):
            return
        entry = _Entry(listed.text[listed.start:listed.start + listed.ends[-1]], listed.ends,
                       listed.items, list(messages), list(nodes))
        # A request the new one extends is superseded by it.
        kept = tuple(e for e in self._entries if not entry.text.startswith(e.text))
        self._entries = (kept + (entry,))[-ENTRIES:]

    def clear(self) -> None:
        """Forget everything; scans made before this give no nodes."""
        self._entries = ()
        self.generation += 1

    def __len__(self) -> int:
        return len(self._entries)


def touches(overrides: Iterable[Any], key: str) -> bool:
    """Whether any of ``overrides`` (objects with a dotted ``key``) changed the list ``key``:
    its elements may then have been changed in place, and must not be shared."""
    return any(o.key.split(".", 1)[0] == key for o in overrides)

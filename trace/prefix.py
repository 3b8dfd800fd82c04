"""Recognise the history a request restates from its bytes, without parsing it again.

Every turn of an agent restates its whole history, and all but the newest messages are ones
the session's graph already holds. Parsing them again (JSON, then the canonical messages)
would make every turn cost what the whole conversation costs, late in a rollout most of
the proxy's CPU. Instead each session remembers, for its last few requests, the text of the
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

Used for every dialect's message list (``Dialect.message_list``), whose elements each make
zero or more canonical messages, counted in ``Listed.marks``: Chat Completions (one each),
Anthropic Messages (a user turn is one message per tool result and per run of other
blocks), Gemini (a user turn read with the model turn before it) and Responses (a run of
assistant items is one message, so its known items stop where a run may go on:
``Listed.keep``). A dialect may put messages before the list's (a system prompt): those are
parsed every time, and the remembered nodes are used only when they are the same messages as
when the list was remembered (the list's nodes hang under theirs). Imports nothing else of
ours.
"""

from __future__ import annotations

import itertools
import operator
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
    ``text`` (the body's text); ``items`` are the elements as parsed. ``marks[j]`` is how
    many canonical messages elements ``0..j`` make (the dialect's ``parse_request`` fills it
    for the elements it parses), and ``lead`` how many of the request's messages come before
    the list's (set by Rewrite once the request is parsed).

    The first ``known`` elements were recognised from an earlier request (``source``): their
    canonical ``messages`` come from it, and so, when ``generation`` is still current and the
    request's lead messages are ``lead_known`` (those the earlier request had), do the graph
    ``nodes`` of the lead and those messages.

    ``sent`` is set when the request's messages may be delivered otherwise than its bytes say
    them (a session with request hooks: a remembered rewrite is spliced in, a hook changes a
    new message). It is the request's messages as parsed (the lead's, then the list's), and
    they are what the list is remembered with: remembering the delivered ones would hand a
    rewritten message back for the original's text, and the rewrite would not be spliced in
    again. The nodes are the delivered messages' all the same, checked against them before
    use (``Recorder.held_path``).
    """

    key: str
    text: str
    start: int
    ends: list[int] = field(default_factory=list)
    items: list[Any] = field(default_factory=list)
    marks: list[int] = field(default_factory=list)
    lead: int = 0
    known: int = 0
    messages: list[Message] = field(default_factory=list)
    nodes: list[int] = field(default_factory=list)
    generation: int = 0
    source: _Entry | None = None  # the remembered list the known elements came from
    sent: list[Message] | None = None  # the messages as parsed, where others may be delivered
    # The body's bytes when they are ``text`` byte for character (ASCII, what JSON encoders
    # write by default): a remembered list then keeps views of them, not a copy of its text.
    raw: bytes | None = None

    def keep(self, k: int) -> None:
        """Use only the first ``k`` known elements (a dialect whose element's messages may
        depend on the elements after it stops where they cannot)."""
        if k >= self.known:
            return
        lead = len(self.lead_known)  # the nodes are the lead's, then the messages'
        made = self.marks[k - 1] if k else 0
        self.nodes = self.nodes[:lead + made] if k else []
        self.messages = self.messages[:made]
        self.marks = self.marks[:k]
        self.known = k

    @property
    def lead_known(self) -> tuple[Message, ...]:
        """The messages before the list in the request the known elements came from."""
        return self.source.lead if self.source is not None else ()

    @property
    def complete(self) -> bool:
        """Whether every element's messages were counted (the request was parsed from this
        scan's elements, not from other ones)."""
        return bool(self.ends) and len(self.marks) == len(self.ends)


#: An entry's text: a string, or a view of the ASCII bytes it was read from (``Listed.raw``).
Text = str | memoryview


@dataclass(slots=True, frozen=True)
class _Entry:
    """A remembered list. Its text (from just after the ``[`` to the end of its last
    element) is kept as two pieces, ``head`` up to the end of the element before the last
    and ``last`` the rest, so that both the whole list and all of it but the last element
    (the Claude Code turn's case) are compared without copying either out first. Each piece
    is a view of the request's own bytes when they were ASCII (no copy: a copy of the
    history would be a fresh history-sized block each turn, whose pages the kernel faults in
    anew, as glibc's heap does not reuse a freed block for a slightly larger one), else a copy of its text."""

    head: Text
    last: Text
    ends: list[int]
    items: list[Any]
    marks: list[int]
    messages: list[Message]  # the list's, without the lead
    lead: tuple[Message, ...]  # the messages before the list's
    nodes: list[int]  # the lead's and the list's, in order: the prompt's path


class Prefixes:
    """One session's remembered message lists, newest last."""

    def __init__(self) -> None:
        self._entries: tuple[_Entry, ...] = ()
        self.generation = 0

    def match(self, text: str, start: int, raw: bytes | None = None) -> tuple[_Entry | None, int]:
        """The entry sharing the most leading elements with the list starting at
        ``start`` in ``text`` (whose bytes are ``raw`` if they are ASCII), and how many it
        shares (0: none)."""
        best: _Entry | None = None
        best_k = 0
        for entry in reversed(self._entries):  # tuple: safe against a concurrent replacement
            if len(entry.ends) > best_k and _restates(text, start, entry, raw):
                best, best_k = entry, len(entry.ends)
        if best is not None or not self._entries:
            return best, best_k
        # No entry is a whole prefix. Most often only its last element changed: Claude Code
        # moves its cache_control marker to the newest block every turn, so the message that
        # carried it is restated without it. One compare per entry (a sub-agent's request
        # may have come in between, so not only the newest).
        for entry in reversed(self._entries):
            k = len(entry.ends) - 1
            if k > best_k and _at(text, raw, start, entry.head):
                best, best_k = entry, k
        if best is not None:
            return best, best_k
        # Something earlier changed (a compaction, an edited message): the newest one's
        # longest prefix of whole elements, by bisection (each probe is one compare, of a copy).
        entry = self._entries[-1]
        lo, hi = 0, len(entry.ends) - 2  # the answer is in [lo, hi]: not even the head matched
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _at(text, raw, start, entry.head[:entry.ends[mid - 1]]):
                lo = mid
            else:
                hi = mid - 1
        return (entry, lo) if lo else (None, 0)

    def remember(self, listed: Listed, messages: list[Message], nodes: list[int]) -> None:
        """Remember a committed request's list: ``messages`` are the request's canonical
        messages (its ``listed.lead`` first, then its elements') and ``nodes`` their graph
        nodes, one each."""
        lead = listed.lead
        if not listed.complete or len(messages) != lead + listed.marks[-1] or len(nodes) != len(messages):
            return
        start, ends, raw = listed.start, listed.ends, listed.raw
        cut = start + (ends[-2] if len(ends) > 1 else 0)
        whole: Any = memoryview(raw) if raw is not None else listed.text
        entry = _Entry(whole[start:cut], whole[cut:start + ends[-1]], ends,
                       listed.items, listed.marks, messages[lead:], tuple(messages[:lead]), list(nodes))
        # A request the new one extends is superseded by it, and so is the one it was read
        # from when it restates all of that one but the last element (the element Claude Code
        # took its marker from): kept, every turn of such a loop would hold a copy of the
        # whole history until ENTRIES of them are.
        source = listed.source if listed.source is not None and listed.known >= len(listed.source.ends) - 1 else None
        kept = tuple(e for e in self._entries if e is not source and not _restates(listed.text, start, e, raw))
        self._entries = (kept + (entry,))[-ENTRIES:]

    def clear(self) -> None:
        """Forget everything; scans made before this give no nodes."""
        self._entries = ()
        self.generation += 1

    def __len__(self) -> int:
        return len(self._entries)


def _restates(text: str, start: int, entry: _Entry, raw: bytes | None = None) -> bool:
    """Whether the list at ``start`` in ``text`` begins with all of ``entry``'s text."""
    return _at(text, raw, start, entry.head) and _at(text, raw, start + len(entry.head), entry.last)


def _at(text: str, raw: bytes | None, start: int, piece: Text) -> bool:
    """Whether ``piece`` stands at ``start`` in ``text`` (whose bytes are ``raw`` if they are
    ASCII): a memory compare either way, a view compared with bytes without a copy."""
    if type(piece) is str:
        return text.startswith(piece, start)
    if raw is not None:
        return raw.startswith(piece, start)
    return text.startswith(str(piece, "ascii"), start)  # an ASCII entry, a request that is not


def touches(overrides: Iterable[Any], key: str) -> bool:
    """Whether any of ``overrides`` (objects with a dotted ``key``) changed the list ``key``:
    its elements may then have been changed in place, and must not be shared."""
    return any(o.key.split(".", 1)[0] == key for o in overrides)


def identical(a: list[Any], b: list[Any]) -> int:
    """The index of the first item that is not the same object in ``a`` and ``b`` (the
    shorter one's length if there is none), in one pass in C that reads no item: a restated
    history is mostly the very objects its last request's scan made."""
    return next(itertools.compress(itertools.count(), map(operator.is_not, a, b)), min(len(a), len(b)))


def alike(a: list[Any], b: list[Any]) -> int:
    """The index of the first item that is neither the same object in ``a`` and ``b`` nor
    equal (the shorter one's length if there is none): ``identical``'s pass in C, and an
    equality test in Python only where the objects differ (a restated reply parsed anew,
    a lead message the scan does not keep)."""
    for k in itertools.compress(itertools.count(), map(operator.is_not, a, b)):
        if a[k] != b[k]:
            return k
    return min(len(a), len(b))

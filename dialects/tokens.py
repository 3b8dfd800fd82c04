"""Token fields: what a dialect's upstream returns for training when asked, and the harness never sees.

An upstream that can return the tokens a model saw and sampled (vLLM, SGLang: ``vllm.py``)
does so only when the request asks, and answers with fields the harness never asked for. A
dialect says which keys ask and where the answer carries them (``Dialect.tokens``, a
``TokenFields`` subclass); the proxy's mitmproxy side (``addons/gateway/answer/collect.py``) decides which
sessions ask, sets the keys (``asks``), and takes the fields out of what the harness receives
with what is here: ``stripped`` for a JSON body, ``EventStrip`` for a stream, event by event.

An ``EventStrip`` cuts SSE bytes into whole events, O(chunk) per call, and forwards each event
as soon as its blank line arrives; events it does not touch go out byte for byte, the usual
event loses the fields from its bytes (``TokenFields.cut``; for an event the Tee read by a
learned shape, by that shape's template, ``_Cut``), any other is parsed, stripped and written
again. A key the request already asked for is never added, hence never stripped.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from interceptor.dialects import prompt_ids
from interceptor.dialects.sse import blank, lines_kept, split_lines

log = logging.getLogger(__name__)


@dataclass(eq=False)
class TokenFields:
    """What the proxy added to one request, hence what it takes out of the answer; a
    subclass per wire format says where its fields are. ``token_ids``: the first of ``keys``
    was added; ``logprobs``: the second (a format whose logprobs are not asked for has one
    key). The counts are what the ``rewrite`` record says was removed."""

    token_ids: bool
    logprobs: bool = False
    removed: set[str] = field(default_factory=set)
    streamed: bool = False  # the answer is SSE, stripped event by event
    events: int = 0  # SSE events rewritten
    dropped: int = 0  # SSE events that existed only to carry token ids
    recorded: bool = False

    #: The body keys set true to ask for the fields: the token ids' first, the logprobs' next.
    keys: ClassVar[tuple[str, ...]] = ()
    #: The field whose presence in an answer proves the upstream returned token ids.
    proof: ClassVar[str] = ""
    #: What to tell the operator when an answer lacks ``proof``: which upstream returns them.
    hint: ClassVar[str] = ""
    #: Keys (quoted, as in JSON text) whose presence in an event's bytes means it may carry a
    #: field to take out (``touches``), and which a learned shape's list hole must not hold.
    quoted: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def wanted(cls, body: dict[str, Any]) -> TokenFields | None:
        """The fields to ask ``body`` for: each key it does not set true already; None when
        it asks for all of them itself (nothing added, nothing to strip)."""
        asked = [body.get(key) is not True for key in cls.keys]
        if not any(asked):
            return None
        return cls(token_ids=asked[0], logprobs=len(asked) > 1 and asked[1])

    @property
    def asks(self) -> list[str]:
        """The keys this adds to the request, each set true."""
        return [k for k, add in zip(self.keys, (self.token_ids, self.logprobs)) if add]

    def fresh(self) -> TokenFields:
        """A plan asking for the same, with nothing removed yet."""
        return type(self)(token_ids=self.token_ids, logprobs=self.logprobs)

    def touches(self, block: bytes) -> bool:
        """Whether an SSE event's bytes may carry what was added (a cheap test first)."""
        return any(key.encode() in block for key in self.quoted)

    def strip(self, obj: dict[str, Any]) -> bool:
        """Remove what was added from one answer body or event, in place; True if anything
        was there."""
        raise NotImplementedError

    def stripped(self, payload: bytes) -> dict[str, Any] | None:
        """The body or event ``payload`` without what was added, or None when it carries
        none of it (or is no JSON object): then it goes on as it came."""
        try:
            obj = json.loads(payload)
        except ValueError:
            return None
        return obj if isinstance(obj, dict) and self.strip(obj) else None

    def cut(self, payload: bytes) -> bytes | None:
        """``stripped`` done on the bytes, without parsing, for the usual event: None when
        this cannot (the JSON path decides), ``payload`` itself when there is nothing to take
        out."""
        return None

    def only_carrier(self, obj: dict[str, Any]) -> bool:
        """Whether a stripped event says nothing and existed only to carry what was added:
        then it is dropped."""
        return False


def without(payload: bytes, k: int, end: int) -> tuple[bytes, bytes]:
    """``payload`` before the key at ``k`` and after its value's last byte ``end``, the
    comma between that member and a neighbour left out."""
    before, after = payload[:k].rstrip(), payload[end + 1:].lstrip()
    if before.endswith(b","):
        before = before[:-1]
    elif after.startswith(b","):
        after = after[1:]
    return before, after


def cut_arrays(payload: bytes, key: bytes) -> tuple[bytes, bool] | None:
    """``payload`` without each ``key`` and its flat array, cut from the bytes, and whether
    there was one; None when a value of the key is anything else (``null``, a nested
    array), which the JSON path removes too."""
    cut = False
    pos = 0
    while (k := payload.find(key, pos)) >= 0:
        where = prompt_ids.span(payload, key, k)
        if where is None or b"[" in payload[where[1] + 1:where[2]]:
            return None
        before, after = without(payload, k, where[2])
        payload, pos, cut = before + after, len(before), True
    return payload, cut


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def with_true_keys(content: bytes, keys: list[str]) -> bytes | None:
    """The JSON object ``content`` with ``"key":true`` appended for each key, or None when
    it does not end like an object. Splicing two keys costs a copy; re-serialising the whole
    history would cost the event loop a parse and a dump of it per turn; and the copy is one
    join of a view, not a strip, a slice and concatenations of the whole body."""
    end = _back(content, len(content), b" \t\r\n")
    if not end or content[end - 1] != 0x7D:  # '}'
        return None
    head = _back(content, end - 1, b" \t\r\n")
    fields = b",".join(b'"%s":true' % key.encode() for key in keys)
    comma = b"" if head and content[head - 1] == 0x7B else b","  # '{': no member before
    return b"".join((memoryview(content)[:head], comma, fields, b"}"))



class _Cut:
    """``TokenFields.cut`` of every event of one learned shape (``dialects.common.Shape``), as a
    template: the event's bytes are the shape's fixed text with its holes' texts, and the
    cut depends on the fixed text alone (the keys it looks for carry a quote, which a
    string hole holds only escaped; a number or a list of ints holds none; a list of anything,
    vLLM's logprobs entries, is checked for them: ``guards``). So it is the fixed pieces the
    cut kept, with the holes it kept in between, filled from the Tee's match of the same
    event (``StreamTee.matches``): no search, no scan. Learned from one event with a marker
    in each hole (``learn``) and checked against that event's own cut."""

    __slots__ = ("parts", "removed", "guards", "head", "keys")

    def __init__(self, parts: list[str | int], removed: set[str], guards: tuple[int, ...], head: str,
                 keys: tuple[str, ...]) -> None:
        self.parts = parts  # fixed text, or the number of the group whose text goes there
        self.removed = removed
        self.guards = guards  # the list holes: their text may hold a key the cut looks for
        self.keys = keys  # those keys, quoted (``TokenFields.quoted``)
        # The fixed text before the pattern's start: the shape's head (``Shape.first``), which
        # the pattern leaves out, so two shapes of one stream may share the pattern.
        self.head = head

    def fits(self, m: re.Match[str]) -> bool:
        """``m``'s event begins with the head this was learned with (its shape's, not only its
        pattern's), and no list hole of ``m`` holds a key the cut looks for (an entry with its
        own fields the cut looks for): then the template is the cut."""
        head = self.head
        if m.pos != len(head) or not m.string.startswith(head):
            return False
        for g in self.guards:
            text = m.group(g)
            if any(key in text for key in self.keys):
                return False
        return True

    def fill(self, m: re.Match[str]) -> bytes:
        return "".join([p if type(p) is str else m.group(p) for p in self.parts]).encode()

    @classmethod
    def learn(cls, plan: TokenFields, m: re.Match[str], block: bytes, out: bytes) -> _Cut | None:
        """The template of ``m``'s shape, if its event ``block`` (which the plan's cut made
        ``out``) is one ``data:`` line with nothing the cut would not take from the bytes."""
        text = m.string
        if text[-4] == " " or not text.startswith("data: ") or not text.endswith("}\n\n") or out == block:
            return None  # padded (its spaces are in no hole), or not the usual line
        pieces, pos, markers = [], 0, {}
        for g in range(1, m.re.groups + 1):
            start, end = m.span(g)
            raw = text[start:end]
            marker = (f'"~interceptor-cut-{g}~"' if raw[0] == '"' else f"[987654321{g:02d}]" if raw[0] == "["
                      else f"-987654321{g:02d}.5")
            pieces += (text[pos:start], marker)
            markers[marker], pos = g, end
        marked = "".join(pieces) + text[pos:]
        if any(marked.count(k) != 1 for k in markers):
            return None
        scratch = plan.fresh()
        cut = scratch.cut(marked[6:-2].encode())
        if cut is None:
            return None
        result = "data: " + cut.decode() + "\n\n"
        found = sorted((at, k) for k in markers if (at := result.find(k)) >= 0)
        if any(result.count(k) > 1 for _, k in found):
            return None
        parts: list[str | int] = []
        pos = 0
        for at, k in found:
            parts += (result[pos:at], markers[k])
            pos = at + len(k)
        parts.append(result[pos:])
        guards = tuple(g for g in range(1, m.re.groups + 1) if text[m.start(g)] == "[")
        made = cls([p for p in parts if p != ""], scratch.removed, guards, text[:m.pos], plan.quoted)
        return made if made.fits(m) and made.fill(m) == out else None


class EventStrip:
    """Cuts SSE bytes into whole events and strips each one of what ``plan`` added.

    Only the unfinished event is held (at most one event's bytes). Lines keep their own
    terminators; an event is rewritten only when it carries something to strip, and then
    only its ``data`` line changes. An event the Tee read by a learned shape (``matches``,
    filled by the Tee in the same call) is stripped by that shape's template (``_Cut``).
    """

    def __init__(self, plan: TokenFields, matches: list[tuple[bytes, re.Match[str]]] | None = None) -> None:
        self.plan = plan
        self.event = bytearray()  # the unfinished event, as received
        self.line = 0  # length of its unfinished last line
        self.pending_cr = False  # a chunk ended in CR: an LF may follow in the next
        self.dropped = False  # the last event was dropped (its split LF goes with it)
        self.matches = matches  # this call's events the Tee read by a shape, in order
        self.next = 0  # the first of them not yet met
        # Per shape (by its pattern's id, the pattern kept alive with it, so the id is not
        # reused): its template, or None where it has none.
        self.cuts: dict[int, tuple[re.Pattern[str], _Cut | None]] = {}

    def begin(self) -> None:
        """A new chunk: the Tee is about to list the events it reads in it (``matches``)."""
        if self.matches is not None:
            self.matches.clear()
            self.next = 0

    def feed(self, data: bytes) -> bytes:
        out = bytearray()
        if not data:
            return b""  # an empty chunk must not forget a pending CR
        if (not self.event and not self.pending_cr and len(data) > 1 and blank(data) == len(data) - 2
                and data.find(b"\r") < 0):
            # The usual chunk: one whole event, LF lines (a provider flushes each event).
            sent = self._event(data)
            self.dropped = not sent
            return sent
        i = 0
        if self.pending_cr and data[0] == 0x0A:  # the LF of a CRLF split across chunks
            if self.event:
                self.event += b"\n"
            elif not self.dropped:
                out += b"\n"
            i = 1
        for begin, end, i in split_lines(data, i):
            ends = self.line == 0 and end == begin  # a blank line: the event is whole
            self.event += data[begin:i]
            self.line = 0
            if ends:
                sent = self._event(bytes(self.event))
                self.dropped = not sent
                out += sent
                self.event.clear()
        self.event += data[i:]
        self.line += len(data) - i
        self.pending_cr = data.endswith(b"\r")
        return bytes(out)

    def flush(self) -> bytes:
        """End of stream: a last event without its blank line goes out too."""
        rest, self.event, self.line = bytes(self.event), bytearray(), 0
        return self._event(rest) if rest else b""

    def _event(self, block: bytes) -> bytes:
        try:
            matches = self.matches  # the Tee read it by a shape if it is the next of these
            if matches and self.next < len(matches):
                piece, m = matches[self.next]
                if piece is block or piece == block:
                    self.next += 1
                    return self._by_shape(block, m)
            return self._usual(block)
        except Exception:  # a shape nobody foresaw must not break the harness's stream
            log.exception("interceptor: could not strip token fields from an event; forwarded as is")
            return block

    def _usual(self, block: bytes) -> bytes:
        return self._rewrite(block) if self.plan.touches(block) else block

    def _by_shape(self, block: bytes, m: re.Match[str]) -> bytes:
        """An event the Tee read by a shape (``m``): by the shape's template, learned from
        the first such event (which takes the usual way), or the usual way if it has none."""
        known = self.cuts.get(id(m.re))
        if known is None:
            out = self._usual(block)
            if len(self.cuts) < 8:  # a stream learns a handful of shapes at most
                self.cuts[id(m.re)] = (m.re, _Cut.learn(self.plan, m, block, out))
            return out
        cut = known[1]
        if cut is None or m.string[-4] == " " or not cut.fits(m):
            return self._usual(block)
        plan = self.plan
        plan.events += 1
        plan.removed |= cut.removed
        return cut.fill(m)

    def _rewrite(self, block: bytes) -> bytes:
        plan = self.plan
        lines = lines_kept(block)
        data = [k for k, line in enumerate(lines) if line.startswith(b"data:")]
        if not data:
            return block
        if len(data) == 1:  # the usual chunk: cut from its bytes, if the plan can
            payload = _field_value(lines[data[0]])
            cut = plan.cut(payload)
            if cut is payload:
                return block
            if cut is not None:
                plan.events += 1
                first = lines[data[0]]
                lines[data[0]] = b"data: " + cut + _ending(first)
                return b"".join(lines)
        obj = plan.stripped(b"\n".join(_field_value(lines[k]) for k in data))
        if obj is None:
            return block
        if plan.only_carrier(obj):
            plan.dropped += 1
            return b""
        plan.events += 1
        first = lines[data[0]]
        ending = _ending(first)
        lines[data[0]] = b"data: " + dumps(obj) + ending
        return b"".join(line for k, line in enumerate(lines) if k == data[0] or k not in data)


def _back(data: bytes, end: int, chars: bytes) -> int:
    """Where ``data[:end]`` ends once ``chars`` are stripped from its right: ``rstrip``
    without copying what it keeps (vLLM's first line carries the whole prompt's ids)."""
    while end and data[end - 1] in chars:
        end -= 1
    return end


def _ending(line: bytes) -> bytes:
    """The line's terminator (LF if it has none)."""
    return line[_back(line, len(line), b"\r\n"):] or b"\n"


def _field_value(line: bytes) -> bytes:
    """The value of a ``data:`` line: after the colon and one space, before the line's end,
    in one copy."""
    return line[6 if line[5:6] == b" " else 5:max(5, _back(line, len(line), b"\r\n"))]

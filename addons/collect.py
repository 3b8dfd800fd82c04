"""Collect: token ids and logprobs for training, from an upstream that returns them.

A session with ``collect_tokens`` asks an OpenAI-compatible upstream (vLLM >= 0.10.2, SGLang)
for ``return_token_ids`` and ``logprobs`` on every Chat Completions request, JSON and
streamed (and vLLM's own Responses route for ``enable_response_messages``: ``ResponsesPlan``;
the keys are the wire dialect's ``token_keys``). The reply's ``prompt_token_ids`` and
completion ``token_ids``/logprobs are what the
trace needs to train on exactly the tokens the model saw; the harness never asked for them,
so they are taken out of what it receives.

- ``request`` (after Rewrite): adds the two keys to the body Rewrite left in ``ex.body`` and
  to the bytes it left in ``flow.request.content`` (spliced in, not re-serialised), and lists
  them among the call's overrides (reason ``collect_tokens``). A key the body already asks
  for (the harness's own ``logprobs``) is left alone and, below, never stripped.
- ``on_headers`` (the pipeline's strip stage): wraps the Tee's stream callable, so the Tee assembles the
  upstream's bytes, token ids included, and the harness gets each event without them. The
  wrapper cuts the stream into whole events, O(chunk) per call, and forwards each event as
  soon as its blank line arrives; events it does not touch go out byte for byte, the usual
  chunk (text, its ids and logprobs) loses them from its bytes (``Plan.cut``; for an event
  the Tee read by a learned shape, by that shape's template, ``_Cut``), any other is parsed,
  stripped and written again.
- ``on_response`` (after the Tee, which has parsed and recorded the full JSON body): strips the
  body. Either way one ``rewrite`` record (direction ``response``) says what was removed,
  written right after the turn and before the harness has the answer.

``addons/pipeline.py`` runs the answer-side stages after the Tee's and before Retry's capture,
so the capture (and any replay) holds the bytes the harness actually received.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from mitmproxy import http

from interceptor.addons.exchange import Exchange, exchange_of
from interceptor.dialects import prompt_ids
from interceptor.dialects.base import Override
from interceptor.dialects.body import scan_value
from interceptor.dialects.encoding import Decoder, TooLarge
from interceptor.dialects.sse import EventTooLarge, blank, lines_kept, split_lines
from interceptor.trace.ids import new_id

log = logging.getLogger(__name__)

REASON = "collect_tokens"


@dataclass(eq=False)
class Plan:
    """What the proxy added to one request, hence what it takes out of the answer."""

    token_ids: bool  # asked for return_token_ids: drop prompt_token_ids and token_ids
    logprobs: bool  # asked for logprobs: set each choice's logprobs back to null
    removed: set[str] = field(default_factory=set)
    streamed: bool = False  # the answer is SSE, stripped event by event
    events: int = 0  # SSE events rewritten
    dropped: int = 0  # SSE events that existed only to carry token ids
    recorded: bool = False

    #: The field whose presence proves the upstream returned token ids (see ``_check``).
    proof = "prompt_token_ids"
    #: Chunks that exist only to carry token ids may be dropped (``_only_token_carrier``).
    carriers = True

    def touches(self, block: bytes) -> bool:
        """Whether an SSE event's bytes may carry what was added (a cheap test first)."""
        return b"token_ids" in block or (self.logprobs and b"logprobs" in block)

    def strip(self, obj: dict[str, Any]) -> bool:
        """Remove what was added from one ChatCompletion body or chunk, in place; True if
        anything was there."""
        found = False
        if self.token_ids and "prompt_token_ids" in obj:
            del obj["prompt_token_ids"]
            self.removed.add("prompt_token_ids")
            found = True
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if self.token_ids and "token_ids" in choice:
                del choice["token_ids"]
                self.removed.add("choices[].token_ids")
                found = True
            if self.logprobs and choice.get("logprobs") is not None:
                choice["logprobs"] = None
                self.removed.add("choices[].logprobs")
                found = True
        return found

    def stripped(self, payload: bytes) -> dict[str, Any] | None:
        """The body or chunk ``payload`` without what was added, or None when it carries
        none of it (or is no JSON object): then it goes on as it came."""
        cut = False
        if self.token_ids:
            payload, cut = cut_prompt_ids(payload)
        try:
            obj = json.loads(payload)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        if cut:
            self.removed.add("prompt_token_ids")
        return obj if self.strip(obj) or cut else None

    def cut(self, payload: bytes) -> bytes | None:
        """``stripped`` done on the bytes, for the usual vLLM chunk (a piece of text, its
        token ids and logprobs): each ``"token_ids":[...]`` cut out, each ``"logprobs":``
        value set to ``null``, the rest of the upstream's bytes as they came: a fraction of
        what parsing the chunk and writing it again costs per event (``bench/pipeline.py
        --collect``). The keys are matched in the raw text because a quote inside a JSON
        string is always escaped; Chat puts both only on a choice. None for any other chunk:
        one that may exist only to carry ids (no choice with a non-empty delta), one that is
        not UTF-8, a value the scanner cannot read; the JSON path decides those. The
        payload itself when there is nothing to take out."""
        removed: list[str] = []
        out = payload
        if self.token_ids:
            out, cut = cut_prompt_ids(out)
            if cut:
                removed.append("prompt_token_ids")
            ids = _cut_arrays(out, _TOKEN_IDS)
            if ids is None or prompt_ids.KEY in ids[0]:
                return None  # a value that is no flat array: the JSON path removes it
            out, cut = ids
            if cut:
                removed.append("choices[].token_ids")
        if _NON_EMPTY_DELTA not in out:
            return None
        if self.logprobs and _LOGPROBS in out:
            try:
                text = out.decode("utf-8")
            except UnicodeDecodeError:
                return None
            pieces, pos = [], 0
            while (k := text.find(_LOGPROBS_TEXT, pos)) >= 0:
                start = k + len(_LOGPROBS_TEXT)
                while text[start:start + 1] in _JSON_SPACE:
                    start += 1
                try:
                    value, end = scan_value(text, start)
                except (StopIteration, ValueError):
                    return None
                if value is not None:
                    pieces += [text[pos:start], "null"]
                    pos = end
                    if "choices[].logprobs" not in removed:
                        removed.append("choices[].logprobs")
                else:
                    pieces.append(text[pos:end])
                    pos = end
            if pos:
                out = ("".join(pieces) + text[pos:]).encode("utf-8")
        if not removed:
            return payload
        self.removed.update(removed)
        return out

    def record(self, ex: Exchange) -> None:
        """One ``rewrite`` record for the exchange, once, if anything was removed."""
        if not self.removed or self.recorded:
            return
        self.recorded = True
        kind = "sse" if self.streamed else "json"
        rewrite: dict[str, Any] = {"direction": "response", "by": REASON, "call": ex.call_id,
                                   "body": kind, "removed": sorted(self.removed)}
        if self.streamed:
            rewrite["events"] = self.events
            if self.dropped:
                rewrite["dropped_events"] = self.dropped
        try:
            ex.session.recorder.record_rewrite(rewrite)
        except Exception:
            log.exception(f"interceptor: session {ex.session.id!r}: could not record the response rewrite")


class ResponsesPlan(Plan):
    """vLLM's Responses route (``enable_response_messages``, see dialects/responses.py): the
    token ids come as ``input_messages`` / ``output_messages`` on the response object (the
    JSON body; each event's ``response``, lists on the terminal one); both go."""

    proof = "input_messages"
    carriers = False
    KEYS = ("input_messages", "output_messages")

    def touches(self, block: bytes) -> bool:
        return b"_messages" in block

    def strip(self, obj: dict[str, Any]) -> bool:
        target = obj.get("response") if isinstance(obj.get("response"), dict) else obj
        found = False
        for key in self.KEYS:
            if self.token_ids and key in target:
                del target[key]
                self.removed.add(key)
                found = True
        return found

    def stripped(self, payload: bytes) -> dict[str, Any] | None:
        try:
            obj = json.loads(payload)
        except ValueError:
            return None
        return obj if isinstance(obj, dict) and self.strip(obj) else None

    def cut(self, payload: bytes) -> bytes | None:
        return None  # the token arrays are nested in the response object: the JSON path


_TOKEN_IDS = b'"token_ids":'
_LOGPROBS = b'"logprobs":'
_LOGPROBS_TEXT = _LOGPROBS.decode()
_NON_EMPTY_DELTA = b'"delta":{"'
_JSON_SPACE = frozenset(" \t\r\n")


def _without(payload: bytes, k: int, end: int) -> tuple[bytes, bytes]:
    """``payload`` before the key at ``k`` and after its value's last byte ``end``, the
    comma between that member and a neighbour left out."""
    before, after = payload[:k].rstrip(), payload[end + 1:].lstrip()
    if before.endswith(b","):
        before = before[:-1]
    elif after.startswith(b","):
        after = after[1:]
    return before, after


def _cut_arrays(payload: bytes, key: bytes) -> tuple[bytes, bool] | None:
    """``payload`` without each ``key`` and its flat array, cut from the bytes, and whether
    there was one; None when a value of the key is anything else (``null``, a nested
    array), which the JSON path removes too."""
    cut = False
    pos = 0
    while (k := payload.find(key, pos)) >= 0:
        where = prompt_ids.span(payload, key, k)
        if where is None or b"[" in payload[where[1] + 1:where[2]]:
            return None
        before, after = _without(payload, k, where[2])
        payload, pos, cut = before + after, len(before), True
    return payload, cut


def _dumps(obj: Any) -> bytes:
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


def _only_token_carrier(obj: dict[str, Any]) -> bool:
    """A chunk that, stripped, says nothing: vLLM sends one per token the tool or reasoning
    parser held back, only because token ids were asked for (empty delta, no finish)."""
    choices = obj.get("choices")
    if not choices or obj.get("usage") or obj.get("error"):
        return False
    return all(isinstance(c, dict) and not c.get("delta") and c.get("finish_reason") is None
               and c.get("logprobs") is None for c in choices)


class _Cut:
    """``Plan.cut`` of every event of one learned shape (``dialects.common.Shape``), as a
    template: the event's bytes are the shape's fixed text with its holes' texts, and the
    cut depends on the fixed text alone (the keys it looks for carry a quote, which a
    string hole holds only escaped; a number or a list of ints holds none; a list of anything,
    vLLM's logprobs entries, is checked for them: ``guards``). So it is the fixed pieces the
    cut kept, with the holes it kept in between, filled from the Tee's match of the same
    event (``StreamTee.matches``): no search, no scan. Learned from one event with a marker
    in each hole (``learn``) and checked against that event's own cut."""

    __slots__ = ("parts", "removed", "guards", "head")

    def __init__(self, parts: list[str | int], removed: set[str], guards: tuple[int, ...], head: str) -> None:
        self.parts = parts  # fixed text, or the number of the group whose text goes there
        self.removed = removed
        self.guards = guards  # the list holes: their text may hold a key the cut looks for
        # The fixed text before the pattern's start: the shape's head (``Shape.first``), which
        # the pattern leaves out, so two shapes of one stream may share the pattern.
        self.head = head

    def fits(self, m: re.Match[str]) -> bool:
        """``m``'s event begins with the head this was learned with (its shape's, not only its
        pattern's), and no list hole of ``m`` holds a key the cut looks for (an entry with its
        own ``token_ids`` or ``logprobs``): then the template is the cut."""
        head = self.head
        if m.pos != len(head) or not m.string.startswith(head):
            return False
        for g in self.guards:
            text = m.group(g)
            if '"token_ids"' in text or '"logprobs"' in text:
                return False
        return True

    def fill(self, m: re.Match[str]) -> bytes:
        return "".join([p if type(p) is str else m.group(p) for p in self.parts]).encode()

    @classmethod
    def learn(cls, plan: Plan, m: re.Match[str], block: bytes, out: bytes) -> _Cut | None:
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
        scratch = Plan(token_ids=plan.token_ids, logprobs=plan.logprobs)
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
        made = cls([p for p in parts if p != ""], scratch.removed, guards, text[:m.pos])
        return made if made.fits(m) and made.fill(m) == out else None


class EventStrip:
    """Cuts SSE bytes into whole events and strips each one; see the module docstring.

    Only the unfinished event is held (at most one event's bytes). Lines keep their own
    terminators; an event is rewritten only when it carries something to strip, and then
    only its ``data`` line changes. An event the Tee read by a learned shape (``matches``,
    filled by the Tee in the same call) is stripped by that shape's template (``_Cut``).
    """

    def __init__(self, plan: Plan, matches: list[tuple[bytes, re.Match[str]]] | None = None) -> None:
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
        if plan.token_ids and plan.carriers and _only_token_carrier(obj):
            plan.dropped += 1
            return b""
        plan.events += 1
        first = lines[data[0]]
        ending = _ending(first)
        lines[data[0]] = b"data: " + _dumps(obj) + ending
        return b"".join(line for k, line in enumerate(lines) if k == data[0] or k not in data)


def cut_prompt_ids(payload: bytes) -> tuple[bytes, bool]:
    """``payload`` without its ``prompt_token_ids`` array, cut from the bytes unparsed: for a
    long conversation it is most of vLLM's first event (larger than the prompt's text), and
    parsing and re-dumping it would cost the event loop that much work per turn. Only
    a flat array is cut (``prompt_ids.span``); anything else is left to the JSON path."""
    where = prompt_ids.span(payload)
    if where is None:
        return payload, False
    before, after = _without(payload, where[0], where[2])
    return before + after, True


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


class StripStream:
    """The ``flow.response.stream`` callable around the Tee's: the inner callable sees (and
    records) the upstream's bytes, the harness gets them stripped. The rewrite record is
    written in the call where the Tee commits the turn, so it follows the turn on the record
    and precedes the terminal event the harness then receives.

    It holds what the Tee may hold (the Tee's bounds: ``intercept_max_answer`` decoded,
    ``intercept_max_event`` an event): past either, the rest cannot be stripped, so the
    harness's stream ends there (the token fields never reach it) and the Tee's record says
    what was cut."""

    def __init__(self, inner: Any, ex: Exchange, plan: Plan, content_encoding: str | None) -> None:
        self.inner = inner
        self.ex = ex
        self.plan = plan
        limit = getattr(getattr(inner, "decoder", None), "limit", 0)
        self.max_event = getattr(getattr(inner, "sse", None), "max_event", 0)
        self.cut = False
        # An upstream that compressed despite ``accept-encoding: identity`` is decoded here
        # and the header removed, so the harness gets plain events.
        self.decoder = Decoder.for_encoding(content_encoding, limit) if content_encoding else None
        # The Tee's readings by a shape, for the same bytes only (it decodes what it reads).
        matches = None
        if self.decoder is None and getattr(inner, "matches", False) is None and getattr(inner, "identity", False):
            matches = inner.matches = []
        self.events = EventStrip(plan, matches)

    def __call__(self, chunk: bytes) -> list[bytes]:
        """A list, never ``b""``: mitmproxy sends an empty bytes result as an empty chunk,
        which in a chunked HTTP/1.1 body is its end (a held partial event yields none)."""
        self.events.begin()
        out = self.inner(chunk) if callable(self.inner) else chunk
        if not isinstance(out, bytes):  # an inner callable may return an iterable of chunks
            out = b"".join(out)
        if self.cut:
            return []
        try:
            if self.decoder is not None:
                out = self.decoder.decode(out) if out else b""
                if not chunk:
                    out += self.decoder.flush()
            out = self.events.feed(out) if chunk else self.events.feed(out) + self.events.flush()
            if self.max_event and len(self.events.event) > self.max_event:
                self._cut(EventTooLarge(f"an event of the stream passed {self.max_event} bytes"))
        except TooLarge as e:
            self._cut(e)
            out = b""
        if self.ex.committed:
            self.plan.record(self.ex)
        return [out] if out else []

    def _cut(self, e: TooLarge) -> None:
        self.cut = True
        self.events = EventStrip(self.plan)  # what it held goes now
        self.decoder = None
        log.warning(f"interceptor: session {self.ex.session.id!r}: {e}; token fields cannot be "
                    "stripped past it, so the harness's stream ends there")


class Collect:
    def __init__(self) -> None:
        self._warned: set[str] = set()

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        ex = exchange_of(flow)
        if (ex is None or ex.route.kind != "model" or not ex.wire.collects_tokens or ex.body is None
                or not ex.session.config.collect_tokens):
            return
        body = ex.body
        keys = ex.wire.token_keys
        asked = [body.get(key) is not True for key in keys]
        plan = (ResponsesPlan if ex.wire.name == "responses" else Plan)(
            token_ids=asked[0], logprobs=len(asked) > 1 and asked[1])
        if not any(asked):
            return  # the body asks for them already: nothing added, nothing to strip
        added = [key for key, add in zip(keys, asked) if add]
        present = any(key in body for key in added)  # e.g. "logprobs": false
        for key in added:
            ex.overrides.append(Override(key, body.get(key), True, REASON))
            body[key] = True
        if not ex.unwritten:  # else Stops writes the body, these keys with the rest (Exchange.unwritten)
            content = None if present else with_true_keys(flow.request.content or b"", added)
            flow.request.content = content if content is not None else _dumps(body)
        # Plain bytes back, so events can be cut and rewritten as they pass.
        flow.request.headers["accept-encoding"] = "identity"
        ex.call_id = ex.call_id or new_id()  # the rewrite record names the call
        ex.collect = plan

    def on_headers(self, flow: http.HTTPFlow, stream):
        plan = self._plan(flow)
        response = flow.response
        if plan is None or response is None or not stream:
            return stream
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            return stream
        encoding = response.headers.get("content-encoding", "").strip()
        if encoding.lower() in ("", "identity"):
            encoding = ""
        try:
            stripped = StripStream(stream, exchange_of(flow), plan, encoding or None)
        except ValueError as e:  # an encoding nobody here can read: forward as is
            log.warning(f"interceptor: token fields left in a {encoding} stream: {e}")
            return stream
        plan.streamed = True
        if encoding:
            del response.headers["content-encoding"]
        return stripped

    def on_response(self, flow: http.HTTPFlow) -> None:
        plan = self._plan(flow)
        response = flow.response
        if plan is None or response is None:
            return
        ex = exchange_of(flow)
        if plan.streamed:
            self._check(ex, plan)
            plan.record(ex)
            return
        if response.stream or not response.headers.get("content-type", "").startswith("application/json"):
            return
        body = plan.stripped(response.get_content(strict=False) or b"")
        if body is not None:
            response.content = _dumps(body)
        if response.status_code == 200:
            self._check(ex, plan)
        plan.record(ex)

    def on_error(self, flow: http.HTTPFlow) -> None:
        """A stream that broke after events were stripped: the rewrite is still on record."""
        plan = self._plan(flow)
        if plan is not None and plan.streamed:
            plan.record(exchange_of(flow))

    def _check(self, ex: Exchange, plan: Plan) -> None:
        """Say once per session when the upstream ignores the request for token ids (not
        vLLM >= 0.10.2 or SGLang): the trace then has no tokens to train on."""
        if not plan.token_ids or plan.proof in plan.removed or ex.session.id in self._warned:
            return
        if ex.replayed:
            return
        self._warned.add(ex.session.id)
        log.warning(f"interceptor: session {ex.session.id!r} collects tokens, but the upstream "
                    f"returned no {plan.proof}: use vLLM >= 0.10.2 (or SGLang) as the upstream")

    @staticmethod
    def _plan(flow: http.HTTPFlow) -> Plan | None:
        ex = exchange_of(flow)
        return ex.collect if ex is not None else None

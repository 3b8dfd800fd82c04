"""Server-sent events framing, incremental in both directions.

The tee feeds whatever chunk the network produced; an event may be split anywhere, even
inside a multi-byte UTF-8 character or between the CR and LF of a line ending. The decoder
keeps only the unfinished line and the unfinished event, so each ``feed`` costs O(chunk),
never O(stream): a long stream must not be re-scanned per chunk. Those two are what an
upstream can make grow without end (one huge event, a line with no end): a decoder made
with ``max_event`` raises ``EventTooLarge`` once either passes it, and its caller stops
reading the stream for the record and says so there.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from interceptor.dialects.encoding import TooLarge


@dataclass(slots=True)
class SSEEvent:
    """One dispatched event. ``data`` is the lines joined by ``\\n``, decoded as UTF-8 with
    replacement (a malformed byte must not stop the recording; the harness gets the bytes)."""

    event: str | None = None
    data: str = ""
    id: str | None = None
    retry: int | None = None
    #: A line of this event was not valid UTF-8 (replaced with U+FFFD). Providers never send
    #: that, so the bytes were damaged on the way: the harness still gets them, but the
    #: record must not present a corrupted answer as a turn.
    malformed: bool = False

    def encode(self) -> bytes:
        out = []
        if self.event is not None:
            out.append(f"event: {self.event}\n")
        for line in self.data.split("\n"):
            out.append(f"data: {line}\n")
        out.append("\n")
        return "".join(out).encode()


# CPython looks for a one-byte needle with memchr, but for a two-byte one, and splits at a
# one-byte separator, a byte at a time (``find(b"\n\n")``, ``split(b"\n")``, ``splitlines``
# are each many times slower on a long chunk, such as vLLM's first with the prompt's ids).
# So the scans below go from LF to LF by memchr; a short chunk, the usual one, is split by
# the C loop, which costs less there than a call per line.
_LONG = 4096


def blank(data: bytes, pos: int = 0) -> int:
    """``data.find(b"\\n\\n", pos)``: where the first pair of LFs from ``pos`` starts, or -1."""
    find = data.find
    i = find(b"\n", pos)
    while i >= 0 and data[i + 1:i + 2] != b"\n":
        i = find(b"\n", i + 1)
    return i


def lf_split(data: bytes) -> list[bytes]:
    """``data.split(b"\\n")``."""
    if len(data) < _LONG:
        return data.split(b"\n")
    out, pos, find = [], 0, data.find
    while (i := find(b"\n", pos)) >= 0:
        out.append(data[pos:i])
        pos = i + 1
    out.append(data[pos:])
    return out


def lines_kept(data: bytes) -> list[bytes]:
    """``data.splitlines(keepends=True)``."""
    if len(data) < _LONG or data.find(b"\r") >= 0:
        return data.splitlines(keepends=True)
    out, pos, find, n = [], 0, data.find, len(data)
    while pos < n:
        i = find(b"\n", pos)
        if i < 0:
            out.append(data[pos:])
            break
        out.append(data[pos:i + 1])
        pos = i + 1
    return out


def split_lines(data: bytes, i: int = 0) -> Iterator[tuple[int, int, int]]:
    """``(start, end, next)`` of each complete line of ``data`` from ``i``: the line is
    ``data[start:end]``, its terminator (CRLF, LF or CR) ends at ``next``. What follows the
    last one is an unfinished line. A CR that is the last byte ends its line; the caller
    remembers it, because an LF at the start of the next chunk belongs to it. The next CR is
    looked up only once the scan has passed it, so a chunk of many LF-only lines costs
    O(chunk), not O(lines x chunk)."""
    n = len(data)
    cr = data.find(b"\r", i)
    while i < n:
        lf = data.find(b"\n", i)
        if cr != -1 and cr < i:
            cr = data.find(b"\r", i)
        if lf == -1 and cr == -1:
            return
        if cr == -1 or (lf != -1 and lf < cr):
            yield i, lf, lf + 1
            i = lf + 1
        else:
            nxt = cr + 2 if data[cr + 1 : cr + 2] == b"\n" else cr + 1
            yield i, cr, nxt
            i = nxt


class EventTooLarge(TooLarge):
    """One event, or one line of it, passed ``SSEDecoder.max_event``."""


@dataclass(slots=True)
class SSEDecoder:
    """Incremental SSE parser following the WHATWG event-stream rules.

    Lines end at CRLF, LF or CR; ``:`` lines are comments; an event dispatches on a blank
    line; one leading space after the colon is stripped; blocks with no data line are dropped.
    """

    _line: bytearray = field(default_factory=bytearray)
    _pending_cr: bool = False
    _event: str | None = None
    _data: list[str] = field(default_factory=list)
    _has_data: bool = False
    _id: str | None = None
    _retry: int | None = None
    _malformed: bool = False
    _started: bool = False
    bytes_seen: int = 0
    #: Between events: no unfinished line or event, no CR whose LF may come next, the byte
    #: order mark behind (kept by ``feed``, read per chunk). A chunk that is one whole event
    #: may then be read by a dialect's shortcut instead (``NativeAssembler.quick``): feeding
    #: it would dispatch that one event and leave the decoder as it is.
    idle: bool = False
    #: The bytes an unfinished line or the data of an unfinished event may hold (0: no bound).
    max_event: int = 0
    # The unfinished event's data lines measured so far (``_bounded``): the list they are in
    # (a new event has a new one), how many of them, their size.
    _held: list | None = None
    _counted: int = 0
    _size: int = 0

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        self.bytes_seen += len(chunk)
        events: list[SSEEvent] = []
        start = 0
        n = len(chunk)
        if not n:
            return events  # an empty chunk must not forget a pending CR
        if not self._started:
            self._started = True
            if chunk.startswith(b"\xef\xbb\xbf"):
                start = 3  # a UTF-8 byte order mark is not part of the first line
        if self._pending_cr and chunk[start : start + 1] == b"\n":
            start += 1  # the LF of a CRLF split across chunks
        if not start and not self._line and chunk.find(b"\r") < 0:
            # The usual chunk: whole LF-terminated lines, nothing pending. One split instead
            # of a scan and a copy per line; the lines are the same. (``find``, not ``in``:
            # bytes ``in`` first tries the needle as an integer and clears the TypeError.)
            lines = lf_split(chunk)
            rest = lines.pop()
            for raw in lines:
                ev = self._line_done(raw)
                if ev is not None:
                    events.append(ev)
            self._line += rest
            self._pending_cr = False
            self.idle = (not rest and not self._has_data and self._event is None and self._retry is None
                         and not self._malformed)
            if not self.idle and self.max_event:
                self._bounded()
            return events
        i = start
        for begin, end, i in split_lines(chunk, start):
            self._line += chunk[begin:end]
            ev = self._line_done(bytes(self._line))
            self._line.clear()
            if ev is not None:
                events.append(ev)
        self._line += chunk[i:]
        self._pending_cr = chunk.endswith(b"\r")
        self.idle = (not self._line and not self._pending_cr and not self._has_data and self._event is None
                     and self._retry is None and not self._malformed)
        if not self.idle and self.max_event:
            self._bounded()
        return events

    def _bounded(self) -> None:
        """What is held between chunks, measured once per chunk that leaves some (the lines
        added since the last look), never per line: a stream of whole events pays nothing."""
        if len(self._line) > self.max_event:
            raise EventTooLarge(f"a line of the stream passed {self.max_event} bytes")
        if not self._has_data:
            return
        data = self._data
        if data is not self._held:
            self._held, self._counted, self._size = data, 0, 0
        self._size += sum(map(len, data[self._counted:]))
        self._counted = len(data)
        if self._size > self.max_event:
            raise EventTooLarge(f"an event of the stream passed {self.max_event} bytes")

    def flush(self) -> list[SSEEvent]:
        """End of stream: a final event without its blank line is still dispatched, as
        browsers do not but SDKs (httpx-sse, the OpenAI SDK) do."""
        self.idle = False  # the body ended: no chunk comes after
        events = []
        if self._line:
            ev = self._line_done(bytes(self._line))
            self._line.clear()
            if ev is not None:
                events.append(ev)
        ev = self._line_done(b"")
        if ev is not None:
            events.append(ev)
        return events

    def _line_done(self, raw: bytes) -> SSEEvent | None:
        if raw[:6] == b"data: ":  # the usual line, read without the general rules below
            try:
                self._data.append(str(memoryview(raw)[6:], "utf-8"))  # no copy of the line first
                self._has_data = True
                return None
            except UnicodeDecodeError:
                pass
        if not raw:
            # WHATWG: a block with no data line dispatches nothing (even with an event name);
            # a bare ``data`` line dispatches an event whose data is empty.
            ev = None
            if self._has_data:
                ev = SSEEvent(self._event, "\n".join(self._data), self._id, self._retry, self._malformed)
            self._event, self._data, self._has_data, self._retry = None, [], False, None
            self._malformed = False
            return ev
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            line = raw.decode("utf-8", errors="replace")
            self._malformed = True
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
            self._has_data = True
        elif name == "event":
            self._event = value
        elif name == "id":
            self._id = value
        elif name == "retry" and value.isdigit():
            self._retry = int(value)
        return None

"""Framing: where an HTTP/1.1 answer's head and body end, read off its raw bytes.

The relay (``addons/gateway/transport/relay.py``) passes an upstream's answer down its loopback connection to
mitmproxy as it arrives, a chunked body as one chunk per read: decoding each chunk with h11
and encoding it again, one by one, cost more per streamed event than the rest of the hop
(``docs/benchmarks.md``, "The relay"). What the relay has to know is where the answer ends
(to put the connection back in the pool, or to finish an abandoned answer) and the body's
bytes themselves (what it passes on, and the Drain's buffer, which the takeover feeds through
the pipeline). That is this: a tracker fed each read, which says how many of its bytes belong
to the answer and appends the body they carry to a buffer.

``read_head`` parses the head by h11's rules (its grammar, its size limit, a single
``Transfer-Encoding: chunked``, consistent ``Content-Length`` values); ``of`` picks the body's framing exactly as
h11's ``_body_framing`` does (RFC 9112 section 6.3): no body for 204, 304 and a HEAD's
answer; chunked; a length; else up to the connection's close. A chunk header, a chunk's end
and the trailers are checked as h11 checks them (``chunk-size [; extensions] CRLF``, 1-20 hex
digits; extensions are passed on, not read), so a malformed answer breaks here, before any of
the read it was in is passed on.
"""

from __future__ import annotations

import re

LENGTH, CHUNKED, CLOSE = "length", "chunked", "close"
MAX_LINE = 1 << 16  # a chunk header line, or the trailers together
_SIZE = re.compile(rb"([0-9A-Fa-f]{1,20})(?:;[^\r\n]*)?\r\n")
# chunked states
_HEAD, _DATA, _END, _TRAILER = 0, 1, 2, 3


class FramingError(Exception):
    """The answer's body is not framed as its head says."""


class Body:
    """One answer's body on the wire; ``feed`` each read to it until ``done``."""

    __slots__ = ("kind", "left", "done", "drop", "whole", "_state", "_line", "_trailer")

    def __init__(self, kind: str, length: int = 0) -> None:
        self.kind = kind
        self.left = length  # LENGTH: bytes still to come; CHUNKED: of the chunk (or its CRLF)
        self.done = kind == LENGTH and length == 0
        self.drop = 0  # of the last read's bytes that belong to the answer, the trailers at their end
        #: CHUNKED: how many chunks the last read was, when it was whole chunks from a chunk's
        #: start to a chunk's end (the usual read of a stream); 0 for any other read.
        self.whole = 0
        self._state = _HEAD
        self._line = b""  # a chunk header (or a trailer line) split across reads
        self._trailer = 0

    @classmethod
    def of(cls, method: bytes, status: int, headers) -> Body:
        """The framing of an answer to ``method`` with this status and h11's (validated)
        headers, as h11 decides it."""
        if status in (204, 304) or method == b"HEAD" or (method == b"CONNECT" and 200 <= status < 300):
            return cls(LENGTH, 0)
        length = None
        for name, value in headers:
            if name == b"transfer-encoding":
                return cls(CHUNKED)  # h11 admits only "chunked"; it beats a Content-Length
            if name == b"content-length" and length is None:
                length = int(value)
        return cls(CLOSE) if length is None else cls(LENGTH, length)

    def feed(self, data: bytes, body: bytearray) -> int:
        """Take a read: append the body bytes it carries to ``body``; return how many of its
        bytes belong to the answer (all, unless the answer ended inside it). FramingError if
        it breaks the framing (nothing of it appended then is to be trusted)."""
        self.drop = self.whole = 0
        if self.done:
            return 0
        if self.kind == CHUNKED:
            return self._chunked(data, body)
        if self.kind == CLOSE:
            body += data
            return len(data)
        n = min(self.left, len(data))
        body += data if n == len(data) else memoryview(data)[:n]
        self.left -= n
        self.done = not self.left
        return n

    def eof(self) -> None:
        """The upstream closed its connection: the end of a close-delimited answer, else a
        FramingError (the answer was cut)."""
        if self.kind == CLOSE:
            self.done = True
        elif not self.done:
            raise FramingError("the connection closed before the answer's end")

    def passed(self, data: bytes, used: int) -> bytes:
        """Of a read and what ``feed`` said of it, the bytes to pass on: up to the answer's
        end, and a chunked answer's trailers left out (the blank line that ends the answer
        in their place): mitmproxy 12 cannot read HTTP/1 trailers (``Http1Connection``
        raises NotImplementedError and the flow hangs), and h11 dropped them before."""
        if self.drop:
            return data[:used - self.drop] + (b"\r\n" if self.done else b"")
        return data if used == len(data) else data[:used]

    def _chunked(self, data: bytes, body: bytearray) -> int:
        i, n = 0, len(data)
        view = None
        whole = 0  # chunks read whole by the usual case; -1 once any other step ran
        while i < n:
            state = self._state
            if state == _HEAD and not self._line:
                # The usual case, a read of whole chunks (a stream's events): each one's header
                # read where it starts, its data and CRLF checked and taken at once. The
                # same checks as the steps below; anything else (a chunk cut by the read's end,
                # the last chunk, a malformed one) takes them.
                m = _SIZE.match(data, i)
                if m is not None:
                    start = m.end()
                    end = start + int(m.group(1), 16)
                    if start < end and end + 2 <= n and data[end] == 13 and data[end + 1] == 10:
                        if view is None:
                            view = memoryview(data)
                        body += view[start:end]
                        i = end + 2
                        if whole >= 0:
                            whole += 1
                        continue
            whole = -1
            if state == _DATA:
                take = min(self.left, n - i)
                body += memoryview(data)[i:i + take]
                i += take
                self.left -= take
                if not self.left:
                    self._state, self.left = _END, 2
            elif state == _END:
                take = min(self.left, n - i)
                if data[i:i + take] != b"\r\n"[2 - self.left:2 - self.left + take]:
                    raise FramingError("a chunk does not end with CRLF")
                i += take
                self.left -= take
                if not self.left:
                    self._state = _HEAD
            else:
                j = data.find(b"\n", i)
                if j < 0:
                    self._line += data[i:]
                    if len(self._line) + self._trailer > MAX_LINE:
                        raise FramingError("a chunk header or the trailers are too long")
                    if state == _TRAILER:
                        self.drop += n - i
                    return n
                line = self._line + data[i:j + 1] if self._line else data[i:j + 1]
                self._line = b""
                if state == _TRAILER:
                    self.drop += j + 1 - i
                i = j + 1
                if state == _HEAD:
                    m = _SIZE.fullmatch(line)
                    if m is None:
                        raise FramingError(f"illegal chunk header {line[:40]!r}")
                    size = int(m.group(1), 16)
                    if size:
                        self._state, self.left = _DATA, size
                    else:
                        self._state = _TRAILER
                elif line == b"\r\n":
                    self.done = True
                    return i
                else:
                    self._trailer += len(line)
                    if not line.endswith(b"\r\n") or b":" not in line or self._trailer > MAX_LINE:
                        raise FramingError("malformed trailers")
        if whole > 0:
            self.whole = whole
        return n


# -- the head ----------------------------------------------------------------------------------

# RFC 9112's grammar as h11 applies it (h11/_abnf.py): a status line, then header fields
# ``token ":" OWS field-value OWS``, where a value's characters are anything but NUL and
# whitespace, single spaces or tabs between them; lines end in CRLF or a bare LF.
_TOKEN = rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+"
_STATUS_LINE = re.compile(rb"HTTP/([0-9]\.[0-9]) ([0-9]{3})(?: ((?:[ \t]|[^\x00\s])*))?")
_FIELD = re.compile(rb"(" + _TOKEN + rb"):[ \t]*((?:[^\x00\s]+(?:[ \t]+[^\x00\s]+)*)?)[ \t]*")
_FOLD = re.compile(rb"[ \t]+")
_BLANK = re.compile(rb"\n\r?\n")
_DIGITS = re.compile(rb"[0-9]+")
MAX_LENGTH_DIGITS = 20  # h11's CONTENT_LENGTH_MAX_DIGITS


class Head:
    """An answer's status line and headers, as ``read_head`` found them valid.

    ``fields``: (name as sent, value) in order; ``headers``: the same with names in lower
    case, what the framing and the pipeline look names up in. A Content-Length is kept once
    (its repeated equal values said once, as h11 does); a Transfer-Encoding's value lower-cased.
    """

    __slots__ = ("http_version", "status_code", "reason", "fields", "headers")

    def __init__(self, http_version: bytes, status_code: int, reason: bytes,
                 fields: list[tuple[bytes, bytes]], headers: list[tuple[bytes, bytes]]) -> None:
        self.http_version = http_version  # b"1.1"
        self.status_code = status_code
        self.reason = reason
        self.fields = fields
        self.headers = headers


def read_head(buf: bytes | bytearray, limit: int) -> tuple[Head, int] | None:
    """The answer's head at the start of ``buf`` and how many bytes it took, or None while it
    is incomplete; FramingError where h11 would raise (the same grammar, the same checks of
    Content-Length and Transfer-Encoding, an incomplete head over ``limit`` bytes).

    Why not h11: for each exchange an h11 connection, a request event to put it in the state
    that reads an answer, its event objects and header normalisation cost more than the rest
    of the relay's work on a JSON answer (docs/benchmarks.md). mitmproxy reads heads with
    its own parser too; this one keeps h11's strictness, which tests/test_relay_framing.py
    holds it to on generated heads, valid and broken."""
    if buf[:1] == b"\n" or buf[:2] == b"\r\n":
        raise FramingError("no response line received")
    end = _BLANK.search(buf)
    if end is None:
        if len(buf) > limit:
            raise FramingError("the answer's head is too long")
        if buf and buf[0] < 0x21:
            raise FramingError("illegal status line")
        return None
    used = end.end()
    lines = bytes(buf[:end.start()]).split(b"\n")
    lines = [line[:-1] if line.endswith(b"\r") else line for line in lines]
    status = _STATUS_LINE.fullmatch(lines[0])
    if status is None:
        raise FramingError(f"illegal status line: {lines[0][:200]!r}")
    code = int(status.group(2))
    if code < 100:
        raise FramingError(f"illegal status code {code}")
    if code == 101:  # the relay's requests never ask for an upgrade (h11 refuses it so too)
        raise FramingError("a 101 answer to a request that asked for no protocol switch")
    fields: list[tuple[bytes, bytes]] = []
    headers: list[tuple[bytes, bytes]] = []
    length: bytes | None = None
    chunked = False
    for line in _unfolded(lines[1:]):
        field = _FIELD.fullmatch(line)
        if field is None:
            raise FramingError(f"illegal header line: {line[:200]!r}")
        raw, value = field.group(1), field.group(2)
        name = raw.lower()
        if name == b"content-length":
            values = {v.strip() for v in value.split(b",")}
            value = values.pop()
            if values or not _DIGITS.fullmatch(value) or len(value) > MAX_LENGTH_DIGITS:
                raise FramingError("bad Content-Length")
            if length is not None:
                if value != length:
                    raise FramingError("conflicting Content-Length headers")
                continue
            length = value
        elif name == b"transfer-encoding":
            value = value.lower()
            if chunked or value != b"chunked":
                raise FramingError("only a single Transfer-Encoding: chunked is supported")
            chunked = True
        fields.append((raw, value))
        headers.append((name, value))
    return Head(status.group(1), code, status.group(3) or b"", fields, headers), used


def _unfolded(lines: list[bytes]) -> list[bytes]:
    """Header lines with obsolete line folding undone: a line that starts with a space or a
    tab continues the one before it (joined by one space), as h11 reads it."""
    out: list[bytes] = []
    for line in lines:
        fold = _FOLD.match(line)
        if fold is None:
            out.append(line)
        elif not out:
            raise FramingError("continuation line at start of headers")
        else:
            out[-1] = out[-1] + b" " + line[fold.end():]
    return out

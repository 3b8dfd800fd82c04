"""Incremental ``Content-Encoding`` decoding for the tee.

The harness receives the provider's bytes untouched; the assembler needs them decoded, one
chunk at a time, as they arrive. Each decoder keeps only the codec's own window, so a chunk
costs O(chunk). ``Decoder.for_encoding`` takes the header value as sent, including a list
(``gzip, br``: applied in that order, so undone in reverse).

A chunk can inflate a thousandfold (a compression bomb: a megabyte of gzip can be a gigabyte of zeros), so
``pieces`` gives a chunk's output about ``PIECE`` bytes at a time (each codec asked for no
more: zlib's ``max_length``, brotli's ``output_buffer_limit``, zstd's writer size), and a
decoder made with a ``limit`` raises ``TooLarge`` as soon as its output passes it: memory and
the event loop's time stay bounded by the option that set the limit, whatever the upstream
sent, and the caller says on the record what was cut.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Protocol

import brotli
import zstandard

PIECE = 1 << 16  # decoded bytes handed on at a time
_ZSTD_IN = 64  # zstd input fed at a time: ~4 bytes can be a whole RLE block (1 << 17 bytes) out


class TooLarge(ValueError):
    """A decoded answer (or one event of it) passed the bound an option sets."""


class Decoder(ABC):
    """Turns encoded chunks into decoded bytes; ``flush`` at end of body returns the rest
    and raises ``ValueError`` if the body was cut inside a compressed frame."""

    limit = 0  # decoded bytes this decoder may produce in all; 0: no bound
    produced = 0

    def pieces(self, chunk: bytes) -> Iterator[bytes]:
        """``chunk`` decoded, in pieces of about ``PIECE`` bytes (identity: as it came);
        ``TooLarge`` once the output passes ``limit``."""
        for piece in self._pieces(chunk):
            self.count(len(piece))
            yield piece

    def decode(self, chunk: bytes) -> bytes:
        return b"".join(self.pieces(chunk))

    def flush(self) -> bytes:
        out = self._flush()
        self.count(len(out))
        return out

    def count(self, n: int) -> None:
        """``n`` more decoded bytes (the caller's, for an identity body read as it came)."""
        self.produced += n
        if self.limit and self.produced > self.limit:
            raise TooLarge(f"the decoded answer passed {self.limit} bytes")

    @abstractmethod
    def _pieces(self, chunk: bytes) -> Iterator[bytes]: ...

    def _flush(self) -> bytes:
        return b""

    @staticmethod
    def for_encoding(name: str | None, limit: int = 0) -> Decoder:
        """A fresh decoder for a ``Content-Encoding`` header value, producing at most
        ``limit`` bytes (0: no bound).

        Unknown codings raise ``ValueError`` naming them: the tee then records the turn as
        undecodable rather than feeding garbage to the assembler.
        """
        names = [n.strip().lower() for n in (name or "").split(",") if n.strip()]
        stages = [_one(n) for n in reversed(names)]
        stages = [s for s in stages if not isinstance(s, Identity)] or [Identity()]
        for stage in stages:  # each stage bounded: an inner bomb never inflates past it either
            stage.limit = limit
        return stages[0] if len(stages) == 1 else Chain(stages, limit)


def _one(name: str) -> Decoder:
    if name == "identity":
        return Identity()
    if name in ("gzip", "x-gzip"):
        return Gzip()
    if name == "deflate":
        return Deflate()
    if name == "br":
        return Brotli()
    if name == "zstd":
        return Zstd()
    raise ValueError(
        f"unsupported Content-Encoding {name!r}: the interceptor decodes gzip, deflate, br, zstd "
        "and identity (ask for one of those in Accept-Encoding)"
    )


class Identity(Decoder):
    def _pieces(self, chunk: bytes) -> Iterator[bytes]:
        if chunk:
            yield chunk


class Chain(Decoder):
    """Several codings, the last applied undone first, piece by piece through each."""

    def __init__(self, stages: list[Decoder], limit: int = 0):
        self.stages = stages
        self.limit = limit

    def _pieces(self, chunk: bytes) -> Iterator[bytes]:
        return self._through(0, chunk)

    def _through(self, i: int, data: bytes) -> Iterator[bytes]:
        if i == len(self.stages):
            yield data
            return
        for piece in self.stages[i].pieces(data):
            yield from self._through(i + 1, piece)

    def _flush(self) -> bytes:
        out = []
        for i, stage in enumerate(self.stages):
            tail = stage.flush()
            out.append(b"".join(self._through(i + 1, tail)) if tail else b"")
        return b"".join(out)


class Inflater(Protocol):
    """What ``zlib.decompressobj()`` returns, as this module uses it: zlib documents the
    object's methods and attributes but gives its type no public name."""

    @property
    def eof(self) -> bool: ...
    @property
    def unconsumed_tail(self) -> bytes: ...
    @property
    def unused_data(self) -> bytes: ...

    def decompress(self, data: bytes, max_length: int = 0, /) -> bytes: ...


def _inflate(z: Inflater, chunk: bytes) -> Iterator[bytes]:
    """A zlib stream's output for ``chunk``, ``PIECE`` bytes at a time, up to the stream's
    end (what follows it is left in ``z.unused_data``)."""
    while True:
        out = z.decompress(chunk, PIECE)
        if out:
            yield out
        chunk = z.unconsumed_tail
        if z.eof or (not chunk and len(out) < PIECE):
            return


class Gzip(Decoder):
    """gzip, including bodies of several concatenated members (allowed by RFC 1952)."""

    def __init__(self) -> None:
        self._z = zlib.decompressobj(wbits=31)
        self._in_member = False

    def _pieces(self, chunk: bytes) -> Iterator[bytes]:
        while chunk:
            self._in_member = True
            yield from _inflate(self._z, chunk)
            if not self._z.eof:
                return
            chunk = self._z.unused_data
            self._z = zlib.decompressobj(wbits=31)
            self._in_member = False

    def _flush(self) -> bytes:
        if self._in_member:
            raise ValueError("gzip body ended inside a compressed member")
        return b""


class Deflate(Decoder):
    """``deflate`` is zlib-wrapped by the RFC and raw by many servers; the first two bytes
    tell which (a zlib header is a multiple of 31 with compression method 8)."""

    def __init__(self) -> None:
        self._head = b""
        self._z: Inflater | None = None

    def _pieces(self, chunk: bytes) -> Iterator[bytes]:
        if self._z is None:
            self._head += chunk
            if len(self._head) < 2:
                return
            b0, b1 = self._head[0], self._head[1]
            zlib_wrapped = (b0 & 0x0F) == 8 and (b0 << 8 | b1) % 31 == 0
            self._z = zlib.decompressobj(wbits=15 if zlib_wrapped else -15)
            chunk, self._head = self._head, b""
        if not self._z.eof:
            yield from _inflate(self._z, chunk)

    def _flush(self) -> bytes:
        if self._z is None:
            if self._head:
                raise ValueError("deflate body ended after one byte")
            return b""
        if not self._z.eof:
            raise ValueError("deflate body ended inside the compressed stream")
        return b""


class _Library(Decoder):
    """A third-party streaming decompressor: its errors become ``ValueError`` like zlib's,
    and a body that ends before the codec says it is finished is a cut body."""

    name: str
    errors: type[Exception]

    def __init__(self) -> None:
        self._seen = False

    def _pieces(self, chunk: bytes) -> Iterator[bytes]:
        if not chunk:
            return
        self._seen = True
        try:
            yield from self._process(chunk)
        except self.errors as e:
            raise ValueError(f"invalid {self.name} data: {e}") from e

    def _flush(self) -> bytes:
        if self._seen and not self._finished():
            raise ValueError(f"{self.name} body ended inside the compressed stream")
        return b""

    @abstractmethod
    def _process(self, chunk: bytes) -> Iterator[bytes]: ...

    def _finished(self) -> bool:
        return True


class Brotli(_Library):
    name, errors = "brotli", brotli.error

    def __init__(self) -> None:
        super().__init__()
        self._d = brotli.Decompressor()

    def _process(self, chunk: bytes) -> Iterator[bytes]:
        # What the input holds comes out over calls with empty input (brotli's rule after a
        # call stopped at the limit), until one gives nothing.
        out = self._d.process(chunk, output_buffer_limit=PIECE)
        while out:
            yield out
            if self._d.is_finished():
                return
            out = self._d.process(b"", output_buffer_limit=PIECE)

    def _finished(self) -> bool:
        return self._d.is_finished()


class _Pieces:
    """zstd's writer target: what one write decoded, ``PIECE`` bytes a write."""

    def __init__(self) -> None:
        self.out: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.out.append(bytes(data))
        return len(data)


class Zstd(_Library):
    """zstd, across frames. zstandard's decompressor takes no output bound, so the input goes
    in a few bytes at a time to a writer that hands on ``PIECE``-byte pieces. It does not say
    where a frame ends, so a body cut inside a frame is not detected here (the missing
    terminal event still is)."""

    name, errors = "zstd", zstandard.ZstdError

    def __init__(self) -> None:
        super().__init__()
        self._out = _Pieces()
        self._d = zstandard.ZstdDecompressor().stream_writer(self._out, write_size=PIECE)

    def _process(self, chunk: bytes) -> Iterator[bytes]:
        out, write = self._out.out, self._d.write
        for i in range(0, len(chunk), _ZSTD_IN):
            write(chunk[i:i + _ZSTD_IN])
            if out:
                yield from out
                out.clear()

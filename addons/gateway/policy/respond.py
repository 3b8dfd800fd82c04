"""Response hooks: the evaluator's rewrite or veto of what the model said, before the harness
sees it.

A hook marked ``@intercept`` with a ``Response`` parameter gets the assembled answer (a copy)
and returns ``None`` (unchanged: the answer is released byte for byte) or a ``Response`` whose
message may differ from the sampled one only by

- text parts replaced (a string content, or the text of its text parts),
- parts removed (any non-text part it keeps must be one of the message's own, in order:
  server-tool blocks, images),
- tool calls removed (the ones it keeps, unchanged and in order).

Adding or editing a tool call, changing the reasoning, the role or anything else is a hook
error: the delivered reply must be something the model could have said by saying less, so a
trainer can hold the sample against what the harness acted on. The proxy sets the finish
reason to match (a reply left without its tool calls stopped; one that kept some still calls
tools). Response stops (``@stop`` on a ``Response``) run after the hooks, on what would be
delivered. See ``addons/gateway/answer/hold.py`` for how the answer is held back meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from interceptor.addons.gateway.policy.hookrun import HookFailure, call, context, first_stop
from interceptor.addons.gateway.policy.memory import digest, kept
from interceptor.trace.hooks import HookSpec
from interceptor.trace.ids import new_id
from interceptor.trace.messages import Message, Part, Response, copied, piece_order
from interceptor.trace.model import Rewrite

if TYPE_CHECKING:
    from interceptor.addons.gateway.exchange import Exchange


@dataclass
class Verdict:
    """What the session's response hooks and stops decided for one answer."""

    delivered: Response | None = None  # None: the sampled answer, byte for byte
    hooks: list[str] = field(default_factory=list)  # the hooks that changed it
    removed: list[str] = field(default_factory=list)  # what they took out
    stop: str | None = None  # a response stop's name


def _parts(content: str | list[Part]) -> list[Part]:
    if isinstance(content, str):
        return [Part(text=content)] if content else []
    return list(content)


def _subsequence(kept_items: list, of: list) -> list[int] | None:
    """The indices of ``of`` that ``kept_items`` keeps, in order, or None if it is not a
    subsequence of it."""
    out, j = [], 0
    for item in kept_items:
        while j < len(of) and of[j] != item:
            j += 1
        if j == len(of):
            return None
        out.append(j)
        j += 1
    return out


def check(spec: HookSpec, before: Message, after: Message) -> list[str]:
    """What ``spec`` removed from ``before`` (``content[k]``, ``tool_calls[k]``); HookFailure
    for a change a response hook may not make."""
    if not isinstance(after, Message):
        raise HookFailure(spec, "a response hook's Response needs a message")
    if after.role != before.role:
        raise HookFailure(spec, "a response hook may not change the reply's role")
    if after.reasoning != before.reasoning:
        raise HookFailure(spec, "a response hook may not change the reasoning")
    for name in ("tool_call_id", "name"):
        if getattr(after, name) != getattr(before, name):
            raise HookFailure(spec, f"a response hook may not change the reply's {name}")
    calls = _subsequence(after.tool_calls, before.tool_calls)
    if calls is None:
        raise HookFailure(spec, "a response hook may remove tool calls, not add or edit them")
    old, new = _parts(before.content), _parts(after.content)
    others = _subsequence([p for p in new if p.type != "text"], [p for p in old if p.type != "text"])
    if others is None:
        raise HookFailure(spec, "a response hook may keep or remove the reply's non-text parts, not add or edit them")
    removed = [f"tool_calls[{k}]" for k in range(len(before.tool_calls)) if k not in calls]
    kinds = [k for k, p in enumerate(old) if p.type != "text"]
    removed += [f"content[{kinds[k]}]" for k in range(len(kinds)) if k not in others]
    return removed


def _order(before: Message, after: Message) -> list | None:
    """``before.order`` for what ``after`` kept (the pieces left, in the model's order)."""
    if before.order is None:
        return None
    counts = {"reasoning": len(after.reasoning), "content": len(_parts(after.content)),
              "tool_call": len(after.tool_calls)}
    tags = []
    for tag in before.order:
        if counts[tag] > 0:
            counts[tag] -= 1
            tags.append(tag)
    for tag in ("reasoning", "content", "tool_call"):
        tags += [tag] * counts[tag]
    return piece_order(tags)


def delivered_response(sampled: Response, message: Message) -> Response:
    """The answer the harness gets: the sampled one's id, model and usage, the hook's message,
    a finish reason that fits it, and none of the token fields the proxy collects."""
    finish, native = sampled.finish_reason, sampled.native_finish_reason
    if message.tool_calls and finish != "tool_calls":
        finish, native = "tool_calls", None
    elif not message.tool_calls and finish == "tool_calls":
        finish, native = "stop", None
    return sampled.model_copy(update={
        "message": message, "finish_reason": finish, "native_finish_reason": native,
        "prompt_token_ids": None, "token_ids": None, "logprobs": None,
        "choices": [c.model_copy(update={"token_ids": None, "logprobs": None}) for c in sampled.choices],
    })


async def decide(ex: Exchange, sampled: Response, endpoint: str) -> Verdict:
    """Run the session's response hooks, then its response stops. Raises HookFailure."""
    hooks = ex.session.hooks
    ctx = context(ex, endpoint)
    verdict = Verdict()
    current = sampled.message
    try:
        for spec in hooks.response:
            given = sampled.model_copy(deep=True)  # (an update= value would not be copied)
            given.message = current.model_copy(deep=True)
            result = await call(spec, ctx, given)
            if result is None:
                continue
            if not isinstance(result, Response):
                raise HookFailure(spec, f"a response hook returns a Response or None, not {type(result).__name__}")
            after = result.message
            check(spec, sampled.message, after)
            if after != current:
                verdict.hooks.append(spec.name)
                current = after
        if current != sampled.message:
            current = current.model_copy(update={"order": _order(sampled.message, current)})
            verdict.removed = check(hooks.response[0], sampled.message, current)
            verdict.delivered = delivered_response(sampled, current)
        if hooks.response_stops:
            # A copy: the answer is what the harness gets and the trace records as sampled.
            verdict.stop = await first_stop(hooks.response_stops, ctx, copied(verdict.delivered or sampled))
    finally:
        ex.session.record_metrics(ctx.metrics)
    return verdict


def rewrite_record(ex: Exchange, sampled: Response, verdict: Verdict) -> Rewrite:
    """The ``rewrite`` record of a replaced reply (direction ``response``); the recorder names
    its delivered and sampled nodes when the turn is committed."""
    before, size_before = digest(sampled.message.content)
    delivered = verdict.delivered.message
    after, size_after = digest(delivered.content)
    keep = ex.session.memory.keep_bytes
    original, cut = kept(sampled.message.content, keep) if keep > 0 else (None, size_before > 0)
    return Rewrite(
        direction="response", by="hook", id=new_id(), call=ex.call_id or None,
        hooks=verdict.hooks, target="assistant", what="reply", message="the model's reply",
        digest_before=before, digest_after=after, size_before=size_before, size_after=size_after,
        original=original, original_truncated=cut, removed=verdict.removed,
    )

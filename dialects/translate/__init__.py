"""Translation between wire formats: a harness on one API, an upstream that serves another.

The people who train inside harnesses serve their policy with vLLM or SGLang, which speak
Chat Completions; Claude Code speaks Messages. A ``Translation`` carries one harness dialect
(``source``) to one upstream dialect (``target``) and back: the request body, the answer as
JSON, the answer as a stream one event at a time (``events``: no buffering beyond the event
in flight), and the upstream's error re-shaped into the harness's (status and headers stay
the flow's). What one side cannot express is returned as an ``Override`` with reason
``translation`` and goes on the call's record; nothing is dropped without saying so.

The record of a translated turn is the answer as the harness received it (``recorded``), so
the harness's restatement next turn hashes equal to it, with the upstream's token ids,
prompt ids and logprobs, which are what the model produced for exactly the translated
request.

This package depends on the dialects only (and, through them, on ``trace``).
"""

from __future__ import annotations

from interceptor.dialects.translate.anthropic_chat import ANTHROPIC_CHAT
from interceptor.dialects.translate.base import TRANSLATION, EventTranslator, Translation
from interceptor.dialects.translate.gemini_chat import GEMINI_CHAT
from interceptor.dialects.translate.responses_chat import RESPONSES_CHAT

__all__ = ["TRANSLATION", "EventTranslator", "Translation", "pairs", "translation"]

_PAIRS: dict[tuple[str, str], Translation] = {
    (t.source.name, t.target.name): t for t in (ANTHROPIC_CHAT, RESPONSES_CHAT, GEMINI_CHAT)}


def translation(source: str, target: str) -> Translation | None:
    """The translation from the harness's dialect ``source`` to the upstream's ``target``,
    or None when there is none (the request is then refused, never forwarded)."""
    return _PAIRS.get((source, target))


def pairs() -> list[tuple[str, str]]:
    """Every ``(harness dialect, upstream dialect)`` the proxy translates."""
    return sorted(_PAIRS)

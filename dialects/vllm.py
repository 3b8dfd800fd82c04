"""vLLM's and SGLang's token fields over the OpenAI formats, asked for by ``collect_tokens``.

- Chat Completions (vLLM >= 0.10.2, SGLang): ``return_token_ids`` and ``logprobs`` in the
  request; the answer's ``prompt_token_ids`` (the body, or a stream's first chunk) and each
  choice's ``token_ids`` and ``logprobs`` (vllm/entrypoints/openai/protocol.py,
  ChatCompletionResponse and ChatCompletionStreamResponse).
- Responses (vLLM's own ``/v1/responses``): ``enable_response_messages``; the answer's
  ``input_messages`` / ``output_messages`` (on the response object; each event's
  ``response``), see dialects/responses.py.

What the request gets and where the answer carries them is here; taking them out of a
stream event by event is ``tokens.EventStrip``'s.
"""

from __future__ import annotations

import json
from typing import Any

from interceptor.dialects import prompt_ids
from interceptor.dialects.body import scan_value
from interceptor.dialects.tokens import TokenFields, cut_arrays, without

HINT = "use vLLM >= 0.10.2 (or SGLang) as the upstream"

_TOKEN_IDS = b'"token_ids":'
_LOGPROBS = b'"logprobs":'
_LOGPROBS_TEXT = _LOGPROBS.decode()
_NON_EMPTY_DELTA = b'"delta":{"'
_JSON_SPACE = frozenset(" \t\r\n")


class ChatTokens(TokenFields):
    """Chat Completions' fields: ``return_token_ids`` drops ``prompt_token_ids`` and each
    choice's ``token_ids``; ``logprobs`` sets each choice's ``logprobs`` back to null."""

    keys = ("return_token_ids", "logprobs")
    proof = "prompt_token_ids"
    hint = HINT
    quoted = ('"token_ids"', '"logprobs"')

    def touches(self, block: bytes) -> bool:
        """Whether an SSE event's bytes may carry what was added (a cheap test first)."""
        return b"token_ids" in block or (self.logprobs and b"logprobs" in block)

    def strip(self, obj: dict[str, Any]) -> bool:
        """Remove what was added from one ChatCompletion body or chunk, in place; True if
        anything was there."""
        found = False
        if self.token_ids and "prompt_token_ids" in obj:
            del obj["prompt_token_ids"]
            self.removed.add("prompt_token_ids")
            found = True
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if self.token_ids and "token_ids" in choice:
                del choice["token_ids"]
                self.removed.add("choices[].token_ids")
                found = True
            if self.logprobs and choice.get("logprobs") is not None:
                choice["logprobs"] = None
                self.removed.add("choices[].logprobs")
                found = True
        return found

    def stripped(self, payload: bytes) -> dict[str, Any] | None:
        """The body or chunk ``payload`` without what was added, or None when it carries
        none of it (or is no JSON object): then it goes on as it came."""
        cut = False
        if self.token_ids:
            payload, cut = cut_prompt_ids(payload)
        try:
            obj = json.loads(payload)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        if cut:
            self.removed.add("prompt_token_ids")
        return obj if self.strip(obj) or cut else None

    def cut(self, payload: bytes) -> bytes | None:
        """``stripped`` done on the bytes, for the usual vLLM chunk (a piece of text, its
        token ids and logprobs): each ``"token_ids":[...]`` cut out, each ``"logprobs":``
        value set to ``null``, the rest of the upstream's bytes as they came: a fraction of
        what parsing the chunk and writing it again costs per event (``bench/pipeline.py
        --collect``). The keys are matched in the raw text because a quote inside a JSON
        string is always escaped; Chat puts both only on a choice. None for any other chunk:
        one that may exist only to carry ids (no choice with a non-empty delta), one that is
        not UTF-8, a value the scanner cannot read; the JSON path decides those. The
        payload itself when there is nothing to take out."""
        removed: list[str] = []
        out = payload
        if self.token_ids:
            out, cut = cut_prompt_ids(out)
            if cut:
                removed.append("prompt_token_ids")
            ids = cut_arrays(out, _TOKEN_IDS)
            if ids is None or prompt_ids.KEY in ids[0]:
                return None  # a value that is no flat array: the JSON path removes it
            out, cut = ids
            if cut:
                removed.append("choices[].token_ids")
        if _NON_EMPTY_DELTA not in out:
            return None
        if self.logprobs and _LOGPROBS in out:
            try:
                text = out.decode("utf-8")
            except UnicodeDecodeError:
                return None
            pieces, pos = [], 0
            while (k := text.find(_LOGPROBS_TEXT, pos)) >= 0:
                start = k + len(_LOGPROBS_TEXT)
                while text[start:start + 1] in _JSON_SPACE:
                    start += 1
                try:
                    value, end = scan_value(text, start)
                except (StopIteration, ValueError):
                    return None
                if value is not None:
                    pieces += [text[pos:start], "null"]
                    pos = end
                    if "choices[].logprobs" not in removed:
                        removed.append("choices[].logprobs")
                else:
                    pieces.append(text[pos:end])
                    pos = end
            if pos:
                out = ("".join(pieces) + text[pos:]).encode("utf-8")
        if not removed:
            return payload
        self.removed.update(removed)
        return out

    def only_carrier(self, obj: dict[str, Any]) -> bool:
        """A chunk that, stripped, says nothing: vLLM sends one per token the tool or reasoning
        parser held back, only because token ids were asked for (empty delta, no finish)."""
        if not self.token_ids:
            return False
        choices = obj.get("choices")
        if not choices or obj.get("usage") or obj.get("error"):
            return False
        return all(isinstance(c, dict) and not c.get("delta") and c.get("finish_reason") is None
                   and c.get("logprobs") is None for c in choices)


class ResponsesTokens(TokenFields):
    """vLLM's Responses route (``enable_response_messages``, see dialects/responses.py): the
    token ids come as ``input_messages`` / ``output_messages`` on the response object (the
    JSON body; each event's ``response``, lists on the terminal one); both go."""

    keys = ("enable_response_messages",)
    proof = "input_messages"
    hint = HINT
    quoted = ('"input_messages"', '"output_messages"')
    KEYS = ("input_messages", "output_messages")

    def touches(self, block: bytes) -> bool:
        return b"_messages" in block

    def strip(self, obj: dict[str, Any]) -> bool:
        target = obj.get("response") if isinstance(obj.get("response"), dict) else obj
        found = False
        for key in self.KEYS:
            if self.token_ids and key in target:
                del target[key]
                self.removed.add(key)
                found = True
        return found

    def cut(self, payload: bytes) -> bytes | None:
        return None  # the token arrays are nested in the response object: the JSON path


def cut_prompt_ids(payload: bytes) -> tuple[bytes, bool]:
    """``payload`` without its ``prompt_token_ids`` array, cut from the bytes unparsed: for a
    long conversation it is most of vLLM's first event (larger than the prompt's text), and
    parsing and re-dumping it would cost the event loop that much work per turn. Only
    a flat array is cut (``prompt_ids.span``); anything else is left to the JSON path."""
    where = prompt_ids.span(payload)
    if where is None:
        return payload, False
    before, after = without(payload, where[0], where[2])
    return before + after, True

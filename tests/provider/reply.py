"""What a test asks the simulator to answer: `Reply` and `ToolCall`.

One `Reply` describes one provider answer in dialect-neutral terms (text, tool calls,
reasoning, usage, timing, failure modes). The dialect modules turn it into the wire format
of whichever endpoint the request hit, so one script works unchanged against Chat
Completions, Responses and Messages; a test that needs a dialect-specific value
(`finish_reason="pause_turn"`) passes the native value and it goes through untouched.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from . import tokens


@dataclass
class ToolCall:
    """One tool call the model makes.

    `arguments` is a dict (serialised compactly, as the providers do), a raw string
    (sent verbatim, so a test can send malformed JSON), or a list of strings (the exact
    fragments to stream). `type="custom"` makes a Responses `custom_tool_call` whose
    freeform `input` is `arguments` as text; the other dialects treat it as a function.
    """

    name: str
    arguments: Mapping[str, Any] | str | Sequence[str] = field(default_factory=dict)
    id: str | None = None
    type: str = "function"

    def arguments_text(self) -> str:
        if isinstance(self.arguments, str):
            return self.arguments
        if isinstance(self.arguments, Mapping):
            return json.dumps(self.arguments, separators=(",", ":"), ensure_ascii=False)
        return "".join(self.arguments)

    def fragments(self) -> list[str]:
        """The pieces the arguments stream in; a list given by the test wins."""
        if isinstance(self.arguments, (str, Mapping)):
            return tokens.split(self.arguments_text())
        return list(self.arguments)

    def arguments_object(self) -> Any:
        """The arguments as a JSON value (Anthropic's `input`); unparsable text stays text."""
        if isinstance(self.arguments, Mapping):
            return dict(self.arguments)
        try:
            return json.loads(self.arguments_text() or "{}")
        except ValueError:
            return self.arguments_text()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ToolCall:
        return cls(**_known(cls, data))


@dataclass
class Reply:
    """One scripted answer; every field has a default so `Reply(text="hi")` is enough.

    Content (emitted in the providers' order: reasoning, text/refusal, tool calls):
      text            str, or a list of str = the exact deltas to stream. None (with no
                      other content) means "echo the last user message".
      tool_calls      list of ToolCall (or dicts with the same keys).
      reasoning       thinking text (Anthropic `thinking` block, Responses reasoning
                      summary, chat `reasoning_content` as vLLM sends it); str or deltas.
      signature       Anthropic thinking signature (default: derived from the text).
      encrypted_content  Responses reasoning `encrypted_content` (default: derived,
                      sent when the request includes `reasoning.encrypted_content`).
      refusal         chat/Responses refusal text; Anthropic sends it as text with
                      stop_reason `refusal`.
      finish_reason   "stop" | "length" | "tool_calls" | "refusal" | "failed", mapped to
                      each dialect, or any native value (`end_turn`, `incomplete`, ...)
                      which is sent as is. Default: tool calls -> tool_calls, else stop.
      model           model name in the answer (default: the request's).
    Usage (default: counted with `tokens.split` from the request and the reply):
      input_tokens, output_tokens, cached_tokens (cache reads), cache_creation_tokens,
      reasoning_tokens.
    Token-level data (vLLM mode, and OpenAI `logprobs`):
      token_ids       completion token ids, one per streamed piece (reasoning, text,
                      refusal, then tool-call fragments); prompt_token_ids likewise for
                      the prompt; logprobs one float per piece.
    Timing and failure:
      delay           seconds slept between SSE events (WebSocket frames); a list: the gap
                      before each event in turn (the first entry before the second event).
      first_byte_delay seconds slept before the status line.
      status          >= 400 answers with the dialect's error body (error_type,
                      error_message, error_code, error_param override its fields; error_body replaces
                      it whole). retry_after / should_retry set `retry-after` /
                      `x-should-retry` (Anthropic gets `x-should-retry` by default, as
                      the real API sends it).
      cut_after       send only this many SSE events (JSON: this many body bytes), then
                      drop the connection without the terminal chunk.
      error_after     after this many SSE events send the dialect's `error` event and
                      end the stream.
      hang_up         close the connection without answering (after first_byte_delay), as
                      an upstream that dies mid-request or a load balancer that drops it does.
      pause_before    with resume (a threading.Event): an SSE stream waits before this
                      event until the test sets it (at most a minute), so a test holds a
                      stream open mid-way on an event, not a delay.
    Bytes on the wire:
      headers         extra response headers.
      raw             bytes/str sent verbatim as the body, or a pathlib.Path (any
                      os.PathLike) of a file to send; SSE (by content_type, or a .sse
                      file) is sent event by event so delay/cut_after still apply.
      content_type    content type for `raw` (default: from the file suffix).
      content_encoding "gzip" | "br" | "zstd" | "deflate"; SSE is compressed and
                      flushed event by event.
      encoded         `raw` is already in `content_encoding` (a compression bomb the test
                      built): sent as it is, chunked, at most 1 MiB a chunk.
      pad             Anthropic SSE JSON padded with spaces before its last brace, as
                      the real API does (default True for Anthropic streams).
      chunked         JSON sent chunked (default: 2xx chunked, errors Content-Length,
                      as in the captures).
      framing         how a chunked body is put on the wire (JSON and SSE): "extensions"
                      (chunk extensions on every chunk, trailers after the last, RFC 9112
                      7.1.1-7.1.2), "split" (each chunk header, chunk and CRLF cut in pieces
                      written apart, so a client reads them apart), "close" (no chunking nor
                      length: the body ends when the connection closes, RFC 9112 6.3 item 8),
                      "burst" (every chunk, one per event as usual, and the last chunk held
                      and written at once: the events reach the reader in one read, as a fast
                      model's reach a busy proxy; `delay` then only postpones the body).
    """

    text: str | Sequence[str] | None = None
    tool_calls: Sequence[ToolCall] = ()
    reasoning: str | Sequence[str] | None = None
    signature: str | None = None
    encrypted_content: str | None = None
    refusal: str | Sequence[str] | None = None
    finish_reason: str | None = None
    model: str | None = None

    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int = 0
    cache_creation_tokens: int = 0
    reasoning_tokens: int | None = None

    token_ids: Sequence[int] | None = None
    prompt_token_ids: Sequence[int] | None = None
    logprobs: Sequence[float] | None = None

    delay: float | Sequence[float] = 0.0
    first_byte_delay: float = 0.0
    status: int = 200
    error_type: str | None = None
    error_message: str | None = None
    error_code: str | None = None
    error_param: str | None = None
    error_body: Any = None
    retry_after: float | str | None = None
    should_retry: bool | None = None
    cut_after: int | None = None
    error_after: int | None = None
    hang_up: bool = False
    pause_before: int | None = None
    resume: Any = None

    headers: Mapping[str, str] = field(default_factory=dict)
    raw: bytes | str | os.PathLike | None = None
    content_type: str | None = None
    content_encoding: str | None = None
    encoded: bool = False
    pad: bool | None = None
    chunked: bool | None = None
    framing: str | None = None

    def __post_init__(self) -> None:
        self.tool_calls = [
            tc if isinstance(tc, ToolCall) else ToolCall.from_dict(tc) for tc in self.tool_calls
        ]
        if self.content_encoding not in (None, "identity", "gzip", "br", "zstd", "deflate"):
            raise ValueError(f"unknown content_encoding {self.content_encoding!r}")
        if self.framing not in (None, "extensions", "split", "close", "burst"):
            raise ValueError(f"unknown framing {self.framing!r}")
        if self.framing == "burst" and self.cut_after is not None:
            raise ValueError('framing "burst" writes the body with its last chunk, which a cut never sends: '
                             "cut_after would send none of it")

    def gap(self, index: int) -> float:
        """Seconds to sleep before event ``index`` (none before the first)."""
        if not index or not self.delay:
            return 0.0
        if isinstance(self.delay, (int, float)):
            return float(self.delay)
        return float(self.delay[index - 1]) if index - 1 < len(self.delay) else 0.0

    @property
    def is_empty(self) -> bool:
        """No content at all: the simulator fills in its default (echo) text."""
        return (
            self.text is None
            and not self.tool_calls
            and self.reasoning is None
            and self.refusal is None
            and self.raw is None
        )

    def replace(self, **changes: Any) -> Reply:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Reply:
        """Build from JSON (script files of the standalone server).

        `raw` there is text sent verbatim; `raw_file` names a file.
        """
        data = dict(data)
        raw_file = data.pop("raw_file", None)
        reply = cls(**_known(cls, data))
        if raw_file is not None:
            reply.raw = pathlib.Path(raw_file)
        return reply

    @classmethod
    def fixture(cls, path: str | os.PathLike, **changes: Any) -> Reply:
        """Serve a capture file verbatim (content type from its suffix)."""
        return cls(raw=pathlib.Path(path), **changes)

    @classmethod
    def from_exchange(cls, exchange: Mapping[str, Any]) -> Reply:
        """The response half of one `anthropic-exchanges/*.json` entry, as it was sent.

        JSON bodies were stored parsed; compact re-serialisation gives back the
        original bytes (it reproduces the captured Content-Length). SSE bodies were
        stored as text and go out verbatim, padding included.
        """
        response = exchange["response"]
        headers = {
            k: v
            for k, v in response.get("headers", {}).items()
            if k.lower() not in _HOP_BY_HOP
        }
        body = response.get("body")
        if isinstance(body, str):
            raw = body.encode()
        else:
            raw = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        content_type = headers.pop("content-type", None) or "application/json"
        return cls(
            status=int(response.get("status_code", 200)),
            headers=headers,
            raw=raw,
            content_type=content_type,
            chunked="content-length" not in {k.lower() for k in response.get("headers", {})},
        )


# Framing headers are recomputed for our own connection; copying them would lie.
_HOP_BY_HOP = {"content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive"}


def _known(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    return dict(data)

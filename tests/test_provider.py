"""The provider simulator speaks each wire format like the real provider.

Every other test trusts `tests/provider/` to stand in for OpenAI and Anthropic, so it is
checked two ways: the real `openai` and `anthropic` SDKs (and their `.stream()` helpers)
must accept everything it sends and end up with the scripted content, and its bytes must
have the framing and key sets of the real captures in `tests/fixtures/`.
"""

from __future__ import annotations

import gzip
import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import zlib
from dataclasses import dataclass, field
from typing import Any

import anthropic
import openai
import pytest

try:
    from tests.provider import ProviderSimulator, Reply, ToolCall
    from tests.waiting import wait_until
except ImportError:  # run from another directory: put the repository root on the path
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from tests.provider import ProviderSimulator, Reply, ToolCall
    from tests.waiting import wait_until

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = pathlib.Path(os.environ.get("INTERCEPTOR_FIXTURES", ROOT / "tests" / "fixtures"))

CLAUDE = "claude-sim-test"  # a name the SDK has no deprecation notice for
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_TOOL_OPENAI = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
    },
}


@pytest.fixture
def sim():
    with ProviderSimulator() as s:
        yield s


@pytest.fixture
def oai(sim):
    return openai.OpenAI(base_url=sim.url("/v1"), api_key="sk-test", max_retries=0)


@pytest.fixture
def ant(sim):
    return anthropic.Anthropic(base_url=sim.base_url, api_key="sk-ant-test", max_retries=0)


# ----------------------------------------------------------------- raw HTTP client
# The SDKs hide framing; these tests need the chunks, their timing and a torn body.


@dataclass
class Raw:
    status: int
    headers: dict[str, str]
    header_lines: list[str] = field(default_factory=list)  # as sent, repeats included
    chunks: list[tuple[float, bytes]] = field(default_factory=list)  # (arrival, payload)
    complete: bool = False  # saw the terminating 0-chunk (or the whole Content-Length)

    @property
    def body(self) -> bytes:
        return b"".join(c for _, c in self.chunks)


def raw_request(sim: ProviderSimulator, path: str, body: Any = None, headers: dict | None = None, method: str = "POST") -> Raw:
    data = json.dumps(body).encode() if body is not None else b""
    head = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{sim.port}", "Connection: close",
            "Content-Type: application/json", f"Content-Length: {len(data)}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    sock = socket.create_connection(("127.0.0.1", sim.port), timeout=10)
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + data)
    reader = sock.makefile("rb")
    status = int(reader.readline().split()[1])
    hdrs: dict[str, str] = {}
    lines = []
    while (line := reader.readline()) not in (b"\r\n", b""):
        lines.append(line.decode().strip())
        name, _, value = lines[-1].partition(":")
        hdrs[name.strip().lower()] = value.strip()
    raw = Raw(status, hdrs, lines)
    try:
        if hdrs.get("transfer-encoding") == "chunked":
            while True:
                size_line = reader.readline()
                if not size_line:
                    break
                size = int(size_line.strip(), 16)
                if size == 0:
                    raw.complete = True
                    break
                payload = reader.read(size)
                reader.readline()
                raw.chunks.append((time.monotonic(), payload))
        else:
            length = int(hdrs.get("content-length", 0))
            payload = reader.read(length)
            raw.chunks.append((time.monotonic(), payload))
            raw.complete = len(payload) == length
    finally:
        sock.close()
    return raw


def sse_events(body: bytes) -> list[tuple[str | None, str]]:
    """(event name, data) pairs of a well-formed SSE body; asserts the framing."""
    out = []
    assert body.endswith(b"\n\n"), body[-40:]
    for block in body.decode().split("\n\n")[:-1]:
        lines = block.split("\n")
        name = None
        if lines[0].startswith("event: "):
            name = lines.pop(0)[len("event: "):]
        assert len(lines) == 1 and lines[0].startswith("data: "), block
        out.append((name, lines[0][len("data: "):]))
    return out


def shape(value: Any) -> Any:
    """Keys and value types, recursively: what "same key sets" means below."""
    if isinstance(value, dict):
        return tuple(sorted((k, shape(v)) for k, v in value.items()))
    if isinstance(value, list):
        return ("list", tuple(sorted({repr(shape(v)) for v in value})))
    return type(value).__name__


# ---------------------------------------------------------------- chat completions


def test_chat_json_text_tool_calls_and_usage(sim, oai):
    sim.script(
        Reply(text="It is sunny.", input_tokens=11, output_tokens=4),
        Reply(tool_calls=[ToolCall("get_weather", {"location": "Paris"}, id="call_1"),
                          ToolCall("get_time", '{"tz": "CET"}')]),
    )
    first = oai.chat.completions.create(model="gpt-4o", messages=USER)
    assert first.choices[0].message.content == "It is sunny."
    assert first.choices[0].finish_reason == "stop"
    assert (first.usage.prompt_tokens, first.usage.completion_tokens, first.usage.total_tokens) == (11, 4, 15)
    assert first.model == "gpt-4o" and first.object == "chat.completion"

    second = oai.chat.completions.create(model="gpt-4o", messages=USER, tools=[WEATHER_TOOL_OPENAI])
    calls = second.choices[0].message.tool_calls
    assert second.choices[0].finish_reason == "tool_calls"
    assert second.choices[0].message.content is None
    assert [(c.id, c.function.name) for c in calls][0] == ("call_1", "get_weather")
    assert json.loads(calls[0].function.arguments) == {"location": "Paris"}
    assert calls[1].function.arguments == '{"tz": "CET"}'  # raw strings go out verbatim
    assert second.usage.completion_tokens > 0


def test_chat_stream_helper_assembles_text_tool_calls_and_usage(sim, oai):
    sim.script(Reply(text="Checking.", tool_calls=[ToolCall("get_weather", {"location": "Paris"})],
                     input_tokens=30, output_tokens=9))
    with oai.chat.completions.stream(model="gpt-4o", messages=USER, tools=[WEATHER_TOOL_OPENAI],
                                     stream_options={"include_usage": True}) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert message.content == "Checking."
    assert message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments) == {"location": "Paris"}
    assert final.choices[0].finish_reason == "tool_calls"
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (30, 9)
    assert {"content.delta", "tool_calls.function.arguments.delta", "chunk"} <= kinds


def test_chat_stream_n_choices_refusal_and_reasoning(sim, oai):
    sim.script(Reply(text="Same answer"), Reply(refusal="I can't help with that."),
               Reply(text="42", reasoning="Think first."))
    stream = oai.chat.completions.create(model="gpt-4o", messages=USER, n=2, stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {0: "Same answer", 1: "Same answer"}

    with oai.chat.completions.stream(model="gpt-4o", messages=USER) as stream:
        refused = stream.get_final_completion()
    assert refused.choices[0].message.refusal == "I can't help with that."
    assert refused.choices[0].message.content is None

    body = oai.chat.completions.with_raw_response.create(model="gpt-4o", messages=USER).http_response.json()
    assert body["choices"][0]["message"]["reasoning_content"] == "Think first."
    assert body["choices"][0]["message"]["content"] == "42"


def test_chat_stream_framing_and_key_sets_match_capture(sim):
    """A tool-call-only answer has exactly the chunk shapes of `2018feb66ae1.sse`."""
    fixture = (FIXTURES / "openai-chat-sse" / "2018feb66ae1.sse").read_bytes()
    sim.script(Reply(tool_calls=[ToolCall("get_weather", {"city": "New York City"})]))
    raw = raw_request(sim, "/v1/chat/completions", {"model": "gpt-4o", "messages": USER, "stream": True,
                                                    "stream_options": {"include_usage": True}})
    assert raw.status == 200 and raw.complete
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.headers["transfer-encoding"] == "chunked"
    ours, theirs = sse_events(raw.body), sse_events(fixture)
    assert all(name is None for name, _ in ours)  # chat SSE has no event: lines
    assert ours[-1][1] == theirs[-1][1] == "[DONE]"
    our_shapes = [shape(json.loads(d)) for _, d in ours[:-1]]
    their_shapes = [shape(json.loads(d)) for _, d in theirs[:-1]]
    assert set(our_shapes) == set(their_shapes)
    assert our_shapes[0] == their_shapes[0] and our_shapes[-2:] == their_shapes[-2:]
    # One SSE event per HTTP chunk, so a client sees each as it is written.
    assert [c for _, c in raw.chunks] == [f"data: {d}\n\n".encode() for _, d in ours]


def test_chat_logprobs_and_vllm_token_ids(sim, oai):
    """vLLM mode: prompt_token_ids once, token_ids per choice (JSON) or per chunk
    (stream) that add up to the same ids, content logprobs per token."""
    extra = {"return_token_ids": True, "logprobs": True, "top_logprobs": 2}
    sim.script(Reply(text="Hello there!"), Reply(text="Hello there!"),
               Reply(text=["Hi", "!"], token_ids=[7, 8], logprobs=[-0.5, -0.25], prompt_token_ids=[1, 2, 3]))
    body = oai.chat.completions.with_raw_response.create(
        model="qwen", messages=USER, extra_body={"return_token_ids": True}, logprobs=True, top_logprobs=2
    ).http_response.json()
    choice = body["choices"][0]
    assert len(body["prompt_token_ids"]) == body["usage"]["prompt_tokens"]
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"] == 3
    assert "".join(t["token"] for t in choice["logprobs"]["content"]) == "Hello there!"
    assert len(choice["logprobs"]["content"][0]["top_logprobs"]) == 2

    raw = raw_request(sim, "/v1/chat/completions", {"model": "qwen", "messages": USER, "stream": True, **extra})
    chunks = [json.loads(d) for _, d in sse_events(raw.body)[:-1]]
    assert chunks[0]["prompt_token_ids"] == body["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == choice["token_ids"]
    streamed = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["logprob"] for e in streamed] == [e["logprob"] for e in choice["logprobs"]["content"]]

    explicit = oai.chat.completions.with_raw_response.create(
        model="qwen", messages=USER, extra_body={"return_token_ids": True}, logprobs=True
    ).http_response.json()
    assert explicit["prompt_token_ids"] == [1, 2, 3]
    assert explicit["choices"][0]["token_ids"] == [7, 8]
    assert [e["logprob"] for e in explicit["choices"][0]["logprobs"]["content"]] == [-0.5, -0.25]


def test_token_ids_must_align_with_pieces(sim):
    with pytest.raises(ValueError, match="one per piece"):
        sim.script(Reply(text="three little pieces", token_ids=[1]))


# ----------------------------------------------------------------------- responses


def test_responses_json_function_call_reasoning_and_usage(sim, oai):
    sim.script(Reply(text="Let me look.", reasoning="The user wants weather.",
                     tool_calls=[ToolCall("get_weather", {"location": "Paris"}, id="call_w")],
                     input_tokens=50, output_tokens=20, reasoning_tokens=6, cached_tokens=8))
    response = oai.responses.create(model="gpt-5", input="weather?", include=["reasoning.encrypted_content"])
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message", "function_call"]
    assert response.output[0].summary[0].text == "The user wants weather."
    assert response.output[0].encrypted_content.startswith("gAAAAAB")
    assert response.output_text == "Let me look."
    assert (response.output[2].name, response.output[2].call_id) == ("get_weather", "call_w")
    assert json.loads(response.output[2].arguments) == {"location": "Paris"}
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (50, 20, 70)
    assert usage.output_tokens_details.reasoning_tokens == 6
    assert usage.input_tokens_details.cached_tokens == 8
    assert response.status == "completed"


def test_responses_stream_helper_with_custom_tool_call(sim, oai):
    sim.script(Reply(text="Patching.", reasoning="Plan.", encrypted_content="opaque",
                     tool_calls=[ToolCall("get_weather", {"location": "Paris"}),
                                 ToolCall("apply_patch", "*** Begin Patch\n*** End Patch", type="custom")]))
    with oai.responses.stream(model="gpt-5", input="fix it") as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert {"response.reasoning_summary_text.delta", "response.output_text.delta",
            "response.function_call_arguments.delta", "response.custom_tool_call_input.delta"} <= set(kinds)
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call", "custom_tool_call"]
    assert final.output[0].encrypted_content == "opaque"
    assert final.output_text == "Patching."
    assert final.output[3].input == "*** Begin Patch\n*** End Patch"
    assert final.usage.output_tokens > 0


def test_responses_stream_framing_and_sequence_numbers(sim):
    sim.script(Reply(text="Hi there", tool_calls=[ToolCall("f", {"a": 1})]))
    raw = raw_request(sim, "/v1/responses", {"model": "gpt-5", "input": "hi", "stream": True})
    events = sse_events(raw.body)
    data = [json.loads(d) for _, d in events]
    assert [name for name, _ in events] == [d["type"] for d in data]  # event: line == type
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert [d["type"] for d in data[:3]] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert data[-1]["type"] == "response.completed"
    assert data[-1]["response"]["usage"]["total_tokens"] > 0
    assert all(list(d)[:2] == ["type", "sequence_number"] for d in data)


def test_responses_incomplete_and_failed_terminals(sim, oai):
    sim.script(Reply(text="cut short", finish_reason="length"), Reply(text="x", finish_reason="failed"))
    raw = raw_request(sim, "/v1/responses", {"model": "gpt-5", "input": "hi", "stream": True})
    last = json.loads(sse_events(raw.body)[-1][1])
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    failed = oai.responses.create(model="gpt-5", input="hi")
    assert failed.status == "failed" and failed.error.code == "server_error"


# ----------------------------------------------------------------------- anthropic


def test_anthropic_json_thinking_text_tool_use_and_usage(sim, ant):
    sim.script(Reply(text="I'll check.", reasoning="Need the weather tool.", signature="sig-1",
                     tool_calls=[ToolCall("get_weather", {"location": "Paris"}, id="toolu_1")],
                     input_tokens=377, output_tokens=65, cached_tokens=100, cache_creation_tokens=20))
    message = ant.messages.create(model=CLAUDE, max_tokens=1024, messages=USER,
                                  thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert (message.content[0].thinking, message.content[0].signature) == ("Need the weather tool.", "sig-1")
    assert message.content[1].text == "I'll check."
    assert (message.content[2].id, message.content[2].input) == ("toolu_1", {"location": "Paris"})
    assert message.stop_reason == "tool_use"
    u = message.usage
    assert (u.input_tokens, u.output_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens) == (377, 65, 100, 20)


def test_anthropic_stream_helper(sim, ant):
    sim.script(Reply(text="Paris is sunny.", reasoning="Think.", output_tokens=12,
                     tool_calls=[ToolCall("get_weather", {"location": "Paris", "units": "c"})]))
    with ant.messages.stream(model=CLAUDE, max_tokens=1024, messages=USER,
                             extra_body={"temperature": 0.5}) as stream:
        kinds = {event.type for event in stream}
        message = stream.get_final_message()
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[0].signature  # signature_delta arrived
    assert message.content[1].text == "Paris is sunny."
    assert message.content[2].input == {"location": "Paris", "units": "c"}
    assert message.usage.output_tokens == 12
    assert {"thinking", "text", "input_json", "content_block_stop", "message_stop"} <= kinds
    assert sim.model_requests()[0].json["temperature"] == 0.5


def test_anthropic_stream_matches_capture(sim):
    """Same event sequence (runs of deltas collapsed), framing and key sets as
    `tool_use_response.sse`; usage keys and padding as the newer 200 of
    `retry-429-429-200-stream.json`."""
    fixture = (FIXTURES / "anthropic-messages-sse" / "tool_use_response.sse").read_bytes()
    sim.script(Reply(text="I'll check the current weather in Paris for you.",
                     tool_calls=[ToolCall("get_weather", {"location": "Paris"})]))
    raw = raw_request(sim, "/v1/messages?beta=true", {"model": CLAUDE, "max_tokens": 100, "messages": USER, "stream": True})
    assert raw.complete and raw.headers["content-type"].startswith("text/event-stream")
    ours, theirs = sse_events(raw.body), sse_events(fixture + b"\n\n" if not fixture.endswith(b"\n\n") else fixture)

    def collapsed(events):
        names = [n for n, _ in events]
        return [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]

    assert collapsed(ours) == collapsed(theirs)
    for name, data in ours:
        assert json.loads(data)["type"] == name  # event: line agrees with the payload

    def shapes(events):
        out = set()
        for _, data in events:
            obj = json.loads(data)
            obj.pop("usage", None)
            if "message" in obj:
                obj["message"] = {k: v for k, v in obj["message"].items() if k != "usage"}
            out.add(shape(obj))
        return out

    assert shapes(ours) == shapes(theirs)

    exchange = json.loads((FIXTURES / "anthropic-exchanges" / "retry-429-429-200-stream.json").read_text())
    newer = sse_events(exchange[2]["response"]["body"].encode())
    usage = lambda events, kind: [json.loads(d) for n, d in events if n == kind][0]  # noqa: E731
    assert set(usage(ours, "message_start")["message"]["usage"]) == set(usage(newer, "message_start")["message"]["usage"])
    assert set(usage(ours, "message_delta")["usage"]) == set(usage(newer, "message_delta")["usage"])
    # Padded like the real API (spaces before the last brace), ping left alone.
    assert all(d.endswith(" }") for n, d in ours if n != "ping")
    assert dict(ours)["ping"] == '{"type": "ping"}'


def test_anthropic_count_tokens_and_models_do_not_consume_replies(sim, oai, ant):
    sim.script(Reply(text="scripted"))
    count = ant.messages.count_tokens(model=CLAUDE, messages=USER)
    assert count.input_tokens > 0
    assert oai.responses.input_tokens.count(model="gpt-5", input="hello there").input_tokens == 2
    assert any(m.id for m in oai.models.list().data)
    assert any(m.type == "model" for m in ant.models.list().data)
    assert sim.pending() == 1
    assert ant.messages.create(model=CLAUDE, max_tokens=10, messages=USER).content[0].text == "scripted"
    assert [r.route for r in sim.model_requests()] == ["messages"]


# ------------------------------------------------------------------------- errors


def test_anthropic_error_shape_matches_capture(sim):
    exchange = json.loads((FIXTURES / "anthropic-exchanges" / "retry-429-429-200-stream.json").read_text())
    captured = exchange[0]["response"]
    sim.script(Reply(status=429))
    raw = raw_request(sim, "/v1/messages", {"model": CLAUDE, "max_tokens": 10, "messages": USER, "stream": True})
    body = json.loads(raw.body)
    assert raw.status == 429 and raw.complete
    assert shape(body) == shape(captured["body"])
    assert body["error"]["type"] == "rate_limit_error"
    assert body["request_id"] == raw.headers["request-id"]
    assert raw.headers["x-should-retry"] == captured["headers"]["x-should-retry"] == "true"
    assert raw.headers["content-type"] == captured["headers"]["content-type"]
    assert raw.headers["content-length"] == str(len(raw.body))
    assert raw.body == json.dumps(body, separators=(",", ":")).encode()  # compact, like the capture


def test_reply_headers_override_ours_whatever_their_case(sim):
    sim.script(Reply(text="x", headers={"Content-Type": "application/json; charset=utf-8", "X-Extra": "1"}))
    raw = raw_request(sim, "/v1/chat/completions", {"model": "m", "messages": USER})
    names = [line.split(":")[0].lower() for line in raw.header_lines]
    assert names.count("content-type") == 1
    assert raw.headers["content-type"] == "application/json; charset=utf-8" and raw.headers["x-extra"] == "1"


def test_openai_error_shape(sim):
    sim.script(Reply(status=400, error_message="bad model", error_code="model_not_found"))
    raw = raw_request(sim, "/v1/chat/completions", {"model": "nope", "messages": USER})
    body = json.loads(raw.body)
    assert raw.status == 400
    assert set(body) == {"error"} and list(body["error"]) == ["message", "type", "param", "code"]
    assert (body["error"]["message"], body["error"]["code"]) == ("bad model", "model_not_found")


def test_status_errors_raise_the_sdk_exception(sim, oai, ant):
    sim.script(Reply(status=429, retry_after=0), Reply(status=500), Reply(status=401))
    with pytest.raises(openai.RateLimitError):
        oai.chat.completions.create(model="gpt-4o", messages=USER)
    with pytest.raises(openai.InternalServerError):
        oai.responses.create(model="gpt-5", input="hi")
    with pytest.raises(openai.AuthenticationError):
        oai.chat.completions.create(model="gpt-4o", messages=USER, stream=True)

    sim.script(Reply(status=529), Reply(status=429), Reply(status=400, error_message="messages: bad"))
    with pytest.raises(anthropic.OverloadedError) as overloaded:
        ant.messages.create(model=CLAUDE, max_tokens=10, messages=USER)
    assert overloaded.value.body["error"]["type"] == "overloaded_error"
    with pytest.raises(anthropic.RateLimitError):
        with ant.messages.stream(model=CLAUDE, max_tokens=10, messages=USER) as stream:
            stream.get_final_message()
    with pytest.raises(anthropic.BadRequestError, match="messages: bad"):
        ant.messages.create(model=CLAUDE, max_tokens=10, messages=USER)


def test_mid_stream_error_event_after_200(sim, oai, ant):
    sim.script(Reply(text="a b c", error_after=3))
    with pytest.raises(anthropic.APIStatusError) as caught:
        with ant.messages.stream(model=CLAUDE, max_tokens=10, messages=USER) as stream:
            stream.get_final_message()
    assert caught.value.body["error"]["type"] == "overloaded_error"

    sim.script(Reply(text="a b c", error_after=2))
    with pytest.raises(openai.APIError):
        list(oai.chat.completions.create(model="gpt-4o", messages=USER, stream=True))

    sim.script(Reply(text="a b c", error_after=4))
    with oai.responses.stream(model="gpt-5", input="hi") as stream:
        kinds = [event.type for event in stream]
        assert kinds[-1] == "error"
        with pytest.raises(RuntimeError, match="response.completed"):
            stream.get_final_response()


def test_sdk_retries_through_scripted_exchange(sim):
    """The 429, 429, 200 capture served in order: the SDK retries twice, then gets the
    padded stream as it was sent."""
    replies = sim.script_exchange_file(FIXTURES / "anthropic-exchanges" / "retry-429-429-200-stream.json")
    for reply in replies:  # keep the SDK's back-off short; bodies untouched
        reply.headers = {**reply.headers, "retry-after-ms": "1"}
    client = anthropic.Anthropic(base_url=sim.base_url, api_key="k", max_retries=2)
    with client.messages.stream(model=CLAUDE, max_tokens=1024, messages=USER) as stream:
        message = stream.get_final_message()
    assert message.content[0].text == "[12345,67890]"
    seen = sim.model_requests()
    assert [r.headers["X-Stainless-Retry-Count"] for r in seen] == ["0", "1", "2"]
    assert [r.reply.status for r in seen] == [429, 429, 200]


def test_exchange_file_bodies_and_status_are_verbatim(sim, ant):
    path = FIXTURES / "anthropic-exchanges" / "tool-runner-f59a9391.json"
    captured = json.loads(path.read_text())
    sim.script_exchange_file(path)
    first = raw_request(sim, "/v1/messages?beta=true", {"model": CLAUDE, "max_tokens": 10, "messages": USER})
    assert json.loads(first.body) == captured[0]["response"]["body"]
    names = [line.split(":")[0].lower() for line in first.header_lines]
    assert names.count("server") == 1 and "request-id" not in names  # the capture's headers, not ours
    assert first.headers["cf-cache-status"] == captured[0]["response"]["headers"]["cf-cache-status"]
    with pytest.raises(anthropic.BadRequestError) as caught:
        ant.messages.create(model=CLAUDE, max_tokens=10, messages=USER)
    assert caught.value.body == captured[1]["response"]["body"]
    assert caught.value.response.headers["content-length"] == captured[1]["response"]["headers"]["content-length"]


# ----------------------------------------------------------- timing, cuts, bytes


def test_delay_spreads_events_over_time(sim, oai):
    sim.script(Reply(text="one two", delay=0.2))
    stream = oai.chat.completions.create(model="gpt-4o", messages=USER, stream=True)
    arrivals = [time.monotonic() for _ in stream]
    assert len(arrivals) == 4  # role, "one", " two", finish
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    # Three 0.2 s pauses; loose bounds so a loaded machine does not make this flaky.
    assert arrivals[-1] - arrivals[0] >= 0.45 and sum(g >= 0.1 for g in gaps) >= 2, gaps


def test_first_byte_delay(sim):
    sim.script(Reply(text="x", first_byte_delay=0.3))
    start = time.monotonic()
    raw = raw_request(sim, "/v1/chat/completions", {"model": "m", "messages": USER})
    assert raw.status == 200 and time.monotonic() - start >= 0.3


def test_cut_stream_makes_the_sdk_raise_and_the_server_survives(sim, oai, ant):
    sim.script(Reply(text="a b c d e", cut_after=3), Reply(text="a b c d e", cut_after=4))
    with pytest.raises(openai.APIConnectionError):
        list(oai.chat.completions.create(model="gpt-4o", messages=USER, stream=True))
    with pytest.raises(Exception) as caught:  # httpx's RemoteProtocolError, not wrapped by this SDK
        with ant.messages.stream(model=CLAUDE, max_tokens=10, messages=USER) as stream:
            stream.get_final_message()
    assert "incomplete chunked read" in str(caught.value)

    sim.script(Reply(text="a b c", cut_after=2))
    raw = raw_request(sim, "/v1/messages", {"model": CLAUDE, "max_tokens": 10, "messages": USER, "stream": True})
    assert not raw.complete and [n for n, _ in sse_events(raw.body)] == ["message_start", "content_block_start"]
    assert oai.chat.completions.create(model="gpt-4o", messages=USER).choices[0].message.content


def test_client_disconnect_mid_stream_is_survived(sim, oai, capfd):
    sim.script(Reply(text=" ".join(["word"] * 200), delay=0.01))
    closed = sim.connections()["closed"]
    sock = socket.create_connection(("127.0.0.1", sim.port))
    body = json.dumps({"model": "m", "messages": USER, "stream": True}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert sock.recv(100).startswith(b"HTTP/1.1 200")
    sock.close()
    # the server hits the closed socket on its next writes, and ends the connection
    wait_until(lambda: sim.connections()["closed"] > closed, 10, "the simulator ending the connection the client left")
    assert oai.chat.completions.create(model="gpt-4o", messages=USER).choices[0].message.content
    assert "Traceback" not in capfd.readouterr().err  # a hang-up is not a server error


@pytest.mark.parametrize("encoding", ["gzip", "br", "zstd", "deflate"])
def test_content_encoding_json_and_incremental_sse(sim, oai, encoding):
    sim.script(Reply(text="compressed hello", content_encoding=encoding),
               Reply(text="streamed compressed hello", content_encoding=encoding))
    assert oai.chat.completions.create(model="m", messages=USER).choices[0].message.content == "compressed hello"
    with oai.chat.completions.stream(model="m", messages=USER) as stream:
        assert stream.get_final_completion().choices[0].message.content == "streamed compressed hello"
    if encoding == "gzip":  # each chunk decodes on its own arrival: compressed incrementally
        sim.script(Reply(text="one two three", content_encoding="gzip"))
        raw = raw_request(sim, "/v1/chat/completions", {"model": "m", "messages": USER, "stream": True})
        assert raw.headers["content-encoding"] == "gzip"
        decoder = zlib.decompressobj(wbits=31)
        pieces = [decoder.decompress(c) for _, c in raw.chunks]
        assert all(p.endswith(b"\n\n") for p in pieces[:-1] if p)
        assert gzip.decompress(raw.body).endswith(b"data: [DONE]\n\n")


def test_raw_fixture_is_served_byte_for_byte(sim, oai):
    path = FIXTURES / "openai-chat-sse" / "2018feb66ae1.sse"
    sim.script(Reply.fixture(path), Reply.fixture(path))
    raw = raw_request(sim, "/v1/chat/completions", {"model": "gpt-4o", "messages": USER, "stream": True})
    assert raw.body == path.read_bytes() and raw.complete
    assert raw.headers["content-type"].startswith("text/event-stream")
    with oai.chat.completions.stream(model="gpt-4o", messages=USER) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert final.usage.total_tokens == 60


# ------------------------------------------------------------- scripting and log


def test_keyed_scripts_serve_concurrent_sessions(sim):
    sim.script(*[Reply(text=f"a{i}") for i in range(3)], key="session-a")
    sim.script(*[Reply(text=f"b{i}") for i in range(3)], key="sk-b")
    sim.script(Reply(text="for gpt-5 only"), key=lambda r: (r.json or {}).get("model") == "gpt-5")
    got: dict[str, list[str]] = {"a": [], "b": []}

    def session(name: str, client: openai.OpenAI) -> None:
        for _ in range(3):
            got[name].append(client.chat.completions.create(model="m", messages=USER).choices[0].message.content)

    a = openai.OpenAI(base_url=sim.url("/v1"), api_key="whatever", default_headers={"x-sim-key": "session-a"})
    b = openai.OpenAI(base_url=sim.url("/v1"), api_key="sk-b")
    threads = [threading.Thread(target=session, args=("a", a)), threading.Thread(target=session, args=("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert got == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1", "b2"]}
    assert b.responses.create(model="gpt-5", input="x").output_text == "for gpt-5 only"
    # Queues empty: the default echoes the last user message.
    assert a.chat.completions.create(model="m", messages=USER).choices[0].message.content == (
        "You said: What is the weather in Paris?")


def test_request_log(sim, ant):
    ant.messages.create(model=CLAUDE, max_tokens=10, messages=USER, extra_headers={"X-Custom": "1"})
    ant.messages.create(model=CLAUDE, max_tokens=10, messages=USER, extra_query={"beta": "true"})
    first, second = sim.requests
    assert (first.method, first.path, second.path) == ("POST", "/v1/messages", "/v1/messages?beta=true")
    assert first.headers["x-custom"] == first.headers["X-CUSTOM"] == "1"
    # anthropic SDK 2.x sends the key as `Authorization: Bearer`, 0.x as `x-api-key`.
    assert "sk-ant-test" in (first.headers.get("x-api-key"), first.headers.get("authorization", "")[7:])
    assert first.key == "sk-ant-test"
    assert json.loads(first.body) == first.json and first.json["model"] == CLAUDE
    assert first.time <= second.time
    assert len(sim.model_requests()) == 2
    sim.clear()
    assert sim.requests == []


def test_default_reply_template_and_callable():
    with ProviderSimulator(default=Reply(output_tokens=99)) as sim:
        client = openai.OpenAI(base_url=sim.url("/v1"), api_key="k")
        answer = client.chat.completions.create(model="m", messages=USER)
        assert answer.choices[0].message.content.startswith("You said:") and answer.usage.completion_tokens == 99
    with ProviderSimulator(default=lambda record: Reply(text=record.json["model"])) as sim:
        client = openai.OpenAI(base_url=sim.url("/v1"), api_key="k")
        assert client.chat.completions.create(model="echo-me", messages=USER).choices[0].message.content == "echo-me"


def test_unknown_route_and_bad_json(sim):
    raw = raw_request(sim, "/v1/nothing", {}, headers={"anthropic-version": "2023-06-01"})
    assert raw.status == 404 and json.loads(raw.body)["type"] == "error"
    raw = raw_request(sim, "/v1/chat/completions", None)
    assert raw.status == 400 and "error" in json.loads(raw.body)
    assert sim.pending() == 0


def test_standalone_process(tmp_path):
    script = tmp_path / "script.json"
    script.write_text(json.dumps([{"text": "from the file", "tool_calls": [{"name": "f", "arguments": {"x": 1}}]}]))
    proc = subprocess.Popen([sys.executable, "-m", "tests.provider", "--port", "0", "--script", str(script)],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:")
        base = line.split()[-1]
        client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
        first = client.chat.completions.create(model="m", messages=USER).choices[0].message
        assert first.content == "from the file" and first.tool_calls[0].function.name == "f"
        assert client.chat.completions.create(model="m", messages=USER).choices[0].message.content.startswith("You said:")
        # Queue more at run time through the control API.
        request = urllib.request.Request(base + "/_sim/script", data=b'[{"text": "queued later"}]', method="POST")
        assert json.loads(urllib.request.urlopen(request, timeout=5).read())["pending"] == 1
        assert client.chat.completions.create(model="m", messages=USER).choices[0].message.content == "queued later"
    finally:
        proc.terminate()
        assert proc.wait(10) == 0

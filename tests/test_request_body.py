"""``Dialect.request_body`` (what ``replay_trace.py resend`` sends): a canonical request
rendered as the dialect's request body reads back (``parse_request``) to the very same messages
and tools, for captured Claude Code and Anthropic SDK requests and for bodies in each dialect's
shapes (tool calls and results, reasoning with signatures, custom and namespaced tools, images
by URL).
What the record cannot restore (inline image bytes, kept as a digest) is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from interceptor.dialects import DIALECTS
from interceptor.trace.messages import message_hash

FIXTURES = Path(__file__).parent / "fixtures"


def _anthropic_captures() -> list[dict]:
    bodies = [json.loads((FIXTURES / "claude-code-requests" / name).read_text())["body"]
              for name in ("interleaved-system-2.1.197.json", "websearch-2.1.332.json")]
    for path in sorted((FIXTURES / "anthropic-exchanges").glob("tool-runner-*.json")):
        for exchange in json.loads(path.read_text()):
            body = exchange["request"].get("body")
            bodies.append(json.loads(body) if isinstance(body, str) else body)
    return bodies


RESPONSES_BODY = {
    "model": "gpt-5-codex", "instructions": "be brief",
    "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "perms"}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "fix it"},
            {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "auto"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "plan"}], "encrypted_content": "gAAAA"},
        {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": "{\"cmd\":[\"ls\"]}"},
        {"type": "custom_tool_call", "call_id": "call_2", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.py"},
        {"type": "custom_tool_call_output", "call_id": "call_2", "output": "ok"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
        {"type": "message", "role": "user", "content": "and now?"},
    ],
    "tools": [
        {"type": "function", "name": "shell", "parameters": {"type": "object"}},
        {"type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark", "definition": "x"}},
        {"type": "namespace", "name": "crm", "description": "CRM", "tools": [{"type": "function", "name": "lookup"}]},
        {"type": "web_search"},
    ],
}

GEMINI_BODY = {
    "systemInstruction": {"role": "user", "parts": [{"text": "You are an agent."}]},
    "contents": [
        {"role": "user", "parts": [{"text": "compare the two configs"}]},
        {"role": "model", "parts": [
            {"text": "Both first.", "thought": True, "thoughtSignature": "sig-1"},
            {"functionCall": {"name": "read_file", "args": {"path": "a.toml"}}, "thoughtSignature": "sig-2"},
            {"functionCall": {"name": "read_file", "args": {"path": "b.toml"}}},
            {"functionCall": {"name": "run_shell_command", "args": {"command": "diff a.toml b.toml"}}}]},
        {"role": "user", "parts": [
            {"functionResponse": {"name": "read_file", "response": {"output": "x = 1"}}},
            {"functionResponse": {"name": "read_file", "response": {"output": "x = 2"}}},
            {"functionResponse": {"name": "run_shell_command", "response": {"output": "< x = 1\n> x = 2"}}}]},
        {"role": "model", "parts": [{"text": "They differ in x."}]},
        {"role": "user", "parts": [{"text": "look at"}, {"fileData": {"fileUri": "gs://b/x.png", "mimeType": "image/png"}}]},
    ],
    "tools": [{"functionDeclarations": [{"name": "read_file", "description": "read a file",
                                         "parametersJsonSchema": {"type": "object"}}]},
              {"googleSearch": {}}],
}

CHAT_BODY = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi"},
                                     {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{\"command\": \"ls\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a b"},
        {"role": "assistant", "content": "two files"},
    ],
    "tools": [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}],
}


def _cases():
    for k, body in enumerate(_anthropic_captures()):
        yield pytest.param("anthropic", body, id=f"anthropic-capture-{k}")
    yield pytest.param("responses", RESPONSES_BODY, id="responses")
    yield pytest.param("gemini", GEMINI_BODY, id="gemini")
    yield pytest.param("chat", CHAT_BODY, id="chat")


@pytest.mark.parametrize("dialect,body", list(_cases()))
def test_a_rendered_prompt_reads_back_to_the_same_messages_and_tools(dialect, body):
    d = DIALECTS[dialect]
    request = d.parse_request(body)
    assert request.messages
    rendered = d.request_body(request)
    json.dumps(rendered)  # a body: plain JSON
    again = d.parse_request(rendered)
    assert [message_hash(m) for m in again.messages] == [message_hash(m) for m in request.messages]
    assert again.messages == request.messages
    assert again.tools == request.tools


def test_inline_image_bytes_cannot_be_sent_again_and_the_message_is_named():
    d = DIALECTS["anthropic"]
    request = d.parse_request({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]})
    with pytest.raises(ValueError, match=r"message 0 \(user\) part 1 is inline image data"):
        d.request_body(request)

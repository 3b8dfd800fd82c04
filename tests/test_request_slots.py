"""Where a request hook's rewrite goes in each wire format (in process, no proxy): every
user and tool message a dialect parses has a slot, and content written there reads back as
exactly that message changed, every other message and every other byte as they were."""

from __future__ import annotations

import json

import pytest

from interceptor.dialects import DIALECTS
from interceptor.dialects.base import RewriteError
from interceptor.dialects.body import parse_body
from interceptor.trace.messages import Part

BODIES = {
    "chat": {"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": "https://x/cat.png"}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "out"},
        {"role": "user", "content": "next"}]},
    "anthropic": {"model": "m", "max_tokens": 9, "system": "be brief", "messages": [
        {"role": "user", "content": "look"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "bash", "input": {}},
                                          {"type": "tool_use", "id": "t2", "name": "bash", "input": {}}]},
        {"role": "user", "content": [{"type": "text", "text": "before"},
                                     {"type": "tool_result", "tool_use_id": "t1", "content": "one"},
                                     {"type": "tool_result", "tool_use_id": "t2"},
                                     {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": []}]},
    "responses": {"model": "m", "instructions": "be brief", "input": [
        {"role": "user", "content": "look"},
        {"type": "reasoning", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "out"}]},
        {"type": "additional_tools", "tools": []},
        {"type": "message", "role": "developer", "content": "mind"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "exec", "input": "ls"},
        # Codex's note of a setting it changed: a message of its own, after the run it ends
        {"type": "configuration_update", "reasoning": {"effort": "high"}},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "files"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "next"}]}]},
}


def rewritten(name: str, index: int, content, is_error=None) -> tuple[bytes, bytes]:
    dialect = DIALECTS[name]
    raw = json.dumps(BODIES[name], indent=1).encode()
    parsed = parse_body(raw)
    slot = dialect.content_slots(parsed.data)[index]
    edits = dialect.content_edits(slot, parsed.data, content, is_error)
    for edit in edits:
        edit.apply(parsed.data)
    return raw, parsed.encode(set(), edits)


@pytest.mark.parametrize("name", sorted(BODIES))
def test_every_user_and_tool_message_has_a_slot_and_takes_new_text(name):
    dialect = DIALECTS[name]
    before = dialect.parse_request(BODIES[name]).messages
    slots = dialect.content_slots(BODIES[name])
    assert len(slots) == len(before)
    for i, (slot, message) in enumerate(zip(slots, before)):
        writable = message.role in ("user", "tool") and not (name == "anthropic" and message.content == [])
        assert (slot is not None) == writable, (i, message)
        if slot is None:
            continue
        raw, out = rewritten(name, i, "NEW TEXT")
        after = dialect.parse_request(json.loads(out)).messages
        assert after[i].text() == "NEW TEXT" and after[i].role == message.role
        assert after[i].tool_call_id == message.tool_call_id
        assert after[:i] + after[i + 1:] == before[:i] + before[i + 1:]
        # every other byte is the harness's: only a short stretch holding the new value differs
        head = next(k for k, (a, b) in enumerate(zip(raw, out)) if a != b)
        tail = next(k for k, (a, b) in enumerate(zip(raw[::-1], out[::-1])) if a != b)
        assert b"NEW TEXT" in out[head - 12:len(out) - tail + 12] and len(out) - tail - head < 100, out  # a block without content: the block anew


def test_a_part_kept_is_the_harness_s_own_block_and_a_made_up_image_is_refused():
    chat = DIALECTS["chat"]
    image = chat.parse_request(BODIES["chat"]).messages[1].content[1]
    _, out = rewritten("chat", 1, [Part(text="only this"), image])
    assert json.loads(out)["messages"][1]["content"] == [
        {"type": "text", "text": "only this"}, {"type": "image_url", "image_url": {"url": "https://x/cat.png"}}]
    with pytest.raises(RewriteError, match="image part that was not in the original"):
        rewritten("chat", 1, [Part(type="image", ref="https://x/dog.png")])


def test_anthropic_error_flag_and_a_result_without_content():
    _, out = rewritten("anthropic", 5, "failed", is_error=True)
    block = json.loads(out)["messages"][2]["content"][2]
    assert block == {"type": "tool_result", "tool_use_id": "t2", "content": "failed", "is_error": True}
    messages = DIALECTS["anthropic"].parse_request(json.loads(out)).messages
    assert messages[5].is_error and messages[5].content == "failed"
    with pytest.raises(RewriteError, match="no error flag"):
        rewritten("chat", 3, "x", is_error=True)


def test_a_run_of_blocks_is_one_message_and_is_replaced_as_one():
    _, out = rewritten("anthropic", 6, "ab, rewritten")
    content = json.loads(out)["messages"][2]["content"]
    assert [b.get("text") or b.get("tool_use_id") for b in content] == ["before", "t1", "t2", "ab, rewritten"]
    with pytest.raises(RewriteError, match="cannot be emptied"):
        rewritten("anthropic", 6, [])


@pytest.mark.parametrize("name", ["chat", "anthropic"])
def test_slots_read_element_by_element_are_the_whole_body_s(name):
    """A request hook's session reads the slots it needs element by element, through the
    scan's count of each element's messages: the same slots as the whole body's."""
    from interceptor.addons.gateway.policy.intercept import _Slots
    dialect = DIALECTS[name]
    raw = json.dumps(BODIES[name]).encode()
    parsed = parse_body(raw, dialect.message_list)
    request = dialect.parse_request(parsed.data, parsed.listed)
    listed = parsed.listed
    lead = len(request.messages) - listed.marks[-1]
    lazy = _Slots(dialect, parsed.data, lead, listed.marks)
    assert len(lazy) == len(request.messages)
    assert [lazy[i] for i in range(len(lazy))] == dialect.content_slots(parsed.data)

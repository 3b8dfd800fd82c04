"""Read-only copies (``trace.messages.read_only``): what a request hook is handed of the
messages the conversation already holds (so they need no comparing after each call).

A copy equals its message both ways and hashes the same; every way of changing it, at any
depth, raises ``ReadOnly`` (the hook's error, naming the message); every way of copying it
gives a plain message the hook may change; it dumps, validates and pickles as the message.
"""

from __future__ import annotations

import copy
import json
import pickle

import pytest

from interceptor.hooks import ReadOnly
from interceptor.trace.messages import Message, Part, Reasoning, Tool, ToolCall, message_hash, read_only

MESSAGES = [
    Message(role="user", content="plain text"),
    Message(role="user", content=[Part(text="look"), Part(type="image", ref="sha256:ab", media_type="image/png"),
                                  Part(type="other", data={"type": "document", "nested": {"pages": [1, 2]}})]),
    Message(role="assistant", content="calling", reasoning=[Reasoning(text="think", signature="sig")],
            tool_calls=[ToolCall(id="c1", name="bash", arguments='{"cmd": "ls"}', extra={"caller": {"k": [1]}})],
            order=["reasoning", "content", "tool_call"]),
    Message(role="tool", tool_call_id="c1", content="out", is_error=True),
]

CHANGES = [  # each changes every message of MESSAGES
    lambda m: setattr(m, "content", "changed"),
    lambda m: setattr(m, "is_error", not m.is_error),
    lambda m: delattr(m, "content"),
    lambda m: m.tool_calls.append(ToolCall(id="x", name="y")),
    lambda m: m.reasoning.extend([Reasoning(text="more")]),
    lambda m: m.tool_calls.insert(0, ToolCall(id="x", name="y")),
    lambda m: m.content.append(Part(text="more")) if isinstance(m.content, list) else m.reasoning.insert(0, 1),
    lambda m: m.content.__setitem__(0, Part(text="x")) if isinstance(m.content, list) else m.tool_calls.__iadd__([1]),
    lambda m: m.content.__delitem__(0) if isinstance(m.content, list) else m.reasoning.__iadd__([1]),
    lambda m: setattr(m.content[0], "text", "x") if isinstance(m.content, list) else setattr(m, "order", ["content"]),
]

SAME = [  # each sets what is there already: no change, no error (a redaction run over every message)
    lambda m: setattr(m, "content", copy.deepcopy(m.content)),
    lambda m: setattr(m, "is_error", m.is_error),
    lambda m: m.tool_calls.extend([]),
    lambda m: m.tool_calls.sort(key=lambda t: 0),
    lambda m: m.reasoning.__iadd__([]),
    lambda m: m.content.__setitem__(0, copy.deepcopy(m.content[0])) if isinstance(m.content, list) else None,
    lambda m: setattr(m.content[0], "text", m.content[0].text) if isinstance(m.content, list) else None,
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: m.role)
def test_a_read_only_copy_is_its_message_and_cannot_change(message):
    original = copy.deepcopy(message)
    ro = read_only(message, 7)
    assert ro == message and message == ro and not ro != message
    assert message_hash(ro) == message_hash(message)
    assert isinstance(ro, Message) and ro.text() == message.text()
    assert ro.model_dump() == message.model_dump()
    assert json.loads(ro.model_dump_json()) == json.loads(message.model_dump_json())
    assert Message.model_validate(ro.model_dump()) == message
    for change in CHANGES:
        with pytest.raises(ReadOnly, match="in the conversation already"):
            change(ro)
    with pytest.raises(ReadOnly, match=f"message 7 \\({message.role}\\) is in the conversation already"):
        ro.content = "x"
    for same in SAME:
        same(ro)
    assert ro == message == original  # nothing changed, the original least of all


def test_a_read_only_copy_of_a_read_only_copy_is_read_only():
    again = read_only(read_only(MESSAGES[2], 1), 1)
    assert again == MESSAGES[2]
    for change in CHANGES:
        with pytest.raises(ReadOnly):
            change(again)


def test_tools_are_read_only_too():
    tool = Tool(name="bash", description="run", parameters={"type": "object", "properties": {"cmd": {"type": "string"}}})
    [ro] = read_only([tool])
    assert ro == tool and tool == ro
    with pytest.raises(ReadOnly, match="tool 'bash': a request hook may not change the request's tools"):
        ro.description = "other"
    with pytest.raises(ReadOnly, match="the request's tools"):
        ro.parameters["properties"]["cmd"]["type"] = "integer"
    assert copy.deepcopy(ro) == tool and type(copy.deepcopy(ro)) is Tool


def test_nested_values_cannot_change():
    ro = read_only(MESSAGES[1])
    data = ro.content[2].data
    for change in (lambda: data.update(x=1), lambda: data.__setitem__("x", 1), lambda: data.pop("type"),
                   lambda: data.setdefault("x", 1), lambda: data.clear(), lambda: data["nested"]["pages"].append(3),
                   lambda: data["nested"].popitem()):
        with pytest.raises(ReadOnly):
            change()
    tool = read_only(MESSAGES[2]).tool_calls[0]
    for change in (lambda: setattr(tool, "arguments", "{}"), lambda: tool.extra["caller"]["k"].append(2)):
        with pytest.raises(ReadOnly):
            change()
    assert MESSAGES[1].content[2].data == {"type": "document", "nested": {"pages": [1, 2]}}


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: m.role)
def test_every_copy_of_a_read_only_copy_is_a_plain_message_to_change(message):
    ro = read_only(message, 0)
    copies = [copy.copy(ro), copy.deepcopy(ro), ro.model_copy(), ro.model_copy(deep=True),
              pickle.loads(pickle.dumps(ro)), Message.model_validate(ro.model_dump())]
    for plain in copies:
        assert type(plain) is Message and plain == message
        plain.content = "mine now"
        plain.tool_calls.append(ToolCall(id="z", name="z"))
    assert ro.model_copy(update={"content": "updated"}).content == "updated"
    assert ro == message  # none of it reached the read-only copy


def test_a_request_of_read_only_copies_validates_and_deep_copies():
    from interceptor.trace.messages import Request
    request = Request(messages=[read_only(m, i) for i, m in enumerate(MESSAGES)])
    assert request.messages == MESSAGES
    again = copy.deepcopy(request)
    assert all(type(m) is Message for m in again.messages) and again.messages == MESSAGES
    again.messages[0].content = "fine"

"""``copied`` and ``read_only`` (trace/messages.py) are copies in every respect a reader can
see, beyond equality (tests/test_read_only.py has that and the refusals): the same fields
*set* (``model_fields_set``, which a dialect reads to render only the sampling settings the
harness gave), no mutable value shared with the original at any depth, a message's cached
hash carried over, and a read-only copy's index (``_at``) on it and on nothing else."""
from __future__ import annotations

import pytest

from interceptor.trace.messages import (Message, Part, Reasoning, Request, Response, Sampling, Tool, ToolCall,
                                        cached_hash, copied, message_hash, read_only)

ASSISTANT = Message(role="assistant", content="calling", reasoning=[Reasoning(text="think", signature="sig")],
                    tool_calls=[ToolCall(id="c1", name="bash", arguments='{"cmd": "ls"}', extra={"caller": {"k": [1]}})])
VALUES = [
    Message(role="user", content="plain"),
    Message(role="user", content=[Part(text="look"), Part(type="other", data={"nested": {"pages": [1, 2]}})]),
    ASSISTANT,
    Part(text="alone"),
    Reasoning(text="only atoms"),
    Tool(name="bash", parameters={"type": "object", "properties": {"cmd": {"type": "string"}}}),
    Sampling(temperature=0.5, stop=["x"]),
    Sampling(max_tokens=10),
    Request(messages=[ASSISTANT], sampling=Sampling(top_p=0.9), extra={"metadata": {"a": [1]}}),
    Response(message=ASSISTANT, token_ids=[1, 2, 3], logprobs=[-0.5, -0.1, 0.0], extra={"k": {"v": 1}}),
]


def walk(value, path="v"):
    """Each value inside ``value`` with where it is (models by field, lists, dicts)."""
    yield path, value
    if isinstance(value, list):
        for i, v in enumerate(value):
            yield from walk(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from walk(v, f"{path}[{k!r}]")
    elif hasattr(value, "model_fields_set"):
        for k, v in value.__dict__.items():
            yield from walk(v, f"{path}.{k}")


def fields_set(value):
    return {p: set(v.model_fields_set) for p, v in walk(value) if hasattr(v, "model_fields_set")}


def assert_a_copy(copy, original):
    assert copy == original and fields_set(copy) == fields_set(original)
    mine = dict(walk(copy))
    for path, v in walk(original):
        if not isinstance(v, (str, int, float, bool, type(None))):
            assert mine[path] is not v, f"{path} is shared with the original"


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_copied_is_a_deep_copy_with_the_same_fields_set(value):
    copy = copied(value)
    assert type(copy) is type(value)
    assert_a_copy(copy, value)


@pytest.mark.parametrize("value", [v for v in VALUES if isinstance(v, (Message, Part, ToolCall, Reasoning, Tool))],
                         ids=lambda v: type(v).__name__)
def test_read_only_and_back_keep_the_fields_set(value):
    ro = read_only(value, 3)
    assert_a_copy(ro, value)
    plain = copied(ro)
    assert type(plain) is type(value)
    assert_a_copy(plain, value)
    if isinstance(value, Message):
        assert ro.__pydantic_private__.get("_at") == 3 and plain.__pydantic_private__.get("_at") is None
        assert value.__pydantic_private__.get("_at") is None


def test_a_messages_cached_hash_goes_with_its_copies():
    message = Message(role="user", content=[Part(text="hash me")])
    digest = message_hash(message)
    assert cached_hash(copied(message)) == digest and cached_hash(read_only(message, 0)) == digest
    assert cached_hash(copied(read_only(message, 0))) == digest
    changed = copied(message)
    changed.content = "other"
    assert cached_hash(changed) is None and cached_hash(message) == digest

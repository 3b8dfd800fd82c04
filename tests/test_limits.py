"""Limits, the context-length classification and the max-tokens clamp, in process (no
proxy): the decisions addons/gateway/policy/stops.py and the dialects make, case by case against the real
providers' error bodies and field names."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from interceptor.addons.gateway.policy.limits import Limits, output_cap, reached
from interceptor.addons.gateway.policy.stops import in_flight
from interceptor.dialects import DIALECTS
from interceptor.trace import Message, MessageNode, ModelCall, Trace, Usage
from interceptor.trace.messages import ResponseError


def _trace(*outputs: int, errors: int = 0, replays: int = 0) -> Trace:
    t = Trace(id="t")
    for k, out in enumerate(outputs):  # one branch: user, reply, user, reply...
        t.nodes.append(MessageNode(parent=len(t.nodes) - 1 if t.nodes else None, message=Message(role="user", content="u")))
        t.nodes.append(MessageNode(parent=len(t.nodes) - 1, message=Message(role="assistant", content="a"), sampled=True))
        t.calls.append(ModelCall(id=f"c{k}", node=len(t.nodes) - 1,
                                 usage=Usage(input_tokens=10 * (k + 1) + k * out, output_tokens=out)))
    t.calls += [ModelCall(id=f"e{k}", error=ResponseError(type="api_error", message="x")) for k in range(errors)]
    t.calls += [ModelCall(id=f"r{k}", replay_of="c0") for k in range(replays)]
    t.calls.append(ModelCall(id="refused", error=ResponseError(type="interceptor_stopped", message="x")))
    return t


def test_reached_names_the_first_limit_at_its_count():
    t = _trace(5, 5, errors=1, replays=3)
    assert reached(Limits(max_turns=3), t, 0, 0) is None
    assert reached(Limits(max_turns=3), t, 1, 0) == "max_turns"  # one in flight takes the last turn
    assert reached(Limits(max_calls=4), t, 0, 0) is None  # 2 turns + 1 error; replays and refusals are free
    assert reached(Limits(max_calls=3), t, 0, 0) == "max_calls"
    assert reached(Limits(max_output_tokens=10), t, 0, 0) == "max_output_tokens"
    assert reached(Limits(max_output_tokens=11), t, 0, 0) is None
    assert reached(Limits(max_wall_seconds=5), t, 0, started_at=100, now=104.9) is None
    assert reached(Limits(max_wall_seconds=5), t, 0, started_at=100, now=105) == "max_wall_seconds"
    assert reached(Limits(max_turns=1, max_output_tokens=1), t, 0, 0) == "max_turns"  # first wins


def test_in_flight_lets_go_of_the_recorded():
    class Ex:
        def __init__(self, committed):
            self.committed = committed

    admitted = [Ex(True), Ex(False), Ex(True), Ex(False)]
    assert in_flight(admitted) == 2 and all(not e.committed for e in admitted)


def test_output_cap():
    t = _trace(30)
    assert output_cap(None, t) is None
    assert output_cap(Limits(max_output_tokens=50), t) is None  # no clamp asked
    assert output_cap(Limits(max_output_tokens=50, clamp_max_tokens=True), t) == 20
    assert t.num_total_tokens == 40
    assert output_cap(Limits(max_output_tokens=50, max_total_tokens=45, clamp_max_tokens=True), t) == 5
    assert output_cap(Limits(max_output_tokens=30, clamp_max_tokens=True), t) == 1  # never 0: the stop refuses
    with pytest.raises(ValidationError, match="clamp_max_tokens needs"):
        Limits(clamp_max_tokens=True)


@pytest.mark.parametrize("dialect, status, body", [
    # OpenAI Chat / Responses (platform.openai.com/docs/guides/error-codes)
    ("chat", 400, {"error": {"message": "This model's maximum context length is 128000 tokens. However, your "
                           "messages resulted in 130000 tokens.", "type": "invalid_request_error",
                           "param": "messages", "code": "context_length_exceeded"}}),
    ("responses", 400, {"error": {"message": "Your input exceeds the context window of this model.",
                                "type": "invalid_request_error", "param": "input", "code": "context_length_exceeded"}}),
    # Anthropic (docs.anthropic.com/en/api/errors)
    ("anthropic", 400, {"type": "error", "error": {"type": "invalid_request_error",
                                                 "message": "prompt is too long: 208310 tokens > 200000 maximum"}}),
    # vLLM, older bare shape and the wrapped one
    ("chat", 400, {"object": "error", "message": "This model's maximum context length is 4096 tokens. However, you "
                 "requested 5000 tokens (4000 in the messages, 1000 in the completion).",
                 "type": "BadRequestError", "param": None, "code": 400}),
    ("chat", 400, {"error": {"message": "The prompt (total length 25938) is too long to fit into the model "
                           "(context length 4096).", "type": "BadRequestError", "param": None, "code": 400}}),
    # SGLang
    ("chat", 400, {"object": "error", "message": "The input (5000 tokens) is longer than the model's context "
                 "length (4096 tokens).", "type": "BadRequestError", "code": 400}),
])
def test_context_too_long_is_classified(dialect, status, body):
    d = DIALECTS[dialect]
    err = d.response_error(status, body)
    assert err.type == "context_length" and err.status == 400 and err.message  # the provider's text kept


@pytest.mark.parametrize("body", [
    {"error": {"message": "Invalid value for 'temperature'", "type": "invalid_request_error", "code": None}},
    {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: must be at most 8192"}},
])
def test_other_errors_keep_their_type(body):
    d = DIALECTS["anthropic" if body.get("type") == "error" else "chat"]
    assert d.response_error(400, body).type == "invalid_request_error"


@pytest.mark.parametrize("module, body, key, expect", [
    ("chat", {"max_tokens": 1000}, "max_completion_tokens", 20),
    ("chat", {"max_completion_tokens": 10}, "max_completion_tokens", 10),  # under the cap: untouched
    ("chat", {}, "max_completion_tokens", 20),
    ("responses", {"max_output_tokens": 900}, "max_output_tokens", 20),
    ("anthropic", {"max_tokens": 4096}, "max_tokens", 20),
])
def test_clamp_max_tokens(module, body, key, expect):
    d = DIALECTS[module]
    changes = d.clamp_max_tokens(body, 20)
    assert body[key] == expect and set(body) == {key}
    assert all(c.reason == "limit" for c in changes) and bool(changes) == (expect == 20)

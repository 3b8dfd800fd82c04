"""Rewrite's body handling in-process: the bytes it forwards are exactly the body the dialect
produced, and every change on the way is an Override on the record.

Rewrite re-encodes only the top-level keys the overrides name and copies every other key's
bytes as the harness wrote them (``dialects.body``). That is only right if no dialect step
changes a key without saying so; this property test is what holds every dialect (and every
reconciliation rule added later) to it. A silent change would show here twice: in bytes that
still carry the old value, and in a record that does not mention it.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from interceptor.addons.gateway.rewrite import prepare
from interceptor.addons.gateway.sessions.session import SessionConfig
from interceptor.dialects import ANTHROPIC, CHAT, RESPONSES

MODELS = st.sampled_from(["gpt-4.1", "o3", "gpt-5", "claude-sonnet-4-5", "claude-opus-4", "m"])
NUMBER = st.floats(0, 2, allow_nan=False) | st.integers(0, 2)
THINKING = st.sampled_from([None, {"type": "enabled", "budget_tokens": 2048}, {"type": "adaptive"},
                            {"type": "disabled"}])
TOOL_CHOICE = st.sampled_from([None, "auto", "required", "none", {"type": "any"},
                               {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
                               {"type": "function", "function": {"name": "f"}}])
SESSION_SAMPLING = st.fixed_dictionaries({}, optional={
    "temperature": NUMBER, "top_p": st.floats(0, 1, allow_nan=False), "top_k": st.integers(1, 50),
    "max_tokens": st.integers(1, 5000), "seed": st.integers(0, 9), "stop": st.lists(st.text(max_size=3), max_size=2),
    "presence_penalty": NUMBER, "frequency_penalty": NUMBER,
    "reasoning_effort": st.sampled_from(["low", "medium", "high"]), "thinking": THINKING,
    "tool_choice": TOOL_CHOICE, "n": st.integers(1, 3), "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
})
# What a harness sends beside its messages: settings the session may replace or reconcile,
# and keys no dialect knows (they must pass untouched).
HARNESS_KEYS = st.fixed_dictionaries({}, optional={
    "temperature": NUMBER, "top_p": NUMBER, "top_k": st.integers(0, 100), "max_tokens": st.integers(1, 64000),
    "max_completion_tokens": st.integers(1, 9000), "max_output_tokens": st.integers(1, 9000),
    "thinking": THINKING, "tool_choice": TOOL_CHOICE, "reasoning": st.sampled_from([{"effort": "low"}, {"summary": "auto"}]),
    "output_config": st.sampled_from([{"effort": "high"}, {"format": {"type": "json_schema"}}]),
    "stream": st.booleans(), "seed": st.integers(0, 5), "stop_sequences": st.just(["Human:"]),
    "metadata": st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2),
})
DIALECTS = {
    "chat": (CHAT, lambda: {"messages": [{"role": "user", "content": "hi"}]}),
    "responses": (RESPONSES, lambda: {"input": "hi"}),
    "anthropic": (ANTHROPIC, lambda: {"max_tokens": 1024, "messages": [{"role": "user", "content": "hi"}]}),
}


@settings(max_examples=400, deadline=None)
@given(name=st.sampled_from(sorted(DIALECTS)), model=MODELS, session_model=st.none() | MODELS,
       harness=HARNESS_KEYS, sampling=SESSION_SAMPLING, indent=st.sampled_from([None, 2]))
def test_forwarded_bytes_are_the_dialects_body_and_every_change_is_on_the_record(
        name, model, session_model, harness, sampling, indent):
    dialect, base = DIALECTS[name]
    sent = {"model": model, **base(), **harness}
    raw = json.dumps(sent, indent=indent).encode()
    config = SessionConfig.model_validate({"model": session_model, "sampling": sampling})
    prepared = prepare(raw, dialect, "model", config)
    assert prepared.refusal is None
    forwarded = json.loads(prepared.content) if prepared.content is not None else json.loads(raw)
    assert forwarded == prepared.body  # the upstream gets what the dialect decided, all of it
    named = {o.key.split(".", 1)[0] for o in prepared.overrides}
    silent = {k for k in set(sent) | set(forwarded) if k not in named and sent.get(k) != forwarded.get(k)}
    assert not silent, f"changed without an override: {sorted(silent)}"
    last: dict[str, object] = {}
    for o in prepared.overrides:  # a reconciliation may change a key the session set
        for key in [k for k in last if k.startswith(o.key + ".")]:
            del last[key]  # ... or remove the whole object it sat in (`reasoning` on a model that does not reason)
        last[o.key] = o.new
    for key, new in last.items():  # the record says what the upstream received
        assert value_at(forwarded, key) == new, (key, new, value_at(forwarded, key))


def value_at(body: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(body, dict) or part not in body:
            return None
        body = body[part]
    return body


def test_a_small_value_nested_deeper_than_any_api_takes_is_refused_not_parsed_on():
    """500 levels fit a 1 KB value and json.loads, yet break recursive code further on: refused
    here, in the dialect's words, as a body too deep to parse is (the proxy test is
    tests/test_faults.py's deeply nested body)."""
    config = SessionConfig.model_validate({"model": "m"})
    deep = '{"model": "x", "messages": [], "metadata": %s}' % ("[" * 500 + "]" * 500)
    assert "nested too deeply" in prepare(deep.encode(), CHAT, "model", config).refusal
    fine = '{"model": "x", "messages": [], "metadata": %s}' % ("[" * 40 + '"]]"' + "]" * 40)
    assert prepare(fine.encode(), CHAT, "model", config).refusal is None

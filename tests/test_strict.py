"""Strict mode through the proxy, rule by rule, with the real SDKs.

For each rule of tests/provider/strict.py two requests: one where the harness itself sends
what breaks it, with a session that sets nothing (overlay mode: the proxy changes nothing,
so the provider's 400 reaches the SDK unchanged, and the simulator says which rule refused
it), and one where the session's settings would break it (the proxy's reconciliation makes
it pass, says why on the record, and the simulator accepts it).
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import anthropic
import httpx
import openai
import pytest

from clients import session_clients
from interceptor.addons.gateway.sessions.session import SessionConfig
from interceptor.dialects import ANTHROPIC, CHAT, RESPONSES
from interceptor.dialects.common import apply_knobs, set_model
from provider import strict
from test_dialects_proxy import make_session, mproxy, msim, sim, the_call  # noqa: F401 (fixtures)

HI = [{"role": "user", "content": "hi"}]
TOOL = {"name": "f", "description": "f", "input_schema": {"type": "object", "properties": {}}}
CLEAR = {"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}}
# A tool-use loop whose assistant turn lost its thinking block (Claude Code drops them when
# the answer came from another model than it asked for).
LOOP = [
    {"role": "user", "content": "run it"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]},
]
UNSIGNED = [
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                      {"type": "text", "text": "b"}]},
    {"role": "user", "content": "c"},
]

# A prefilled answer that started with the model's thinking (signed, as Anthropic sent it).
PREFILLED = [
    {"role": "user", "content": "what is 2+2?"},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "easy", "signature": "c2lnbmVk"},
                                      {"type": "text", "text": "The answer is"}]},
]


@dataclass
class Case:
    rule: str
    api: str  # "messages" | "chat" | "responses"
    call: dict[str, Any]  # the SDK call's arguments, as the harness sends them
    session: dict[str, Any] | None = None  # None: the harness's own breach, passed through
    check: Callable[[dict], bool] = lambda body: True  # what reconciliation left
    reason: str = ""  # a word of the override's reason


def msg(model: str = "claude-x", max_tokens: Any = 1024, **kw: Any) -> dict[str, Any]:
    """messages.create arguments; the sampling keys go as extra body (this SDK's typed
    create no longer takes them: newer models refuse them)."""
    extra = {k: kw.pop(k) for k in ("temperature", "top_p", "top_k") if k in kw}
    if extra or "extra_body" in kw:
        kw["extra_body"] = {**kw.get("extra_body", {}), **extra}
    return {"model": model, "max_tokens": max_tokens, "messages": HI, **kw}


ADAPTIVE = {"thinking": {"type": "adaptive"}}

CASES = [
    # -- Anthropic
    Case("unknown_field", "messages", msg(extra_body={"frobnicate": 1})),
    Case("max_tokens_required", "messages", msg(max_tokens=anthropic.NOT_GIVEN)),
    Case("max_tokens_range", "messages", msg(max_tokens=500_000)),
    Case("max_tokens_range", "messages", msg(), {"sampling": {"max_tokens": 500_000}},
         lambda b: b["max_tokens"] == 128_000, "at most"),
    # A model with a lower output cap than the harness's model: Claude Code's 128000 on Sonnet 4.5.
    Case("max_tokens_model", "messages", msg("claude-sonnet-4-5-20250929", max_tokens=128_000)),
    Case("max_tokens_model", "messages", msg("claude-opus-4-6", max_tokens=128_000),
         {"model": "claude-sonnet-4-5-20250929"}, lambda b: b["max_tokens"] == 64_000, "at most 64000"),
    Case("max_tokens_model", "messages",
         msg("claude-opus-4-6", max_tokens=128_000, thinking={"type": "enabled", "budget_tokens": 100_000}),
         {"model": "claude-sonnet-4-5-20250929"},
         lambda b: b["max_tokens"] == 64_000 and b["thinking"]["budget_tokens"] == 32_000, "at most 64000"),
    Case("max_tokens_model", "messages", msg("claude-opus-4-6", max_tokens=40_000),
         {"model": "claude-opus-4-1-20250805"}, lambda b: b["max_tokens"] == 32_000, "at most 32000"),
    Case("sampling_removed", "messages", msg("claude-opus-4-8", temperature=0.5)),
    Case("sampling_removed", "messages", msg("claude-opus-4-8"), {"sampling": {"temperature": 0.5}},
         lambda b: "temperature" not in b, "refuses temperature"),
    Case("temperature_top_p", "messages", msg("claude-sonnet-4-5-20250929", temperature=0.5, top_p=0.9)),
    Case("temperature_top_p", "messages", msg("claude-sonnet-4-5-20250929", top_p=0.9),
         {"sampling": {"temperature": 0.5}}, lambda b: b["temperature"] == 0.5 and "top_p" not in b, "not both"),
    Case("thinking_mode", "messages", msg("claude-sonnet-4-5-20250929", **ADAPTIVE)),
    Case("thinking_mode", "messages", msg("claude-sonnet-4-5-20250929", max_tokens=4096),
         {"sampling": {"thinking": {"type": "adaptive"}}},
         lambda b: b["thinking"]["type"] == "enabled" and b["thinking"]["budget_tokens"] < b["max_tokens"],
         "budget instead"),
    Case("thinking_mode", "messages", msg("claude-opus-4-8"),
         {"sampling": {"thinking": {"type": "enabled", "budget_tokens": 2048}}},
         lambda b: b["thinking"] == {"type": "adaptive"}, "adaptive instead"),
    Case("thinking_temperature", "messages", msg(temperature=0.5, **ADAPTIVE)),
    Case("thinking_temperature", "messages", msg(**ADAPTIVE), {"sampling": {"temperature": 0.5}},
         lambda b: b["temperature"] == 0.5 and "thinking" not in b, "thinking is removed"),
    Case("thinking_temperature", "messages", msg(temperature=0.5),
         {"sampling": {"thinking": {"type": "adaptive"}}},
         lambda b: "temperature" not in b and b["thinking"] == {"type": "adaptive"}, "only temperature 1"),
    Case("thinking_top_k", "messages", msg(top_k=5, **ADAPTIVE)),
    Case("thinking_top_k", "messages", msg(**ADAPTIVE), {"sampling": {"top_k": 5}},
         lambda b: b["top_k"] == 5 and "thinking" not in b, "thinking is removed"),
    Case("thinking_top_p", "messages", msg(top_p=0.5, **ADAPTIVE)),
    Case("thinking_top_p", "messages", msg(), {"sampling": {"top_p": 0.5, "thinking": {"type": "adaptive"}}},
         lambda b: b["top_p"] == 0.95, "[0.95, 1]"),
    Case("thinking_tool_choice", "messages", msg(tools=[TOOL], tool_choice={"type": "any"}, **ADAPTIVE)),
    Case("thinking_tool_choice", "messages", msg(tools=[TOOL], tool_choice={"type": "any"}),
         {"sampling": {"thinking": {"type": "adaptive"}}},
         lambda b: b["tool_choice"] == {"type": "auto"}, "forced tool choice"),
    Case("thinking_budget", "messages", msg(thinking={"type": "enabled", "budget_tokens": 4000})),
    Case("thinking_budget", "messages", msg(), {"sampling": {"thinking": {"type": "enabled", "budget_tokens": 4000}}},
         lambda b: b["max_tokens"] == 4000 + 1024, "below max_tokens"),
    Case("thinking_budget", "messages", msg(max_tokens=4096),
         {"sampling": {"thinking": {"type": "enabled", "budget_tokens": 100}}},
         lambda b: b["thinking"]["budget_tokens"] == 1024, "at least 1024"),
    Case("clear_thinking_requires_thinking", "messages", msg(extra_body=CLEAR)),
    Case("clear_thinking_requires_thinking", "messages", msg(extra_body=CLEAR, **ADAPTIVE),
         {"sampling": {"thinking": {"type": "disabled"}}},
         lambda b: "context_management" not in b and b["thinking"] == {"type": "disabled"}, "clear_thinking"),
    Case("clear_thinking_requires_thinking", "messages", msg(extra_body=CLEAR, **ADAPTIVE),
         {"sampling": {"thinking": None}}, lambda b: "context_management" not in b, "clear_thinking"),
    Case("clear_thinking_requires_thinking", "messages", msg(extra_body=CLEAR, **ADAPTIVE),
         {"sampling_mode": "exact", "sampling": {"temperature": 0.5}},
         lambda b: "context_management" not in b and b["temperature"] == 0.5, "clear_thinking"),
    Case("thinking_history", "messages", {**msg(**ADAPTIVE), "messages": LOOP, "tools": [TOOL]}),
    Case("thinking_history", "messages", {**msg("claude-harness", **ADAPTIVE), "messages": LOOP, "tools": [TOOL]},
         {"model": "claude-session"}, lambda b: "thinking" not in b, "no thinking block"),
    Case("thinking_signature", "messages", {**msg(), "messages": UNSIGNED}),
    Case("thinking_disabled_history", "messages", {**msg(), "messages": PREFILLED}),
    Case("thinking_disabled_history", "messages", {**msg(**ADAPTIVE), "messages": PREFILLED},
         {"sampling": {"thinking": {"type": "disabled"}}},
         lambda b: b["messages"][-1]["content"] == [{"type": "text", "text": "The answer is"}], "final assistant turn"),
    Case("thinking_disabled_history", "messages", {**msg(**ADAPTIVE), "messages": PREFILLED},
         {"sampling": {"thinking": None}}, lambda b: "thinking" not in b and len(b["messages"]) == 2,
         "final assistant turn"),
    # -- OpenAI Chat Completions
    Case("unknown_field", "chat", {"model": "gpt-4o", "messages": HI, "extra_body": {"frobnicate": 1}}),
    Case("unsupported_parameter", "chat", {"model": "o3", "messages": HI, "max_tokens": 100}),
    Case("unsupported_parameter", "chat", {"model": "gpt-4o", "messages": HI, "max_tokens": 100}, {"model": "o3"},
         lambda b: "max_tokens" not in b and b["max_completion_tokens"] == 100, "max_completion_tokens"),
    Case("unsupported_parameter", "chat", {"model": "gpt-4o", "messages": HI, "presence_penalty": 0.5},
         {"model": "o3"}, lambda b: "presence_penalty" not in b, "refuses presence_penalty"),
    Case("unsupported_parameter", "chat", {"model": "gpt-4o", "messages": HI, "reasoning_effort": "low"}),
    Case("unsupported_parameter", "chat", {"model": "gpt-4o", "messages": HI},
         {"sampling": {"reasoning_effort": "high"}}, lambda b: "reasoning_effort" not in b, "not a reasoning"),
    Case("reasoning_sampling", "chat", {"model": "gpt-6.2-sol", "messages": HI, "temperature": 0.5}),
    Case("reasoning_sampling", "chat", {"model": "gpt-6.2-sol", "messages": HI}, {"sampling": {"temperature": 0.5}},
         lambda b: "temperature" not in b, "reasoning model"),
    Case("reasoning_sampling", "chat", {"model": "gpt-4o", "messages": HI, "temperature": 0.5}, {"model": "o3"},
         lambda b: "temperature" not in b, "reasoning model"),
    # -- OpenAI Responses
    Case("unknown_field", "responses", {"model": "gpt-4o", "input": "hi", "extra_body": {"frobnicate": 1}}),
    Case("moved_parameter", "responses", {"model": "o3", "input": "hi", "extra_body": {"reasoning_effort": "low"}}),
    Case("unsupported_parameter", "responses", {"model": "gpt-6.2-sol", "input": "hi", "temperature": 0.5}),
    Case("unsupported_parameter", "responses", {"model": "gpt-6.2-sol", "input": "hi"},
         {"sampling": {"temperature": 0.5}}, lambda b: "temperature" not in b, "reasoning model"),
    Case("unsupported_parameter", "responses", {"model": "gpt-4.1", "input": "hi", "reasoning": {"effort": "low"}}),
    Case("unsupported_parameter", "responses", {"model": "gpt-4.1", "input": "hi"},
         {"sampling": {"reasoning_effort": "high"}}, lambda b: "reasoning" not in b, "not a reasoning"),
    Case("unsupported_parameter", "responses",
         {"model": "gpt-5", "input": "hi", "reasoning": {"effort": "low", "summary": "auto"}},
         {"model": "gpt-4o"}, lambda b: "reasoning" not in b, "not a reasoning"),
]


def _id(case: Case) -> str:
    return f"{case.api}-{case.rule}-{'reconciled' if case.session is not None else 'harness'}"


def send(session: dict, case: Case):
    oai, claude = session_clients(session)
    if case.api == "messages":
        return claude.messages.create(**case.call)
    if case.api == "chat":
        return oai.chat.completions.create(**case.call)
    return oai.responses.create(**case.call)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_strict_rule_through_the_proxy(make_session, sim, mproxy, case):
    session = make_session(**(case.session or {}))
    if case.session is None:
        # The harness's own breach: nothing changed, the provider's answer reaches the SDK as sent.
        with pytest.raises((anthropic.BadRequestError, openai.BadRequestError)) as caught:
            send(session, case)
        [refused] = sim.refusals()
        assert refused.refusal.rule == case.rule
        assert caught.value.status_code == 400 and refused.refusal.message in str(caught.value)
        assert mproxy.api("GET", f"sessions/{session['id']}")[1]["calls"] == 1
        return
    send(session, case)
    assert not sim.refusals(), sim.refusals()[0].refusal
    [seen] = sim.model_requests()
    assert strict.check(seen.route, seen.json) is None and case.check(seen.json), seen.json
    call = the_call(mproxy, session)
    reasons = [o.reason for o in call.overrides if o.reason != "session"]
    assert any(case.reason in r for r in reasons), call.overrides
    # Without reconciliation the same request breaks the rule: the session's settings alone,
    # laid over the harness's request, are what strict mode refuses (so the case tests it).
    unreconciled = {k: v for k, v in case.call.items() if k != "extra_body"} | case.call.get("extra_body", {})
    config = SessionConfig.model_validate(case.session)
    set_model(unreconciled, config.model)
    dialect = {"messages": ANTHROPIC, "chat": CHAT, "responses": RESPONSES}[case.api]
    apply_knobs(unreconciled, dialect.knobs, config.sampling, config.sampling_mode)
    refusal = strict.check(case.api, unreconciled)
    assert refusal is not None and refusal.rule == case.rule, (refusal, unreconciled)


def test_every_rule_has_both_cases():
    """Each rule a harness can break has a pass-through case; each one the proxy can cause, a
    reconciled one (unknown fields, a moved or unsigned parameter are only ever the harness's)."""
    harness_only = {"unknown_field", "moved_parameter", "thinking_signature", "max_tokens_required"}
    by_rule: dict[str, set[bool]] = {}
    for case in CASES:
        by_rule.setdefault(case.rule, set()).add(case.session is None)
    for rule, kinds in by_rule.items():
        assert True in kinds, rule
        assert rule in harness_only or False in kinds, rule


def test_thinking_turned_off_strips_the_final_turns_thinking_only(make_session, sim, mproxy):
    """Claude Code's tool-use loop, thinking on, and a session that turns it off: the loop's
    thinking blocks go (one thinking configuration per assistant turn), an earlier turn's stay
    (the API drops those itself), each removal is on the record, and the trace keeps what
    the harness sent."""
    history = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t1", "signature": "s1"},
                                          {"type": "text", "text": "b"}]},
        {"role": "user", "content": "run it"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t2", "signature": "s2"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]},
    ]
    session = make_session(sampling={"thinking": {"type": "disabled"}})
    send(session, Case("", "messages", {**msg(**ADAPTIVE), "messages": history, "tools": [TOOL]}))
    [seen] = sim.model_requests()
    assert strict.check(seen.route, seen.json) is None
    sent = seen.json["messages"]
    assert sent[:3] == history[:3] and sent[4] == history[4]
    assert sent[3]["content"] == [history[3]["content"][1]]
    call = the_call(mproxy, session)
    assert [(o.key, o.old, o.new) for o in call.overrides if "final assistant turn" in o.reason] == \
           [("messages.3.content.0", {"type": "thinking"}, None)]


def test_required_max_tokens_survives_an_explicit_null(make_session, sim, mproxy):
    """The proxy never causes max_tokens_required: a session's null cannot remove it."""
    session = make_session(sampling={"max_tokens": None, "temperature": 0.5})
    send(session, Case("", "messages", msg(max_tokens=2048)))
    assert not sim.refusals() and sim.model_requests()[0].json["max_tokens"] == 2048


CLAUDE_CODE = Path(__file__).parent / "fixtures" / "claude-code-requests" / "websearch-2.1.332.json"


def test_claude_codes_output_cap_fits_a_smaller_session_model(make_session, sim, mproxy):
    """Claude Code 2.1.332's request as it sent it (max_tokens 128000 for its own model) under a
    session that swaps in claude-sonnet-4-5, which writes at most 64000: the request reaches the
    provider within the model's cap, and the record says why, with the table's source."""
    captured = json.loads(CLAUDE_CODE.read_text())
    body = captured["body"]
    assert body["max_tokens"] == 128_000
    session = make_session(model="claude-sonnet-4-5-20250929")
    headers = {k: v for k, v in captured["headers"].items() if k.lower() not in ("x-api-key", "authorization")}
    with httpx.Client(proxy=mproxy.url, verify=ssl.create_default_context(cafile=str(mproxy.ca_bundle)),
                      timeout=30) as http:
        r = http.post("https://api.anthropic.com/v1/messages?beta=true", content=json.dumps(body).encode(),
                      headers={**headers, "x-api-key": session["model_secret"]})
    assert r.status_code == 200, r.text
    assert not sim.refusals(), sim.refusals()[0].refusal
    [seen] = sim.model_requests()
    assert seen.json["model"] == "claude-sonnet-4-5-20250929" and seen.json["max_tokens"] == 64_000
    [cap] = [o for o in the_call(mproxy, session).overrides if o.key == "max_tokens"]
    assert (cap.old, cap.new) == (128_000, 64_000)
    assert "platform.claude.com" in cap.reason and "64000" in cap.reason

"""Gemini's documented generationConfig rules: strict mode refuses what the Gemini
API refuses (tests/provider/strict.py, ``check_gemini``), and every request the proxy rewrote
passes it. In-process, each case is also sent without reconciliation to show that it breaks the
rule it is about; through a real mitmdump, the harness's own breach reaches it unchanged and
the proxy's change is fixed (or, for a parameter no table knows, learned from the 400)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

import pytest

from interceptor.addons.gateway.sessions.session import SessionConfig
from interceptor.dialects import GEMINI
from interceptor.dialects.common import PROVIDER_REJECTED, apply_knobs
from interceptor.trace import read_trace
from provider import strict
from test_gemini import REQUEST, _client, _post

GC = "generationConfig"


@dataclass
class Case:
    rule: str
    model: str  # the model the request goes to (the path's, after the session's)
    harness: dict[str, Any]  # the harness's generationConfig
    session: dict[str, Any] | None = None  # None: the harness's own breach, passed through
    check: Callable[[dict], bool] = lambda gc: True
    requested: str | None = None  # the model the harness asked for, when the session changed it


def body_of(harness: dict[str, Any]) -> dict[str, Any]:
    return {"contents": REQUEST["contents"], **({GC: harness} if harness else {})}


def thinking(gc: dict) -> dict:
    return gc.get("thinkingConfig") or {}


CASES = [
    # thinkingLevel before Gemini 3: a budget instead (the family's most for "high")
    Case("gemini_thinking_level", "gemini-2.5-flash", {}, {"sampling": {"reasoning_effort": "high"}},
         lambda gc: thinking(gc) == {"thinkingBudget": 24576}),
    Case("gemini_thinking_level", "gemini-2.5-pro", {"thinkingConfig": {"thinkingLevel": "low"}}),
    # ... also when it is the harness's, written for the Gemini 3 model it asked for
    Case("gemini_thinking_level", "gemini-2.5-flash-lite", {"thinkingConfig": {"thinkingLevel": "low"}},
         {"model": "gemini-2.5-flash-lite"}, lambda gc: thinking(gc) == {"thinkingBudget": 512},
         requested="gemini-3-flash-preview"),
    # a level the model does not take: the nearest
    Case("gemini_thinking_level", "gemini-3-pro-preview", {}, {"sampling": {"reasoning_effort": "minimal"}},
         lambda gc: thinking(gc) == {"thinkingLevel": "low"}),
    Case("gemini_thinking_level", "gemini-3-pro-preview", {}, {"sampling": {"reasoning_effort": "medium"}},
         lambda gc: thinking(gc) == {"thinkingLevel": "high"}),
    Case("gemini_thinking_level", "gemini-3-pro-preview", {"thinkingConfig": {"thinkingLevel": "minimal"}}),
    # budget and level together: the level wins, but not on a model that takes none
    Case("gemini_thinking_both", "gemini-3-flash-preview", {"thinkingConfig": {"thinkingBudget": 1024}},
         {"sampling": {"reasoning_effort": "low"}}, lambda gc: thinking(gc) == {"thinkingLevel": "low"}),
    Case("gemini_thinking_both", "gemini-2.5-flash", {"thinkingConfig": {"thinkingBudget": 1024}},
         {"sampling": {"reasoning_effort": "low"}}, lambda gc: thinking(gc) == {"thinkingBudget": 1024}),
    # budgets per family
    Case("gemini_thinking_budget", "gemini-2.5-pro", {}, {"sampling": {"thinking": {"thinkingBudget": 0}}},
         lambda gc: thinking(gc) == {"thinkingBudget": 128}),
    Case("gemini_thinking_budget", "gemini-2.5-pro", {"thinkingConfig": {"thinkingBudget": 0}}),
    Case("gemini_thinking_budget", "gemini-2.5-flash-lite", {}, {"sampling": {"thinking": {"thinkingBudget": 100}}},
         lambda gc: thinking(gc) == {"thinkingBudget": 512}),
    Case("gemini_thinking_budget", "gemini-2.5-flash", {},
         {"sampling": {"thinking": {"thinkingBudget": 50000, "includeThoughts": True}}},
         lambda gc: thinking(gc) == {"thinkingBudget": 24576, "includeThoughts": True}),
    Case("gemini_thinking_budget", "gemini-2.5-flash", {"thinkingConfig": {"thinkingBudget": 50000}}),
    Case("gemini_thinking_budget", "gemini-3.1-pro-preview", {}, {"sampling": {"thinking": {"thinkingBudget": 0}}},
         lambda gc: thinking(gc) == {"thinkingBudget": -1}),
    # logprobs only with responseLogprobs; at most 5 stop sequences
    Case("gemini_logprobs", "gemini-2.5-flash", {}, {"sampling": {"top_logprobs": 3}},
         lambda gc: gc["logprobs"] == 3 and gc["responseLogprobs"] is True),
    Case("gemini_logprobs", "gemini-2.5-flash", {"logprobs": 3}),
    Case("gemini_range", "gemini-2.5-flash", {}, {"sampling": {"stop": list("abcdefg")}},
         lambda gc: gc["stopSequences"] == list("abcde")),
    # the harness's own: ranges, unknown fields
    Case("gemini_range", "gemini-2.5-flash", {"temperature": 2.5}),
    Case("gemini_range", "gemini-2.5-flash", {"topP": 1.5}),
    Case("gemini_range", "gemini-2.5-flash", {"candidateCount": 9}),
    Case("unknown_field", "gemini-2.5-flash", {"frobnicate": 1}),
]


def _id(case: Case) -> str:
    return f"{case.model}-{case.rule}-{'reconciled' if case.session is not None else 'harness'}"


def rewrite(case: Case) -> tuple[dict, list]:
    body = body_of(json.loads(json.dumps(case.harness)))
    config = SessionConfig.model_validate(case.session or {})
    changes = GEMINI.apply_overrides(body, config.model, config.sampling, config.sampling_mode,
                                     requested=case.requested or case.model)
    return body, changes


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_a_rewritten_gemini_request_passes_strict_mode(case):
    body, changes = rewrite(case)
    if case.session is None:  # the harness's own: untouched, and the provider refuses it
        assert changes == []
        refusal = strict.check("gemini", body, model=case.model)
        assert refusal is not None and refusal.rule == case.rule, refusal
        return
    assert strict.check("gemini", body, model=case.model) is None, (body, changes)
    assert case.check(body.get(GC, {})), body
    assert any(o.reason != "session" for o in changes), changes
    # Without reconciliation, the session's settings alone break the rule the case is about.
    unreconciled = body_of(json.loads(json.dumps(case.harness)))
    config = SessionConfig.model_validate(case.session)
    apply_knobs(unreconciled, GEMINI.knobs, config.sampling, config.sampling_mode)
    refusal = strict.check("gemini", unreconciled, model=case.model)
    assert refusal is not None and refusal.rule == case.rule, (refusal, unreconciled)


def test_gemini_cli_s_own_request_passes_strict_mode():
    """What Gemini CLI sends (its generationConfig, as tests/test_harness_gemini.py sees it)
    is one the real API takes: strict mode must not refuse the harness's normal traffic."""
    body = {**REQUEST, "generationConfig": {"temperature": 0, "topP": 1,
                                            "thinkingConfig": {"includeThoughts": True, "thinkingBudget": 8192}}}
    assert strict.check("gemini", body, model="gemini-2.5-flash") is None
    assert strict.check("gemini", body, model="gemini-2.5-pro") is None


# -- through the proxy ------------------------------------------------------------------------


def _session(new_session, harness_env, **config) -> dict:
    session = new_session(**config)
    harness_env(session["env"])
    return session


def test_the_proxys_gemini_change_is_reconciled_and_the_harnesss_own_breach_passes(
        new_session, sim, proxy, harness_env):
    session = _session(new_session, harness_env, sampling={"reasoning_effort": "high"})
    with _client(session) as http:
        ok = _post(http, "gemini-2.5-flash:generateContent", REQUEST, secret=session["model_secret"])
        bad = _post(http, "gemini-2.5-flash:generateContent",
                    {**REQUEST, GC: {**REQUEST[GC], "temperature": 2.5}}, secret=session["model_secret"])
    assert ok.status_code == 200, ok.text
    assert bad.status_code == 400 and bad.json()["error"]["status"] == "INVALID_ARGUMENT"
    first, second = sim.model_requests()
    # The CLI's own budget stays: a model before Gemini 3 takes no level beside it.
    assert first.refusal is None and thinking(first.json[GC]) == REQUEST[GC]["thinkingConfig"]
    assert second.refusal is not None and second.refusal.rule == "gemini_range"
    proxy.api("DELETE", f"sessions/{session['id']}")
    calls = read_trace(session["trace_path"]).calls
    assert [c.status for c in calls] == [200, 400]
    assert any("thinkingLevel" in o.key and o.reason != "session" for o in calls[0].overrides)


def test_a_gemini_parameter_refused_for_an_unknown_model_is_learned(new_session, sim, proxy, harness_env):
    sim.refuse = {"gemini-mystery": {"temperature"}}
    session = _session(new_session, harness_env, model="gemini-mystery", sampling={"temperature": 0.3})
    with _client(session) as http:
        for path in ("gemini-2.5-pro:generateContent", "gemini-2.5-pro:streamGenerateContent?alt=sse"):
            r = _post(http, path, {**REQUEST, GC: {"topP": 0.95}}, secret=session["model_secret"])
            assert r.status_code == 200, r.text
    requests = sim.model_requests()
    assert [("temperature" in r.json.get(GC, {}), r.refusal is not None) for r in requests] == \
           [(True, True), (False, False), (False, False)]
    assert all(r.route_path.split("/")[-1].startswith("gemini-mystery:") for r in requests)
    proxy.api("DELETE", f"sessions/{session['id']}")
    trace = read_trace(session["trace_path"])
    assert [c.status for c in trace.calls] == [400, 200, 200] and trace.num_turns == 2
    for call in trace.calls[1:]:
        assert [(o.key, o.old, o.new) for o in call.overrides if o.reason == PROVIDER_REJECTED] == \
               [(f"{GC}.temperature", 0.3, None)]

"""Gemini CLI (`gemini -p`, pinned in tests/harnesses) through the proxy: Gemini's API with its
own shell tool, several turns; the model in the path replaced by the session's, its sampling
by the session's, its key never leaving the machine."""

from __future__ import annotations

import uuid

import pytest

from harness import (
    FINAL, PROMPT, SECRET_PREFIX, TOOL_OUTPUT, check_history_recognised, check_ran, check_task_trace,
    check_unknown_secret_fails, node_harness, run_harness, trace_of,
)
from harness import hproxy, hsim, sim  # noqa: F401 (this module's fixtures)
from conftest import REAL_KEY
from interceptor.dialects import GEMINI
from provider import Reply, ToolCall

SESSION = {"model": "gemini-session-model", "sampling": {"temperature": 0.2, "max_tokens": 2048}}
WIRE = {"temperature": 0.2, "maxOutputTokens": 2048}


@pytest.fixture
def gemini() -> list[str]:
    # -m: a fixed model skips the CLI's routing call (a classifier it asks first on "auto").
    return [node_harness("gemini"), "-p", PROMPT, "--yolo", "-m", "gemini-2.5-flash"]


def _script_task(sim) -> None:
    sim.script(
        Reply(tool_calls=[ToolCall(name="run_shell_command", arguments={"command": f"echo {TOOL_OUTPUT}"})]),
        Reply(text=["The answer is ", FINAL]),
    )


def _check_sim_saw_only_the_session(requests, trace) -> None:
    assert requests, "nothing reached the simulator"
    for r in requests:
        assert r.route == "gemini" and r.stream, (r.method, r.path)
        assert r.route_path == f"/v1/models/{SESSION['model']}:streamGenerateContent", r.path
        assert r.headers.get("x-goog-api-key") == REAL_KEY
        assert SECRET_PREFIX not in r.path + r.body.decode(errors="replace") + str(r.headers.items_raw())
        config = r.json.get("generationConfig") or {}
        assert {k: config.get(k) for k in WIRE} == WIRE
    # Overlay (the default): only what the session set was changed; the CLI's own topP and
    # thinkingConfig reach the model as it sent them.
    assert all(o.key in {"model", "generationConfig.temperature", "generationConfig.maxOutputTokens"}
               for c in trace.calls for o in c.overrides), [c.overrides for c in trace.calls]
    assert len(requests) == len(trace.calls)


def test_gemini_cli_runs_a_tool_task_through_the_proxy(hproxy, sim, gemini, tmp_path):
    _script_task(sim)
    sid = f"gemini-{uuid.uuid4().hex[:8]}"
    result = run_harness(hproxy, sim, gemini, sid=sid, cwd=tmp_path / "work", session=SESSION)
    check_ran(result)
    trace = trace_of(hproxy, sid)
    _check_sim_saw_only_the_session(sim.requests, trace)
    check_task_trace(trace, turns=2, tool="run_shell_command")
    assert all(c.dialect == "gemini" and c.model == SESSION["model"] for c in trace.calls)
    assert all(c.requested_model == "gemini-2.5-flash" for c in trace.calls)
    check_history_recognised(sim.model_requests(), GEMINI, "contents")


def test_gemini_cli_retries_a_429_and_the_graph_has_one_turn(hproxy, sim, gemini, tmp_path):
    sim.script(Reply(status=429, retry_after=0))
    _script_task(sim)
    sid = f"gemini-429-{uuid.uuid4().hex[:8]}"
    result = run_harness(hproxy, sim, gemini, sid=sid, cwd=tmp_path / "work", session=SESSION)
    check_ran(result)
    trace = trace_of(hproxy, sid)
    assert [c.status for c in trace.calls] == [429, 200, 200]
    assert trace.calls[0].error.type == "RESOURCE_EXHAUSTED" and trace.calls[0].node is None
    assert trace.num_turns == 2 and len(trace.branches) == 1


def test_gemini_cli_with_an_unknown_secret_fails_and_nothing_is_recorded(hproxy, sim, gemini, tmp_path):
    check_unknown_secret_fails(hproxy, sim, gemini, tmp_path, SESSION, GEMINI_API_KEY="sk-ic-m-unknown-secret",
                               GEMINI_CLI_TRUST_WORKSPACE="true", GEMINI_TELEMETRY_ENABLED="false")


def test_gemini_cli_on_a_chat_upstream_in_vllm_mode(sim, gemini, tmp_path):
    """Gemini CLI on an OpenAI-compatible server: its streamGenerateContent requests
    go as Chat Completions (the model from the path into the body), the answers come back as
    Gemini's chunks, the trace's branch is the upstream's token ids."""
    import json

    from harness import KEY_ENV, HOSTS, MitmProcess
    from test_trace_proxy import FakeVLLM, check_branch_tokens

    sim.strict = False  # vLLM's return_token_ids and logprobs are no OpenAI parameters
    upstreams = json.dumps({"vllm": {"base_url": sim.url("/v1"), "api_key_env": KEY_ENV, "dialect": "chat"}})
    arguments = json.dumps({"command": f"echo {TOOL_OUTPUT}"})  # as vLLM's tool parsers write it
    # Reasoning on the last turn only: Gemini CLI does not send thoughts back, so a template
    # renders a restated turn without them and the tokens would rightly branch there.
    vllm = sim.default = FakeVLLM([
        Reply(tool_calls=[ToolCall(name="run_shell_command", arguments=arguments)]),
        Reply(reasoning="It printed.", text=["The answer is ", FINAL])])
    sid = f"gemini-vllm-{uuid.uuid4().hex[:8]}"
    with MitmProcess(options={"intercept_upstreams": upstreams, "intercept_hosts": HOSTS},
                     env={KEY_ENV: REAL_KEY}) as proxy:
        result = run_harness(proxy, sim, gemini, sid=sid, cwd=tmp_path / "work",
                             session={**SESSION, "collect_tokens": True})
        check_ran(result)
        trace = trace_of(proxy, sid)
    assert {(r.method, r.route) for r in sim.requests} == {("POST", "chat")}  # only Chat reached it
    bodies = [r.json for r in sim.model_requests()]
    assert all(b["model"] == SESSION["model"] and b["stream"] and b["temperature"] == 0.2 for b in bodies)
    check_task_trace(trace, turns=2, tool="run_shell_command")
    assert all((c.dialect, c.upstream_dialect) == ("gemini", "chat") for c in trace.calls)
    check_branch_tokens(trace, vllm)
    assert trace.branches[0].messages[-1].reasoning[0].text == "It printed."  # thought parts, as streamed


INVALID = "Flash, I think."  # not JSON: Gemini CLI asks again
VALID = '{"complexity_reasoning": "One shell command.", "complexity_score": 10}'  # below the threshold: flash


def _classifier(record) -> bool:
    """Gemini CLI's routing classifier (NumericalClassifierStrategy through
    BaseLlmClient.generateJson): a generateContent asking for JSON by schema, sent before a
    prompt's first turn when the model is ``auto``."""
    return isinstance(record.json, dict) and "responseJsonSchema" in (record.json.get("generationConfig") or {})


def test_gemini_cli_content_retry_reaches_the_upstream(hproxy, sim, tmp_path):
    """Gemini CLI re-sends its classifier's request, byte for byte, after a backoff of seconds
    when the answer is not JSON (generateJson's shouldRetryOnContent). That answer was handed
    to it in full, so the identical request is a new sample: it reaches the upstream, and the
    valid second answer lets the run go on, rather than the invalid one replayed from the
    record until the CLI gives up."""
    sim.script(Reply(text=INVALID), Reply(text=VALID), key=_classifier)
    _script_task(sim)
    sid = f"gemini-content-retry-{uuid.uuid4().hex[:8]}"
    command = [node_harness("gemini"), "-p", PROMPT, "--yolo", "-m", "auto"]
    result = run_harness(hproxy, sim, command, sid=sid, cwd=tmp_path / "work", session=SESSION)
    asks = [r for r in sim.model_requests() if _classifier(r)]
    assert len(asks) == 2 and asks[0].body == asks[1].body, [r.path for r in sim.model_requests()]
    assert not asks[0].stream and [r.reply.text for r in asks] == [INVALID, VALID]
    check_ran(result)
    trace = trace_of(hproxy, sid)
    assert len(trace.calls) == len(sim.model_requests()) == 4 and not trace.errors
    assert not [c.replay_of for c in trace.calls if c.replay_of]
    # The valid answer routed the task: its turns asked for a flash model (a classifier that
    # failed would leave the CLI's default, a pro model).
    routed = [c.requested_model for c in trace.calls if c.stream]
    assert len(routed) == 2 and all("flash" in m and "pro" not in m for m in routed), routed
    first, second = [c for c in trace.calls if not c.stream]
    assert first.node is not None and second.node is not None and first.node != second.node
    assert first.delivered and second.delivered
    # Two samples of one prompt: sibling leaves, each its own branch; the task's turns a third.
    leaves = {b.messages[-1].text(): b.messages[:-1] for b in trace.branches}
    assert len(leaves) == 3 and trace.num_turns == 4, list(leaves)
    assert leaves[INVALID] == leaves[VALID] and f"The answer is {FINAL}" in leaves, list(leaves)

"""Gemini CLI (`gemini -p`, pinned in tests/harnesses) through the proxy: Gemini's API with its
own shell tool, several turns; the model in the path replaced by the session's, its sampling
by the session's, its key never leaving the machine."""

from __future__ import annotations

import uuid

import pytest

from harness import (
    FINAL, PROMPT, SECRET_PREFIX, TOOL_OUTPUT, check_ran, check_task_trace, check_unknown_secret_fails,
    node_harness, run_harness, trace_of,
)
from harness import hproxy, hsim, sim  # noqa: F401 (this module's fixtures)
from conftest import REAL_KEY
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

"""Claude Code (`claude -p`) through the proxy: streamed Anthropic Messages with thinking and
its own Bash tool, several turns; its model, sampling and thinking replaced by the
session's; its settings and telemetry calls answered locally, never forwarded."""

from __future__ import annotations

import uuid

import pytest

from harness import (
    FINAL, PROMPT, TOOL_OUTPUT, check_ran, check_retried_529, check_sim_saw_only_the_session,
    check_task_trace, check_unknown_secret_fails, node_harness, run_harness, trace_of,
)
from harness import hproxy, hsim, sim  # noqa: F401 (this module's fixtures)
from provider import Reply, ToolCall

SESSION = {"model": "claude-session-model",
           "sampling": {"max_tokens": 4096, "thinking": {"type": "enabled", "budget_tokens": 1024}}}
WIRE = {"max_tokens": 4096, "thinking": {"type": "enabled", "budget_tokens": 1024}, "temperature": None}


@pytest.fixture
def claude() -> list[str]:
    return [node_harness("claude"), "-p", PROMPT, "--allowedTools", "Bash"]


def _script_task(sim) -> None:
    sim.script(
        Reply(reasoning="The user wants a command run.",
              tool_calls=[ToolCall(name="Bash", arguments={"command": f"echo {TOOL_OUTPUT}", "description": "Print"})]),
        Reply(reasoning="It printed.", text=["The answer is ", FINAL]),
    )


def test_claude_code_runs_a_tool_task_through_the_proxy(hproxy, sim, claude, tmp_path):
    _script_task(sim)
    sid = f"claude-{uuid.uuid4().hex[:8]}"
    result = run_harness(hproxy, sim, claude, sid=sid, cwd=tmp_path / "work", session=SESSION)
    check_ran(result)
    trace = trace_of(hproxy, sid)
    check_sim_saw_only_the_session(sim.requests, trace, SESSION, WIRE)
    check_task_trace(trace, turns=2, tool="Bash")
    assert all(r.route == "messages" and r.stream for r in sim.requests)  # nothing else forwarded
    assert trace.branches[0].messages[-1].reasoning[0].text == "It printed."
    assert all(c.sampling.thinking == SESSION["sampling"]["thinking"] for c in trace.calls)
    # Its settings and limits calls were answered by the proxy itself.
    assert "GET https://api.anthropic.com/api/claude_code/" in hproxy.log()


def test_claude_code_retries_a_529_and_the_graph_has_one_turn(hproxy, sim, claude, tmp_path):
    sim.script(Reply(status=529))
    _script_task(sim)
    sid = f"claude-529-{uuid.uuid4().hex[:8]}"
    result = run_harness(hproxy, sim, claude, sid=sid, cwd=tmp_path / "work", session=SESSION)
    check_ran(result)
    trace = trace_of(hproxy, sid)
    check_retried_529(trace)
    assert trace.calls[0].error.type == "overloaded_error"


def test_claude_code_with_an_unknown_secret_fails_and_nothing_is_recorded(hproxy, sim, claude, tmp_path):
    check_unknown_secret_fails(hproxy, sim, claude, tmp_path, SESSION)

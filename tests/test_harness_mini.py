"""mini-swe-agent (`mini`, from PyPI) through the proxy: non-streamed chat completions with
its `bash` tool until it submits (its final answer is what the submit command prints)."""

from __future__ import annotations

import uuid

import pytest

from harness import (
    FINAL, PROMPT, SESSIONS, TOOL_OUTPUT, check_ran, check_retried_529, check_sim_saw_only_the_session,
    check_strict, check_task_trace, check_unknown_secret_fails, mini_harness, run_harness, trace_of,
)
from harness import hproxy, hsim, sim  # noqa: F401 (this module's fixtures)
from provider import Reply, ToolCall

SESSION = {"model": "mini-session-model", "sampling": {"temperature": 0.2, "max_tokens": 1024}}
WIRE = {"temperature": 0.2, "max_completion_tokens": 1024}
SUBMIT = f"echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && echo {FINAL}"


def _mini() -> list[str]:
    # litellm's `openai/` provider: the OpenAI SDK at its default base URL, as a user runs it.
    return [mini_harness(), "-m", "openai/gpt-4o", "-t", PROMPT, "-y", "--exit-immediately"]


def _script_task(sim) -> None:
    sim.script(
        Reply(text="Let me run it.", tool_calls=[ToolCall(name="bash", arguments={"command": f"echo {TOOL_OUTPUT}"})]),
        Reply(text="Submitting.", tool_calls=[ToolCall(name="bash", arguments={"command": SUBMIT})]),
    )


def test_mini_swe_agent_runs_a_tool_task_through_the_proxy(hproxy, sim, tmp_path):
    _script_task(sim)
    sid = f"mini-{uuid.uuid4().hex[:8]}"
    result = run_harness(hproxy, sim, _mini(), sid=sid, cwd=tmp_path / "work", session=SESSION)
    check_ran(result)
    trace = trace_of(hproxy, sid)
    check_sim_saw_only_the_session(sim.requests, trace, SESSION, WIRE)
    assert all(r.route == "chat" and not r.stream for r in sim.requests)
    check_task_trace(trace, turns=2, tool="bash")
    assert trace.branches[0].messages[-1].tool_calls[0].arguments.endswith(f"echo {FINAL}\"}}")


def test_mini_swe_agent_retries_a_529_and_the_graph_has_one_turn(hproxy, sim, tmp_path):
    sim.script(Reply(status=529))
    _script_task(sim)
    sid = f"mini-529-{uuid.uuid4().hex[:8]}"
    result = run_harness(hproxy, sim, _mini(), sid=sid, cwd=tmp_path / "work", session=SESSION)
    check_ran(result)
    check_retried_529(trace_of(hproxy, sid))


def test_mini_swe_agent_with_an_unknown_secret_fails_and_nothing_is_recorded(hproxy, sim, tmp_path):
    # Its own retry loop would wait 4 s per attempt before giving up.
    check_unknown_secret_fails(hproxy, sim, _mini(), tmp_path, SESSION, MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT="1")


@pytest.mark.parametrize("name", list(SESSIONS))
def test_mini_swe_agent_against_strict_mode(hproxy, sim, tmp_path, name):
    """Every session kind leaves requests the real API accepts."""
    _script_task(sim)
    sid = f"mini-{name}-{uuid.uuid4().hex[:8]}"
    result = run_harness(hproxy, sim, _mini(), sid=sid, cwd=tmp_path / "work", session=SESSIONS[name])
    check_ran(result)
    check_strict(sim)
    trace = trace_of(hproxy, sid)
    check_task_trace(trace, turns=2, tool="bash")
    bodies = [r.json for r in sim.model_requests()]
    keys = [sorted(o.key for o in c.overrides) for c in trace.calls]
    if name in ("empty", "thinking-budget", "thinking-disabled"):
        assert keys == [[], []] and all(b["model"] == "gpt-4o" for b in bodies)
    elif name == "model":
        assert keys == [["model"], ["model"]] and all(b["model"] == "x" for b in bodies)
    elif name == "temperature":
        assert all(b["temperature"] == 0.5 for b in bodies)
    elif name == "exact":
        assert all(b["temperature"] == 0.5 and b["top_p"] == 0.9 for b in bodies)

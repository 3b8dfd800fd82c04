"""mini-swe-agent (`mini`, from PyPI) through the proxy: non-streamed chat completions with
its `bash` tool until it submits (its final answer is what the submit command prints)."""

from __future__ import annotations

import subprocess
import uuid

from harness import (  # noqa: F401 (fixtures)
    FINAL,
    PROMPT,
    TOOL_OUTPUT,
    check_ran,
    check_sim_saw_only_the_session,
    check_task_trace,
    direct_env,
    hproxy,
    hsim,
    mini_harness,
    output_of,
    run_harness,
    sim,
    trace_of,
)
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
    trace = trace_of(hproxy, sid)
    assert [c.status for c in trace.calls] == [529, 200, 200]
    assert trace.calls[0].error is not None and trace.calls[0].node is None
    assert trace.num_turns == 2 and len(trace.branches) == 1


def test_mini_swe_agent_with_an_unknown_secret_fails_and_nothing_is_recorded(hproxy, sim, tmp_path):
    session = hproxy.create_session(**SESSION)
    home = tmp_path / "home"
    home.mkdir()
    env = direct_env(session, "sk-ic-m-unknown-secret", home)
    env["MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT"] = "1"  # its retry loop would wait 4 s per attempt
    result = subprocess.run(_mini(), env=env, cwd=tmp_path, capture_output=True, text=True,
                            stdin=subprocess.DEVNULL, timeout=90)
    assert result.returncode != 0 or FINAL not in result.stdout
    assert "unknown session secret" in output_of(result), output_of(result)[-2000:]
    assert sim.requests == []
    assert hproxy.api("GET", f"sessions/{session['id']}")[1]["calls"] == 0

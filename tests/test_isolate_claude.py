"""Claude Code (`claude -p`) isolated (``run_harness.py --isolate``): its rollout completes
through the proxy, and a command its Bash tool runs that goes around the proxy is refused."""

from __future__ import annotations

import sys
import uuid

import pytest

from harness import FINAL, TOOL_OUTPUT, check_ran, check_task_trace, node_harness, run_harness, trace_of
from harness import hproxy, hsim, sim  # noqa: F401 (this module's fixtures)
from provider import Reply, ToolCall
from test_isolate import namespaces  # noqa: F401 (its fixture)
from test_isolate import pytestmark as isolated

pytestmark = [*isolated, pytest.mark.harness]  # Linux, user namespaces allowed, a real harness CLI

SESSION = {"model": "claude-session-model", "sampling": {"max_tokens": 4096}}


def test_claude_code_completes_a_rollout_isolated_and_its_tool_cannot_go_around_the_proxy(hproxy, sim, tmp_path):
    around = (f"{sys.executable} -c \"import socket; socket.create_connection(('127.0.0.1', {sim.port}), timeout=30)\" "
              f"2>&1 | tail -n 1; echo {TOOL_OUTPUT}")
    sim.script(Reply(tool_calls=[ToolCall(name="Bash", arguments={"command": around, "description": "Probe"})]),
               Reply(text=["The answer is ", FINAL]))
    sid = f"claude-isolated-{uuid.uuid4().hex[:8]}"
    claude = [node_harness("claude"), "-p", "Run the probe, then answer.", "--allowedTools", "Bash"]
    result = run_harness(hproxy, sim, claude, sid=sid, cwd=tmp_path / "work", session=SESSION, extra=["--isolate"])
    check_ran(result)
    trace = trace_of(hproxy, sid)
    check_task_trace(trace, turns=2, tool="Bash")
    messages = trace.branches[0].messages
    tool_result = next(m for m in messages if m.role == "tool").text()
    assert "ConnectionRefusedError" in tool_result, tool_result  # the direct connection, refused at once

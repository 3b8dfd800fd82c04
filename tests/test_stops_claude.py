"""Claude Code (`claude -p`) under ``limits.max_turns``: the rollout ends at the
boundary with the reason visible to the user, and the trace ends where the harness was (its
last Bash result is on it, though no model ever read it)."""

from __future__ import annotations

import json
import uuid

from harness import PROMPT, TOOL_OUTPUT, node_harness, output_of, run_harness, trace_of
from harness import hproxy, hsim, sim  # noqa: F401 (this module's fixtures)
from provider import Reply, ToolCall


def test_claude_code_with_max_turns_ends_with_the_message_visible(hproxy, sim, tmp_path):
    sim.script(Reply(tool_calls=[ToolCall(name="Bash", arguments={"command": f"echo {TOOL_OUTPUT}", "description": "Print"})]),
               Reply(text="never sent"))
    sid = f"claude-stop-{uuid.uuid4().hex[:8]}"
    claude = [node_harness("claude"), "-p", PROMPT, "--allowedTools", "Bash"]
    result = run_harness(hproxy, sim, claude, sid=sid, cwd=tmp_path / "work", session={},
                         extra=["--session", json.dumps({"limits": {"max_turns": 1}})])
    out = output_of(result)
    assert "rollout stopped: max_turns" in out, out[-3000:]
    assert len([r for r in sim.requests if r.route == "messages"]) == 1  # the second never went out, nor a retry
    trace = trace_of(hproxy, sid)
    assert trace.stop_condition == "max_turns" and trace.stopped_by == "limit" and trace.truncated
    assert trace.num_turns == 1
    last = trace.branches[0].messages[-1]
    assert last.role == "tool" and TOOL_OUTPUT in str(last.content)
    refused = [c for c in trace.calls if c.error is not None]
    assert refused and all(c.error.type == "interceptor_stopped" for c in refused)

"""Claude Code (`claude -p`) with a request hook that rewrites its Bash tool result:
the model's next request holds the rewritten text, Claude Code finishes normally, and the
trace keeps the original in the rewrite record."""

from __future__ import annotations

import json
import textwrap
import uuid

from harness import FINAL, PROMPT, TOOL_OUTPUT, check_ran, node_harness, run_harness, trace_of
from harness import hproxy, hsim, sim  # noqa: F401 (this module's fixtures)
from provider import Reply, ToolCall

REWRITTEN = "rewritten-by-the-evaluator"


def test_claude_code_bash_result_rewritten_by_a_hook(hproxy, sim, tmp_path):
    hooks = tmp_path / "claude_hooks.py"
    hooks.write_text(textwrap.dedent(f"""
        from interceptor.hooks import Request, intercept

        @intercept
        def hide_tool_output(request: Request):
            for m in request.messages:
                if m.role == "tool" and {TOOL_OUTPUT!r} in m.text():
                    m.content = {REWRITTEN!r}
    """))
    sim.script(Reply(reasoning="The user wants a command run.",
                     tool_calls=[ToolCall(name="Bash", arguments={"command": f"echo {TOOL_OUTPUT}", "description": "Print"})]),
               Reply(reasoning="It printed.", text=f"The tool said so. {FINAL}"))
    sid = f"claude-hook-{uuid.uuid4().hex[:8]}"
    claude = [node_harness("claude"), "-p", PROMPT, "--allowedTools", "Bash"]
    result = run_harness(hproxy, sim, claude, sid=sid, cwd=tmp_path / "work", session={},
                         extra=["--session", json.dumps({"hooks": {"module": str(hooks)}})])
    check_ran(result)
    turns = [r for r in sim.requests if r.route == "messages"]
    assert len(turns) == 2
    results = [b for m in turns[1].json["messages"] if isinstance(m["content"], list)
               for b in m["content"] if b.get("type") == "tool_result"]
    assert len(results) == 1 and results[0]["content"] == REWRITTEN
    trace = trace_of(hproxy, sid)
    [rewrite] = trace.request_rewrites
    assert rewrite.hooks == ["hide_tool_output"] and rewrite.target == "tool"
    assert TOOL_OUTPUT in json.dumps(rewrite.original)
    assert trace.nodes[rewrite.node].message.text() == REWRITTEN
    assert trace.calls[-1].rewrites == [rewrite.id] and len(trace.branches) == 1

"""Claude Code with ``run_harness.py --tool-hooks``: its PreToolUse and PostToolUse
command hooks ask the proxy's tool route, where the session's request hook decides. It blocks
``rm`` (the command never runs: the file survives, and the model's next request holds the
block content, exactly, as the tool's result) and redacts a secret a ``cat`` printed. Claude
Code 2.1.332 does not apply a user-settings hook's ``updatedToolOutput`` to its own tools
(its transcript keeps the original), so the model reads the redaction because the proxy
enforces the decision at the model boundary. The trace records each decision; the harness
exits 0."""

from __future__ import annotations

import json
import sys
import textwrap
import uuid

from harness import FINAL, PROMPT, check_ran, node_harness, run_harness, trace_of
from harness import hproxy, hsim, sim  # noqa: F401 (this module's fixtures)
from mitm import ROOT
from provider import Reply, ToolCall

BLOCKED = "blocked by the evaluator: rm is not allowed here"
REDACTED = "[redacted by the evaluator]"
HOOKS = f'''
import json
from interceptor.hooks import HookContext, Request, intercept

@intercept
def police(request: Request, ctx: HookContext):
    if ctx.tool_phase is None:  # the model boundary: the route decided already
        return None
    tool = request.messages[-1]
    call = next(tc for m in request.messages if m.role == "assistant" for tc in m.tool_calls
                if tc.id == tool.tool_call_id)
    command = json.loads(call.arguments).get("command", "")
    if ctx.tool_phase == "before" and command.startswith("rm "):
        tool.content, tool.is_error = {BLOCKED!r}, True
    elif ctx.tool_phase == "after" and "SECRET" in tool.text():
        tool.content = {REDACTED!r}
    return request
'''


def tool_results(request: dict) -> dict[str, str]:
    return {b["tool_use_id"]: json.dumps(b["content"]) for m in request["messages"]
            if m["role"] == "user" and isinstance(m["content"], list)
            for b in m["content"] if b.get("type") == "tool_result"}


def test_claude_code_tool_hooks_block_rm_and_redact_output(hproxy, sim, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "victim.txt").write_text("keep me")
    (work / "notes.txt").write_text("SECRET=42\n")
    hooks = tmp_path / "police.py"
    hooks.write_text(textwrap.dedent(HOOKS))
    sim.script(
        Reply(reasoning="Remove it.", tool_calls=[ToolCall(name="Bash", id="toolu_rm", arguments={
            "command": "rm victim.txt", "description": "Remove the file"})]),
        Reply(reasoning="Read the notes.", tool_calls=[ToolCall(name="Bash", id="toolu_cat", arguments={
            "command": "cat notes.txt", "description": "Show the notes"})]),
        Reply(reasoning="Done.", text=["The answer is ", FINAL]),
    )
    sid = f"claude-toolhooks-{uuid.uuid4().hex[:8]}"
    result = run_harness(hproxy, sim, [node_harness("claude"), "-p", PROMPT, "--allowedTools", "Bash"], sid=sid,
                         cwd=work, session={"hooks": {"module": str(hooks)}},
                         extra=["--tool-hooks"])
    check_ran(result)
    assert (work / "victim.txt").read_text() == "keep me"  # the command never ran

    requests = [r.json for r in sim.model_requests()]
    assert len(requests) == 3
    assert json.loads(tool_results(requests[1])["toolu_rm"]) in (BLOCKED, [{"type": "text", "text": BLOCKED}])
    assert REDACTED in tool_results(requests[2])["toolu_cat"]
    assert "SECRET=42" not in json.dumps(requests)

    trace = trace_of(hproxy, sid)
    decisions = [(d.phase, d.tool_call_id, d.action) for d in trace.tool_decisions]
    assert decisions == [("before", "toolu_rm", "block"), ("before", "toolu_cat", "allow"),
                         ("after", "toolu_cat", "rewrite")], decisions
    assert trace.tool_decisions[-1].delivered == REDACTED and "SECRET=42" in trace.tool_decisions[-1].content
    tools = {m.tool_call_id: m.text() for m in trace.branches[0].messages if m.role == "tool"}
    assert tools == {"toolu_rm": BLOCKED, "toolu_cat": REDACTED}
    assert {r.tool_call_id: r.by for r in trace.request_rewrites} == {"toolu_rm": "tool_route",
                                                                      "toolu_cat": "tool_route"}


SERVER = ROOT / "examples" / "mcp_task_server.py"
REWRITE_MCP = '''
from interceptor.hooks import HookContext, Request, intercept

@intercept
def hide_version(request: Request, ctx: HookContext):
    if ctx.tool_phase == "after" and "state version" in request.messages[-1].text():
        request.messages[-1].content = "submitted"
    return request
'''


def test_claude_code_replaces_an_mcp_tool_output_the_route_rewrote(hproxy, sim, tmp_path):
    """For an MCP tool Claude Code applies the route's rewrite itself (``updatedToolOutput``):
    its own transcript holds the rewritten result, as does what the model reads."""
    env_file = tmp_path / "secret" / "tool-server.env"
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"task": {
        "type": "stdio", "command": sys.executable, "args": [str(SERVER), str(env_file)]}}}))
    hooks = tmp_path / "hide.py"
    hooks.write_text(REWRITE_MCP)
    tool = "mcp__task__submit"
    sim.script(Reply(reasoning="Submit.", tool_calls=[ToolCall(name=tool, id="toolu_submit", arguments={"answer": FINAL})]),
               Reply(reasoning="Submitted.", text=["The answer is ", FINAL]))
    sid = f"claude-toolhooks-mcp-{uuid.uuid4().hex[:8]}"
    home = tmp_path / "home"
    result = run_harness(hproxy, sim, [node_harness("claude"), "-p", PROMPT, "--mcp-config", str(config),
                                       "--strict-mcp-config", "--allowedTools", tool], sid=sid, cwd=tmp_path / "work",
                         session={"hooks": {"module": str(hooks)}},
                         extra=["--tool-server-env", str(env_file), "--tool-hooks", "--home", str(home)])
    check_ran(result)
    assert json.loads(tool_results(sim.model_requests()[1].json)["toolu_submit"]) in (
        "submitted", [{"type": "text", "text": "submitted"}])
    transcript = [json.loads(line) for t in (home / ".claude" / "projects").rglob("*.jsonl")
                  for line in t.read_text().splitlines()]
    results = [b for e in transcript if isinstance(e.get("message"), dict) and e["message"].get("role") == "user"
               and isinstance(e["message"].get("content"), list)
               for b in e["message"]["content"] if b.get("type") == "tool_result"]
    assert [r["content"] for r in results if r["tool_use_id"] == "toolu_submit"] in (
        ["submitted"], [[{"type": "text", "text": "submitted"}]]), results
    trace = trace_of(hproxy, sid)
    assert [(d.phase, d.action) for d in trace.tool_decisions] == [("before", "allow"), ("after", "rewrite")]
    assert "state version 1" in trace.tool_decisions[-1].content  # what the tool server answered, on the record

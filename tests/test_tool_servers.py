"""A tool server in a real rollout: Claude Code launches an MCP server (the `mcp`
package, stdio: examples/mcp_task_server.py) through ``--mcp-config``; the server gets the
task and state URLs and the state secret from the file ``run_harness.py --tool-server-env``
wrote, reads ``/task`` and PATCHes ``/state`` when the model calls its tool. The trace holds
the state record; neither the harness's environment (as the model's own Bash tool prints
it) nor any record holds the state secret."""

from __future__ import annotations

import json
import sys
import uuid

from harness import FINAL, PROMPT, check_ran, node_harness, run_harness, trace_of
from harness import hproxy, hsim, sim  # noqa: F401 (this module's fixtures)
from mitm import ROOT
from provider import Reply, ToolCall

SERVER = ROOT / "examples" / "mcp_task_server.py"
TOOL = "mcp__task__submit"  # Claude Code names an MCP tool mcp__<server>__<tool>


def test_claude_code_calls_an_mcp_tool_server_that_writes_the_task_state(hproxy, sim, tmp_path):
    env_file = tmp_path / "secret" / "tool-server.env"
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"task": {
        "type": "stdio", "command": sys.executable, "args": [str(SERVER), str(env_file)]}}}))
    claude = [node_harness("claude"), "-p", PROMPT, "--mcp-config", str(config), "--strict-mcp-config",
              "--allowedTools", f"Bash,{TOOL}"]
    sim.script(
        Reply(reasoning="Look around, then submit.",
              tool_calls=[ToolCall(name="Bash", arguments={"command": "env", "description": "Show the environment"}),
                          ToolCall(name=TOOL, arguments={"answer": FINAL})]),
        Reply(reasoning="Submitted.", text=["The answer is ", FINAL]),
    )
    sid = f"claude-mcp-{uuid.uuid4().hex[:8]}"
    result = run_harness(hproxy, sim, claude, sid=sid, cwd=tmp_path / "work",
                         session={"task": {"name": "answer-42"}, "state": {"attempts": 0}},
                         extra=["--tool-server-env", str(env_file)])
    check_ran(result)
    assert not env_file.exists()  # removed with the run: its secret opens nothing any more
    created = json.loads((tmp_path / "work" / "summary.json").read_text())

    first, second = [r.json for r in sim.model_requests()]
    # Claude Code 2.1.332 defers MCP tools behind its ToolSearch tool: named in the request, not in `tools`.
    assert TOOL in json.dumps(first)
    results = {b["tool_use_id"]: b for m in second["messages"] if m["role"] == "user" and isinstance(m["content"], list)
               for b in m["content"] if b.get("type") == "tool_result"}
    calls = {b["name"]: b["id"] for m in second["messages"] if m["role"] == "assistant"
             for b in m["content"] if b.get("type") == "tool_use"}
    text = {name: json.dumps(results[i]["content"]) for name, i in calls.items()}
    assert f"submitted '{FINAL}' for task 'answer-42' (state version 1)" in text[TOOL], text[TOOL]
    # The harness's environment, as its own Bash tool sees it: the model secret, never the state secret.
    assert "ANTHROPIC_API_KEY=sk-ic-m-" in text["Bash"], text["Bash"][:2000]
    assert "sk-ic-s-" not in text["Bash"] and "INTERCEPT_STATE" not in text["Bash"]

    trace = trace_of(hproxy, sid)
    assert [(w.version, w.by, w.op) for w in trace.state_writes] == [(0, "config", "init"), (1, "tool", "patch")]
    assert trace.state_writes[-1].value == {"attempts": 1, "answer": FINAL, "task": "answer-42"}
    assert trace.sealed and trace.state_version == 1 and trace.state_digest == trace.state_writes[-1].digest
    assert created["state_version"] == 1
    raw = (hproxy.trace_dir / f"{sid}.msgpack").read_bytes()
    assert b"sk-ic-s-" not in raw and b"sk-ic-s-" not in hproxy.log().encode()


def test_an_mcp_tool_server_ends_the_rollout_with_post_stop(hproxy, sim, tmp_path):
    env_file = tmp_path / "secret" / "tool-server.env"
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"task": {
        "type": "stdio", "command": sys.executable, "args": [str(SERVER), str(env_file)]}}}))
    give_up = "mcp__task__give_up"
    claude = [node_harness("claude"), "-p", PROMPT, "--mcp-config", str(config), "--strict-mcp-config",
              "--allowedTools", give_up]
    sim.script(
        Reply(reasoning="This cannot be done.", tool_calls=[ToolCall(name=give_up, arguments={"reason": "no tools"})]),
        Reply(reasoning="Never asked for.", text=["The answer is ", FINAL]),
    )
    sid = f"claude-stop-{uuid.uuid4().hex[:8]}"
    result = run_harness(hproxy, sim, claude, sid=sid, cwd=tmp_path / "work", session={},
                         extra=["--tool-server-env", str(env_file)])
    output = result.stdout + result.stderr
    # The request after the tool call was refused: it never reached the simulator, and
    # Claude Code (which does not retry x-should-retry: false) shows the refusal.
    assert len(sim.model_requests()) == 1, output[-3000:]
    assert FINAL not in result.stdout
    assert "rollout stopped: gave_up: no tools" in output, output[-3000:]

    trace = trace_of(hproxy, sid)
    assert trace.sealed and (trace.stop_condition, trace.stopped_by) == ("gave_up: no tools", "tool")
    assert [c.status for c in trace.calls] == [200, 400]
    assert trace.calls[-1].error.type == "interceptor_stopped"
    # The refused request's tool result is on the record: the tool server's answer.
    tool = [m for m in trace.branches[0].messages if m.role == "tool"]
    assert tool and "the rollout is over (gave_up: no tools)" in tool[-1].text()

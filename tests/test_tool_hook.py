"""Claude Code's tool hook command (``interceptor.scripts.tool_hook``) and the settings
``run_harness.py --tool-hooks`` writes, without a harness: the route's answers in Claude
Code's hook format, fail closed when the proxy cannot be asked, existing settings kept."""

from __future__ import annotations

import json
import subprocess
import sys

from interceptor.scripts.run_harness import parse_args, write_tool_hooks
from interceptor.scripts.tool_hook import answer, request_body

PRE = {"hook_event_name": "PreToolUse", "tool_name": "Bash", "tool_use_id": "toolu_1",
       "tool_input": {"command": "rm -rf x"}}
POST = {**PRE, "hook_event_name": "PostToolUse", "tool_response": {"stdout": "hi", "interrupted": False}}


def test_the_route_answer_in_claude_codes_hook_format():
    assert request_body(PRE) == {"phase": "before", "tool_call_id": "toolu_1", "name": "Bash",
                                 "arguments": {"command": "rm -rf x"}}
    assert request_body(POST)["content"] == {"stdout": "hi", "interrupted": False}
    assert request_body(POST)["is_error"] is False
    assert answer(PRE, {"action": "allow"}) is None and answer(POST, {"action": "allow"}) is None
    deny = answer(PRE, {"action": "block", "content": "no", "is_error": True})["hookSpecificOutput"]
    assert deny == {"hookEventName": "PreToolUse", "permissionDecision": "deny", "permissionDecisionReason": "no"}
    stop = answer(PRE, {"action": "stop", "reason": "max_turns"})
    assert stop["continue"] is False and stop["hookSpecificOutput"]["permissionDecision"] == "deny"
    assert "max_turns" in stop["stopReason"]
    assert answer(POST, {"action": "stop", "reason": "x"})["continue"] is False
    rewrite = answer(POST, {"action": "rewrite", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                            "is_error": False})
    assert rewrite == {"hookSpecificOutput": {"hookEventName": "PostToolUse", "updatedToolOutput": "ab"}}


def test_no_proxy_to_ask_means_the_call_does_not_run():
    env = {"HTTPS_PROXY": "http://127.0.0.1:9", "ANTHROPIC_API_KEY": "sk-ic-m-x", "PATH": "/usr/bin:/bin"}
    for env_now in (env, {"PATH": "/usr/bin:/bin"}):
        result = subprocess.run([sys.executable, "-m", "interceptor.scripts.tool_hook"], input=json.dumps(PRE),
                                capture_output=True, text=True, env=env_now, timeout=60)
        assert result.returncode == 2 and "tool call is not allowed" in result.stderr, result.stderr
        assert result.stdout == ""


def test_tool_hooks_are_merged_into_the_harness_settings(tmp_path):
    settings = tmp_path / ".claude" / "settings.json"
    settings.parent.mkdir()
    settings.write_text(json.dumps({"model": "x", "hooks": {"PreToolUse": [{"matcher": "Bash", "hooks": []}]}}))
    write_tool_hooks(tmp_path)
    written = json.loads(settings.read_text())
    assert written["model"] == "x"
    assert [h["matcher"] for h in written["hooks"]["PreToolUse"]] == ["Bash", "*"]
    command = written["hooks"]["PostToolUse"][0]["hooks"][0]
    assert command["type"] == "command" and command["command"].endswith("-m interceptor.scripts.tool_hook")


def test_tool_hooks_need_the_harnesss_own_home(capsys):
    try:
        parse_args(["--tool-hooks", "--keep-home", "--", "claude"])
        raise AssertionError("accepted")
    except SystemExit as e:
        assert e.code == 2
    assert "--keep-home would change yours" in capsys.readouterr().err

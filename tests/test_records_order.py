"""Records say what the harness said: every role as sent, and the pieces of one
reply in the order the model produced them, in the trace, in `show`, in `export`, and through
a dialect round trip.

The request is a capture of Claude Code 2.1.197 (tests/fixtures/claude-code-requests): a
`role: "system"` message in the middle of `messages` (its deferred-tools note) and an
assistant turn whose blocks interleave thinking and tool use (think, call, think, text,
call), restated as it was answered.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from clients import session_clients
from interceptor.dialects import ANTHROPIC, RESPONSES
from interceptor.trace import read_trace
from mitm import ROOT
from provider import Reply

CAPTURE = Path(__file__).parent / "fixtures" / "claude-code-requests" / "interleaved-system-2.1.197.json"
ORDER = ["reasoning", "tool_call", "reasoning", "content", "tool_call"]
BLOCKS = ["thinking", "tool_use", "thinking", "text", "tool_use"]


def captured() -> dict:
    return json.loads(CAPTURE.read_text())["body"]


def expected_roles(body: dict) -> list[str]:
    """The roles as Claude Code sent them: the top-level system, then each message's own (a
    user turn of tool results is one `tool` message per result)."""
    roles = ["system"] if body.get("system") else []
    for m in body["messages"]:
        content = m["content"]
        if m["role"] == "user" and isinstance(content, list) and any(b["type"] == "tool_result" for b in content):
            roles += ["tool"] * sum(b["type"] == "tool_result" for b in content)
        else:
            roles.append(m["role"])
    return roles


def interleaved_reply() -> dict:
    """A reply that itself interleaves: think, call, think, call."""
    return {"id": "msg_01ReplyInterleaved0000001", "type": "message", "role": "assistant", "model": "claude-opus-4-8",
            "content": [{"type": "thinking", "thinking": "Check once more.", "signature": "EqSigC"},
                        {"type": "tool_use", "id": "toolu_01CCCCCCCCCCCCCCCCCCCCCC", "name": "Bash",
                         "input": {"command": "echo third"}},
                        {"type": "thinking", "thinking": "And the last.", "signature": "EqSigD"},
                        {"type": "tool_use", "id": "toolu_01DDDDDDDDDDDDDDDDDDDDDD", "name": "Bash",
                         "input": {"command": "echo fourth"}}],
            "stop_reason": "tool_use", "stop_sequence": None,
            "usage": {"input_tokens": 10, "output_tokens": 20}}


def test_dialect_round_trip_keeps_roles_and_block_order():
    body = captured()
    request = ANTHROPIC.parse_request(body)
    assert [m.role for m in request.messages] == expected_roles(body)
    [assistant] = [m for m in request.messages if m.role == "assistant"]
    assert assistant.order == ORDER
    native = next(m for m in body["messages"] if m["role"] == "assistant")["content"]
    assert [b["type"] for b in native] == BLOCKS
    # canonical -> native -> canonical: the same blocks in the same order, twice over.
    reply = ANTHROPIC.parse_response({**interleaved_reply(), "content": native})
    again = ANTHROPIC.json_body(reply)["content"]
    assert again == [{k: v for k, v in b.items() if k != "caller" or v != {"type": "direct"}} for b in native]
    assert ANTHROPIC.parse_response(ANTHROPIC.json_body(reply)) == reply
    # Responses output items keep their order the same way.
    items = [{"id": "rs_1", "type": "reasoning", "summary": [{"type": "summary_text", "text": "a"}]},
             {"id": "fc_1", "type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}",
              "status": "completed"},
             {"id": "rs_2", "type": "reasoning", "summary": [{"type": "summary_text", "text": "b"}]},
             {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": "t", "annotations": [], "logprobs": []}]},
             {"id": "fc_2", "type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}",
              "status": "completed"}]
    response = RESPONSES.parse_response({"id": "resp_1", "status": "completed", "model": "gpt-5", "output": items})
    assert response.message.order == ORDER
    assert [i["type"] for i in RESPONSES.json_body(response)["output"]] == [i["type"] for i in items]


def test_trace_show_and_export_keep_roles_and_order(new_session, sim, proxy, harness_env, tmp_path):
    body = captured()
    sim.script(Reply(raw=json.dumps(interleaved_reply()), content_type="application/json"))
    session = new_session()
    harness_env(session["env"])
    _, claude = session_clients(session)
    rest = {k: v for k, v in body.items() if k not in ("model", "max_tokens", "messages", "stream")}
    claude.messages.create(model=body["model"], max_tokens=body["max_tokens"], messages=body["messages"],
                           extra_body=rest)
    [seen] = sim.model_requests()
    assert seen.json["messages"] == body["messages"]  # an empty session changes nothing
    proxy.api("DELETE", f"sessions/{session['id']}")
    path = Path(session["trace_path"])
    trace = read_trace(path)
    [branch] = trace.branches
    roles = expected_roles(body) + ["assistant"]
    assert [m.role for m in branch.messages] == roles
    assert [m.order for m in branch.messages if m.role == "assistant"] == [ORDER, ["reasoning", "tool_call"] * 2]

    run = [sys.executable, str(ROOT / "scripts" / "replay_trace.py")]
    shown = subprocess.run([*run, "show", str(path)], capture_output=True, text=True, check=True).stdout
    lines = [line for line in shown.splitlines() if line[:4].strip().isdigit()]
    assert [line[5:14].strip() for line in lines] == roles
    restated = next(line for line in lines if "assistant" in line[:15])
    # pieces in order: [reasoning] ... | -> Bash(...) | [reasoning] ... | text | -> Bash(...)
    pieces = [p.split(" ", 1)[0] for p in restated.split(": ", 1)[1].split(" | ")]
    assert pieces[:3] == ["[reasoning]", "->", "[reasoning]"] and pieces[4] == "->"

    out = tmp_path / "samples.jsonl"
    subprocess.run([*run, "export", str(path), "--out", str(out)], capture_output=True, text=True, check=True)
    [sample] = [json.loads(line) for line in out.read_text().splitlines()]
    assert [m["role"] for m in sample["messages"]] == roles
    exported = [m for m in sample["messages"] if m["role"] == "assistant"]
    assert [p["kind"] for p in exported[0]["pieces"]] == ORDER
    assert [p.get("text") or p.get("name") for p in exported[1]["pieces"]] == \
           ["Check once more.", "Bash", "And the last.", "Bash"]


@pytest.mark.parametrize("role", ["system"])
def test_a_mid_conversation_system_message_is_not_a_user_message(role):
    body = {"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "a"}, {"role": role, "content": "# Environment\ncwd: /w"},
        {"role": "user", "content": "b"}]}
    assert [m.role for m in ANTHROPIC.parse_request(body).messages] == ["user", "system", "user"]

"""A response hook under the real Codex CLI: its default transport is the Responses
WebSocket; the relay holds answers over HTTP only, so the proxy serves a held session's socket
itself (addons/gateway/transport/wsserve.py: each frame a held POST) and the hook replaces the final reply
without Codex falling back. Codex prints the replacement and exits 0; the trace keeps the
model's own reply beside it."""

from __future__ import annotations

import uuid

from harness import FINAL, TOOL_OUTPUT, node_harness, run_harness, trace_of
from harness import hproxy, hsim, sim  # noqa: F401 (this module's fixtures)
from interceptor.trace.verify import problems
from provider import Reply, ToolCall
from test_harness_codex import PROMPT, SCRIPT, _home
from test_request_hooks import hooks_file

REPLACED = "ANSWER-WITHHELD-BY-EVALUATOR"

HOOKS = f"""
from interceptor.hooks import Response, intercept

@intercept
def withhold(response: Response):
    text = response.message.text()
    if "{FINAL}" in text:
        response.message.content = text.replace("{FINAL}", "{REPLACED}")
        return response
    return None
"""


def test_codex_keeps_its_socket_and_prints_the_replacement(hproxy, sim, tmp_path):
    sim.script(
        Reply(reasoning="Run it with exec.", tool_calls=[ToolCall(name="exec", arguments=SCRIPT, type="custom",
                                                                 id="call_codex_exec")]),
        Reply(text=["The answer is ", FINAL]),
    )
    sid = f"codex-hold-{uuid.uuid4().hex[:8]}"
    session = {"model": "codex-session-model", "hooks": {"module": hooks_file(tmp_path, HOOKS, "codex_hooks.py")}}
    result = run_harness(hproxy, sim, [node_harness("codex"), "exec", "--skip-git-repo-check", PROMPT], sid=sid,
                         cwd=tmp_path / "work", session=session, extra=["--home", str(_home(tmp_path / "home", "websocket"))],
                         timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the Responses WebSocket is served by the proxy (its response hooks hold answers)" in hproxy.log()
    assert REPLACED in result.stdout and FINAL not in result.stdout, result.stdout[-2000:]
    answered = [r for r in sim.requests if r.route == "responses"]
    assert answered and all(r.transport == "http" for r in answered)  # frames went upstream as held POSTs
    trace = trace_of(hproxy, sid)
    assert problems(trace) == []
    last = trace.calls[-1]
    assert FINAL in trace.nodes[last.node].message.text()
    assert REPLACED in trace.nodes[last.delivered_node].message.text()
    assert any(TOOL_OUTPUT in m.text() for m in trace.messages)

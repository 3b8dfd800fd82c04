"""Claude Code (`claude -p`) through the proxy: streamed Anthropic Messages with thinking and
its own Bash tool, several turns; its model, sampling and thinking replaced by the
session's; its settings and telemetry calls answered locally, never forwarded."""

from __future__ import annotations

import json
import uuid

import pytest

from harness import (
    FINAL, PROMPT, SESSIONS, TOOL_OUTPUT, check_history_recognised, check_ran, check_retried_529,
    check_sim_saw_only_the_session,
    check_strict, check_task_trace, check_unknown_secret_fails, check_cut_retry, node_harness, run_harness,
    trace_of, when_left,
)
from harness import hproxy, hsim, sim  # noqa: F401 (this module's fixtures)
from interceptor.dialects import ANTHROPIC
from provider import Reply, ToolCall

SESSION = {"model": "claude-session-model",
           "sampling": {"max_tokens": 4096, "thinking": {"type": "enabled", "budget_tokens": 1024}}}
WIRE = {"max_tokens": 4096, "temperature": None}


@pytest.fixture
def claude() -> list[str]:
    return [node_harness("claude"), "-p", PROMPT, "--allowedTools", "Bash"]


def _task() -> list[Reply]:
    return [Reply(reasoning="The user wants a command run.",
                  tool_calls=[ToolCall(name="Bash", arguments={"command": f"echo {TOOL_OUTPUT}", "description": "Print"})]),
            Reply(reasoning="It printed.", text=["The answer is ", FINAL])]


def _script_task(sim) -> None:
    sim.script(*_task())


def test_claude_code_runs_a_tool_task_through_the_proxy(hproxy, sim, claude, tmp_path):
    _script_task(sim)
    sid = f"claude-{uuid.uuid4().hex[:8]}"
    result = run_harness(hproxy, sim, claude, sid=sid, cwd=tmp_path / "work", session=SESSION)
    check_ran(result)
    trace = trace_of(hproxy, sid)
    check_sim_saw_only_the_session(sim.requests, trace, SESSION, WIRE)
    check_task_trace(trace, turns=2, tool="Bash")
    assert all(r.route == "messages" and r.stream for r in sim.requests)  # nothing else forwarded
    assert trace.branches[0].messages[-1].reasoning[0].text == "It printed."
    check_thinking_kept_or_explained([r.json for r in sim.requests], trace, SESSION["sampling"]["thinking"])
    # Its settings and limits calls were answered by the proxy itself.
    assert "GET https://api.anthropic.com/api/claude_code/" in hproxy.log()


def test_claude_code_retries_a_529_and_the_graph_has_one_turn(hproxy, sim, claude, tmp_path):
    sim.script(Reply(status=529))
    _script_task(sim)
    sid = f"claude-529-{uuid.uuid4().hex[:8]}"
    result = run_harness(hproxy, sim, claude, sid=sid, cwd=tmp_path / "work", session=SESSION)
    check_ran(result)
    trace = trace_of(hproxy, sid)
    check_retried_529(trace)
    assert trace.calls[0].error.type == "overloaded_error"


def test_claude_code_with_an_unknown_secret_fails_and_nothing_is_recorded(hproxy, sim, claude, tmp_path):
    check_unknown_secret_fails(hproxy, sim, claude, tmp_path, SESSION)


def _lost_thinking(body: dict) -> bool:
    """A tool loop whose assistant turn no longer starts with its thinking block."""
    before = body["messages"][-2] if len(body["messages"]) > 1 else {}
    blocks = before.get("content") if before.get("role") == "assistant" else None
    return isinstance(blocks, list) and bool(blocks) and blocks[0].get("type") != "thinking"


def check_thinking_kept_or_explained(bodies: list[dict], trace, thinking: dict | None) -> None:
    """The thinking imposed on every request, except where Claude Code dropped the thinking
    blocks of the session's model (2.1.197 does when another model answered than it asked
    for; 2.1.332 keeps them): the API refuses thinking on such a tool loop, so it is off for
    that request and the record says why."""
    for body, call in zip(bodies, trace.calls):
        if _lost_thinking(body):
            assert "thinking" not in body and call.sampling.thinking is None
            assert any(o.key == "thinking" and "no thinking block" in o.reason for o in call.overrides)
        else:  # None: the harness's own, whatever it is
            assert body["thinking"] == (thinking or body["thinking"]) == call.sampling.thinking


def _edits(body: dict) -> list[str]:
    return [e.get("type") for e in (body.get("context_management") or {}).get("edits") or []]


@pytest.mark.parametrize("name", list(SESSIONS))
def test_claude_code_against_strict_mode(hproxy, sim, claude, tmp_path, name):
    """Every session kind leaves requests the real API accepts, and says so."""
    session = SESSIONS[name]
    _script_task(sim)
    sid = f"claude-{name}-{uuid.uuid4().hex[:8]}"
    result = run_harness(hproxy, sim, claude, sid=sid, cwd=tmp_path / "work", session=session)
    check_ran(result)
    check_strict(sim)
    trace = trace_of(hproxy, sid)
    check_task_trace(trace, turns=2, tool="Bash")
    bodies = [r.json for r in sim.model_requests()]
    keys = [sorted((o.key, o.reason) for o in c.overrides) for c in trace.calls]
    if name == "empty":
        # Claude Code's own request, untouched: no override, so its bytes went out as sent.
        assert keys == [[], []]
        assert all(b["thinking"]["type"] == "adaptive" and "clear_thinking_20251015" in _edits(b) for b in bodies)
        check_history_recognised(sim.model_requests(), ANTHROPIC, "messages")
    elif name == "model":
        assert all(b["model"] == "x" for b in bodies)
        assert keys[0] == [("model", "session")]
        check_thinking_kept_or_explained(bodies, trace, None)
        assert all("clear_thinking_20251015" not in _edits(b) for b in bodies if "thinking" not in b)
    elif name == "temperature":
        # Claude Code's default model (claude-opus-4-8 in 2.1.197, claude-opus-5-5 in 2.1.332) refuses sampling parameters: the session's
        # temperature cannot be honoured, and the record says so; thinking stays the harness's.
        assert all("temperature" not in b and b["thinking"]["type"] == "adaptive" for b in bodies)
        reasons = [o.reason for c in trace.calls for o in c.overrides
                   if o.key == "temperature" and o.reason != "session"]
        assert len(reasons) == 2 and all("refuses temperature" in r for r in reasons)
    elif name == "thinking-budget":
        # Budget thinking is not taken by that model either: adaptive, said on the record.
        assert all(b["thinking"] == {"type": "adaptive"} for b in bodies)
        assert all(any(o.key == "thinking" and "adaptive instead" in o.reason for o in c.overrides)
                   for c in trace.calls)
    elif name == "thinking-disabled":
        assert all(b["thinking"] == {"type": "disabled"} for b in bodies)
        assert all(not any(e.startswith("clear_thinking") for e in _edits(b)) for b in bodies)
        assert all(any(o.key == "context_management" and "clear_thinking" in o.reason for o in c.overrides)
                   for c in trace.calls)
        assert all("interleaved-thinking" not in r.headers.get("anthropic-beta", "") for r in sim.model_requests())
    elif name == "exact":
        # Exact: the harness's decoding keys are gone, only the session's applied.
        assert all("thinking" not in b and "effort" not in (b.get("output_config") or {}) for b in bodies)
        # ... and its model refuses both sampling parameters.
        assert all("temperature" not in b and "top_p" not in b for b in bodies)
        assert all(not any(e.startswith("clear_thinking") for e in _edits(b)) for b in bodies)


def test_claude_code_on_a_chat_upstream_in_vllm_mode(sim, claude, tmp_path):
    """Claude Code (thinking on, its Bash tool) trained against an OpenAI-compatible
    server: the proxy translates Messages to Chat Completions and back, the simulator (vLLM
    mode) sees only Chat, and the trace's branch is the upstream's own token ids."""
    from harness import KEY_ENV, REAL_KEY, HOSTS, MitmProcess
    from test_trace_proxy import FakeVLLM

    sim.strict = False  # vLLM takes return_token_ids and logprobs; OpenAI's strict rules would refuse them
    upstreams = json.dumps({"vllm": {"base_url": sim.url("/v1"), "api_key_env": KEY_ENV, "dialect": "chat"}})
    # Arguments as vLLM's tool parsers write them (json.dumps' spacing), which is also how the
    # proxy writes a restated call back: the next prompt renders the same tokens, one branch.
    arguments = json.dumps({"command": f"echo {TOOL_OUTPUT}", "description": "Print"})
    replies = [Reply(reasoning="The user wants a command run.", tool_calls=[ToolCall(name="Bash", arguments=arguments)]),
               Reply(reasoning="It printed.", text=["The answer is ", FINAL])]
    vllm = sim.default = FakeVLLM(replies)
    sid = f"claude-vllm-{uuid.uuid4().hex[:8]}"
    with MitmProcess(options={"intercept_upstreams": upstreams, "intercept_hosts": HOSTS},
                     env={KEY_ENV: REAL_KEY}) as proxy:
        session = {"model": "policy", "sampling": {"max_tokens": 2048, "temperature": 0.7}, "collect_tokens": True}
        result = run_harness(proxy, sim, claude, sid=sid, cwd=tmp_path / "work", session=session)
        check_ran(result)
        trace = trace_of(proxy, sid)
    assert {(r.method, r.route) for r in sim.requests} == {("POST", "chat")}  # only Chat reached it
    bodies = [r.json for r in sim.model_requests()]
    assert all(b["model"] == "policy" and b["temperature"] == 0.7 and b["return_token_ids"] is True for b in bodies)
    assert bodies[1]["messages"][-1]["role"] == "tool" and TOOL_OUTPUT in json.dumps(bodies[1]["messages"][-1])
    check_task_trace(trace, turns=2, tool="Bash")
    assert all(c.dialect == "anthropic" and c.upstream_dialect == "chat" for c in trace.calls)
    assert all(any(o.reason == "translation" and o.key == "thinking" for o in c.overrides) for c in trace.calls)
    [branch] = trace.branches
    prompt, completion, logprobs = vllm.sent[-1]
    assert branch.token_ids == prompt + completion  # the last call's prompt + completion ids
    assert len(branch.sampled_mask) == len(branch.logprobs) == len(branch.token_ids)
    assert branch.sampled_mask[len(prompt):] == [True] * len(completion)
    assert branch.logprobs[len(prompt):] == logprobs
    # the thinking on the trace is the upstream's reasoning
    thoughts = [r.text for m in branch.messages if m.role == "assistant" for r in m.reasoning]
    assert thoughts == ["The user wants a command run.", "It printed."]


# Where Claude Code 2.1.332 gives up on an answer, and what makes it: API_TIMEOUT_MS is its SDK
# client's timeout to an answer's head (used as set); CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS its
# watchdog on a stream's bytes (10 s at the least). After a cut stream it re-asks without
# streaming (another body: a new sample by the rules) unless that fallback is off.
CUTS = {"head": {"API_TIMEOUT_MS": "3000"},
        "stream": {"CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS": "10000", "CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK": "1"}}


@pytest.mark.parametrize("cut", list(CUTS))
def test_claude_code_retry_after_a_real_cut_gets_the_recorded_answer(hproxy, sim, claude, tmp_path, cut):
    """Claude Code gives up on an answer (before its head, or mid-stream) and its own retry
    loop sends the same body again, unflagged (x-stainless-retry-count 0 every time). The
    simulator holds its first answer (before its status line, or after three events) until
    the proxy has seen the harness leave, so the cut is Claude Code's own; the answer, read
    on by the proxy and never handed to the harness whole, is what the retry gets (one
    sample, no fork), not a second sample of the same prompt."""
    sid = f"claude-cut-{cut}-{uuid.uuid4().hex[:8]}"
    left = when_left(hproxy, sid)
    replies = _task()
    if cut == "stream":
        replies[0] = replies[0].replace(pause_before=3, resume=left)

    def answer(record):
        if cut == "head" and len(replies) == 2:
            left.wait(60)  # the status line only after the harness went away
        return replies.pop(0)

    sim.default = answer
    result = run_harness(hproxy, sim, claude, sid=sid, cwd=tmp_path / "work", session=SESSION, env=CUTS[cut])
    assert left.is_set(), "the proxy never saw Claude Code leave its first answer"
    check_ran(result)
    assert [(r.json["stream"], r.headers.get("x-stainless-retry-count")) for r in sim.model_requests()] == \
           [(True, "0")] * 2
    check_cut_retry(sim.model_requests(), trace_of(hproxy, sid), turns=2)

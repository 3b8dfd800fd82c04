"""Claude Code (`claude -p`) through a pause of its upstream for a weight swap: the answer it
is streaming when the pause comes finishes and is recorded, its next request waits at the
proxy (the simulator sees nothing), and after resume it completes its task with no error and
one branch; held past the hold limit, its own retry waits again and is answered once."""

from __future__ import annotations

import threading
import uuid

import pytest

from harness import FINAL, PROMPT, check_ran, check_task_trace, node_harness, run_harness, trace_of
from harness import hproxy, hsim, sim  # noqa: F401 (this module's fixtures)
from interceptor.client.proxy import call as control_api
from provider import Reply
from test_harness_claude import SESSION, _task
from waiting import wait_until


@pytest.fixture
def claude() -> list[str]:
    return [node_harness("claude"), "-p", PROMPT, "--allowedTools", "Bash"]


def upstream(proxy) -> dict:
    status, body = proxy.api("GET", "upstreams/default")  # the module's proxy: its default upstream is the simulator
    assert status == 200, body
    return body


def run_in_thread(proxy, sim, claude, tmp_path, sid: str, session: dict) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(
        run_harness(proxy, sim, claude, sid=sid, cwd=tmp_path / "work", session=session, timeout=240)))
    thread.start()
    return thread, result


def test_claude_code_through_a_pause_finishes_its_stream_waits_and_completes_after_resume(hproxy, sim, claude, tmp_path):
    midway = threading.Event()
    first, second = _task()
    sim.script(Reply(reasoning=first.reasoning, tool_calls=first.tool_calls, pause_before=3, resume=midway), second)
    sid = f"claude-pause-{uuid.uuid4().hex[:8]}"
    thread, result = run_in_thread(hproxy, sim, claude, tmp_path, sid, SESSION)
    sim.wait_for_requests(1, timeout=120)  # its first turn is streaming, held mid-answer

    answer: list = []
    pausing = threading.Thread(target=lambda: answer.append(control_api(
        hproxy.url, hproxy.admin_token, "POST", "upstreams/default/pause", {"timeout": 120}, timeout=150)))
    pausing.start()
    wait_until(lambda: upstream(hproxy)["paused"] and upstream(hproxy)["in_flight"] == 1, 60, "Claude Code's turn in flight")
    assert pausing.is_alive()
    midway.set()
    pausing.join(150)
    status, body = answer[0]
    assert status == 200 and body["drained"] and body["running"] == []
    wait_until(lambda: upstream(hproxy)["held"] == 1, 120, "Claude Code's next request held")  # it ran the tool, and asks again: held
    assert len(sim.model_requests()) == 1
    assert hproxy.api("POST", "upstreams/default/resume")[1]["released"] == 1
    thread.join(240)
    check_ran(result[0])
    assert FINAL in result[0].stdout
    trace = trace_of(hproxy, sid)
    check_task_trace(trace, turns=2, tool="Bash")
    assert len(sim.model_requests()) == 2 and trace.errors == [] and len(trace.branches) == 1
    assert trace.calls[0].held_ms is None and trace.calls[1].held_ms > 0


def test_claude_code_held_past_the_limit_retries_and_is_answered_once(hproxy, sim, claude, tmp_path):
    sim.script(*_task())
    sid = f"claude-held-{uuid.uuid4().hex[:8]}"
    assert control_api(hproxy.url, hproxy.admin_token, "POST", "upstreams/default/pause", {})[0] == 200
    try:
        thread, result = run_in_thread(hproxy, sim, claude, tmp_path, sid, {**SESSION, "pause_limit": 1.0})
        # Told to retry once at least (an upstream_paused call on the record), and its retry waits again.
        wait_until(lambda: (hproxy.api("GET", f"sessions/{sid}")[1] or {}).get("errors", 0) >= 1
                   and upstream(hproxy)["held"] == 1, 120, "the hold limit's answer on the record and the retry held")
        assert sim.model_requests() == []
    finally:
        hproxy.api("POST", "upstreams/default/resume")
    thread.join(240)
    check_ran(result[0])
    assert FINAL in result[0].stdout
    trace = trace_of(hproxy, sid)
    assert len(sim.model_requests()) == 2 and len(trace.branches) == 1  # each turn sampled once, no fork
    assert trace.num_turns == 2 and trace.branches[0].messages[-1].text() == f"The answer is {FINAL}"
    refused = [c for c in trace.calls if c.error is not None]
    assert refused and all(c.error.type == "upstream_paused" and c.status == 503 and c.node is None
                           for c in refused)
    assert len(trace.calls) == 2 + len(refused)

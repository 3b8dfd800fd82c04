"""``replay_trace.py resend`` (issue 17): a trace's recorded prompts asked again of another
model, the new samples landing beside the recorded replies; interrupted and resumed without
asking any call twice; a 429's retry-after honoured. The source is a real 10-turn rollout
recorded through the proxy; the other model is the simulator under another name."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from clients import KEY_ENV, REAL_KEY, session_clients
from interceptor.trace import read_trace
from mitm import ROOT
from provider import Reply, ToolCall

REPLAY_TRACE = ROOT / "scripts" / "replay_trace.py"
TURNS = 10
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}}]


def _rollout(proxy, sim, harness_env):
    """Ten chat turns: nine tool calls with their results, then the answer."""
    sim.script(*[Reply(text=f"step {k}", tool_calls=[ToolCall(name="bash", arguments={"command": f"echo {k}"})])
                 for k in range(TURNS - 1)], Reply(text="done"))
    session = proxy.create_session(id="ten")
    harness_env(session["env"])
    oai, _ = session_clients(session)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "count to nine"}]
    for _ in range(TURNS):
        reply = oai.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"ran {call.id}"})
    proxy.api("DELETE", "sessions/ten")
    return proxy.trace_dir / "ten.msgpack"


def _resend(source, out, sim, *more) -> subprocess.Popen:
    upstreams = json.dumps({"sim": {"base_url": sim.url("/v1"), "api_key_env": KEY_ENV}})
    return subprocess.Popen(
        [sys.executable, str(REPLAY_TRACE), "resend", str(source), "--upstream", "sim", "--upstreams", upstreams,
         "--model", "other-model", "--sampling", '{"temperature": 0.9}', "--out", str(out), *more],
        env={"PATH": "/usr/bin:/bin", KEY_ENV: REAL_KEY}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _answered(sim) -> list:
    return [r for r in sim.model_requests() if r.json.get("model") == "other-model"]


def test_resend_asks_every_prompt_once_across_an_interruption(proxy, sim, harness_env, tmp_path):
    source = _rollout(proxy, sim, harness_env)
    original = read_trace(source)
    assert original.num_turns == TURNS and len(original.branches) == 1
    sim.clear()
    sim.script(Reply(status=429, retry_after=1),
               *[Reply(text=f"other {k}", first_byte_delay=0.3) for k in range(TURNS)])
    out = tmp_path / "resent.msgpack"

    first = _resend(source, out, sim, "--concurrency", "2")
    deadline = time.time() + 60
    while len(_answered(sim)) < 1 + TURNS // 2 and time.time() < deadline:  # the 429 and half the calls
        time.sleep(0.02)
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=60)
    assert first.returncode == 130, err
    assert "interrupted" in err and "run it again with the same --out" in err
    landed = [c for c in read_trace(out).calls if c.resent_from is not None and c.node is not None]
    assert TURNS // 2 - 1 <= len(landed) < TURNS, len(landed)

    second = _resend(source, out, sim, "--concurrency", "2")
    _, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    assert f"{TURNS}/{TURNS} calls ({len(landed)} from an earlier run" in err

    asked = _answered(sim)
    statuses = [r.reply.status if r.reply else None for r in asked]
    assert len(asked) == TURNS + 1 and statuses.count(429) == 1, statuses
    # No prompt asked twice: each request is a different recorded prompt, asked as recorded.
    prompts = [json.dumps(r.json["messages"], sort_keys=True) for r in asked[1:]]
    assert len(set(prompts)) == TURNS
    assert all(r.json["temperature"] == 0.9 and r.json["tools"] for r in asked)
    assert all(r.headers["authorization"] == f"Bearer {REAL_KEY}" for r in asked)
    # The 429's retry waited its retry-after.
    retried = next(r for r in asked[1:] if r.json["messages"] == asked[0].json["messages"])
    assert retried.time - asked[0].time >= 1.0

    trace = read_trace(out)
    resent = [c for c in trace.calls if c.resent_from is not None]
    assert sorted(c.resent_from.call for c in resent) == sorted(c.id for c in original.calls)
    assert {c.resent_from.trace for c in resent} == {original.id}
    assert all(c.node is not None and c.model == "other-model" for c in resent)
    by_id = {c.id: c for c in original.calls}
    for c in resent:
        src = by_id[c.resent_from.call]
        prompt = [trace.nodes[i].message for i in trace.path(c.node)[:-1]]
        assert prompt == [original.nodes[i].message for i in original.path(src.node)[:-1]]
        # A sibling of the recorded reply: the same parent node in the new trace.
        recorded = next(o for o in trace.calls if o.id == src.id)
        assert trace.nodes[recorded.node].parent == trace.nodes[c.node].parent
        assert trace.nodes[c.node].message.content.startswith("other ")
    assert trace.num_turns == 2 * TURNS
    assert len(trace.branches) == TURNS + 1  # the recorded path and ten one-sample leaves beside it


def test_resend_refuses_what_it_cannot_send_before_sending_anything(proxy, sim, harness_env, tmp_path):
    sim.script(Reply(text="hi"))
    session = proxy.create_session(id="anthropic")
    harness_env(session["env"])
    _, client = session_clients(session)
    client.messages.create(model="claude-x", max_tokens=64, messages=[{"role": "user", "content": "hi"}])
    proxy.api("DELETE", "sessions/anthropic")
    sim.clear()
    run = _resend(proxy.trace_dir / "anthropic.msgpack", tmp_path / "o.msgpack", sim)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 2 and "asked in the anthropic dialect; resend renders chat prompts only" in err
    assert sim.requests == []
    nowhere = subprocess.run([sys.executable, str(REPLAY_TRACE), "resend", str(proxy.trace_dir / "anthropic.msgpack"),
                              "--upstream", "nowhere", "--out", str(tmp_path / "o.msgpack")],
                             capture_output=True, text=True, timeout=60)
    assert nowhere.returncode == 2 and "'nowhere' is not declared" in nowhere.stderr

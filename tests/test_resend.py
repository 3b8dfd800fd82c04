"""``replay_trace.py resend``: a trace's recorded prompts asked again of another
model, the new samples landing beside the recorded replies; interrupted and resumed without
asking any call twice; a 429's retry-after honoured. The source is a real 10-turn rollout
recorded through the proxy; the other model is the simulator under another name."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from clients import KEY_ENV, REAL_KEY, session_clients
from interceptor.trace import read_trace
from mitm import ROOT
from provider import Reply, ToolCall
from waiting import wait_until

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
    wait_until(lambda: len(_answered(sim)) >= 1 + TURNS // 2, 60, "the 429 and half the calls answered")
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
    # The 429, found by its status: with two requests at once the simulator may log the one it
    # answers second first (it logs a request, then takes its reply from the script).
    refused = next(r for r in asked if r.reply and r.reply.status == 429)
    answers = [r for r in asked if r is not refused]
    # No prompt asked twice: each request is a different recorded prompt, asked as recorded.
    prompts = [json.dumps(r.json["messages"], sort_keys=True) for r in answers]
    assert len(set(prompts)) == TURNS
    assert all(r.json["temperature"] == 0.9 and r.json["tools"] for r in asked)
    assert all(r.headers["authorization"] == f"Bearer {REAL_KEY}" for r in asked)
    # The 429's retry waited its retry-after.
    retried = next(r for r in answers if r.json["messages"] == refused.json["messages"])
    assert retried.time - refused.time >= 1.0

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
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    client.messages.create(model="claude-x", max_tokens=64, messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this"}, image]}])
    proxy.api("DELETE", "sessions/anthropic")
    sim.clear()
    run = _resend(proxy.trace_dir / "anthropic.msgpack", tmp_path / "o.msgpack", sim)
    _, err = run.communicate(timeout=60)
    # The record keeps an inline image as its digest: it cannot be sent again, and says where.
    assert run.returncode == 2, err
    assert "cannot be asked again: message 0 (user) part 1 is inline image data" in err and "nothing was sent" in err
    assert sim.requests == []
    nowhere = subprocess.run([sys.executable, str(REPLAY_TRACE), "resend", str(proxy.trace_dir / "anthropic.msgpack"),
                              "--upstream", "nowhere", "--out", str(tmp_path / "o.msgpack")],
                             capture_output=True, text=True, timeout=60)
    assert nowhere.returncode == 2 and "'nowhere' is not declared" in nowhere.stderr


# -- every dialect --------------------------------------------------------------------------

ANTHROPIC_TOOLS = [{"name": "bash", "description": "run a command",
                    "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]
RESPONSES_TOOLS = [{"type": "function", "name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}]
GEMINI_URL = "https://generativelanguage.googleapis.com/v1beta/models"


def _anthropic_rollout(client) -> None:
    """Claude Code's shape: streamed, a system prompt, a tool call, its result, the answer."""
    messages = [{"role": "user", "content": "list the files"}]
    for _ in range(2):
        with client.messages.stream(model="claude-x", max_tokens=256, system="Be brief.", tools=ANTHROPIC_TOOLS,
                                    messages=messages) as s:
            reply = s.get_final_message()
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True, exclude={"caller"})
                                                          for b in reply.content]})
        tool = next((b for b in reply.content if b.type == "tool_use"), None)
        if tool is None:
            return
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool.id,
                                                      "content": "a.txt b.txt"}]})


def _responses_rollout(oai) -> None:
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list the files"}]}]
    for _ in range(2):
        r = oai.responses.create(model="gpt-x", instructions="Be brief.", input=items, tools=RESPONSES_TOOLS,
                                 store=False)
        items += [o.model_dump(exclude_none=True, exclude={"id", "status"}) for o in r.output]
        call = next((o for o in r.output if o.type == "function_call"), None)
        if call is None:
            return
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": "a.txt b.txt"})


def _gemini_rollout(session) -> None:
    import httpx2 as httpx

    contents = [{"role": "user", "parts": [{"text": "list the files"}]}]
    tools = [{"functionDeclarations": [{"name": "run_shell_command", "description": "run",
                                        "parametersJsonSchema": {"type": "object"}}]}]
    with httpx.Client(timeout=30, trust_env=True) as http:
        for _ in range(2):
            r = http.post(f"{GEMINI_URL}/gemini-2.5-pro:generateContent",
                          json={"systemInstruction": {"parts": [{"text": "Be brief."}]}, "contents": contents,
                                "tools": tools},
                          headers={"x-goog-api-key": session["model_secret"]})
            assert r.status_code == 200, r.text
            content = r.json()["candidates"][0]["content"]
            contents.append(content)
            calls = [p["functionCall"] for p in content["parts"] if "functionCall" in p]
            if not calls:
                return
            contents.append({"role": "user", "parts": [{"functionResponse": {"name": c["name"], "response": {
                "output": "a.txt b.txt"}}} for c in calls]})


def _refusals(sim) -> list:
    """What the strict simulator refused, for a failing assertion's message."""
    return [r.refusal for r in sim.requests if getattr(r, "refusal", None) is not None]


ROLLOUTS = {
    "anthropic": lambda s: _anthropic_rollout(session_clients(s)[1]),
    "responses": lambda s: _responses_rollout(session_clients(s)[0]),
    "gemini": _gemini_rollout,
}


def test_resend_asks_each_dialects_prompts_in_that_dialect(proxy, sim, harness_env, tmp_path):
    """A Messages, a Responses and a Gemini rollout, each re-asked of another model: every
    prompt reaches the (strict) simulator in the dialect it was recorded in, reads back to the
    recorded prompt, and its new answer lands as a sibling of the recorded reply."""
    from interceptor.dialects import DIALECTS

    for name, rollout in ROLLOUTS.items():
        sim.clear()
        tool = "run_shell_command" if name == "gemini" else "bash"
        sim.script(Reply(text="Looking.", tool_calls=[ToolCall(name=tool, arguments={"command": "ls"})]),
                   Reply(text="Two files."))
        session = proxy.create_session(id=f"src-{name}")
        harness_env(session["env"])
        rollout(session)
        proxy.api("DELETE", f"sessions/src-{name}")
        source = proxy.trace_dir / f"src-{name}.msgpack"
        original = read_trace(source)
        assert original.num_turns == 2 and {c.dialect for c in original.calls} == {name}, name
        sim.clear()
        sim.script(Reply(status=429, retry_after=0.5), *[Reply(text=f"other {k}") for k in range(2)])
        out = tmp_path / f"{name}.msgpack"
        run = _resend(source, out, sim)
        _, err = run.communicate(timeout=120)
        assert run.returncode == 0, (name, err, _refusals(sim))

        asked = _answered(sim) if name != "gemini" else sim.model_requests()
        assert [r.reply.status for r in asked].count(429) == 1 and len(asked) == 3, name  # the 429 asked again
        asked = [r for r in asked if r.reply.status == 200]
        by_id = {c.id: c for c in original.calls}
        trace = read_trace(out)
        resent = [c for c in trace.calls if c.resent_from is not None]
        assert sorted(c.resent_from.call for c in resent) == sorted(by_id), name
        for r, c in zip(asked, sorted(resent, key=lambda c: c.started_at)):
            src = by_id[c.resent_from.call]
            recorded_prompt = [original.nodes[i].message for i in original.path(src.node)[:-1]]
            if name == "gemini":
                assert "/models/other-model:generateContent" in r.route_path
                assert r.headers["x-goog-api-key"] == REAL_KEY
            else:
                assert r.json["model"] == "other-model" and not r.json.get("stream")
            assert r.json.get("temperature") == 0.9 or r.json.get("generationConfig", {}).get("temperature") == 0.9
            assert DIALECTS[name].parse_request(r.json).messages in (
                [original.nodes[i].message for i in original.path(by_id[x].node)[:-1]] for x in by_id)
            prompt = [trace.nodes[i].message for i in trace.path(c.node)[:-1]]
            assert prompt == recorded_prompt, name
            recorded = next(o for o in trace.calls if o.id == src.id)
            assert trace.nodes[recorded.node].parent == trace.nodes[c.node].parent, name
            assert trace.nodes[c.node].message.text().startswith("other "), name
            assert c.dialect == name and c.node is not None
        assert len(trace.branches) == 3, name  # the recorded path and two one-sample leaves beside it


def test_resend_collects_token_ids_from_a_vllm_upstream(proxy, sim, harness_env, tmp_path):
    sim.script(Reply(text="step", tool_calls=[ToolCall(name="bash", arguments={"command": "ls"})]), Reply(text="done"))
    session = proxy.create_session(id="two")
    harness_env(session["env"])
    oai, _ = session_clients(session)
    messages = [{"role": "user", "content": "go"}]
    for _ in range(2):
        reply = oai.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "a b"})
    proxy.api("DELETE", "sessions/two")
    source = proxy.trace_dir / "two.msgpack"
    sim.clear()
    sim.strict = False  # vLLM takes return_token_ids; OpenAI's strict rules would refuse it
    sim.script(Reply(text=["new ", "one"], prompt_token_ids=[1, 2, 3], token_ids=[7, 8], logprobs=[-0.5, -0.25]),
               Reply(text=["new ", "two"], prompt_token_ids=[1, 2, 3, 4], token_ids=[9, 10], logprobs=[-1.0, -0.1]))
    out = tmp_path / "tokens.msgpack"
    run = _resend(source, out, sim, "--collect-tokens")
    _, err = run.communicate(timeout=120)
    assert run.returncode == 0, (err, _refusals(sim))
    asked = _answered(sim)
    assert len(asked) == 2 and all(r.json["return_token_ids"] is True and r.json["logprobs"] is True for r in asked)
    trace = read_trace(out)
    resent = sorted((c for c in trace.calls if c.resent_from is not None), key=lambda c: c.started_at)
    got = [(trace.nodes[c.node].token_ids, trace.nodes[c.node].logprobs) for c in resent]
    assert got == [([7, 8], [-0.5, -0.25]), ([9, 10], [-1.0, -0.1])]
    assert all(trace.nodes[c.node].mask == [True, True] for c in resent)

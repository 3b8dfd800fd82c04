"""A replay upstream (issue 17): a trace answers a session's requests instead of a model.

Each test records a conversation live (a real mitmdump, the real SDKs, the simulator), then
starts a second proxy whose declared upstream is that trace and asks the same things again,
with the simulator out of the picture: the answers come from the record, in the dialect and
transport asked, and the replay's own trace says where each came from."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from clients import KEY_ENV, session_clients
from harness import trace_of
from mitm import ROOT
from provider import Reply, ToolCall

REPLAY_TRACE = ROOT / "scripts" / "replay_trace.py"
TOOLS = [{"name": "bash", "description": "run a command",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]


def _anthropic_dialog(client, *, stream: bool, task: str = "list the files") -> list:
    """Two turns: a tool call, its result, the final text. Returns what the SDK got back."""
    messages = [{"role": "user", "content": task}]
    got = []
    for _ in range(2):
        kwargs = dict(model="claude-x", max_tokens=512, messages=messages, tools=TOOLS,
                      system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
                              {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
                      metadata={"user_id": "user-run-1"})
        if stream:
            with client.messages.stream(**kwargs) as s:
                reply = s.get_final_message()
        else:
            reply = client.messages.create(**kwargs)
        got.append(reply)
        messages = messages + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]}]
        tool = next((b for b in reply.content if b.type == "tool_use"), None)
        if tool is None:
            break
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool.id,
                                                      "content": "a.txt b.txt"}]})
    return got


def _blocks(replies) -> list:
    """What a reply says (a tool call's default ``caller`` is no part of it: dialects/anthropic.py)."""
    return [[b.model_dump(exclude={"caller"}, exclude_none=True) for b in r.content] for r in replies]


def _script(sim) -> None:
    sim.script(Reply(text="Looking.", tool_calls=[ToolCall(name="bash", arguments={"command": "ls"})]),
               Reply(text="There are two files."))


@pytest.fixture
def recorded(proxy, sim, harness_env):
    """A two-turn Anthropic conversation recorded live, streamed: (trace path, SDK replies)."""
    _script(sim)
    session = proxy.create_session(id="source")
    harness_env(session["env"])
    _, client = session_clients(session)
    replies = _anthropic_dialog(client, stream=True)
    proxy.api("DELETE", "sessions/source")
    return proxy.trace_dir / "source.msgpack", replies


def _replayer(start_proxy, source, on_miss: str = "error", **more):
    upstreams = {"yesterday": {"replay": str(source), "on_miss": on_miss, **more}}
    return start_proxy({"intercept_upstreams": json.dumps(upstreams)})


@pytest.mark.parametrize("stream", [True, False])
def test_a_replay_session_answers_from_the_trace_in_the_harness_transport(
        recorded, start_proxy, sim, harness_env, stream):
    source, live = recorded
    replayer = _replayer(start_proxy, source)
    sim.clear()
    sim.stop()  # nothing may reach a model now
    session = replayer.create_session(id="again", upstream="yesterday")
    harness_env(session["env"])
    _, client = session_clients(session)
    again = _anthropic_dialog(client, stream=stream)
    replayer.api("DELETE", "sessions/again")  # sealed: every record is on disk
    assert _blocks(again) == _blocks(live)
    assert [r.stop_reason for r in again] == ["tool_use", "end_turn"]
    assert [r.usage.output_tokens for r in again] == [r.usage.output_tokens for r in live]
    replay = trace_of(replayer, "again")
    original = _read(source)
    assert [c.replayed_from.call for c in replay.calls] == [c.id for c in original.calls]
    assert {c.replayed_from.trace for c in replay.calls} == {original.id}
    assert [c.stream for c in replay.calls] == [stream, stream]
    assert replay.num_turns == 2 and len(replay.branches) == 1
    assert _diff(source, replayer.trace_dir / "again.msgpack").returncode == 0


def _read(path):
    from interceptor.trace import read_trace
    return read_trace(path)


def _diff(a, b, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPLAY_TRACE), "diff", str(a), str(b), *extra],
                          capture_output=True, text=True, timeout=60)


def test_a_changed_prompt_misses_with_the_turn_and_the_message_named(recorded, start_proxy, sim, harness_env):
    source, _ = recorded
    replayer = _replayer(start_proxy, source)
    sim.clear()
    session = replayer.create_session(id="edited", upstream="yesterday")
    harness_env(session["env"])
    _, client = session_clients(session)
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as err:
        _anthropic_dialog(client, stream=True, task="list the folders")
    replayer.api("DELETE", "sessions/edited")
    response = err.value.response
    assert response.headers["x-should-retry"] == "false"
    message = err.value.body["error"]["message"]
    original = _read(source)
    assert f"call {original.calls[0].id}" in message
    assert "message 1 (user) differs" in message and "'list the f" in message and "iles'" in message
    assert sim.requests == []
    trace = trace_of(replayer, "edited")
    assert trace.num_turns == 0 and [c.error.type for c in trace.calls] == ["replay_miss"]


def test_on_miss_upstream_forwards_the_miss_and_records_it_as_new(recorded, start_proxy, sim, harness_env):
    source, _ = recorded
    replayer = _replayer(start_proxy, source, on_miss="upstream", base_url=sim.url("/v1"), api_key_env=KEY_ENV)
    sim.clear()
    _script(sim)
    session = replayer.create_session(id="onward", upstream="yesterday")
    harness_env(session["env"])
    _, client = session_clients(session)
    got = _anthropic_dialog(client, stream=False, task="list the folders")
    assert got[-1].content[0].text == "There are two files."
    assert len(sim.model_requests()) == 2
    # ... while the recorded prompt is still answered from the record.
    sim.clear()
    _anthropic_dialog(client, stream=False)
    assert sim.requests == []
    replayer.api("DELETE", "sessions/onward")
    trace = trace_of(replayer, "onward")
    assert trace.num_turns == 4
    assert [c.replayed_from is not None for c in trace.calls] == [False, False, True, True]


def test_chat_and_responses_replay_in_their_own_dialect(proxy, start_proxy, sim, harness_env):
    sim.script(Reply(text="chat answer"), Reply(text="responses answer"))
    session = proxy.create_session(id="two-dialects")
    harness_env(session["env"])
    oai, _ = session_clients(session)
    chat = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    resp = oai.responses.create(model="m", input="hello", stream=False)
    proxy.api("DELETE", "sessions/two-dialects")
    replayer = _replayer(start_proxy, proxy.trace_dir / "two-dialects.msgpack")
    sim.clear()
    again = replayer.create_session(id="again", upstream="yesterday")
    harness_env(again["env"])
    oai, _ = session_clients(again)
    stream = oai.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
    with oai.responses.stream(model="m", input="hello") as s:
        final = s.get_final_response()
    assert final.output_text == resp.output_text and final.id == resp.id
    assert sim.requests == []
    # The same prompt in another dialect is a miss that says so.
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model="m", input=[{"role": "user", "content": "hi"}])
    assert "asked in the chat dialect, this request is responses" in str(err.value)


def test_replay_ignore_rules_match_what_moves_between_runs(proxy, start_proxy, sim, harness_env):
    sim.script(Reply(text="ok"))
    session = proxy.create_session(id="dated")
    harness_env(session["env"])
    oai, _ = session_clients(session)
    oai.chat.completions.create(model="m", messages=[{"role": "system", "content": "Today is 2026-11-30."},
                                                     {"role": "user", "content": "hi"}])
    proxy.api("DELETE", "sessions/dated")
    replayer = _replayer(start_proxy, proxy.trace_dir / "dated.msgpack")
    later = [{"role": "system", "content": "Today is 2026-12-01."}, {"role": "user", "content": "hi"}]
    strict_session = replayer.create_session(id="strict", upstream="yesterday")
    harness_env(strict_session["env"])
    import openai

    with pytest.raises(openai.BadRequestError):
        session_clients(strict_session)[0].chat.completions.create(model="m", messages=later)
    loose = replayer.create_session(id="loose", upstream="yesterday", replay={"ignore": [r"\d{4}-\d\d-\d\d"]})
    harness_env(loose["env"])
    assert session_clients(loose)[0].chat.completions.create(model="m", messages=later).choices[0].message.content == "ok"
    status, body = replayer.api("POST", "sessions", {"upstream": "yesterday", "replay": {"ignore": ["(unclosed"]}})
    assert status == 400 and "not a regular expression" in body["error"]["message"]


def test_a_replay_source_must_exist_when_declared(tmp_path):
    from interceptor.addons.upstream import parse_upstreams

    with pytest.raises(ValueError, match="r.replay: .*no trace file"):
        parse_upstreams(json.dumps({"r": {"replay": str(tmp_path / "none.msgpack")}}))


def test_pace_answers_after_the_recorded_duration(proxy, start_proxy, sim, harness_env):
    import time

    sim.script(Reply(text="slowly", first_byte_delay=1.5))
    session = proxy.create_session(id="slow")
    harness_env(session["env"])
    ask = [{"role": "user", "content": "take your time"}]
    session_clients(session)[0].chat.completions.create(model="m", messages=ask)
    proxy.api("DELETE", "sessions/slow")
    source = proxy.trace_dir / "slow.msgpack"
    assert _read(source).calls[0].duration >= 1.5
    replayer = _replayer(start_proxy, source, pace=True)
    again = replayer.create_session(upstream="yesterday")
    harness_env(again["env"])
    started = time.monotonic()
    answer = session_clients(again)[0].chat.completions.create(model="m", messages=ask)
    assert answer.choices[0].message.content == "slowly"
    assert time.monotonic() - started >= 1.5  # the recorded call's duration, waited out


# -- the matcher, in process (interceptor.trace.match) ---------------------------------------

def _rollout(tmp_path, turns: int = 3):
    from test_trace import Rollout, tool_turns

    r = Rollout(tmp_path / "src.msgpack")
    for prompt, reply in tool_turns(turns):
        r.send(prompt, reply)
    return r.recorder.trace, tool_turns(turns)


def test_every_recorded_prompt_finds_its_own_turn_and_a_restatement_too(tmp_path):
    from interceptor.trace.match import Hit, Matcher
    from test_trace import TOOLS

    trace, turns = _rollout(tmp_path, 4)
    m = Matcher(trace)
    for (prompt, reply), call in zip(turns, trace.calls):
        found = m.match(prompt, TOOLS, "openai_chat")
        assert isinstance(found, Hit) and found.call.id == call.id
        assert found.response.message.tool_calls[0].id == reply.tool_calls[0].id
        assert found.response.finish_reason == "tool_calls"


def test_a_miss_names_the_turn_the_message_and_how_it_differs(tmp_path):
    from interceptor.trace import Message
    from interceptor.trace.match import Matcher, Miss
    from test_trace import TOOLS

    trace, turns = _rollout(tmp_path, 3)
    prompt = list(turns[2][0])
    prompt[3] = Message(role="tool", tool_call_id="call_0", content="out 0, changed")
    found = Matcher(trace).match(prompt, TOOLS, "openai_chat")
    assert isinstance(found, Miss) and found.index == 3 and found.nearest.id == trace.calls[1].id
    assert "message 3 (tool) differs" in found.message() and "'out 0'" in found.message()
    assert "'out 0, changed'" in found.message()
    # Other tools, or another dialect, for a recorded prompt: a miss that says which.
    assert "the tools differ" in Matcher(trace).match(turns[0][0], [], "openai_chat").message()
    assert "dialect" in Matcher(trace).match(turns[0][0], TOOLS, "anthropic").message()
    # A prompt that goes on past the record.
    longer = turns[2][0] + [turns[2][1], Message(role="tool", tool_call_id="call_2", content="out 2"),
                            Message(role="user", content="more")]
    assert "past the end of the recorded prompt" in Matcher(trace).match(longer, TOOLS, "openai_chat").message()


def test_ignore_rules_take_paths_and_patterns_out_of_both_sides(tmp_path):
    from interceptor.trace import Message
    from interceptor.trace.match import Hit, Ignore, Matcher, Miss
    from test_trace import TOOLS

    trace, turns = _rollout(tmp_path, 2)
    prompt = [Message(role="system", content="You are a careful agent, run 7.")] + list(turns[1][0][1:])
    assert isinstance(Matcher(trace).match(prompt, TOOLS, "openai_chat"), Miss)
    for rules in ([r", run \d+"], ["$.messages[0]"], ["$.messages[*].content", "$.messages[*].tool_calls"]):
        assert isinstance(Matcher(trace, Ignore.parse(rules)).match(prompt, TOOLS, "openai_chat"), Hit), rules
    other_tools = [TOOLS[0].model_copy(update={"description": "runs a command"})]
    assert isinstance(Matcher(trace, Ignore.parse(["$.tools[*].description"])).match(
        turns[1][0], other_tools, "openai_chat"), Hit)
    for bad in ("$.nothing", "$messages", "(unclosed"):
        with pytest.raises(ValueError):
            Ignore.parse([bad])


def test_a_prompt_answered_twice_replays_both_answers_in_order_and_n_choices(tmp_path):
    from interceptor.trace import Choice, Message
    from interceptor.trace.match import Matcher
    from test_trace import TOOLS, Rollout

    r = Rollout(tmp_path / "twice.msgpack")
    prompt = [Message(role="user", content="pick a number")]
    r.send(prompt, Message(role="assistant", content="4"),
           choices=[Choice(index=1, message=Message(role="assistant", content="5"))])
    r.send(prompt, Message(role="assistant", content="7"))
    m = Matcher(r.recorder.trace)
    used: dict = {}
    first, second, third = (m.match(prompt, TOOLS, "openai_chat", used) for _ in range(3))
    assert [h.response.message.content for h in (first, second, third)] == ["4", "7", "7"]
    assert [c.message.content for c in first.response.choices] == ["5"]


def test_diff_names_the_first_turn_where_two_traces_part(tmp_path):
    from interceptor.trace import Message
    from interceptor.trace.match import Ignore, diff
    from test_trace import Rollout, tool_turns

    a, b = Rollout(tmp_path / "a.msgpack"), Rollout(tmp_path / "b.msgpack")
    for k, (prompt, reply) in enumerate(tool_turns(3)):
        a.send(prompt, reply)
        if k == 2:
            reply = Message(role="assistant", content="done at 12:01")
        b.send(prompt, reply)
    found = diff(a.recorder.trace, b.recorder.trace)
    assert not found.equal and found.parting.turn == 2 and "the reply differs" in found.parting.why
    assert diff(a.recorder.trace, a.recorder.trace).equal
    assert not diff(a.recorder.trace, b.recorder.trace, Ignore.parse([r"\d\d:\d\d"])).equal  # text still differs

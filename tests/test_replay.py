"""A replay upstream: a trace answers a session's requests instead of a model.

Each test records a conversation live (a real mitmdump, the real SDKs, the simulator), then
starts a second proxy whose declared upstream is that trace and asks the same things again,
with the simulator out of the picture: the answers come from the record, in the dialect and
transport asked, and the replay's own trace says where each came from."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
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


def _dated(proxy, sim, harness_env, system: str):
    """One Chat turn recorded live under ``system``: the trace's path."""
    sim.script(Reply(text="ok"))
    session = proxy.create_session(id="dated")
    harness_env(session["env"])
    oai, _ = session_clients(session)
    oai.chat.completions.create(model="m", messages=[{"role": "system", "content": system},
                                                     {"role": "user", "content": "hi"}])
    proxy.api("DELETE", "sessions/dated")
    return proxy.trace_dir / "dated.msgpack"


def test_replay_ignore_rules_match_what_moves_between_runs(proxy, start_proxy, sim, harness_env):
    replayer = _replayer(start_proxy, _dated(proxy, sim, harness_env, "Today is 2026-11-30."))
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
    from interceptor.addons.gateway.sessions.upstream import parse_upstreams

    with pytest.raises(ValueError, match="r.replay: .*no trace file"):
        parse_upstreams(json.dumps({"r": {"replay": str(tmp_path / "none.msgpack")}}))


def _timed_chat(client, ask) -> tuple[str, list[float]]:
    """A streamed Chat answer through the SDK: its text, and when each chunk arrived (seconds
    after the request was sent), measured here in the client."""
    import time

    started = time.monotonic()
    text, times = [], []
    for chunk in client.chat.completions.create(model="m", messages=ask, stream=True,
                                                stream_options={"include_usage": True}):
        times.append(time.monotonic() - started)
        text += [c.delta.content or "" for c in chunk.choices]
    return "".join(text), times


GAPS = [0.25, 0.7, 0.1, 0.45]  # seconds before each event after the first: uneven on purpose


def test_a_paced_replay_sends_each_event_at_its_recorded_time(proxy, start_proxy, sim, harness_env):
    sim.script(Reply(text="slowly", first_byte_delay=0.6, delay=GAPS))
    session = proxy.create_session(id="slow")
    harness_env(session["env"])
    ask = [{"role": "user", "content": "take your time"}]
    text, live = _timed_chat(session_clients(session)[0], ask)
    proxy.api("DELETE", "sessions/slow")
    source = proxy.trace_dir / "slow.msgpack"
    call = _read(source).calls[0]
    # The record: one gap per event the proxy read (the SSE events, [DONE] included).
    assert len(call.event_gaps_ms) == len(GAPS) + 1
    assert call.event_gaps_ms[1:] == pytest.approx([g * 1000 for g in GAPS], abs=60)
    replayer = _replayer(start_proxy, source, pace=True)
    plain = _replayer(start_proxy, source)
    sim.stop()  # nothing may reach a model now
    again = replayer.create_session(id="paced", upstream="yesterday")
    harness_env(again["env"])
    text_again, paced = _timed_chat(session_clients(again)[0], ask)
    assert text_again == text == "slowly"
    # The dialect renders the reply as the simulator streamed it (role, text, finish, usage),
    # so each chunk arrives at the live run's time for it, within scheduling noise.
    assert len(paced) == len(live) == 4
    assert paced == pytest.approx(live, abs=0.25)
    assert paced[0] >= 0.55 and paced[-1] >= 0.6 + sum(GAPS[:3]) - 0.05
    # Asked for JSON, the paced replay answers whole at the recorded call's end.
    import time

    started = time.monotonic()
    answer = session_clients(again)[0].chat.completions.create(model="m", messages=ask)
    assert answer.choices[0].message.content == "slowly"
    assert time.monotonic() - started >= call.duration - 0.05
    # Unpaced, the same replay does not wait.
    quick = plain.create_session(id="quick", upstream="yesterday")
    harness_env(quick["env"])
    _, unpaced = _timed_chat(session_clients(quick)[0], ask)
    assert unpaced[-1] < 0.5
    replayer.api("DELETE", "sessions/paced")
    replay = trace_of(replayer, "paced")
    assert [c.replayed_from.call for c in replay.calls] == [call.id, call.id] and replay.num_turns == 2


def test_a_paced_replay_spreads_a_coarser_rendering_over_the_recorded_times(proxy, start_proxy, sim, harness_env):
    """Anthropic streams text piece by piece; the replay renders it as one delta. The first
    event and the last still come at their recorded times, and nothing in between is early."""
    import time

    pieces = ["a", "b", "c", "d", "e", "f"]
    sim.script(Reply(text=pieces, first_byte_delay=0.4, delay=0.2))
    session = proxy.create_session(id="pieces")
    harness_env(session["env"])
    ask = [{"role": "user", "content": "spell it"}]

    def timed(client):
        started, times = time.monotonic(), []
        with client.messages.stream(model="claude-x", max_tokens=64, messages=ask) as s:
            for _ in s:
                times.append(time.monotonic() - started)
            return s.get_final_message(), times

    live_reply, live = timed(session_clients(session)[1])
    proxy.api("DELETE", "sessions/pieces")
    source = proxy.trace_dir / "pieces.msgpack"
    replayer = _replayer(start_proxy, source, pace=True)
    sim.stop()
    again = replayer.create_session(id="paced", upstream="yesterday")
    harness_env(again["env"])
    reply, paced = timed(session_clients(again)[1])
    assert reply.content[0].text == live_reply.content[0].text == "abcdef"
    assert len(paced) < len(live)  # one text delta instead of six
    assert paced[0] == pytest.approx(live[0], abs=0.25)
    assert paced[-1] == pytest.approx(live[-1], abs=0.25)
    assert all(b >= a for a, b in zip(paced, paced[1:]))


def test_a_paced_replay_over_codex_websocket_sends_each_frame_at_its_recorded_time(
        proxy, start_proxy, sim, harness_env):
    import time

    from wsclient import WSClient

    sim.script(Reply(text="framed", first_byte_delay=0.5, delay=[0.1, 0.6, 0.05, 0.4, 0.1, 0.3, 0.05, 0.2]))
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "frame it"}]}

    def timed(server, session):
        ws = WSClient("wss://api.openai.com/v1/responses", proxy=server.url, cafile=str(server.ca_bundle),
                      headers={"Authorization": f"Bearer {session['model_secret']}"})
        with ws:
            create = {"type": "response.create", "model": "m", "stream": True}
            ws.send_json({**create, "generate": False, "input": [user]})
            warm = ws.until("response.completed")[-1]["response"]["id"]
            ws.send_json({**create, "previous_response_id": warm, "input": []})
            started, frames = time.monotonic(), []
            while not frames or frames[-1][1]["type"] != "response.completed":
                frame = ws.recv_json()
                frames.append((time.monotonic() - started, frame))
        return [t for t, _ in frames], [f["type"] for _, f in frames]

    session = proxy.create_session(id="ws-slow")
    live, live_types = timed(proxy, session)
    proxy.api("DELETE", "sessions/ws-slow")
    source = proxy.trace_dir / "ws-slow.msgpack"
    assert len(_read(source).calls[0].event_gaps_ms) == len(live)
    replayer = _replayer(start_proxy, source, pace=True)
    sim.stop()
    again = replayer.create_session(id="ws-paced", upstream="yesterday")
    paced, types = timed(replayer, again)
    # Rendered as the simulator streamed it, frame for frame: each at its own recorded time.
    assert types == live_types and types[-1] == "response.completed"
    assert paced == pytest.approx(live, abs=0.25)


def test_a_miss_through_the_proxy_shows_the_difference_left_after_the_rules(proxy, start_proxy, sim, harness_env):
    """What the session's replay.ignore rules take out is no difference: the miss shows the
    two sides as they were compared, so a user can tell the rule worked and what did not match."""
    replayer = _replayer(start_proxy, _dated(proxy, sim, harness_env, "Today is 2026-11-30. Be brief."))
    loose = replayer.create_session(id="loose", upstream="yesterday", replay={"ignore": [r"\d{4}-\d\d-\d\d"]})
    harness_env(loose["env"])
    with pytest.raises(openai.BadRequestError) as err:
        session_clients(loose)[0].chat.completions.create(
            model="m", messages=[{"role": "system", "content": "Today is 2026-12-01. Be verbose."},
                                 {"role": "user", "content": "hi"}])
    message = err.value.response.json()["error"]["message"]
    assert "message 0 (system) differs" in message, message
    assert "'Today is . Be brief.'" in message and "'Today is . Be verbose.'" in message, message
    assert "2026" not in message, message  # what the rule took out is not reported as a difference
    assert f"replay miss: {message}" in replayer.log()


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


def test_the_matcher_and_diff_report_the_compared_forms(tmp_path):
    """The matcher in process: a pattern and a path rule; the miss and ``diff`` (scripts/replay_trace.py)
    both show the two sides as the rules left them."""
    from interceptor.trace.match import Hit, Ignore, Matcher, Miss, diff
    from test_trace import TOOLS, Rollout

    trace, turns = _rollout(tmp_path, 2)
    prompt = list(turns[1][0])
    user = prompt[1]  # "fix the bug"
    ignore = Ignore.parse([r" run \d+"])
    prompt[1] = user.model_copy(update={"content": "fix the bug run 8"})
    assert isinstance(Matcher(trace, ignore).match(prompt, TOOLS, "openai_chat"), Hit)  # the rule works
    prompt[1] = user.model_copy(update={"content": "fix the bug run 8 twice"})
    miss = Matcher(trace, ignore).match(prompt, TOOLS, "openai_chat")
    assert isinstance(miss, Miss) and miss.index == 1
    assert "recorded 'fix the bug' vs sent 'fix the bug twice'" in miss.message(), miss.message()
    # A tool result whose content a path rule takes out: what is left (its call id) is compared.
    k = next(i for i, m in enumerate(prompt) if m.role == "tool")
    prompt = list(turns[1][0])
    prompt[k] = prompt[k].model_copy(update={"content": "different output", "tool_call_id": "call_x"})
    miss = Matcher(trace, Ignore.parse(["$.messages[*].content"])).match(prompt, TOOLS, "openai_chat")
    assert isinstance(miss, Miss) and miss.index == k
    assert "call_x" in miss.message() and "different output" not in miss.message(), miss.message()
    # diff: two runs apart by the ignored pattern and one real word.
    other = Rollout(tmp_path / "other.msgpack")
    for (p, reply) in turns:
        p = list(p)
        p[1] = user.model_copy(update={"content": "fix the bug run 9 now"})
        other.send(p, reply)
    parting = diff(trace, other.recorder.trace, ignore).parting
    assert parting is not None and "recorded 'fix the bug' vs sent 'fix the bug now'" in parting.why, parting

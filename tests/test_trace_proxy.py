"""The trace through the real proxy: the graph a real SDK conversation makes, the
training fields from an upstream that plays vLLM, crash recovery, schema versions.

One simulator and one mitmdump serve the whole module (each test makes its own session);
the crash tests start their own proxies, since they kill them.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import anthropic
import msgpack
import openai
import pytest

from interceptor.trace import (
    MIN_SCHEMA_VERSION,
    SCHEMA_VERSION,
    TornRecordWarning,
    TraceVersionError,
    iter_records,
    read_trace,
)
from interceptor.trace.verify import problems
from clients import KEY_ENV, REAL_KEY, session_clients
from mitm import ROOT, MitmProcess
from provider import ProviderSimulator, Reply, ToolCall
from provider import tokens as sim_tokens
from provider.turn import Turn
from waiting import wait_until

REPLAY = [sys.executable, str(ROOT / "scripts" / "replay_trace.py")]
SYSTEM = "You are a careful coding agent."
TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "run a command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]
ANTHROPIC_TOOLS = [{"name": "bash", "description": "run a command",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]
GOLDEN_V1 = Path(__file__).parent / "data" / "trace-v1.msgpack"


# --- fixtures: one simulator and one proxy for the module ------------------------------------

@pytest.fixture(scope="module")
def msim():
    with ProviderSimulator() as s:
        yield s


@pytest.fixture(scope="module")
def mproxy(msim):
    proc = MitmProcess(options={"intercept_upstream": msim.url("/v1"), "intercept_api_key_env": KEY_ENV},
                       env={KEY_ENV: REAL_KEY})
    proc.start()
    yield proc
    proc.cleanup()


@pytest.fixture
def session(mproxy, msim, harness_env):
    """``session(**config)``: a new session on the module's proxy, its env applied."""
    msim.clear()
    msim.clear_scripts()
    msim.default = None

    def create(**config):
        config.setdefault("upstream", {"base_url": msim.url("/v1")})
        s = mproxy.create_session(**config)
        harness_env(s["env"])
        return s

    yield create
    msim.default = None


def sealed_trace(proxy: MitmProcess, s: dict):
    status, _ = proxy.api("DELETE", f"sessions/{s['id']}")
    assert status == 200
    assert kinds(s["trace_path"])[-1:] == ["footer"]  # DELETE answers once it is on disk
    with warnings.catch_warnings():
        warnings.simplefilter("error", TornRecordWarning)  # a clean file reads without one
        return read_trace(s["trace_path"])


def replay_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*REPLAY, *args], capture_output=True, text=True, timeout=60)


# --- a harness: the agent loop of an SDK script ----------------------------------------------

def step_reply(k: int, last: int) -> Reply:
    if k == last:
        return Reply(text="All steps done.")
    return Reply(text=f"Running step {k}.", tool_calls=[ToolCall(name="bash", arguments={"cmd": f"step {k}"})])


def chat_turn(oai: openai.OpenAI, messages: list, *, stream: bool, **kw):
    """One request; returns (the assistant message as a harness restates it: content and
    tool calls, no reasoning; everything the SDK handed over, dumped; the logprobs seen)."""
    seen, logprobs = [], []
    if not stream:
        r = oai.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS, **kw)
        seen.append(r.model_dump())
        msg = r.choices[0].message
        content = msg.content
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in msg.tool_calls or []]
        if r.choices[0].logprobs is not None:
            logprobs.append(r.choices[0].logprobs)
    else:
        parts, slots = [], {}
        for chunk in oai.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS,
                                                 stream=True, **kw):
            seen.append(chunk.model_dump())
            for ch in chunk.choices:
                if ch.delta.content:
                    parts.append(ch.delta.content)
                for tc in ch.delta.tool_calls or []:
                    slot = slots.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                    slot["id"] = tc.id or slot["id"]
                    if tc.function:
                        slot["name"] += tc.function.name or ""
                        slot["arguments"] += tc.function.arguments or ""
                if ch.logprobs is not None:
                    logprobs.append(ch.logprobs)
        content = "".join(parts) or None
        calls = [slots[k] for k in sorted(slots)]
    assistant = {"role": "assistant", "content": content}
    if calls:
        assistant["tool_calls"] = [{"id": c["id"], "type": "function",
                                    "function": {"name": c["name"], "arguments": c["arguments"]}}
                                   for c in calls]
    return assistant, seen, logprobs


def chat_loop(oai, turns: int, *, stream: bool, messages: list | None = None, task: str = "fix the bug",
              **kw) -> tuple[list, list]:
    """A tool loop: each turn restates everything, appends the reply and one tool result per
    call. Returns (the final history, what the SDK handed over on every turn)."""
    messages = messages if messages is not None else [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
    seen = []
    for _ in range(turns):
        assistant, got, _ = chat_turn(oai, messages, stream=stream, **kw)
        seen += got
        messages.append(assistant)
        for call in assistant.get("tool_calls", []):
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": f"ran {call['function']['arguments']}"})
    return messages, seen


def anthropic_loop(ant: anthropic.Anthropic, turns: int, *, stream: bool) -> list:
    messages = [{"role": "user", "content": "fix the bug"}]
    for _ in range(turns):
        kw = dict(model="claude-x", max_tokens=200, system=SYSTEM, tools=ANTHROPIC_TOOLS, messages=messages)
        if stream:
            with ant.messages.stream(**kw) as s:
                r = s.get_final_message()
        else:
            r = ant.messages.create(**kw)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
        results = [{"type": "tool_result", "tool_use_id": b.id, "content": f"ran {json.dumps(b.input)}"}
                   for b in r.content if b.type == "tool_use"]
        if results:
            messages.append({"role": "user", "content": results})
    return messages


def assert_sound(trace, path):
    assert problems(trace) == []
    out = replay_cli("verify", str(path))
    assert out.returncode == 0, out.stderr
    assert "ok (" in out.stdout


# --- the graph -------------------------------------------------------------------------------

@pytest.mark.parametrize("api", ["chat", "chat-stream", "messages-stream"])
def test_ten_turn_tool_conversation_is_one_branch(session, mproxy, msim, api):
    s = session()
    msim.script(*[step_reply(k, 9) for k in range(10)])
    oai, ant = session_clients(s)
    if api.startswith("chat"):
        history, _ = chat_loop(oai, 10, stream=api.endswith("stream"))
        distinct = len(history)  # system, user, 10 replies, 9 tool results
    else:
        history = anthropic_loop(ant, 10, stream=True)
        distinct = 1 + len(history)  # the top-level system prompt is a node too
    assert distinct == 21
    trace = sealed_trace(mproxy, s)
    assert trace.num_turns == 10
    assert len(trace.branches) == 1
    assert len(trace.nodes) == distinct  # every restated prefix was reused, nothing repeated
    assert [c.node for c in trace.calls] == [i for i, n in enumerate(trace.nodes) if n.sampled]
    assert trace.messages[-1].text() == "All steps done."
    turns = [rec for _, rec in iter_records(s["trace_path"]) if rec["kind"] == "turn"]
    assert [len(t["nodes"]) for t in turns] == [3] + [2] * 9  # each turn writes only what is new
    assert_sound(trace, s["trace_path"])


def test_compaction_makes_a_second_branch_sharing_the_system_node(session, mproxy, msim):
    s = session()
    msim.script(*[step_reply(k, 6) for k in range(7)])
    oai, _ = session_clients(s)
    history, _ = chat_loop(oai, 4, stream=True)
    compacted = [history[0], {"role": "user", "content": "Summary so far: ran steps 0-3. Go on."}]
    chat_loop(oai, 3, stream=True, messages=compacted)
    trace = sealed_trace(mproxy, s)
    assert trace.num_turns == 7
    assert len(trace.branches) == 2
    before, after = trace.branches
    assert before.nodes[0] == after.nodes[0] == 0  # one system node, shared
    assert set(before.nodes) & set(after.nodes) == {0}
    # each history's last tool result was never sent; the system prompt is stored once
    assert len(trace.nodes) == (len(history) - 1) + (len(compacted) - 1)
    assert trace.messages[-1].text() == "All steps done."
    assert_sound(trace, s["trace_path"])


def test_two_interleaved_subagents_make_two_branches(session, mproxy, msim):
    s = session()
    oai, _ = session_clients(s)
    main = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "main task"}]
    sub = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "sub-agent: search the code"}]
    for k in range(3):  # main and sub-agent take turns on the same session
        for history in (main, sub):
            msim.script(step_reply(k, 2))
            chat_loop(oai, 1, stream=k % 2 == 0, messages=history)
    trace = sealed_trace(mproxy, s)
    assert trace.num_turns == 6
    assert len(trace.branches) == 2
    a, b = trace.branches
    assert a.nodes[0] == b.nodes[0]  # the shared system prompt, once
    assert sorted(len(br.calls) for br in trace.branches) == [3, 3]
    assert len(trace.nodes) == len(main) + len(sub) - 1
    assert_sound(trace, s["trace_path"])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_reply_restated_without_its_reasoning_stays_on_one_branch(session, mproxy, msim, stream):
    """vLLM sends reasoning_content; a Chat harness does not send it back. The turn must not
    branch, and the sampled nodes keep the reasoning the model produced."""
    s = session()
    replies = [step_reply(k, 4).replace(reasoning=f"I should run step {k}.") for k in range(5)]
    msim.script(*replies)
    oai, _ = session_clients(s)
    history, seen = chat_loop(oai, 5, stream=stream)
    assert "reasoning_content" in json.dumps(seen)  # the harness did get it, and dropped it
    assert all("reasoning_content" not in m for m in history)
    trace = sealed_trace(mproxy, s)
    assert trace.num_turns == 5 and len(trace.branches) == 1
    assert len(trace.nodes) == len(history)
    assert [n.message.reasoning[0].text for n in trace.nodes if n.sampled] == \
        [f"I should run step {k}." for k in range(5)]
    assert_sound(trace, s["trace_path"])


def test_reply_restated_with_other_reasoning_branches(session, mproxy, msim):
    s = session()
    msim.script(Reply(reasoning="First thought.", text="one"), Reply(text="two"))
    oai, _ = session_clients(s)
    history, _ = chat_loop(oai, 1, stream=False)
    history[-1]["reasoning_content"] = "An edited thought."  # not what the model produced
    history.append({"role": "user", "content": "and then?"})
    chat_loop(oai, 1, stream=False, messages=history)
    trace = sealed_trace(mproxy, s)
    assert len(trace.branches) == 2
    assert_sound(trace, s["trace_path"])


# --- training fields from an upstream that plays vLLM ------------------------------------------

ROLE_IDS = {"system": 200_001, "user": 200_002, "assistant": 200_003, "tool": 200_004}


def render(messages: list[dict]) -> list[int]:
    """A toy chat template over the simulator's tokenizer: ``[role] body`` per message, then
    the generation scaffold ``[assistant]``. An assistant message renders as the tokens it
    was sampled as (reasoning if restated, text, tool-call arguments), as vLLM's would."""
    ids: list[int] = []
    for m in messages:
        ids.append(ROLE_IDS[m["role"]])
        content = m.get("content")
        if isinstance(content, list):  # text parts render as their text, as vLLM joins them
            content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
        for text in (m.get("reasoning_content"), content):
            if isinstance(text, str):
                ids += sim_tokens.ids(sim_tokens.split(text))
        for call in m.get("tool_calls") or []:
            ids += sim_tokens.ids(sim_tokens.split(call["function"]["arguments"]))
    return ids + [ROLE_IDS["assistant"]]


class FakeVLLM:
    """The simulator's default reply: the next scripted answer, with prompt token ids from
    ``render``; remembers what each request was answered with, to check alignment."""

    def __init__(self, replies: list[Reply]):
        self.replies = list(replies)
        self.sent: list[tuple[list[int], list[int], list[float]]] = []

    def __call__(self, record) -> Reply:
        reply = self.replies.pop(0).replace(prompt_token_ids=render(record.json["messages"]))
        pieces = Turn(record.json, reply, default_model="m").all_pieces()
        self.sent.append((reply.prompt_token_ids, [p.token_id for p in pieces], [p.logprob for p in pieces]))
        return reply


def check_branch_tokens(trace, vllm: FakeVLLM) -> None:
    """The branch invariant: each branch's token ids are its last call's prompt + completion
    ids as the upstream sent them; the mask is true exactly on every reply of the path, where
    its own call put it, with its logprobs (0.0 elsewhere)."""
    sent = {c.id: vllm.sent[k] for k, c in enumerate(trace.calls)}
    for b in trace.branches:
        prompt, completion, _ = sent[b.calls[-1]]
        assert b.token_ids == prompt + completion
        mask, lps = [False] * len(b.token_ids), [0.0] * len(b.token_ids)
        for call_id in b.calls:
            start, ids, values = len(sent[call_id][0]), sent[call_id][1], sent[call_id][2]
            assert b.token_ids[start:start + len(ids)] == ids
            mask[start:start + len(ids)] = [True] * len(ids)
            lps[start:start + len(ids)] = values
        assert b.sampled_mask == mask and b.logprobs == lps


def assert_no_training_fields(seen: list[dict], *, logprobs_kept: bool = False):
    text = json.dumps(seen)
    assert "token_ids" not in text  # neither prompt_token_ids nor token_ids
    for obj in seen:
        for choice in obj["choices"]:
            assert (choice["logprobs"] is not None) == (logprobs_kept and bool(choice["logprobs"]))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_training_fields_from_vllm_align_and_never_reach_the_harness(session, mproxy, msim, stream):
    s = session(collect_tokens=True)
    # Turn 2 reasons; the harness restates it without, so the template renders it without:
    # those tokens differ from the sampled ones and the trace branches there (retokenised).
    replies = [step_reply(0, 3), step_reply(1, 3).replace(reasoning="Think about step 1."),
               step_reply(2, 3), step_reply(3, 3)]
    vllm = msim.default = FakeVLLM(replies)
    oai, _ = session_clients(s)
    history, seen = chat_loop(oai, 4, stream=stream)
    assert_no_training_fields(seen)
    for request in msim.model_requests():
        assert request.json["return_token_ids"] is True and request.json["logprobs"] is True
        assert "stream_options" not in request.json  # nothing else was asked for
    trace = sealed_trace(mproxy, s)
    assert trace.num_turns == 4
    assert len(trace.branches) == 2  # at the reasoning turn, as the tokens say
    check_branch_tokens(trace, vllm)
    for call, (prompt, completion, _) in zip(trace.calls, vllm.sent):
        assert {o.key: (o.new, o.reason) for o in call.overrides
                if o.reason == "collect_tokens"} == {"return_token_ids": (True, "collect_tokens"),
                                                        "logprobs": (True, "collect_tokens")}
        assert call.sampling.logprobs is True  # what the upstream received
        # the stream carried no usage (the harness did not ask): counted from the token ids
        assert (call.usage.input_tokens, call.usage.output_tokens) == (len(prompt), len(completion))
        assert not call.usage.estimated
    # each exchange's rewrite follows its turn, written before the harness got the answer
    assert kinds(s["trace_path"]) == ["header"] + ["turn", "rewrite"] * 4 + ["footer"]
    removed = {"prompt_token_ids", "choices[].token_ids", "choices[].logprobs"}
    assert [(r.call, set(r.removed), r.body) for r in trace.response_rewrites] == \
        [(c.id, removed, "sse" if stream else "json") for c in trace.calls]
    assert_sound(trace, s["trace_path"])
    shown = replay_cli("show", s["trace_path"]).stdout
    assert "== rewrites ==" in shown and shown.count("collect_tokens") == 4
    assert f"{len(trace.branches[-1].token_ids)} tokens" in shown
    assert len(json.loads(replay_cli("show", "--json", s["trace_path"]).stdout)["response_rewrites"]) == 4
    out = replay_cli("export", s["trace_path"], "--out", "-")
    samples = [json.loads(line) for line in out.stdout.splitlines()]
    assert [smp["token_ids"] for smp in samples] == [b.token_ids for b in trace.branches]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_logprobs_the_harness_asked_for_are_kept(session, mproxy, msim, stream):
    s = session(collect_tokens=True)
    vllm = msim.default = FakeVLLM([Reply(text="Hello there, harness.")])
    oai, _ = session_clients(s)
    _, seen = chat_loop(oai, 1, stream=stream, logprobs=True)
    assert_no_training_fields(seen, logprobs_kept=True)
    got = [e["logprob"] for obj in seen for ch in obj["choices"] if ch["logprobs"]
           for e in ch["logprobs"]["content"]]
    assert got == vllm.sent[0][2]
    trace = sealed_trace(mproxy, s)
    [call] = trace.calls
    assert [o.key for o in call.overrides if o.reason == "collect_tokens"] == ["return_token_ids"]
    assert trace.response_rewrites[0].removed == ["choices[].token_ids", "prompt_token_ids"]
    assert trace.branches[0].logprobs[-len(got):] == got


def vllm_chunk(delta, token_ids, logprob=None, finish=None, **top) -> bytes:
    lp = {"content": [{"token": "t", "logprob": logprob, "bytes": [116], "top_logprobs": []}],
          "refusal": None} if logprob is not None else None
    choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish, "token_ids": token_ids}
    obj = {"id": "chatcmpl-v", "object": "chat.completion.chunk", "created": 1, "model": "q", "choices": [choice], **top}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_a_chunk_that_only_carried_token_ids_is_dropped_and_the_stream_goes_on(session, mproxy, msim):
    """vLLM sends an empty delta for a token its parser held back, only because token ids
    were asked for: the harness does not get it, and its stream still ends properly."""
    s = session(collect_tokens=True)
    raw = b"".join([
        vllm_chunk({"role": "assistant", "content": ""}, [], prompt_token_ids=[1, 2, 3]),
        vllm_chunk({"content": "Hel"}, [11], -0.1),
        vllm_chunk({}, [12], -0.2),  # the held-back token
        vllm_chunk({"content": "lo"}, [13], -0.3),
        vllm_chunk({}, [], finish="stop"),
        b"data: [DONE]\n\n"])
    msim.script(Reply(raw=raw, content_type="text/event-stream"))
    oai, _ = session_clients(s)
    chunks = list(oai.chat.completions.create(model="q", messages=[{"role": "user", "content": "hi"}], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello"
    assert chunks[-1].choices[0].finish_reason == "stop" and len(chunks) == 4
    assert_no_training_fields([c.model_dump() for c in chunks])
    trace = sealed_trace(mproxy, s)
    [branch] = trace.branches
    assert branch.token_ids == [1, 2, 3, 11, 12, 13]
    assert branch.logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, -0.3]
    [rewrite] = trace.response_rewrites
    assert (rewrite.events, rewrite.dropped_events) == (4, 1)


def test_logprobs_the_harness_turned_off_are_asked_for_and_stripped(session, mproxy, msim):
    s = session(collect_tokens=True)
    msim.default = FakeVLLM([Reply(text="Quiet answer.")])
    oai, _ = session_clients(s)
    _, seen = chat_loop(oai, 1, stream=False, logprobs=False)
    assert_no_training_fields(seen)
    [request] = msim.model_requests()
    assert request.json["logprobs"] is True and request.json["return_token_ids"] is True
    trace = sealed_trace(mproxy, s)
    changes = {o.key: (o.old, o.new) for o in trace.calls[0].overrides if o.reason == "collect_tokens"}
    assert changes == {"return_token_ids": (None, True), "logprobs": (False, True)}
    assert trace.branches[0].token_ids is not None


def test_sessions_that_do_not_collect_ask_for_nothing(session, mproxy, msim):
    s = session()
    oai, _ = session_clients(s)
    chat_loop(oai, 1, stream=True)
    [request] = msim.model_requests()
    assert "return_token_ids" not in request.json and "logprobs" not in request.json
    trace = sealed_trace(mproxy, s)
    assert trace.response_rewrites == [] and trace.branches[0].token_ids is None


# --- crashes ---------------------------------------------------------------------------------

def start_crash_proxy(sim: ProviderSimulator, **env) -> tuple[MitmProcess, dict]:
    proc = MitmProcess(options={"intercept_upstream": sim.url("/v1"), "intercept_api_key_env": KEY_ENV},
                       env={KEY_ENV: REAL_KEY, **env}).start()
    s = proc.create_session(collect_tokens=True, upstream={"base_url": sim.url("/v1")})
    return proc, s


def read_with_warnings(path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace = read_trace(path)
    return trace, [w for w in caught if issubclass(w.category, TornRecordWarning)]


def kinds(path) -> list[str]:
    if not Path(path).exists():  # the writer has not got to it yet
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [rec["kind"] for _, rec in iter_records(path)]


def settled(path, turns: int):
    """Every record of ``turns`` collecting turns is on disk (a turn, then its rewrite)."""
    return lambda: kinds(path) == ["header"] + ["turn", "rewrite"] * turns


def test_kill_9_between_turns_keeps_every_turn(sim, harness_env, tmp_path):
    sim.strict = False  # a vLLM upstream (return_token_ids): OpenAI's rules are not its rules
    proc, s = start_crash_proxy(sim)
    try:
        harness_env(s["env"])
        sim.default = FakeVLLM([step_reply(k, 99) for k in range(6)])
        oai, _ = session_clients(s)
        chat_loop(oai, 6, stream=True)
        # The writer thread appends after the turn is committed; give it its moment, as a
        # harness's own next step would, then kill without any chance to clean up.
        wait_until(settled(s["trace_path"], 6), 10, "six turns and their rewrites on disk")
        proc.stop(signal.SIGKILL)
        trace, torn = read_with_warnings(s["trace_path"])
        assert torn == []
        assert trace.num_turns == 6 and not trace.sealed and len(trace.branches) == 1
        assert_sound(trace, s["trace_path"])
        cut_at_random_offsets(Path(s["trace_path"]), tmp_path)
    finally:
        proc.cleanup()


def cut_at_random_offsets(path: Path, tmp_path: Path):
    """The file of a killed proxy, cut anywhere: every complete record stands, a torn tail
    is warned about once, and what is left verifies."""
    data = path.read_bytes()
    records = list(iter_records(path))
    ends = [offset for offset, _ in records[1:]] + [len(data)]  # where each record ends
    full = read_trace(path)
    rng = random.Random(4)
    for cut in sorted(rng.sample(range(ends[0], len(data)), 40)) + ends[:4]:
        part = tmp_path / f"cut-{cut}.msgpack"
        part.write_bytes(data[:cut])
        trace, torn = read_with_warnings(part)
        assert len(torn) == (0 if cut in ends else 1)
        turns = sum(end <= cut and rec["kind"] == "turn" for end, (_, rec) in zip(ends, records))
        assert trace.num_turns == turns
        assert trace.nodes == full.nodes[:len(trace.nodes)]
        assert trace.calls == full.calls[:turns]
        assert problems(trace) == []
        part.unlink()


def test_kill_9_in_the_middle_of_a_write(sim, harness_env):
    """With the store's torn-write hook each record reaches the file in two halves 0.4 s
    apart: the kill lands inside the fourth turn's record for sure."""
    sim.strict = False  # a vLLM upstream (return_token_ids): OpenAI's rules are not its rules
    proc, s = start_crash_proxy(sim, INTERCEPT_TEST_TORN_WRITES="0.4")
    path = Path(s["trace_path"])
    try:
        harness_env(s["env"])
        sim.default = FakeVLLM([step_reply(k, 99) for k in range(4)])
        oai, _ = session_clients(s)
        history, _ = chat_loop(oai, 3, stream=True)
        wait_until(settled(path, 3), 30, "three turns and their rewrites on disk")
        size = path.stat().st_size
        chat_loop(oai, 1, stream=False, messages=history)  # its turn record is being written:
        wait_until(lambda: path.stat().st_size > size, 10, "part of the fourth turn on disk")  # half of it
        proc.stop(signal.SIGKILL)
        trace, torn = read_with_warnings(path)
        assert len(torn) == 1 and "torn last record" in str(torn[0].message)
        assert trace.num_turns == 3 and len(trace.branches) == 1
        assert problems(trace) == []
        out = replay_cli("verify", str(path))
        assert out.returncode == 0 and out.stderr.count("torn last record") == 1
    finally:
        proc.cleanup()


# --- schema versions -------------------------------------------------------------------------

def with_header_version(src: Path, dst: Path, version: int) -> Path:
    from interceptor.trace.records import CHECKSUMS_SINCE
    from interceptor.trace.store import checksum, pack

    records = [rec for _, rec in iter_records(src)]
    records[0]["schema_version"] = version
    if version < CHECKSUMS_SINCE:  # as that version's writer wrote them: no checksums
        dst.write_bytes(b"".join(msgpack.packb(r, use_bin_type=True) for r in records))
        return dst
    out, crc = [], 0
    for r in records:
        out.append(pack(r, crc))
        crc = checksum(out[-1])
    dst.write_bytes(b"".join(out))
    return dst


def test_reader_refuses_a_newer_schema_and_reads_every_supported_one(session, mproxy, msim, tmp_path):
    s = session(collect_tokens=True)
    msim.default = FakeVLLM([step_reply(0, 1), step_reply(1, 1)])
    oai, _ = session_clients(s)
    chat_loop(oai, 2, stream=True)
    written = sealed_trace(mproxy, s)
    src = Path(s["trace_path"])
    for version in range(MIN_SCHEMA_VERSION, SCHEMA_VERSION + 1):
        older = read_trace(with_header_version(src, tmp_path / f"v{version}.msgpack", version))
        assert older.schema_version == version
        assert older.branches == written.branches and older.calls == written.calls
    newer = with_header_version(src, tmp_path / "newer.msgpack", SCHEMA_VERSION + 1)
    with pytest.raises(TraceVersionError, match=f"schema version {SCHEMA_VERSION + 1}.*Upgrade llm-interceptor"):
        read_trace(newer)
    out = replay_cli("verify", str(newer))
    assert out.returncode == 1 and "Upgrade llm-interceptor" in out.stderr


def test_reads_the_golden_file_of_the_previous_version():
    """A file the proxy wrote with schema version 1 (tests/data, made by
    tests/data/make_golden.py). It stays when the version moves on, so the reader keeps
    proving it folds what older proxies wrote."""
    trace = read_trace(GOLDEN_V1)
    assert trace.schema_version == 1 >= MIN_SCHEMA_VERSION
    assert trace.num_turns == 3 and trace.sealed
    assert all(b.token_ids is not None for b in trace.branches)
    assert problems(trace) == []
    # version 1 kept no per-call tool set: every turn advertised the one set written first
    assert [[t.name for t in ts] for ts in trace.tool_sets] == [["bash"]]
    assert [c.tool_set for c in trace.calls] == [0, 0, 0]
    assert [t.name for t in trace.branches[0].tools] == ["bash"]


SUB_SYSTEM = "You are a search sub-agent."
SUB_TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} in the repository",
              "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
             for name in ("read_file", "grep")]


def test_each_subagent_is_exported_with_the_tools_it_advertised(session, mproxy, msim, tmp_path):
    """A main agent (bash) and a sub-agent (read_file, grep) take turns on one session: each
    branch's sample carries its own agent's tools, and each tool set is written once."""
    s = session()
    oai, _ = session_clients(s)
    agents = {"main": ([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "main task"}], TOOLS),
              "sub": ([{"role": "system", "content": SUB_SYSTEM}, {"role": "user", "content": "find the bug"}], SUB_TOOLS)}
    for k in range(2):
        for name, (history, tools) in agents.items():
            msim.script(Reply(text=f"{name} step {k}"))
            r = oai.chat.completions.create(model="gpt-4o", messages=history, tools=tools)
            history += [{"role": "assistant", "content": r.choices[0].message.content},
                        {"role": "user", "content": "go on"}]
    trace = sealed_trace(mproxy, s)
    assert [[t.name for t in ts] for ts in trace.tool_sets] == [["bash"], ["read_file", "grep"]]
    assert [c.tool_set for c in trace.calls] == [0, 1, 0, 1]
    written = [rec for _, rec in iter_records(s["trace_path"]) if rec["kind"] == "turn" and "tools" in rec]
    assert len(written) == 2  # alternating agents do not restate their tools
    out = tmp_path / "samples.jsonl"
    result = replay_cli("export", s["trace_path"], "--out", str(out))
    assert result.returncode == 0, result.stderr
    exported = {sample["messages"][0]["content"]: [t["name"] for t in sample["tools"]]
                for sample in map(json.loads, out.read_text().splitlines())}
    assert exported == {SYSTEM: ["bash"], SUB_SYSTEM: ["read_file", "grep"]}
    assert_sound(trace, s["trace_path"])


def test_reads_the_golden_file_of_version_2():
    """Version 2 (tests/data/make_golden.py): three turns under max_turns=3, the fourth
    request refused (a stop record, its tool result a prompt node that keeps the branch's
    token arrays), sealed with the evaluator's rewards and metrics."""
    trace = read_trace(Path(__file__).parent / "data" / "trace-v2.msgpack")
    assert trace.schema_version == 2 and trace.sealed and trace.num_turns == 3
    assert (trace.stop_condition, trace.stopped_by, trace.truncated) == ("max_turns", "limit", True)
    assert trace.stop.condition == "max_turns" and trace.stop.call == trace.calls[-1].id
    assert trace.calls[-1].error.type == "interceptor_stopped" and trace.calls[-1].node is None
    assert trace.reward == 0.5 and trace.rewards["tests"].weight == 0.5 and trace.metrics == {"steps": 3}
    assert trace.timing.model > 0 and trace.timing.wall >= trace.timing.model
    # the second reply, rewritten by a response hook: the sample ends its own branch
    sample, branch = trace.branches
    call = trace.calls[1]
    assert sample.leaf == call.node and trace.nodes[call.node].message.text() == "Running step 1."
    delivered = trace.nodes[call.delivered_node]
    assert delivered.message.text() == "Running step 1, as the evaluator put it." and not delivered.sampled
    assert delivered.token_ids == [] and call.delivered_node in branch.nodes
    [rw] = [r for r in trace.response_rewrites if r.by == "hook"]
    assert (rw.by, rw.node, rw.sampled_node, rw.hooks) == ("hook", call.delivered_node, call.node,
                                                         ["deliver_other_text"])
    assert branch.messages[-1].role == "tool" and trace.nodes[branch.leaf].token_ids == []
    for b in (sample, branch):
        assert b.token_ids is not None and len(b.sampled_mask) == len(b.token_ids)
    assert problems(trace) == []

"""Response hooks: the answer is held until the hooks decide; a replacement is
written in the harness's own dialect; the model's own reply stays on the trace.

Through a real mitmdump against the strict simulator, with the real SDKs parsing what the
proxy wrote: Chat (SSE and JSON, vLLM token ids), Anthropic Messages (SSE, a tool call
removed), Responses (SSE), Gemini's SSE read back by its own dialect. On the trace: the
sampled node keeps what the model said (and its token ids), the delivered reply is a
non-sampled sibling, the next turn extends the delivered one, one response ``rewrite`` record
names both. A hook that returns None releases the upstream's bytes unchanged; one that
raises is a 500 nobody retries; a response stop refuses the answer; with
``intercept_hold_keepalive`` the headers and SSE comments go out while the hook runs, and a
stop after them is the dialect's error event.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from interceptor.trace import read_trace
from interceptor.trace.verify import problems
from clients import session_clients
from mitm import free_port
from provider import ProviderSimulator, Reply, ToolCall
from test_request_hooks import hooks_file
from test_trace_proxy import ANTHROPIC_TOOLS, SYSTEM, TOOLS, mproxy, msim, session  # noqa: F401

SECRET = "The answer is 42."
WITHHELD = "[the evaluator withheld this reply]"

REPLACE = """
import pathlib, time
from interceptor.hooks import HookContext, Response, intercept

@intercept(priority=3)
def withhold(response: Response, ctx: HookContext):
    with pathlib.Path(ctx.config["log"]).open("a") as f:
        f.write(response.message.text() + "\\n")
    if "42" not in response.message.text():
        return None
    time.sleep(ctx.config.get("sleep", 0))
    response.message.content = ctx.config["replacement"]
    if ctx.config.get("drop_calls"):
        response.message.tool_calls = []
    return response
"""


@pytest.fixture
def withholding(session, tmp_path):
    def make(**config):
        log = tmp_path / "seen.log"
        log.write_text("")
        extra = {k: config.pop(k) for k in ("sleep", "drop_calls") if k in config}
        s = session(hooks={"module": hooks_file(tmp_path, REPLACE, "response_hooks.py"),
                           "config": {"log": str(log), "replacement": WITHHELD, **extra}}, **config)
        return s, log
    return make


def sealed(proxy, s):
    status, _ = proxy.api("DELETE", f"sessions/{s['id']}")
    assert status == 200
    return read_trace(s["trace_path"])


def assert_siblings(trace, sampled_text: str = SECRET, delivered_text: str = WITHHELD):
    """The first call's sampled and delivered replies, side by side on the trace."""
    assert problems(trace) == []
    call = trace.calls[0]
    sampled, delivered = trace.nodes[call.node], trace.nodes[call.delivered_node]
    assert sampled.sampled and not delivered.sampled
    assert sampled.parent == delivered.parent
    assert sampled.message.text() == sampled_text and delivered.message.text() == delivered_text
    [rw] = [r for r in trace.response_rewrites if r.by == "hook"]
    assert rw.hooks == ["withhold"] and rw.target == "assistant" and rw.call == call.id
    assert rw.node == call.delivered_node and rw.sampled_node == call.node
    assert rw.original in (sampled_text, [{"text": sampled_text}]) and rw.digest_before != rw.digest_after
    return call, sampled, delivered


def test_chat_stream_replaced_sampled_node_keeps_token_ids(withholding, msim, mproxy):
    s, log = withholding(collect_tokens=True)
    oai, _ = session_clients(s)
    msim.script(Reply(text=SECRET), Reply(text="fine"))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "what is it?"}]
    stream = oai.chat.completions.create(model="gpt-4o", messages=messages, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == WITHHELD
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0  # asked for: sent
    assert not any("token_ids" in json.dumps(c.model_dump()) for c in chunks)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "ok"}]
    r = oai.chat.completions.create(model="gpt-4o", messages=messages)
    assert r.choices[0].message.content == "fine"
    assert log.read_text().splitlines() == [SECRET, "fine"]
    # the model was asked again with what the harness received
    assert msim.model_requests()[1].json["messages"][2]["content"] == WITHHELD
    trace = sealed(mproxy, s)
    call, sampled, delivered = assert_siblings(trace)
    assert sampled.token_ids and sampled.mask == [True] * len(sampled.token_ids) and sampled.logprobs
    assert delivered.token_ids == [] and delivered.mask == []
    second = trace.calls[1]
    assert trace.path(second.node)[:-1][-2:] == [call.delivered_node, trace.path(second.node)[-2]]
    assert len(trace.branches) == 2  # the sample ends its own branch; the conversation goes on
    by_leaf = {b.leaf: b for b in trace.branches}
    sample = by_leaf[call.node]
    assert sample.token_ids[-len(sampled.token_ids):] == sampled.token_ids
    assert sample.sampled_mask[-len(sampled.token_ids):] == [True] * len(sampled.token_ids)
    on = by_leaf[second.node]
    assert on.messages[len(on.messages) - 3].content == WITHHELD
    # the delivered reply is context on the branch that goes on (mask false where it sits)
    assert sum(on.sampled_mask) == len(trace.nodes[second.node].token_ids)
    from interceptor.scripts.replay_trace import samples

    exported = {row["branch"]: row for row in samples(trace)}
    assert exported[sample.index]["sampled_mask"] == sample.sampled_mask
    assert exported[on.index]["messages"][len(on.messages) - 3]["content"] == WITHHELD


def test_chat_json_replaced(withholding, msim, mproxy):
    s, _ = withholding()
    oai, _ = session_clients(s)
    msim.script(Reply(text=SECRET))
    r = oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "what is it?"}])
    assert r.choices[0].message.content == WITHHELD, mproxy.log()[-3000:]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None
    assert_siblings(sealed(mproxy, s))


def test_anthropic_stream_replaced_and_tool_call_removed(withholding, msim, mproxy):
    s, _ = withholding(drop_calls=True)
    _, ant = session_clients(s)
    msim.script(Reply(text=SECRET, tool_calls=[ToolCall(name="bash", arguments={"cmd": "ls"}, id="toolu_1")]))
    with ant.messages.stream(model="claude-x", max_tokens=200, system=SYSTEM, tools=ANTHROPIC_TOOLS,
                             messages=[{"role": "user", "content": "what is it?"}]) as st:
        events = [e.type for e in st]
        final = st.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert [b.type for b in final.content] == ["text"] and final.content[0].text == WITHHELD
    assert final.stop_reason == "end_turn"
    trace = sealed(mproxy, s)
    call, sampled, delivered = assert_siblings(trace)
    assert [c.name for c in sampled.message.tool_calls] == ["bash"] and delivered.message.tool_calls == []
    [rw] = [r for r in trace.response_rewrites if r.by == "hook"]
    assert rw.removed == ["tool_calls[0]"]


def test_responses_stream_replaced(withholding, msim, mproxy):
    s, _ = withholding()
    oai, _ = session_clients(s)
    msim.script(Reply(text=SECRET), Reply(text="fine"))
    with oai.responses.stream(model="gpt-4o", input="what is it?", instructions=SYSTEM) as st:
        kinds = [e.type for e in st]
        final = st.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final.output_text == WITHHELD
    # the chain goes on from what the harness received
    r = oai.responses.create(model="gpt-4o", input="ok", previous_response_id=final.id)
    assert r.output_text == "fine"
    trace = sealed(mproxy, s)
    call, _, _ = assert_siblings(trace)
    assert trace.path(trace.calls[1].node)[-3] == call.delivered_node


def test_gemini_stream_replaced(withholding, msim, mproxy):
    from interceptor.dialects import gemini
    from interceptor.dialects.sse import SSEDecoder

    s, _ = withholding()
    msim.script(Reply(text=SECRET))
    with httpx.Client(proxy=s["env"]["HTTPS_PROXY"], verify=s["env"]["SSL_CERT_FILE"], timeout=30) as c:
        r = c.post("https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse",
                   headers={"x-goog-api-key": s["model_secret"]},
                   json={"contents": [{"role": "user", "parts": [{"text": "what is it?"}]}]})
    assert r.status_code == 200, r.text
    assembler = gemini.GeminiDialect().assembler()
    assert any(assembler.feed(e) for e in SSEDecoder().feed(r.content) + SSEDecoder().flush()) or True
    assert assembler.result().message.text() == WITHHELD
    assert_siblings(sealed(mproxy, s))


def test_hook_returning_none_releases_the_bytes_unchanged(session, tmp_path, msim, mproxy):
    seen = tmp_path / "seen.log"
    plain = session()
    raw = []
    for s in (plain, session(hooks={"module": hooks_file(tmp_path, REPLACE, "response_hooks.py"),
                                    "config": {"log": str(seen), "replacement": WITHHELD}})):
        msim.script(Reply(text="nothing to hide"))
        with httpx.Client(proxy=s["env"]["HTTPS_PROXY"], verify=s["env"]["SSL_CERT_FILE"], timeout=30) as c:
            r = c.post("https://api.openai.com/v1/chat/completions",
                       headers={"authorization": f"Bearer {s['model_secret']}"},
                       json={"model": "gpt-4o", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        raw.append(r.content)
    assert seen.read_text() == "nothing to hide\n"  # the hook ran on the held answer
    # the simulator's ids and timestamps differ per answer; the shape of the bytes does not
    norm = [b.replace(b"\r", b"") for b in raw]
    assert [len(x.split(b"\n\n")) for x in norm][0] == [len(x.split(b"\n\n")) for x in norm][1]
    trace = sealed(mproxy, plain)
    assert trace.calls[0].delivered_node is None


RAISE = """
from interceptor.hooks import Response, intercept

@intercept
def broken(response: Response):
    raise RuntimeError("grader crashed")
"""

STOP = """
from interceptor.hooks import Response, stop

@stop(name="said_the_answer")
def said(response: Response) -> bool:
    return "42" in response.message.text()
"""


def test_hook_that_raises_is_a_500_nobody_retries(session, tmp_path, msim, mproxy):
    s = session(hooks={"module": hooks_file(tmp_path, RAISE, "raising.py")})
    secret = s["model_secret"]
    msim.script(Reply(text=SECRET))
    oai = openai.OpenAI(api_key=secret, max_retries=2, timeout=30)
    with pytest.raises(openai.InternalServerError) as e:
        oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], stream=True)
    assert e.value.response.headers["x-should-retry"] == "false"
    assert "grader crashed" in e.value.message
    assert len(msim.model_requests()) == 1  # no retry reached the upstream
    trace = sealed(mproxy, s)
    assert trace.stop_condition == "hook_error"
    [call] = trace.calls
    assert call.error.type == "hook_error" and call.delivered is False
    assert trace.nodes[call.node].message.text() == SECRET  # what the model said is still on the trace


def test_response_stop_refuses_the_answer(session, tmp_path, msim, mproxy):
    s = session(hooks={"module": hooks_file(tmp_path, STOP, "stopping.py")})
    _, ant = session_clients(s)
    msim.script(Reply(text=SECRET))
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(model="claude-x", max_tokens=100, messages=[{"role": "user", "content": "hi"}])
    assert e.value.response.headers["x-interceptor-stop"] == "said_the_answer"
    assert "rollout stopped: said_the_answer" in str(e.value)
    with pytest.raises(anthropic.BadRequestError):  # every later request too, never sent upstream
        ant.messages.create(model="claude-x", max_tokens=100, messages=[{"role": "user", "content": "again"}])
    assert len(msim.model_requests()) == 1
    trace = sealed(mproxy, s)
    assert trace.stop_condition == "said_the_answer"
    assert trace.calls[0].error.type == "interceptor_stopped"


TRIMS = """
from interceptor.hooks import Response, stop

@stop
def trims(response: Response) -> bool:
    response.message.content = response.message.text()[:3]  # for its own reading
    return False
"""


def test_a_response_stop_that_changes_the_answer_it_is_handed_changes_nothing_else(session, tmp_path, msim, mproxy):
    """A response stop is handed a copy: trimming it in place changes neither what the
    harness gets nor what the trace says the model said (before, both were the answer)."""
    s = session(hooks={"module": hooks_file(tmp_path, TRIMS, "trimming.py")})
    oai, _ = session_clients(s)
    msim.script(Reply(text="the whole answer"))
    r = oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content == "the whole answer"
    trace = sealed(mproxy, s)
    [call] = trace.calls
    assert trace.nodes[call.node].message.text() == "the whole answer" and call.delivered_node is None


# --- keepalive: a proxy of its own, with intercept_hold_keepalive --------------------------------

@pytest.fixture(scope="module")
def ksim():
    with ProviderSimulator(strict=True) as s:
        yield s


@pytest.fixture(scope="module")
def kproxy(ksim):
    from clients import KEY_ENV, REAL_KEY
    from mitm import MitmProcess

    proc = MitmProcess(options={"intercept_upstream": ksim.url("/v1"), "intercept_api_key_env": KEY_ENV,
                                "intercept_hold_keepalive": "0.2", "intercept_hold_spill": 16},
                       env={KEY_ENV: REAL_KEY})
    proc.start()
    yield proc
    proc.cleanup()


def test_keepalive_sends_headers_and_comments_while_the_hook_runs(kproxy, ksim, tmp_path, harness_env):
    log = tmp_path / "seen.log"
    s = kproxy.create_session(upstream={"base_url": ksim.url("/v1")},
                              hooks={"module": hooks_file(tmp_path, REPLACE, "response_hooks.py"),
                                     "config": {"log": str(log), "replacement": WITHHELD, "sleep": 1.0}})
    harness_env(s["env"])
    ksim.script(Reply(text=SECRET))
    with httpx.Client(proxy=s["env"]["HTTPS_PROXY"], verify=s["env"]["SSL_CERT_FILE"], timeout=30) as c:
        with c.stream("POST", "https://api.openai.com/v1/chat/completions",
                      headers={"authorization": f"Bearer {s['model_secret']}"},
                      json={"model": "gpt-4o", "stream": True, "messages": [{"role": "user", "content": "hi"}]}) as r:
            assert r.status_code == 200
            body = b"".join(r.iter_raw())
    head, _, rest = body.partition(b"data:")
    assert head.count(b": interceptor holds the answer") >= 2  # comments before any event
    assert WITHHELD.encode() in rest and SECRET.encode() not in body
    # the spill threshold is 16 bytes: the held answer went through a file and came back whole
    oai, _ = session_clients(s)
    ksim.script(Reply(text="nothing to hide, said at some length"))
    got = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "again"}], stream=True) if c.choices)
    assert got == "nothing to hide, said at some length"


def test_keepalive_stop_after_the_headers_is_the_dialects_error_event(kproxy, ksim, tmp_path, harness_env):
    s = kproxy.create_session(upstream={"base_url": ksim.url("/v1")},
                              hooks={"module": hooks_file(tmp_path, STOP, "stopping.py")})
    harness_env(s["env"])
    _, ant = session_clients(s)
    ksim.script(Reply(text=SECRET))
    with pytest.raises(anthropic.APIStatusError) as e:
        with ant.messages.stream(model="claude-x", max_tokens=100, messages=[{"role": "user", "content": "hi"}]) as st:
            st.get_final_message()
    assert "rollout stopped: said_the_answer" in str(e.value)


ADD_CALL = """
from interceptor.hooks import Response, intercept
from interceptor.trace.messages import ToolCall

@intercept
def adds(response: Response):
    response.message.tool_calls.append(ToolCall(id="call_x", name="bash", arguments="{}"))
    return response
"""


def test_a_hook_may_not_add_a_tool_call(session, tmp_path, msim, mproxy):
    s = session(hooks={"module": hooks_file(tmp_path, ADD_CALL, "adding.py")})
    oai, _ = session_clients(s)
    msim.script(Reply(text="hello"))
    with pytest.raises(openai.InternalServerError) as e:
        oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert "may remove tool calls, not add or edit them" in e.value.message
    assert e.value.response.headers["x-should-retry"] == "false"
    trace = sealed(mproxy, s)
    assert trace.stop_condition == "hook_error" and trace.calls[0].delivered_node is None


def test_a_listener_given_in_the_mode_holds_answers_as_the_default_one_does(start_proxy, sim, tmp_path, harness_env):
    """``--mode regular@<port>`` (a port without ``--listen-port``) is mitmproxy's default mode:
    the relay holds a session's answers there too. It once took only the bare ``regular``
    spelling for that mode, and every held session was refused."""
    proxy = start_proxy(listen=["--mode", f"regular@{free_port()}"])
    log = tmp_path / "seen.log"
    log.write_text("")
    s = proxy.create_session(upstream={"base_url": sim.url("/v1")},
                             hooks={"module": hooks_file(tmp_path, REPLACE, "response_hooks.py"),
                                    "config": {"log": str(log), "replacement": WITHHELD}})
    harness_env(s["env"])
    oai, _ = session_clients(s)
    sim.script(Reply(text=SECRET))
    r = oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content == WITHHELD
    assert log.read_text() == SECRET + "\n"


def test_without_the_relay_a_held_session_is_refused_and_nothing_is_sent(start_proxy, sim, tmp_path, harness_env):
    proxy = start_proxy({"intercept_drain_timeout": "0"})
    s = proxy.create_session(upstream={"base_url": sim.url("/v1")},
                             hooks={"module": hooks_file(tmp_path, RAISE, "raising.py")})
    harness_env(s["env"])
    oai, _ = session_clients(s)
    with pytest.raises(openai.InternalServerError) as e:
        oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], stream=True)
    assert "need the proxy's relay to hold answers" in e.value.message
    assert sim.model_requests() == []
    status, _ = proxy.api("DELETE", f"sessions/{s['id']}")
    assert status == 200
    [call] = read_trace(s["trace_path"]).calls
    assert call.error.type == "hold_unavailable"

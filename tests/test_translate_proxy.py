"""A Messages harness (the real anthropic SDK) on a Chat Completions upstream, through a real
mitmdump: the upstream gets only Chat, the SDK parses every translated answer (JSON, stream,
tool calls, 429 with its retry headers, 400, a cut stream), and with ``collect_tokens`` the
trace's branches carry the upstream's token ids exactly."""

from __future__ import annotations

import hashlib
import json

import anthropic
import pytest

from clients import KEY_ENV, REAL_KEY, session_clients
from provider import Reply, ToolCall
from provider import strict
from interceptor.dialects import ANTHROPIC
from interceptor.dialects.sse import SSEDecoder
from test_trace_proxy import FakeVLLM, check_branch_tokens, sealed_trace

TOOLS = [{"name": "bash", "description": "Run a command", "input_schema": {
    "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}]
VLLM_KEYS = ("return_token_ids", "logprobs")  # what collect_tokens adds (vLLM's, not OpenAI's)


@pytest.fixture
def chat_session(start_proxy, sim, harness_env):
    """``chat_session(**config)``: a proxy whose upstream ``vllm`` speaks Chat, and a session
    on it with its environment applied."""
    upstreams = json.dumps({"vllm": {"base_url": sim.url("/v1"), "api_key_env": KEY_ENV, "dialect": "chat"}})
    proxy = start_proxy({"intercept_upstreams": upstreams})

    def make(**config):
        s = proxy.create_session(upstream="vllm", **config)
        harness_env(s["env"])
        return proxy, s

    return make


def only_chat(sim) -> None:
    for r in sim.requests:
        assert (r.method, r.route_path) == ("POST", "/v1/chat/completions"), r.path
        assert r.headers["authorization"] == f"Bearer {REAL_KEY}"
        assert "x-api-key" not in r.headers and "anthropic-version" not in r.headers
        assert strict.check_chat({k: v for k, v in r.json.items() if k not in VLLM_KEYS}, set()) is None


def test_json_and_stream_answers_with_tool_calls(chat_session, sim):
    proxy, s = chat_session(model="policy")
    _, client = session_clients(s)
    sim.script(Reply(reasoning="Let me look.", tool_calls=[ToolCall(name="bash", arguments={"cmd": "ls"})]),
               Reply(reasoning="Done.", text="It has two files."))
    messages = [{"role": "user", "content": "What is here?"}]
    first = client.messages.create(model="claude-x", max_tokens=200, system="Be brief.", messages=messages,
                                   tools=TOOLS, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in first.content] == ["thinking", "tool_use"] and first.stop_reason == "tool_use"
    call = first.content[1]
    assert (call.name, call.input, first.content[0].thinking) == ("bash", {"cmd": "ls"}, "Let me look.")
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "a b"}]}]
    with client.messages.stream(model="claude-x", max_tokens=200, system="Be brief.", messages=messages,
                                tools=TOOLS, thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        kinds = [e.type for e in stream]
        second = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.type for b in second.content] == ["thinking", "text"] and second.content[1].text == "It has two files."
    assert second.stop_reason == "end_turn" and second.usage.output_tokens > 0
    only_chat(sim)
    bodies = [r.json for r in sim.requests]
    assert bodies[0]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert bodies[1]["messages"][-1] == {"role": "tool", "tool_call_id": call.id, "content": "a b"}
    assert bodies[1]["messages"][-2]["tool_calls"][0]["id"] == call.id  # ids kept both ways
    assert bodies[1]["messages"][-2]["reasoning_content"] == "Let me look."
    assert bodies[1]["stream"] is True and bodies[1]["stream_options"] == {"include_usage": True}
    trace = sealed_trace(proxy, s)
    assert trace.num_turns == 2 and len(trace.branches) == 1  # the restated turn is the recorded one
    for c, r in zip(trace.calls, sim.requests):
        assert (c.dialect, c.upstream_dialect, c.endpoint) == ("anthropic", "chat", "/v1/chat/completions")
        assert c.translated_digest == hashlib.sha256(r.body).hexdigest()
        assert ("thinking", "translation") in {(o.key, o.reason) for o in c.overrides}
        assert c.sampling.max_tokens == 200 and c.model == "policy"
    leaf = trace.branches[0].messages
    assert leaf[0].role == "system" and leaf[-1].reasoning[0].text == "Done."  # as the harness sent it
    assert leaf[-1].text() == "It has two files."


def test_errors_keep_status_and_retry_headers_in_anthropic_shape(chat_session, sim):
    proxy, s = chat_session()
    _, client = session_clients(s)
    sim.script(Reply(status=429, retry_after=7, error_message="Rate limit reached"),
               Reply(status=400, error_message="messages: bad"))
    with pytest.raises(anthropic.RateLimitError) as e:
        client.messages.create(model="m", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    assert e.value.response.headers["retry-after"] == "7"
    assert e.value.body == {"type": "error", "error": {"type": "rate_limit_error", "message": "Rate limit reached"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=10, messages=[{"role": "user", "content": "hi"}], stream=True)
    assert e.value.body["error"] == {"type": "invalid_request_error", "message": "messages: bad"}
    trace = sealed_trace(proxy, s)
    assert [c.status for c in trace.calls] == [429, 400] and trace.num_turns == 0
    assert trace.calls[0].error.message == "Rate limit reached"


def test_a_cut_stream_fails_in_the_sdk_and_records_no_turn(chat_session, sim):
    proxy, s = chat_session()
    _, client = session_clients(s)
    sim.script(Reply(text="one two three four five six", cut_after=3))
    seen = []
    with pytest.raises(Exception) as e:  # the SDK's transport says the body was cut, as from Anthropic
        with client.messages.stream(model="m", max_tokens=10, messages=[{"role": "user", "content": "hi"}]) as st:
            seen += [event.type for event in st]
    assert "incomplete chunked read" in str(e.value) or isinstance(e.value, anthropic.APIError)
    assert "message_stop" not in seen
    trace = sealed_trace(proxy, s)
    assert trace.num_turns == 0 and trace.calls[0].error.type == "incomplete_stream"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_token_ids_of_a_translated_session_are_the_upstreams(chat_session, sim, stream):
    """collect_tokens on a Messages harness: the Chat upstream is asked for token ids, the
    harness never sees them, every branch is the last call's prompt + completion ids."""
    sim.strict = False  # vLLM's keys are not OpenAI's
    proxy, s = chat_session(model="policy", collect_tokens=True)
    _, client = session_clients(s)
    replies = [Reply(reasoning="Step one.", tool_calls=[ToolCall(name="bash", arguments={"cmd": "ls"})]),
               Reply(reasoning="Step two.", tool_calls=[ToolCall(name="bash", arguments={"cmd": "pwd"})]),
               Reply(text="All done.")]
    vllm = sim.default = FakeVLLM(replies)
    messages = [{"role": "user", "content": "Look around."}]
    raw = []
    for _ in replies:
        kw = dict(model="m", max_tokens=300, system="You are terse.", messages=messages, tools=TOOLS)
        if stream:
            with client.messages.with_streaming_response.create(**kw, stream=True) as response:
                raw.append(response.read())
            asm = ANTHROPIC.assembler()
            decoder = SSEDecoder()
            for event in decoder.feed(raw[-1]) + decoder.flush():
                asm.feed(event)
            assert asm.done
            content = asm.native()["content"]
        else:
            reply = client.messages.with_raw_response.create(**kw)
            raw.append(reply.http_response.content)
            content = [b.model_dump(exclude_none=True) for b in reply.parse().content]
        messages.append({"role": "assistant", "content": content})
        uses = [b for b in content if b["type"] == "tool_use"]
        if uses:
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u["id"], "content": "ok"} for u in uses]})
    assert all(b"token_ids" not in r and b"logprob" not in r for r in raw)
    for r in sim.model_requests():
        assert r.json["return_token_ids"] is True and r.json["logprobs"] is True
    trace = sealed_trace(proxy, s)
    assert trace.num_turns == len(sim.model_requests())
    check_branch_tokens(trace, vllm)


RESPONSES_TOOLS = [{"type": "function", "name": "bash", "description": "Run a command",
                    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}]


def test_responses_harness_on_a_chat_upstream_json_stream_and_chain(chat_session, sim):
    """The openai SDK's Responses client on a Chat upstream: a tool call as JSON, the answer
    to it chained on previous_response_id (the proxy sends the whole conversation: Chat has
    no stored answers), then a stream; the SDK parses each, the upstream saw only Chat."""
    import openai

    proxy, s = chat_session(model="policy")
    oai, _ = session_clients(s)
    sim.script(Reply(reasoning="Look first.", tool_calls=[ToolCall(name="bash", arguments={"cmd": "ls"})]),
               Reply(text="Two files."), Reply(reasoning="Sure.", text=["All ", "done."]))
    first = oai.responses.create(model="gpt-x", instructions="Be brief.", input="What is here?", tools=RESPONSES_TOOLS,
                                 max_output_tokens=300)
    assert [i.type for i in first.output] == ["reasoning", "function_call"] and first.status == "completed"
    call = first.output[1]
    assert (call.name, json.loads(call.arguments)) == ("bash", {"cmd": "ls"})
    assert first.output[0].summary[0].text == "Look first."
    second = oai.responses.create(model="gpt-x", instructions="Be brief.", previous_response_id=first.id,
                                  input=[{"type": "function_call_output", "call_id": call.call_id, "output": "a b"}])
    assert second.output_text == "Two files." and second.usage.output_tokens > 0
    with oai.responses.stream(model="gpt-x", input="Anything else?", tools=RESPONSES_TOOLS) as stream:
        kinds = [e.type for e in stream]
        third = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.reasoning_summary_text.delta" in kinds
    assert third.output_text == "All done." and third.output[0].summary[0].text == "Sure."
    only_chat(sim)
    chained = sim.requests[1].json["messages"]
    assert [m["role"] for m in chained] == ["system", "user", "assistant", "tool"]
    assert chained[2]["tool_calls"][0]["id"] == chained[3]["tool_call_id"] == call.call_id
    assert chained[2]["reasoning_content"] == "Look first."
    assert sim.requests[0].json["max_completion_tokens"] == 300
    sim.script(Reply(status=429, retry_after=3, error_message="slow down"))
    with pytest.raises(openai.RateLimitError) as e:
        oai.responses.create(model="gpt-x", input="again")
    assert e.value.response.headers["retry-after"] == "3" and e.value.body["message"] == "slow down"
    trace = sealed_trace(proxy, s)
    assert trace.num_turns == 3 and trace.calls[3].status == 429
    assert all((c.dialect, c.upstream_dialect) == ("responses", "chat") for c in trace.calls)
    assert trace.calls[1].previous_response_id == first.id and not trace.calls[1].previous_response_unknown
    chain = next(b for b in trace.branches if len(b.messages) > 3).messages  # the chained turn extends the first
    assert [m.role for m in chain] == ["system", "user", "assistant", "tool", "assistant"]


def test_a_decided_tool_result_that_cannot_be_written_into_a_translated_body_is_refused(chat_session, sim, tmp_path):
    """The tool route decided a result before the harness sent it; a translated body is not
    the harness's, so the decision cannot be spliced into it. The request is refused in the
    harness's dialect (nothing forwarded: the model never reads the tool's own output) and
    the rollout stops as on a hook error; before, it went upstream with the harness's output."""
    import textwrap

    from test_tool_route import BLOCKED, POLICE, route
    hooks = tmp_path / "police.py"
    hooks.write_text(textwrap.dedent(POLICE))
    proxy, s = chat_session(model="policy", hooks={"module": str(hooks)})
    _, client = session_clients(s)
    sim.script(Reply(tool_calls=[ToolCall(name="bash", arguments={"cmd": "rm -rf victim"})]), Reply(text="never"))
    messages = [{"role": "user", "content": "clean up"}]
    first = client.messages.create(model="claude-x", max_tokens=200, messages=messages, tools=TOOLS)
    call = first.content[0]
    status, decided = route(proxy, s["model_secret"], {"phase": "before", "tool_call_id": call.id})
    assert (status, decided["action"], decided["content"]) == (200, "block", BLOCKED)
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": "removed 3 files"}]}]
    with pytest.raises(anthropic.InternalServerError) as e:
        client.messages.create(model="claude-x", max_tokens=200, messages=messages, tools=TOOLS)
    assert e.value.response.headers["x-should-retry"] == "false"
    assert e.value.body["error"]["type"] == "hook_error" and "cannot be written" in e.value.message
    assert len(sim.requests) == 1  # the tool's own output never went upstream
    trace = sealed_trace(proxy, s)
    assert trace.stopped_by == "hook" and trace.calls[-1].error.type == "hook_error"
    assert "removed 3 files" not in json.dumps([n.message.model_dump() for n in trace.nodes])

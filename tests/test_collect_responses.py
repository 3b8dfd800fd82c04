"""collect_tokens on a native Responses upstream that returns token ids (vLLM's own
/v1/responses with ``enable_response_messages``): the real openai SDK through a real mitmdump,
JSON and streamed; the branch invariant holds and the harness never sees a token field. And
Codex over its WebSocket on such an upstream (served by the proxy, sent as POSTs)."""

from __future__ import annotations

import json

import pytest

from clients import KEY_ENV, session_clients
from provider import Reply, ToolCall
from provider.turn import Turn
from test_trace_proxy import FakeVLLM, check_branch_tokens, render, sealed_trace

TOOLS = [{"type": "function", "name": "shell", "description": "run a command", "strict": False,
          "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}]
TOKEN_FIELDS = ("input_messages", "output_messages")


def as_chat(body: dict) -> list[dict]:
    """A Responses request as the chat messages vLLM's template renders (the toy ``render``):
    instructions, messages, tool outputs, and each run of assistant-side items (reasoning,
    text, calls) as one assistant message, rendered as it was sampled."""
    out: list[dict] = []

    def assistant() -> dict:
        if not (out and out[-1]["role"] == "assistant"):
            out.append({"role": "assistant", "content": None})
        return out[-1]

    if body.get("instructions"):
        out.append({"role": "system", "content": body["instructions"]})
    items = body["input"] if isinstance(body["input"], list) else [{"role": "user", "content": body["input"]}]
    for item in items:
        kind = item.get("type", "message")
        if kind == "message" and item["role"] == "assistant":
            last = assistant()
            last["content"] = (last["content"] or "") + "".join(p["text"] for p in item["content"])
        elif kind == "message":
            out.append({"role": "system" if item["role"] == "developer" else item["role"], "content": item["content"]})
        elif kind == "reasoning":  # restated: its summary is what was sampled as reasoning
            assistant()["reasoning_content"] = "".join(p.get("text", "") for p in item.get("summary") or [])
        elif kind in ("function_call", "custom_tool_call"):
            args = item["arguments"] if kind == "function_call" else item["input"]
            assistant().setdefault("tool_calls", []).append({"function": {"arguments": args}})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item["output"]
            out.append({"role": "tool", "content": output if isinstance(output, (str, list)) else json.dumps(output)})
    return out


class FakeResponsesVLLM(FakeVLLM):
    """FakeVLLM for vLLM's /v1/responses: the prompt's token ids from the toy template."""

    def __call__(self, record) -> Reply:
        reply = self.replies.pop(0).replace(prompt_token_ids=render(as_chat(record.json)))
        pieces = Turn(record.json, reply, default_model="m").all_pieces()
        self.sent.append((reply.prompt_token_ids, [p.token_id for p in pieces], [0.0] * len(pieces)))
        return reply


@pytest.fixture
def responses_vllm(start_proxy, sim, harness_env):
    sim.strict = False  # enable_response_messages is vLLM's, not OpenAI's
    upstreams = json.dumps({"vllm": {"base_url": sim.url("/v1"), "api_key_env": KEY_ENV, "websocket": False}})
    proxy = start_proxy({"intercept_upstreams": upstreams})
    s = proxy.create_session(upstream="vllm", model="policy", collect_tokens=True)
    harness_env(s["env"])
    return proxy, s


def _dumped(obj) -> str:
    return json.dumps(obj.model_dump(), default=str)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_token_ids_from_vllm_responses_align_and_never_reach_the_harness(responses_vllm, sim, stream):
    proxy, s = responses_vllm
    vllm = sim.default = FakeResponsesVLLM([
        Reply(tool_calls=[ToolCall(name="shell", arguments={"cmd": "ls"})]), Reply(text=["two ", "files"])])
    oai, _ = session_clients(s)
    history = [{"role": "user", "content": [{"type": "input_text", "text": "What is here?"}]}]
    seen = []
    for _ in range(2):
        kwargs = dict(model="m", instructions="Be brief.", input=history, tools=TOOLS)
        if stream:
            events = list(oai.responses.create(stream=True, **kwargs))
            seen += [_dumped(e) for e in events]
            answer = next(e.response for e in events if e.type == "response.completed")
        else:
            answer = oai.responses.create(**kwargs)
            seen.append(_dumped(answer))
        for item in answer.output:
            history.append(item.model_dump(exclude_none=True))
            if item.type == "function_call":
                history.append({"type": "function_call_output", "call_id": item.call_id, "output": "a b"})
    assert answer.output_text == "two files"
    assert not any(key in text for text in seen for key in TOKEN_FIELDS)  # stripped
    assert all(r.json["enable_response_messages"] is True for r in sim.model_requests())
    trace = sealed_trace(proxy, s)
    assert trace.num_turns == 2 and len(trace.branches) == 1
    check_branch_tokens(trace, vllm)
    assert trace.branches[0].token_ids  # not vacuous: the upstream's ids are on the branch
    assert [sorted(r.removed) for r in trace.response_rewrites] == [sorted(TOKEN_FIELDS)] * 2
    for call in trace.calls:
        assert [(o.key, o.new) for o in call.overrides if o.reason == "collect_tokens"] == \
            [("enable_response_messages", True)]


def test_codex_on_vllm_responses_gets_its_socket_served_and_the_branch_its_token_ids(sim, tmp_path):
    """Codex over its WebSocket against vLLM's own Responses API (declared ``"websocket":
    false``): the proxy serves the socket, each frame goes as a POST asking for token ids,
    Codex never sees them, the branch is the upstream's."""
    from harness import HOSTS, REAL_KEY, MitmProcess, check_ran, check_task_trace, trace_of
    from test_harness_codex import SCRIPT, SESSION, _codex, _run
    from harness import FINAL

    sim.strict = False
    upstreams = json.dumps({"vllm": {"base_url": sim.url("/v1"), "api_key_env": KEY_ENV, "websocket": False}})
    vllm = sim.default = FakeResponsesVLLM([
        Reply(reasoning="Run it with exec.", tool_calls=[ToolCall(name="exec", arguments=SCRIPT, type="custom",
                                                                 id="call_codex_exec")]),
        Reply(text=["The answer is ", FINAL])])
    with MitmProcess(options={"intercept_upstreams": upstreams, "intercept_hosts": HOSTS},
                     env={KEY_ENV: REAL_KEY}) as proxy:
        result, sid = _run(proxy, sim, tmp_path, "websocket", "vllm-responses", {**SESSION, "collect_tokens": True})
        check_ran(result)
        trace = trace_of(proxy, sid)
        assert "the Responses WebSocket is served by the proxy" in proxy.log()
    assert {(r.method, r.route, r.transport) for r in sim.requests} == {("POST", "responses", "http")}
    assert all(r.json["enable_response_messages"] is True for r in sim.requests)
    check_task_trace(trace, turns=2, tool="exec")
    check_branch_tokens(trace, vllm)
    assert trace.branches[0].token_ids

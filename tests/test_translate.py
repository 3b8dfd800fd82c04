"""Messages <-> Chat translation (interceptor.dialects.translate), in process.

- requests from the real captures and from generated conversations translate into Chat that
  reads back as the same canonical conversation, except exactly what the translation recorded
  as lost (reason ``translation``);
- any split of a translated stream (the real Chat captures, and generated answers) gives the
  harness the reply the JSON translation gives, and the reply the record holds.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from hypothesis import given, settings, strategies as st

from interceptor.addons.gateway.answer.translate import TranslateStream
from interceptor.dialects import ANTHROPIC, CHAT, GEMINI, RESPONSES
from interceptor.dialects.sse import SSEDecoder
from interceptor.dialects.translate import TRANSLATION, pairs, translation
from interceptor.trace.messages import Message, Reasoning, Response, ToolCall, Usage, message_hash

FIXTURES = Path(__file__).parent / "fixtures"
TR = translation("anthropic", "chat")
RTR = translation("responses", "chat")
GTR = translation("gemini", "chat")
BOTH = [TR, RTR, GTR]
CAPTURED = [json.loads(p.read_text())["body"] for p in sorted((FIXTURES / "claude-code-requests").glob("*.json"))] + [
    exchange["request"]["body"] for p in sorted((FIXTURES / "anthropic-exchanges").glob("*.json"))
    for exchange in json.loads(p.read_text()) if isinstance(exchange["request"].get("body"), dict)]
CHAT_STREAMS = sorted((FIXTURES / "openai-chat-sse").glob("*.sse"))


def test_the_pairs():
    assert {("anthropic", "chat"), ("responses", "chat"), ("gemini", "chat")} <= set(pairs())
    assert translation("chat", "klingon") is None


# --------------------------------------------------------------------------------------
# requests


def _as_sent(message: Message, lost_signature: bool = True) -> Message:
    """A harness message as Chat can carry it: reasoning as one text (a Chat upstream signs
    nothing), no interleaving order, no error flag on a tool result."""
    update = {"order": None, "is_error": False, "name": None if message.name == "developer" else message.name}
    if message.reasoning:
        update["reasoning"] = [Reasoning(text="".join(r.text for r in message.reasoning))]
    if message.tool_calls:
        update["tool_calls"] = [c.model_copy(update={"extra": None}) for c in message.tool_calls]
    return message.model_copy(update=update)


def _path(key: str) -> list:
    """``messages[2].content[0]`` -> ``["messages", 2, "content", 0]``."""
    out: list = []
    for name in key.split("."):
        head, *idx = name.replace("]", "").split("[")
        out += [head, *map(int, idx)]
    return out


def without_lost(body: dict, lost) -> dict:
    """``body`` without what the translation recorded as lost, as the harness would have to
    send it for nothing to be lost (signatures and order are ``_as_sent``'s)."""
    body = json.loads(json.dumps(body))
    order = lambda k: [(0, x, "") if isinstance(x, int) else (1, 0, x) for x in _path(k)]  # noqa: E731
    for key in sorted((o.key for o in lost), key=order, reverse=True):  # later siblings first
        path = _path(key)
        if path[-1] in ("signature", "order", "billing_header", "is_error"):
            continue
        node = body
        for step in path[:-1]:
            node = node[step]
        del node[path[-1]]
    return body


def check_round_trip(body: dict) -> list:
    """The translated request reads back as the harness's conversation, hash for hash, where
    nothing was recorded lost; returns the overrides."""
    chat, lost = TR.request(body)
    assert all(o.reason == TRANSLATION and o.new is None for o in lost)
    json.dumps(chat)  # plain JSON, sendable
    harness = ANTHROPIC.parse_request(without_lost(body, lost)).messages
    upstream = CHAT.parse_request(chat).messages
    assert [message_hash(_as_sent(m)) for m in harness] == [message_hash(m) for m in upstream]
    tools = {t.name: t for t in CHAT.parse_request(chat).tools}
    for t in ANTHROPIC.parse_request(without_lost(body, lost)).tools:
        if t.type == "function":
            assert tools[t.name].parameters == (t.parameters or {}) and tools[t.name].description == t.description
    assert CHAT.parse_request(chat).sampling.max_tokens == body.get("max_tokens")
    return lost


def test_captured_requests_round_trip_and_say_what_they_lose():
    assert CAPTURED
    for body in CAPTURED:
        check_round_trip(body)
    claude = CAPTURED[0]
    _, lost = TR.request(claude)
    keys = {o.key for o in lost}
    # Claude Code's: what Chat cannot carry, each on the record
    assert {"thinking", "context_management", "metadata", "system.billing_header",
            "messages[2].content.order"} <= keys
    assert {o.key for o in lost if o.key.endswith(".signature")}  # the real model's signatures


text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20)
ident = st.text("abcdefghijklmnopqrstuvwxyz0123456789_", min_size=3, max_size=12)
image = st.builds(lambda d: {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": d}},
                  st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdef0123456789+/", min_size=4, max_size=16))
user_block = st.one_of(st.builds(lambda t: {"type": "text", "text": t}, text), image)


@st.composite
def conversations(draw) -> dict:
    """A Messages request in what Chat can express: text and images from the user, thinking
    (unsigned, as a Chat upstream's comes back), text and tool calls from the assistant, each
    call answered by a tool result."""
    messages = [{"role": "user", "content": draw(st.one_of(text, st.lists(user_block, min_size=1, max_size=3)))}]
    for turn in range(draw(st.integers(0, 3))):
        blocks = []
        if draw(st.booleans()):
            blocks.append({"type": "thinking", "thinking": draw(text), "signature": ""})
        if draw(st.booleans()):
            blocks.append({"type": "text", "text": draw(text)})
        calls = [{"type": "tool_use", "id": f"call_{turn}_{k}", "name": draw(ident),
                  "input": draw(st.dictionaries(ident, st.one_of(text, st.integers()), max_size=2))}
                 for k in range(draw(st.integers(0, 2)))]
        messages.append({"role": "assistant", "content": blocks + calls or [{"type": "text", "text": "ok"}]})
        if calls:
            results = [{"type": "tool_result", "tool_use_id": c["id"],
                        "content": draw(st.one_of(text, st.lists(st.builds(lambda t: {"type": "text", "text": t}, text),
                                                                  min_size=1, max_size=2)))} for c in calls]
            extra = draw(st.lists(user_block, max_size=1))
            messages.append({"role": "user", "content": results + extra})
        else:
            messages.append({"role": "user", "content": draw(text)})
    body = {"model": "m", "max_tokens": draw(st.integers(1, 4096)), "messages": messages,
            "system": draw(st.one_of(text, st.lists(st.builds(lambda t: {"type": "text", "text": t}, text),
                                                     min_size=1, max_size=2)))}
    if draw(st.booleans()):
        body["tools"] = [{"name": draw(ident), "description": draw(text),
                          "input_schema": {"type": "object", "properties": {}}}]
        body["tool_choice"] = draw(st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"},
                                                    {"type": "tool", "name": body["tools"][0]["name"]}]))
    if draw(st.booleans()):
        body["stop_sequences"] = draw(st.lists(text, min_size=1, max_size=2))
    return body


@settings(max_examples=150, deadline=None)
@given(conversations())
def test_generated_conversations_translate_without_loss(body):
    lost = check_round_trip(body)
    assert lost == []  # everything above is expressible in Chat
    chat, _ = TR.request(body)
    if "stop_sequences" in body:
        assert chat["stop"] == body["stop_sequences"]
    choice = body.get("tool_choice")
    if choice:
        assert CHAT.parse_request(chat).sampling.tool_choice == {
            "auto": "auto", "any": "required", "none": "none",
            "tool": {"type": "function", "function": {"name": choice.get("name")}}}[choice["type"]]


def test_what_chat_cannot_express_is_recorded_not_dropped():
    body = {"model": "m", "max_tokens": 10, "stream": True, "thinking": {"type": "enabled", "budget_tokens": 2000},
            "tools": [{"type": "web_search_20250305", "name": "web_search"},
                      {"name": "f", "input_schema": {"type": "object"}, "defer_loading": True}],
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
            "output_config": {"effort": "high", "format": {"type": "json_schema", "schema": {}}},
            "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "xx"},
                                                  {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                              "content": [{"type": "text", "text": "boom"},
                                                          {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}]}
    chat, lost = TR.request(body)
    assert {o.key: o.reason for o in lost} == {
        "thinking": TRANSLATION, "tools[0]": TRANSLATION, "tools[1].defer_loading": TRANSLATION,
        "output_config.format": TRANSLATION, "messages[1].content[0]": TRANSLATION,
        "messages[2].content[0].is_error": TRANSLATION, "messages[2].content[0].content[1]": TRANSLATION}
    assert chat["reasoning_effort"] == "high" and chat["parallel_tool_calls"] is False
    assert chat["stream_options"] == {"include_usage": True} and chat["tool_choice"] == "auto"
    assert chat["messages"][-1] == {"role": "tool", "tool_call_id": "t1", "content": [{"type": "text", "text": "boom"}]}


# --------------------------------------------------------------------------------------
# answers


def _decode(data: bytes) -> list:
    d = SSEDecoder()
    return d.feed(data) + d.flush()


def translated(data: bytes, cuts: list[int], tr=TR) -> bytes:
    """``data`` (Chat SSE) through the pipeline's translate stage, cut at ``cuts``."""
    stream = TranslateStream(None, SimpleNamespace(), tr.events(), None)
    out, last = [], 0
    for cut in sorted(set(c for c in cuts if 0 < c < len(data))) + [len(data)]:
        out += stream(data[last:cut])
        last = cut
    out += stream(b"")
    return b"".join(out)


def assembled(asm, data: bytes) -> Response:
    for event in _decode(data):
        asm.feed(event)
    assert asm.done
    return asm.result()


def harness_sees(data: bytes, tr=TR) -> Response:
    """The reply the harness's own dialect reads from the translated bytes."""
    return assembled(tr.source.assembler(), data)


def upstream_record(chat: bytes, tr=TR) -> Response:
    """The reply the trace records from the upstream's bytes."""
    return assembled(tr.assembler(), chat)


def _without_tokens(r: Response) -> Response:
    return r.model_copy(update={"logprobs": None, "token_ids": None, "prompt_token_ids": None})


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(BOTH), st.sampled_from(CHAT_STREAMS), st.lists(st.integers(0, 4000), max_size=10))
def test_any_split_of_a_captured_stream_gives_the_recorded_reply(tr, path, cuts):
    chat = path.read_bytes()
    seen = harness_sees(translated(chat, cuts, tr), tr)
    record = upstream_record(chat, tr)
    assert seen == _without_tokens(record)
    # ... which is the JSON translation of the same answer
    asm = CHAT.assembler()
    for event in _decode(chat):
        asm.feed(event)
    assert tr.source.parse_response(tr.response(asm.native())) == seen


calls = st.lists(st.builds(lambda n, a, i: ToolCall(id=f"call_{i}", name=n, arguments=json.dumps(a)),
                           ident, st.dictionaries(ident, st.one_of(text, st.integers()), max_size=3),
                           st.integers(0, 10 ** 6)), max_size=3, unique_by=lambda c: c.id)


@st.composite
def chat_answers(draw) -> Response:
    tool_calls = draw(calls)
    message = Message(role="assistant", content=draw(st.one_of(st.just(""), text)), tool_calls=tool_calls,
                      reasoning=[Reasoning(text=draw(text))] if draw(st.booleans()) else [])
    finish = "tool_calls" if tool_calls else draw(st.sampled_from(["stop", "length"]))
    prompt = draw(st.integers(0, 500))
    usage = Usage(input_tokens=prompt, output_tokens=draw(st.integers(0, 500)),
                  cached_input_tokens=draw(st.integers(0, prompt)))
    return Response(id="chatcmpl-x", model="policy", message=message, finish_reason=finish, usage=usage)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(BOTH), chat_answers(), st.lists(st.integers(0, 3000), max_size=12))
def test_any_split_of_a_generated_stream_gives_the_json_reply(tr, answer, cuts):
    chat = b"".join(e.encode() for e in CHAT.stream_events(answer))
    seen = harness_sees(translated(chat, cuts, tr), tr)
    assert seen == tr.source.parse_response(tr.response(CHAT.json_body(answer)))
    assert seen == _without_tokens(upstream_record(chat, tr))
    # what the model said, said to the harness
    assert seen.message.text() == answer.message.text()
    assert [(c.name, json.loads(c.arguments)) for c in seen.message.tool_calls] == \
        [(c.name, json.loads(c.arguments)) for c in answer.message.tool_calls]
    if tr is not GTR:  # Gemini has no call ids: its dialect derives them from the call
        assert [c.id for c in seen.message.tool_calls] == [c.id for c in answer.message.tool_calls]
    assert [r.text for r in seen.message.reasoning] == [r.text for r in answer.message.reasoning]
    assert seen.finish_reason == answer.finish_reason
    assert seen.usage.input_tokens == answer.usage.input_tokens  # the whole prompt, as canonical
    assert seen.usage.cached_input_tokens == answer.usage.cached_input_tokens
    assert seen.usage.output_tokens == answer.usage.output_tokens


@st.composite
def responses_inputs(draw) -> dict:
    """A Responses request in what Chat can express: user text and images, one reasoning
    summary, output text and function calls per assistant turn, each call answered."""
    items: list = [{"role": "user", "content": draw(st.one_of(text, st.lists(st.one_of(
        st.builds(lambda t: {"type": "input_text", "text": t}, text),
        st.builds(lambda d: {"type": "input_image", "image_url": f"data:image/png;base64,{d}"},
                  st.text("ABCDEFGHabcdef0123456789+/", min_size=4, max_size=12))), min_size=1, max_size=3)))}]
    for turn in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):
            items.append({"type": "reasoning", "id": f"rs_{turn}", "summary": [{"type": "summary_text", "text": draw(text)}]})
        if draw(st.booleans()):
            items.append({"type": "message", "role": "assistant", "id": f"msg_{turn}",
                          "content": [{"type": "output_text", "text": draw(text), "annotations": []}]})
        calls = [{"type": "function_call", "id": f"fc_{turn}_{k}", "call_id": f"call_{turn}_{k}", "name": draw(ident),
                  "arguments": json.dumps(draw(st.dictionaries(ident, st.integers(), max_size=2)))}
                 for k in range(draw(st.integers(0, 2)))]
        items += calls
        items += [{"type": "function_call_output", "call_id": c["call_id"], "output": draw(text)} for c in calls]
        items.append({"role": draw(st.sampled_from(["user", "system"])), "content": draw(text)})
    body = {"model": "m", "input": items, "instructions": draw(text), "max_output_tokens": draw(st.integers(1, 999))}
    if draw(st.booleans()):
        body["tools"] = [{"type": "function", "name": draw(ident), "description": draw(text),
                          "parameters": {"type": "object", "properties": {}}}]
        body["tool_choice"] = draw(st.sampled_from(["auto", "required", "none"]))
    return body


@settings(max_examples=150, deadline=None)
@given(responses_inputs())
def test_generated_responses_requests_translate_without_loss(body):
    chat, lost = RTR.request(body)
    assert lost == []
    harness = RESPONSES.parse_request(body)
    upstream = CHAT.parse_request(chat)
    assert [message_hash(_as_sent(m)) for m in harness.messages] == [message_hash(m) for m in upstream.messages]
    assert [(t.name, t.parameters) for t in harness.tools] == [(t.name, t.parameters) for t in upstream.tools]
    assert upstream.sampling.max_tokens == body["max_output_tokens"]
    assert upstream.sampling.tool_choice == body.get("tool_choice")


def test_a_responses_chain_is_the_recorded_conversation_plus_the_new_input():
    first = {"model": "m", "instructions": "be brief", "input": "list files"}
    answer = RTR.response({"id": "chatcmpl-1", "model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls",
        "message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]}}]})
    assert answer["id"] == "resp_1" and answer["output"][0]["call_id"] == "call_1"
    conversation = RESPONSES.parse_request(first).messages + [RESPONSES.parse_response(answer).message]
    chained = {"model": "m", "instructions": "be brief", "previous_response_id": "resp_1",
               "input": [{"type": "function_call_output", "call_id": "call_1", "output": "a.txt"}]}
    chat, lost = RTR.request(chained)
    assert lost == [] and RTR.prefix(chat, conversation)
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool"]
    assert chat["messages"][2]["tool_calls"][0]["id"] == chat["messages"][3]["tool_call_id"] == "call_1"
    # what the Chat upstream reads is what the proxy records for the chained turn
    whole = RESPONSES.chained_request({k: v for k, v in chained.items() if k != "instructions"}, conversation)
    assert [message_hash(m) for m in whole.messages] == [message_hash(m) for m in CHAT.parse_request(chat).messages]


def test_vllm_stop_string_is_a_stop_sequence_and_errors_keep_their_kind():
    body = {"id": "c", "model": "m", "choices": [{"index": 0, "finish_reason": "stop", "stop_reason": "END",
                                                  "message": {"role": "assistant", "content": "x"}}]}
    out = TR.response(body)
    assert (out["stop_reason"], out["stop_sequence"]) == ("stop_sequence", "END")
    err = TR.error(429, {"error": {"message": "slow down", "type": "rate_limit_exceeded", "code": None}})
    assert err == {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    assert TR.error(400, {"object": "error", "message": "bad", "type": "BadRequestError"})["error"] == {
        "type": "invalid_request_error", "message": "bad"}
    # an error inside a stream ends it with Anthropic's error event
    events = TR.events()
    events.feed(_decode(b'data: {"id":"c","model":"m","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n')[0])
    [error] = events.feed(_decode(b'data: {"error":{"message":"overloaded"}}\n\n')[0])
    assert error.event == "error" and json.loads(error.data)["error"]["message"] == "overloaded"


def test_a_freeform_tool_is_a_function_of_one_string_and_its_calls_come_back_freeform():
    """vLLM serves function tools only: Codex's freeform ``exec`` goes as a function taking
    ``{"input": string}``, and a call of it comes back as the custom_tool_call it was, JSON
    and streamed, whatever the split."""
    script = 'const r = await tools.exec_command({cmd: "ls"});\ntext(r.output);'
    body = {"model": "m", "tools": [{"type": "custom", "name": "exec", "description": "run JS",
                                     "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}],
            "input": [{"role": "user", "content": "go"},
                      {"type": "custom_tool_call", "call_id": "c0", "name": "exec", "input": script},
                      {"type": "custom_tool_call_output", "call_id": "c0", "output": "a b"}]}
    chat, lost = RTR.request(body)
    assert [o.key for o in lost] == ["tools[0].format"]
    assert chat["tools"][0]["function"]["parameters"]["properties"] == {
        "input": {"type": "string", "description": "the tool's input, as text"}}
    assert json.loads(chat["messages"][1]["tool_calls"][0]["function"]["arguments"]) == {"input": script}
    tr = RTR.bind(RESPONSES.parse_request(body))
    answer = Response(id="chatcmpl-9", model="m", finish_reason="tool_calls", message=Message(
        role="assistant", tool_calls=[ToolCall(id="c1", name="exec", arguments=json.dumps({"input": script}))]))
    expected = RESPONSES.parse_response(tr.response(CHAT.json_body(answer)))
    assert [(c.type, c.name, c.arguments) for c in expected.message.tool_calls] == [("custom", "exec", script)]
    chat_stream = b"".join(e.encode() for e in CHAT.stream_events(answer))
    for cuts in ([], [5, 40, 41, 200], list(range(0, len(chat_stream), 7))):
        assert harness_sees(translated(chat_stream, cuts, tr), tr) == expected
    assert RTR.custom == frozenset()  # bound per exchange, the shared one untouched


def test_a_gemini_request_is_its_canonical_conversation_in_chat():
    """Gemini's calls have no ids: the dialect's derived ones pair each call with its
    response in Chat, the same ids the record uses, every turn."""
    body = {"systemInstruction": {"parts": [{"text": "Be brief."}]},
            "contents": [{"role": "user", "parts": [{"text": "list"}, {"inlineData": {"mimeType": "image/png", "data": "AAAA"}}]},
                         {"role": "model", "parts": [{"text": "Let me see.", "thought": True},
                                                     {"functionCall": {"name": "ls", "args": {"d": "."}},
                                                      "thoughtSignature": "sig"}]},
                         {"role": "user", "parts": [{"functionResponse": {"name": "ls", "response": {"out": "a"}}}]}],
            "tools": [{"functionDeclarations": [{"name": "ls", "description": "list", "parametersJsonSchema": {"type": "object"}}]},
                      {"googleSearch": {}}],
            "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["ls"]}},
            "generationConfig": {"temperature": 0.2, "topK": 5, "maxOutputTokens": 100, "stopSequences": ["END"],
                                 "thinkingConfig": {"includeThoughts": True}}}
    chat, lost = GTR.request(body)
    assert sorted(o.key for o in lost) == ["contents[0].parts[1]", "contents[1].parts[1].thoughtSignature",
                                           "generationConfig.thinkingConfig", "tools[1].googleSearch"]
    canonical = GEMINI.parse_request(body)
    call_id = canonical.messages[2].tool_calls[0].id
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool"]
    assert chat["messages"][2]["tool_calls"][0]["id"] == chat["messages"][3]["tool_call_id"] == call_id
    assert chat["messages"][2]["reasoning_content"] == "Let me see."
    assert (chat["temperature"], chat["top_k"], chat["max_completion_tokens"], chat["stop"]) == (0.2, 5, 100, ["END"])
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "ls"}}
    assert chat["tools"] == [{"type": "function", "function": {"name": "ls", "description": "list",
                                                               "parameters": {"type": "object"}}}]
    # the answer's call, restated by the harness next turn, has the id the record gave it
    answer = GTR.response({"id": "c", "model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [{"id": "x", "type": "function",
                                                              "function": {"name": "ls", "arguments": '{"d": "."}'}}]}}]})
    assert answer["candidates"][0]["content"]["parts"] == [{"functionCall": {"name": "ls", "args": {"d": "."}}}]
    assert GEMINI.parse_response(answer).message.tool_calls[0].id == call_id

"""The Gemini dialect: its wire format against the simulator's bytes (which follow Google's
documentation), the same invariants as the other dialects (any split of a stream assembles
the same reply; a request that satisfies the session goes through byte for byte), and the
proxy claiming, rewriting and recording Gemini requests end to end."""

from __future__ import annotations

import json

import httpx2 as httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interceptor.dialects import GEMINI, Route, default_hosts, host_dialect, resolve
from interceptor.dialects.gemini import JSONArrayFrames
from interceptor.dialects.sse import SSEDecoder
from interceptor.trace import read_trace
from interceptor.trace.messages import Sampling
from conftest import REAL_KEY
from provider import Reply, ToolCall, gemini as sim_gemini
from provider.turn import Turn

HOST = "generativelanguage.googleapis.com"
BASE = f"https://{HOST}/v1beta/models"


class _Record:
    """Just what the simulator's renderer reads of a request."""

    def __init__(self, body: dict, path: str) -> None:
        self.json, self.route_path = body, path


REQUEST = {
    "contents": [{"role": "user", "parts": [{"text": "list the files"}]}],
    "systemInstruction": {"role": "user", "parts": [{"text": "You are an agent."}]},
    "tools": [{"functionDeclarations": [{"name": "run_shell_command", "description": "run",
                                         "parametersJsonSchema": {"type": "object"}}]}],
    "generationConfig": {"temperature": 0.9, "topP": 0.95, "thinkingConfig": {"includeThoughts": True,
                                                                              "thinkingBudget": 8192}},
}

REPLIES = {
    "text": Reply(text=["Hello", ", ", "world", "!"]),
    "thinking": Reply(reasoning=["Let me ", "think."], text=["The answer", " is 4."]),
    "tools": Reply(reasoning="I should list them.",
                   tool_calls=[ToolCall(name="run_shell_command", arguments={"command": "ls"}),
                               ToolCall(name="run_shell_command", arguments={"command": "pwd"})]),
    "length": Reply(text=["cut"], finish_reason="length"),
    # Quotes, backslashes and brackets inside strings: the array framing must not count them.
    "escapes": Reply(text=['She said "hi" ', '{not json} [x] \\', ' back\\"slash']),
}


def turn_for(reply: Reply, path: str = "/v1beta/models/gemini-2.5-pro:streamGenerateContent") -> Turn:
    return sim_gemini.turn_of(_Record(REQUEST, path), reply, "gemini-2.5-pro")


def assemble(frames, chunks: list[bytes]):
    assembler = GEMINI.assembler()
    said = []
    for chunk in chunks:
        said += [assembler.feed(e) for e in frames.feed(chunk)]
    said += [assembler.feed(e) for e in frames.flush()]
    return assembler.result(), said


def streams(name: str) -> dict[str, bytes]:
    turn = turn_for(REPLIES[name])
    return {"sse": b"".join(sim_gemini.sse_events(turn)), "array": b"".join(sim_gemini.array_events(turn)),
            "json": sim_gemini.json_body(turn)}


FRAMES = {"sse": SSEDecoder, "array": JSONArrayFrames}


# --------------------------------------------------------------------------------------
# Routes, credentials, where the model lives


@pytest.mark.parametrize(("method", "path", "kind"), [
    ("POST", "/v1beta/models/gemini-2.5-pro:generateContent", "model"),
    ("POST", "/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse", "model"),
    ("POST", "/v1/models/gemini-2.5-flash:streamGenerateContent", "model"),
    ("POST", "/v1beta/models/gemini-2.5-pro:countTokens", "side"),
    ("GET", "/v1beta/models", "side"),
    ("GET", "/v1beta/models/gemini-2.5-pro", "side"),
    ("POST", "/v1beta/models/gemini-2.5-pro:embedContent", None),
    ("GET", "/v1beta/models/gemini-2.5-pro:generateContent", None),
    ("POST", "/v1beta/cachedContents", None),
])
def test_routes(method, path, kind):
    route = resolve(method, path, host=HOST)
    assert route == (Route(GEMINI, kind) if kind else None)


def test_gemini_is_a_default_host_and_answers_locally_in_its_shape():
    assert HOST in default_hosts()
    assert host_dialect(HOST) is GEMINI
    assert GEMINI.error_body(404, "no") == {"error": {"code": 404, "message": "no", "status": "NOT_FOUND"}}
    assert GEMINI.error_body(429, "slow")["error"]["status"] == "RESOURCE_EXHAUSTED"


def test_secret_and_real_key_go_where_they_came():
    assert GEMINI.secret({"x-goog-api-key": "s1"}, {}) == "s1"
    assert GEMINI.secret({}, {"key": "s2"}) == "s2"
    headers, query = {"x-goog-api-key": "secret"}, {}
    GEMINI.put_key(headers, query, "real")
    assert headers == {"x-goog-api-key": "real"} and query == {}
    headers, query = {"authorization": "Bearer x"}, {"key": "secret", "alt": "sse"}
    GEMINI.put_key(headers, query, "real")
    assert headers == {} and query == {"key": "real", "alt": "sse"}


def test_the_model_lives_in_the_path():
    path = "/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse"
    assert GEMINI.requested_model({}, path) == "gemini-2.5-pro"
    new, override = GEMINI.path_with_model(path, "gemini-session")
    assert new == "/v1beta/models/gemini-session:streamGenerateContent?alt=sse"
    assert (override.key, override.old, override.new) == ("model", "gemini-2.5-pro", "gemini-session")
    assert GEMINI.path_with_model(path, "gemini-2.5-pro") == (path, None)
    assert GEMINI.upstream_path("/v1beta", path) == path
    assert GEMINI.upstream_path("/v1", path) == "/v1/models/gemini-2.5-pro:streamGenerateContent?alt=sse"
    assert GEMINI.upstream_path("", path) == path
    assert GEMINI.upstream_path("/google", path) == "/google" + path


# --------------------------------------------------------------------------------------
# Sampling


def test_overrides_in_geminis_names_and_thinking_config():
    body = json.loads(json.dumps(REQUEST))
    changes = GEMINI.apply_overrides(body, "ignored: the path has it", Sampling(
        temperature=0.2, max_tokens=512, seed=7, thinking={"thinkingBudget": 1024, "includeThoughts": True}),
        "exact")
    assert body["generationConfig"] == {"temperature": 0.2, "maxOutputTokens": 512, "seed": 7,
                                        "thinkingConfig": {"thinkingBudget": 1024, "includeThoughts": True}}
    assert "model" not in body
    keys = {c.key: c for c in changes}
    assert keys["generationConfig.topP"].new is None and keys["generationConfig.topP"].old == 0.95
    assert GEMINI.sampling(body).thinking == {"thinkingBudget": 1024, "includeThoughts": True}


def test_no_thinking_from_the_session_drops_the_harnesss_in_exact_mode_and_keeps_it_in_overlay():
    body = json.loads(json.dumps(REQUEST))
    GEMINI.apply_overrides(body, None, Sampling(temperature=0.5), "exact")
    assert body["generationConfig"] == {"temperature": 0.5}
    body = json.loads(json.dumps(REQUEST))
    GEMINI.apply_overrides(body, None, Sampling(temperature=0.5))
    assert body["generationConfig"] == {**REQUEST["generationConfig"], "temperature": 0.5}


def test_level_and_budget_together_are_reconciled():
    body = {"contents": []}
    changes = GEMINI.apply_overrides(body, None, Sampling(thinking={"thinkingBudget": 100}, reasoning_effort="low"))
    assert body["generationConfig"]["thinkingConfig"] == {"thinkingLevel": "low"}
    assert any(c.key == "generationConfig.thinkingConfig.thinkingBudget" and "thinkingLevel" in c.reason
               for c in changes)


def test_a_conforming_request_is_left_alone():
    body = {"contents": REQUEST["contents"], "generationConfig": {"temperature": 0.5, "maxOutputTokens": 100}}
    assert GEMINI.apply_overrides(body, "m", Sampling(temperature=0.5, max_tokens=100)) == []


# --------------------------------------------------------------------------------------
# Canonical messages


def test_request_canonical_messages_pair_calls_and_results_by_order_and_name():
    body = {"contents": [
        {"role": "user", "parts": [{"text": "go"}]},
        {"role": "model", "parts": [
            {"text": "plan", "thought": True, "thoughtSignature": "sig-a"},
            {"functionCall": {"name": "read", "args": {"p": "a"}}, "thoughtSignature": "sig-b"},
            {"functionCall": {"name": "shell", "args": {"c": "ls"}}},
            {"functionCall": {"name": "read", "args": {"p": "b"}}}]},
        {"role": "user", "parts": [
            {"functionResponse": {"name": "shell", "response": {"output": "x"}}},
            {"functionResponse": {"name": "read", "response": {"output": "A"}}},
            {"functionResponse": {"name": "read", "response": {"output": "B"}}}]},
    ]}
    messages = GEMINI.parse_request(body).messages
    assert [m.role for m in messages] == ["user", "assistant", "tool", "tool", "tool"]
    model = messages[1]
    assert model.reasoning[0].text == "plan" and model.reasoning[0].signature == "sig-a"
    assert [c.name for c in model.tool_calls] == ["read", "shell", "read"]
    assert model.tool_calls[0].extra == {"thoughtSignature": "sig-b"}
    by_id = {c.id: json.loads(c.arguments) for c in model.tool_calls}
    assert by_id[messages[2].tool_call_id] == {"c": "ls"}
    assert by_id[messages[3].tool_call_id] == {"p": "a"} and by_id[messages[4].tool_call_id] == {"p": "b"}
    assert len(by_id) == 3


def test_a_restated_call_with_a_harness_id_and_a_placeholder_signature_is_the_sampled_call():
    """Gemini CLI restates a call with an id of its own and, when the model sent none, the
    documented placeholder signature: the canonical message must still be the sampled one."""
    sampled = GEMINI.parse_response({"candidates": [{"content": {"role": "model", "parts": [
        {"functionCall": {"name": "run_shell_command", "args": {"command": "ls"}}}]}, "finishReason": "STOP"}]})
    restated = GEMINI.parse_request({"contents": [
        {"role": "model", "parts": [{"functionCall": {"id": "run_shell_command_17961_0", "name": "run_shell_command",
                                                      "args": {"command": "ls"}},
                                     "thoughtSignature": "skip_thought_signature_validator"}]},
        {"role": "user", "parts": [{"functionResponse": {"id": "run_shell_command_17961_0",
                                                         "name": "run_shell_command", "response": {"output": "x"}}}]},
    ]}).messages
    assert restated[0] == sampled.message
    assert restated[1].tool_call_id == sampled.message.tool_calls[0].id
    assert sampled.finish_reason == "tool_calls" and sampled.native_finish_reason == "STOP"


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_usage_finish_and_json_round_trip(name):
    body = json.loads(streams(name)["json"])
    response = GEMINI.parse_response(body)
    usage = body["usageMetadata"]
    assert response.usage.input_tokens == usage["promptTokenCount"]
    assert response.usage.output_tokens == usage["candidatesTokenCount"] + usage.get("thoughtsTokenCount", 0)
    assert response.usage.reasoning_tokens == usage.get("thoughtsTokenCount", 0)
    assert response.native_finish_reason == body["candidates"][0]["finishReason"]
    assert response.finish_reason == {"text": "stop", "thinking": "stop", "tools": "tool_calls", "length": "length",
                                    "escapes": "stop"}[name]
    assert GEMINI.parse_response(GEMINI.json_body(response)) == response


def test_thoughts_are_reasoning_with_their_signature():
    response = GEMINI.parse_response(json.loads(streams("thinking")["json"]))
    assert response.message.content == "The answer is 4."
    assert [r.text for r in response.message.reasoning if r.text] == ["Let me think."]
    assert any(r.signature for r in response.message.reasoning)


# --------------------------------------------------------------------------------------
# Streams: any split assembles the same reply, as JSON does


@pytest.mark.parametrize("framing", sorted(FRAMES))
@pytest.mark.parametrize("name", sorted(REPLIES))
def test_stream_equals_json_and_ends_on_its_terminal_chunk(name, framing):
    data = streams(name)
    whole, said = assemble(FRAMES[framing](), [data[framing]])
    assert whole.error is None and said.count(True) == 1 and said[-1] is True
    reference = GEMINI.parse_response(json.loads(data["json"]))
    assert whole.model_dump(exclude={"id"}) == reference.model_dump(exclude={"id"})


@pytest.mark.parametrize("framing", sorted(FRAMES))
def test_stream_byte_by_byte(framing):
    data = streams("tools")[framing]
    whole, _ = assemble(FRAMES[framing](), [data])
    byte, said = assemble(FRAMES[framing](), [data[i:i + 1] for i in range(len(data))])
    assert byte == whole and said.count(True) == 1


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(REPLIES)), framing=st.sampled_from(sorted(FRAMES)),
       cuts=st.lists(st.integers(0, 5000), max_size=30))
def test_any_split_assembles_the_same_reply(name, framing, cuts):
    data = streams(name)[framing]
    whole, _ = assemble(FRAMES[framing](), [data])
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    assert assemble(FRAMES[framing](), [data[a:b] for a, b in zip(points, points[1:])])[0] == whole


def test_a_cut_stream_is_an_error_not_a_turn():
    data = streams("text")["sse"]
    response, said = assemble(SSEDecoder(), [data[: len(data) // 2]])
    assert True not in said and response.error is not None and response.error.type == "incomplete_stream"


def test_an_error_chunk_is_terminal_and_on_the_record():
    turn = turn_for(Reply(text=["a", "b"], error_after=1))
    data = sim_gemini.sse_events(turn)[0] + sim_gemini.error_event(turn, sse=True)
    response, said = assemble(SSEDecoder(), [data])
    assert said[-1] is True and response.error.type == "INTERNAL"


# --------------------------------------------------------------------------------------
# Through the proxy


def _client(session: dict) -> httpx.Client:
    return httpx.Client(timeout=30, trust_env=True)


def _post(http, path: str, body, *, secret: str, how: str = "header"):
    url = f"{BASE}/{path}"
    headers = {"content-type": "application/json"}
    if how == "header":
        headers["x-goog-api-key"] = secret
    else:
        url += ("&" if "?" in url else "?") + f"key={secret}"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(url, content=content, headers=headers)


@pytest.mark.parametrize("how", ["header", "query"])
@pytest.mark.parametrize("framing", ["json", "sse", "array"])
def test_gemini_through_the_proxy(new_session, sim, proxy, harness_env, how, framing):
    session = new_session(model="gemini-session", sampling={"temperature": 0.3, "max_tokens": 200})
    harness_env(session["env"])
    sim.script(Reply(text=["Hi ", "there"]))
    method = {"json": "gemini-2.5-pro:generateContent", "sse": "gemini-2.5-pro:streamGenerateContent?alt=sse",
              "array": "gemini-2.5-pro:streamGenerateContent"}[framing]
    with _client(session) as http:
        r = _post(http, method, REQUEST, secret=session["model_secret"], how=how)
        assert r.status_code == 200, r.text
        if framing == "json":
            text = r.json()["candidates"][0]["content"]["parts"][0]["text"]
        elif framing == "array":
            text = "".join(p["text"] for c in r.json() for p in c["candidates"][0]["content"]["parts"])
        else:
            chunks = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
            text = "".join(p["text"] for c in chunks for p in c["candidates"][0]["content"]["parts"])
    assert text == "Hi there"
    seen = sim.model_requests()[0]
    assert seen.route_path == f"/v1/models/gemini-session:{method.split(':')[1].split('?')[0]}"
    key = seen.headers.get("x-goog-api-key") if how == "header" else seen.query["key"][0]
    assert key == REAL_KEY
    assert session["model_secret"] not in seen.path + seen.body.decode() + str(seen.headers.items_raw())
    # Overlay (the default): the session's keys replace the harness's, its others stay.
    assert seen.json["generationConfig"] == {**REQUEST["generationConfig"], "temperature": 0.3, "maxOutputTokens": 200}
    proxy.api("DELETE", f"sessions/{session['id']}")
    trace = read_trace(session["trace_path"])
    (call,) = trace.calls
    assert call.dialect == "gemini" and call.model == "gemini-session" and call.requested_model == "gemini-2.5-pro"
    assert call.usage.input_tokens > 0 and call.finish_reason == "stop" and call.native_finish_reason == "STOP"
    assert {"key": "model", "old": "gemini-2.5-pro", "new": "gemini-session", "reason": "session"} in [o.model_dump() for o in call.overrides]
    assert trace.branches[0].messages[-1].text() == "Hi there"


def test_a_conforming_gemini_request_is_forwarded_byte_for_byte(new_session, sim, proxy, harness_env):
    session = new_session(model="gemini-2.5-pro", sampling={"temperature": 0.5})
    harness_env(session["env"])
    raw = (b'{ "contents": [{"role":"user","parts":[{"text":"caf\\u00e9 \xe2\x82\xac"}]}],\n'
           b'  "generationConfig": {"temperature": 0.5} }')
    with _client(session) as http:
        r = _post(http, "gemini-2.5-pro:generateContent", raw, secret=session["model_secret"])
    assert r.status_code == 200
    assert sim.model_requests()[0].body == raw


def test_gemini_refusals_are_in_geminis_shape(new_session, sim, proxy, harness_env):
    session = new_session()
    harness_env(session["env"])
    with _client(session) as http:
        r = _post(http, "gemini-2.5-pro:generateContent", REQUEST, secret="sk-ic-m-nobody")
        assert r.status_code == 401 and r.json()["error"]["status"] == "UNAUTHENTICATED"
        assert "unknown session secret" in r.json()["error"]["message"]
        r = _post(http, "gemini-2.5-pro:generateContent", b"{nope", secret=session["model_secret"])
        assert r.status_code == 400 and r.json()["error"]["status"] == "INVALID_ARGUMENT"
        r = http.post(f"https://{HOST}/v1beta/files", content=b"{}")
        assert r.status_code == 404 and r.json()["error"]["code"] == 404
    assert sim.requests == []


def test_gemini_side_routes_are_relayed_not_recorded(new_session, sim, proxy, harness_env):
    session = new_session(model="gemini-session")
    harness_env(session["env"])
    with _client(session) as http:
        r = _post(http, "gemini-2.5-pro:countTokens", {"contents": REQUEST["contents"]}, secret=session["model_secret"])
        assert r.status_code == 200 and r.json()["totalTokens"] > 0
        r = http.get(f"{BASE}", headers={"x-goog-api-key": session["model_secret"]})
        assert r.status_code == 200 and r.json()["models"]
    assert [q.route_path for q in sim.requests] == ["/v1/models/gemini-session:countTokens", "/v1/models"]
    proxy.api("DELETE", f"sessions/{session['id']}")
    assert read_trace(session["trace_path"]).calls == []


def test_an_upstream_error_keeps_geminis_status_on_the_record(new_session, sim, proxy, harness_env):
    session = new_session()
    harness_env(session["env"])
    sim.script(Reply(status=429))
    with _client(session) as http:
        r = _post(http, "gemini-2.5-pro:streamGenerateContent?alt=sse", REQUEST, secret=session["model_secret"])
    assert r.status_code == 429 and r.json()["error"]["status"] == "RESOURCE_EXHAUSTED"
    proxy.api("DELETE", f"sessions/{session['id']}")
    (call,) = read_trace(session["trace_path"]).calls
    assert call.error.type == "RESOURCE_EXHAUSTED" and call.status == 429 and call.node is None

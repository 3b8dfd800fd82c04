"""Any body either leaves rewritten or is refused in shape, by property test.

In process, fast: the addons the entry script lists, guarded and gated exactly as there,
run by mitmproxy's own addon manager on ``tflow`` flows (Reach, which would probe a socket,
and the WebSocket relay are left out). Hypothesis builds request bodies and headers for all
three dialects from a valid request: deep nesting, lone surrogates, NaN/Infinity, duplicate
keys, huge numbers, a wrong type at every field, invalid UTF-8, an empty body, compressed
bodies (good and broken). Invariant on each example: the request is either forwarded
rewritten (the session's upstream and model, the real key, no secret anywhere) or answered
4xx/5xx in the dialect's error shape with nothing forwarded; never forwarded as the harness
sent it. A forwarded one gets an answer, which is recorded; after every example a plain
turn of the same session records, and the trace verifies.
The end-to-end counterparts, through the real mitmdump, are in test_faults.py.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st
from mitmproxy import http
from mitmproxy.proxy.layers.http import HttpRequestHeadersHook as RequestHeadersHook, HttpRequestHook as RequestHook, HttpResponseHeadersHook as ResponseHeadersHook, HttpResponseHook as ResponseHook
from mitmproxy.test import taddons, tflow

from interceptor.addons.mitm.bodycap import BodyCap
from interceptor.addons.mitm.claim import Claim
from interceptor.addons.mitm.control import Control
from interceptor.addons.mitm.gate import Gate, guarded
from interceptor.addons.gateway.retry import Retry
from interceptor.addons.gateway.rewrite import Rewrite
from interceptor.addons.gateway.sessions.session import Registry, SessionConfig
from interceptor.addons.mitm.settings import Settings
from interceptor.addons.gateway.policy.stops import Stops
from interceptor.addons.gateway.answer.tee import Tee
from interceptor.addons.gateway.sessions.upstream import Upstream
from interceptor.trace import read_trace
from interceptor.trace.verify import problems

KEY_ENV = "INTERCEPT_FUZZ_KEY"
REAL_KEY = "sk-real-fuzz-key-0123456789"
UPSTREAM = ("127.0.0.1", 9)
IMPOSED = "imposed-model"

DIALECTS = {
    "chat": ("api.openai.com", "/v1/chat/completions", {
        "model": "harness-model", "temperature": 1.0, "max_tokens": 50,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]}),
    "responses": ("api.openai.com", "/v1/responses", {
        "model": "harness-model", "temperature": 1.0, "max_output_tokens": 50, "instructions": "be brief",
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]}]}),
    "anthropic": ("api.anthropic.com", "/v1/messages", {
        "model": "harness-model", "max_tokens": 50, "temperature": 1.0, "system": "be brief",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]}),
}
ANSWERS = {
    "chat": {"id": "c1", "object": "chat.completion", "created": 1, "model": IMPOSED,
             "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}},
    "responses": {"id": "resp_1", "object": "response", "created_at": 1, "status": "completed", "model": IMPOSED,
                  "output": [{"type": "message", "id": "m1", "status": "completed", "role": "assistant",
                              "content": [{"type": "output_text", "text": "ok", "annotations": []}]}],
                  "usage": {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}},
    "anthropic": {"id": "msg_1", "type": "message", "role": "assistant", "model": IMPOSED,
                  "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn", "stop_sequence": None,
                  "usage": {"input_tokens": 3, "output_tokens": 1}},
}


class Loaded:
    """Stands for the loaded script: mitmproxy runs its addons as one chain of children."""

    def __init__(self, addons):
        self.addons = addons


class Proxy:
    """The request side of the entry script, plus the Tee to record answers."""

    def __init__(self, trace_dir):
        os.environ[KEY_ENV] = REAL_KEY
        self.registry = Registry()
        settings_ = Settings(self.registry)
        self.tctx = taddons.context()
        self.loop = self.tctx.master.event_loop
        retry = Retry()  # its capture is the pipeline's last stage, as in the script: it settles
        # what it has in flight there (without it a flagged retry of an earlier body would wait forever)
        self.tctx.master.addons.add(Loaded(guarded([
            settings_, Control(self.registry, settings_), Claim(self.registry, settings_), BodyCap(settings_),
            Rewrite(), retry, Tee(capture=retry), Stops()]) + [Gate(settings_)]))
        self.tctx.options.update(intercept_trace_dir=str(trace_dir), intercept_max_body="1m")
        config = SessionConfig(model=IMPOSED, sampling={"temperature": 0.5})
        upstream = Upstream(base_url=f"http://{UPSTREAM[0]}:{UPSTREAM[1]}/v1", api_key_env=KEY_ENV)
        self.session = self.registry.create(config, trace_dir, "never", upstream=upstream)

    def run(self, flow, *hooks):
        async def go():
            for hook in hooks:
                await self.tctx.master.addons.handle_lifecycle(hook(flow))
        self.loop.run_until_complete(go())

    def send(self, dialect: str, raw: bytes, headers: dict[str, str] | None = None) -> http.HTTPFlow:
        host, path, _ = DIALECTS[dialect]
        auth = {"x-api-key": self.session.model_secret} if dialect == "anthropic" else \
               {"authorization": f"Bearer {self.session.model_secret}"}
        req = http.Request.make("POST", f"https://{host}{path}", raw,
                                {"content-type": "application/json", **auth, **(headers or {})})
        flow = tflow.tflow(req=req)
        self.run(flow, RequestHeadersHook, RequestHook)
        return flow

    def answer(self, flow: http.HTTPFlow, dialect: str) -> None:
        flow.response = http.Response.make(200, json.dumps(ANSWERS[dialect]).encode(),
                                           {"content-type": "application/json"})
        self.run(flow, ResponseHeadersHook, ResponseHook)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    p = Proxy(tmp_path_factory.mktemp("fuzz"))
    yield p
    p.tctx.__exit__(None, None, None)


def check(proxy: Proxy, dialect: str, flow: http.HTTPFlow, raw: bytes) -> str:
    """The invariant; returns "refused" or "forwarded"."""
    secret = proxy.session.model_secret
    if flow.response is not None and "x-interceptor-replay" in flow.response.headers:
        return "replayed"  # a flagged retry of the last turn (same body, retry-count header)
    if flow.response is not None:
        assert 400 <= flow.response.status_code < 600, flow.response.status_code
        assert flow.response.headers.get("x-should-retry") == "false"
        text = flow.response.get_text(strict=False)
        assert secret not in text and REAL_KEY not in text
        body = json.loads(text)
        if dialect == "anthropic":
            assert body["type"] == "error" and {"type", "message"} <= set(body["error"])
        else:
            assert {"type", "message"} <= set(body["error"])
        # Bad input is the request's fault (4xx); a 500 is the Gate catching a bug in a step.
        assert flow.response.status_code < 500, text
        return "refused"
    assert (flow.request.host, flow.request.port) == UPSTREAM
    headers = str(flow.request.headers)
    assert secret not in headers
    if dialect == "anthropic":
        assert flow.request.headers["x-api-key"] == REAL_KEY
    else:
        assert flow.request.headers["authorization"] == f"Bearer {REAL_KEY}"
    content = flow.request.get_content(strict=True)
    assert secret.encode() not in content
    sent = json.loads(content)
    assert sent["model"] == IMPOSED  # never as the harness sent it
    assert content != raw
    return "forwarded"


# --- the bodies --------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


def dumps(value) -> str:
    return json.dumps(value, separators=(",", ":"))


@st.composite
def bodies(draw, dialect: str) -> tuple[bytes, dict[str, str]]:
    base = json.loads(json.dumps(DIALECTS[dialect][2]))
    history = "input" if dialect == "responses" else "messages"
    kind = draw(st.sampled_from(["nesting", "surrogate", "nan", "duplicate", "huge", "wrong_type",
                                 "wrong_inner_type", "invalid_utf8", "empty", "compressed", "headers"]))
    headers: dict[str, str] = {}
    text = dumps(base)
    if kind == "nesting":
        depth = draw(st.sampled_from([10, 400, 600, 1500, 5000]))
        nested = "[" * depth + "]" * depth
        where = draw(st.sampled_from(["top", "history"]))
        text = (text[:-1] + f',"metadata":{nested}}}') if where == "top" else \
            text.replace('"hello"', f'"hello","x":{nested}', 1) if dialect == "chat" else \
            text.replace(f'"{history}":[', f'"{history}":[{nested},', 1)
    elif kind == "surrogate":
        escape = draw(st.sampled_from(["\\ud800", "\\udfff", "\\udbff\\udbff", "x\\ud83d", "\\ude00y"]))
        text = text.replace("hello", "hel" + escape + "lo").replace("be brief", "be" + escape)
    elif kind == "nan":
        value = draw(st.sampled_from(["NaN", "Infinity", "-Infinity"]))
        text = text.replace('"temperature":1.0', f'"temperature":{value}')
    elif kind == "duplicate":
        key = draw(st.sampled_from(["model", "temperature", "max_tokens", history, "stream"]))
        text = "{" + f'"{key}":{draw(st.sampled_from(["1", dumps("harness-model"), "null", "[]"]))},' + text[1:] + \
               ("" if draw(st.booleans()) else "")
        text = text[:-1] + f',"{key}":{dumps("harness-model") if key == "model" else "true"}}}'
    elif kind == "huge":
        value = draw(st.sampled_from(["1e400", "-1e400", "1" + "0" * 400, "123456789012345678901234567890", "-0"]))
        key = draw(st.sampled_from(["temperature", "max_tokens" if dialect != "responses" else "max_output_tokens"]))
        text = text.replace(f'"{key}":', f'"{key}":{value},"_{key}":', 1)
    elif kind == "wrong_type":
        key = draw(st.sampled_from(sorted(base) + ["stream", "tools", "tool_choice", "stream_options"]))
        base[key] = draw(JSON)
        text = dumps(base)
    elif kind == "wrong_inner_type":
        item = base[history][-1]
        key = draw(st.sampled_from(sorted(item) + ["tool_calls", "name"]))
        item[key] = draw(JSON)
        if draw(st.booleans()):
            base[history] = [draw(JSON)] + base[history]
        text = dumps(base)
    elif kind == "empty":
        return b"", headers
    elif kind == "headers":
        headers = draw(st.dictionaries(
            st.sampled_from(["x-stainless-retry-count", "content-type", "idempotency-key", "anthropic-version",
                             "x-api-key", "authorization", "accept-encoding"]),
            st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=12), max_size=3))
    raw = text.encode("utf-8")
    if kind == "invalid_utf8":
        at = raw.index(b"hello")
        raw = raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80", b"\xf4\x90\x80\x80"])) + raw[at:]
    elif kind == "compressed":
        how = draw(st.sampled_from(["gzip", "deflate", "broken-gzip", "unknown"]))
        headers["content-encoding"] = {"broken-gzip": "gzip", "unknown": "x-foo"}.get(how, how)
        raw = gzip.compress(raw) if how == "gzip" else zlib.compress(raw) if how == "deflate" else \
            b"\x1f\x8b\x08garbage" if how == "broken-gzip" else raw
    return raw, headers


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_any_body_leaves_rewritten_or_is_refused_in_shape(proxy, dialect, data):
    raw, headers = data.draw(bodies(dialect))
    flow = proxy.send(dialect, raw, headers)
    outcome = check(proxy, dialect, flow, raw)
    if outcome == "replayed":
        proxy.run(flow, ResponseHeadersHook, ResponseHook)
    event(f"{outcome} {flow.response.status_code if flow.response else ''}")
    if outcome == "forwarded":
        proxy.answer(flow, dialect)
    # The session goes on: a plain request of this dialect records a turn.
    turns = proxy.session.recorder.trace.num_turns
    good = proxy.send(dialect, json.dumps(DIALECTS[dialect][2]).encode())
    assert check(proxy, dialect, good, b"") == "forwarded"
    proxy.answer(good, dialect)
    assert proxy.session.recorder.trace.num_turns == turns + 1


def test_the_trace_of_all_those_examples_verifies(proxy):
    """Runs after the property tests in this module (same proxy): everything they recorded,
    weird text included, folds back and verifies. A plain turn of each dialect first, so it
    has turns of its own to verify when the property tests ran in another process (xdist
    splits a module between its workers)."""
    for dialect in sorted(DIALECTS):
        good = proxy.send(dialect, json.dumps(DIALECTS[dialect][2]).encode())
        assert check(proxy, dialect, good, b"") == "forwarded"
        proxy.answer(good, dialect)
    proxy.session.recorder.store.flush(timeout=10)
    trace = read_trace(proxy.session.trace_path)
    assert trace.num_turns >= 3 and problems(trace) == []
    assert [c.id for c in trace.calls] == [c.id for c in proxy.session.recorder.trace.calls]

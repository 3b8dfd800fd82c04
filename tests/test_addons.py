"""Each addon's decisions, in-process: mitmproxy's ``taddons`` and ``tflow``, no mitmdump, no
sockets, seconds for the lot. The end-to-end suite proves the wiring through a real proxy;
this one proves what each addon decides (claim, refusal shapes, overrides, retry, delivery)
and that the script lists them in an order that works.
"""

from __future__ import annotations

import base64
import importlib.util
import inspect
import json
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest
from mitmproxy import flow as mflow
from mitmproxy import http
from mitmproxy.test import taddons, tflow

from interceptor.addons.mitm.claim import Claim
from interceptor.addons.gateway.answer.collect import Collect
from interceptor.addons.gateway.exchange import Exchange, exchange_of
from interceptor.addons.gateway.retry import Retry
from interceptor.addons.gateway.rewrite import Rewrite
from interceptor.addons.gateway.sessions.session import Registry, Session, SessionConfig
from interceptor.addons.mitm.settings import Settings
from interceptor.addons.gateway.answer.tee import Tee
from interceptor.addons.gateway.sessions.upstream import Upstream
from interceptor.dialects import ANTHROPIC, CHAT, RESPONSES
from interceptor.dialects.sse import SSEEvent

ROOT = Path(__file__).resolve().parent.parent
REAL = "sk-real-key-in-process-0123456789"
ENV = "INTERCEPT_INPROC_KEY"


@dataclass
class World:
    tctx: taddons.context
    registry: Registry
    settings: Settings
    claim: Claim
    rewrite: Rewrite
    collect: Collect
    retry: Retry
    tee: Tee
    trace_dir: Path

    def session(self, upstream: dict | None = None, **config) -> Session:
        """A session on an upstream the operator declared (``upstream`` its fields), else on
        the default one: the provider host, with the real key from ``ENV``."""
        declared = Upstream(**(upstream or {"api_key_env": ENV}))
        return self.registry.create(SessionConfig(**config), self.trace_dir, "never", declared)

    def run(self, value):
        if inspect.isawaitable(value):
            return self.tctx.master.event_loop.run_until_complete(value)
        return value

    def send(self, flow: http.HTTPFlow) -> http.HTTPFlow:
        """The request half, in the script's order."""
        for hook in (self.claim.requestheaders, self.rewrite.request,
                     self.collect.request, self.retry.request):
            self.run(hook(flow))
        return flow

    def answer(self, flow: http.HTTPFlow, status: int = 200, body: bytes = b"", ctype: str = "application/json",
               chunks: list[bytes] | None = None) -> bytes:
        """The answer half through the pipeline; returns the bytes the harness receives."""
        flow.response = http.Response.make(status, b"" if chunks is not None else body, {"content-type": ctype})
        self.tee.responseheaders(flow)
        received = b""
        if chunks is not None:
            assert callable(flow.response.stream), "a streamed answer must be streamed"
            for chunk in [*chunks, b""]:
                out = flow.response.stream(chunk)
                received += out if isinstance(out, bytes) else b"".join(out)
        else:
            received = flow.response.content
        self.tee.response(flow)
        return received


@pytest.fixture
def world(tmp_path, monkeypatch) -> World:
    monkeypatch.setenv(ENV, REAL)
    registry = Registry()
    settings = Settings(registry)
    retry, collect = Retry(), Collect()
    addons = dict(claim=Claim(registry, settings), rewrite=Rewrite(), collect=collect, retry=retry,
                  tee=Tee(strip=collect, capture=retry))
    with taddons.context(retry) as tctx:
        yield World(tctx, registry, settings, trace_dir=tmp_path, **addons)
    registry.seal_all("test")
    registry.store.close()


def flow_for(method: str, url: str, body: dict | bytes | None = None, headers: dict | None = None,
             client=None) -> http.HTTPFlow:
    content = json.dumps(body).encode() if isinstance(body, dict) else (body or b"")
    req = http.Request.make(method, url, content, {"content-type": "application/json", **(headers or {})})
    return tflow.tflow(req=req, client_conn=client or tflow.tclient_conn())


def error_json(flow: http.HTTPFlow) -> dict:
    assert flow.response is not None
    return json.loads(flow.response.content)


CHAT_URL = "https://api.openai.com/v1/chat/completions"
MESSAGES_URL = "https://api.anthropic.com/v1/messages"
CHAT_BODY = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}


# --------------------------------------------------------------------------------------
# Claim


@pytest.mark.parametrize(("url", "headers", "dialect", "kind"), [
    (CHAT_URL, "bearer", CHAT, "model"),
    ("https://api.openai.com/v1/responses", "bearer", RESPONSES, "model"),
    (MESSAGES_URL + "?beta=true", "x-api-key", ANTHROPIC, "model"),
    ("https://api.anthropic.com/v1/messages/count_tokens", "x-api-key", ANTHROPIC, "side"),
    ("https://api.anthropic.com/v1/models", "x-api-key", ANTHROPIC, "side"),
    ("https://api.openai.com/v1/models", "bearer", CHAT, "side"),
])
def test_claim_finds_dialect_kind_and_session_by_the_secret_where_the_sdk_puts_it(world, url, headers, dialect, kind):
    session = world.session()
    auth = {"bearer": {"authorization": f"Bearer {session.model_secret}"},
            "x-api-key": {"x-api-key": session.model_secret}}[headers]
    flow = flow_for("GET" if url.endswith("/models") else "POST", url, CHAT_BODY, auth)
    world.claim.requestheaders(flow)
    ex = exchange_of(flow)
    assert flow.response is None and ex is not None
    assert (ex.session, ex.dialect, ex.route.kind) == (session, dialect, kind)


def test_claim_takes_the_secret_from_the_connects_proxy_authorization(world):
    session = world.session()
    client = tflow.tclient_conn()
    connect = flow_for("CONNECT", "https://api.openai.com/", client=client)
    connect.request.headers["proxy-authorization"] = "Basic " + base64.b64encode(
        f"session:{session.model_secret}".encode()).decode()
    world.claim.http_connect(connect)
    assert "proxy-authorization" not in connect.request.headers  # never forwarded
    flow = flow_for("POST", CHAT_URL, CHAT_BODY, client=client)
    world.claim.requestheaders(flow)
    assert exchange_of(flow).session is session


def test_claim_leaves_other_hosts_alone(world):
    flow = flow_for("GET", "https://pypi.org/simple/")
    world.claim.requestheaders(flow)
    assert flow.response is None and exchange_of(flow) is None


@pytest.mark.parametrize(("url", "shape"), [
    ("https://api.anthropic.com/api/event_logging/batch", "anthropic"),
    ("https://api.openai.com/v1/completions", "openai"),
    ("https://chatgpt.com/backend-api/codex/models", "openai"),
])
def test_claim_answers_non_model_paths_locally_in_the_hosts_shape(world, url, shape):
    flow = flow_for("POST", url, {})
    world.claim.requestheaders(flow)
    assert flow.response.status_code == 404 and exchange_of(flow) is None
    body = error_json(flow)
    assert (body.get("type") == "error") == (shape == "anthropic")
    assert "forwards nothing" in body["error"]["message"]


@pytest.mark.parametrize("problem", ["none", "unknown", "state", "sealed"])
@pytest.mark.parametrize("url", [CHAT_URL, MESSAGES_URL])
def test_claim_refuses_in_the_dialects_shape(world, problem, url):
    session = world.session()
    secret = {"none": None, "unknown": "sk-ic-m-nobody", "state": session.state_secret,
              "sealed": session.model_secret}[problem]
    if problem == "sealed":
        session.recorder.seal("deleted")
    flow = flow_for("POST", url, CHAT_BODY, {"x-api-key": secret} if secret else {})
    world.claim.requestheaders(flow)
    assert flow.response.status_code == 401 and exchange_of(flow) is None
    assert flow.response.headers["x-should-retry"] == "false"
    body = error_json(flow)
    if url == MESSAGES_URL:
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    else:
        assert body["error"]["code"] == "invalid_api_key"
    message = body["error"]["message"]
    assert {"none": "no session secret", "unknown": "unknown session secret",
            "state": "state secret", "sealed": "sealed"}[problem] in message
    if secret:
        assert secret not in message


# --------------------------------------------------------------------------------------
# Rewrite: refusals and overrides


@pytest.mark.parametrize(("url", "raw"), [(CHAT_URL, b"{not json"), (MESSAGES_URL, b"[1, 2]")])
def test_a_body_that_is_not_an_object_is_refused_in_shape_and_leaves_no_exchange(world, url, raw):
    session = world.session()
    flow = world.send(flow_for("POST", url, raw, {"x-api-key": session.model_secret}))
    assert flow.response.status_code == 400 and exchange_of(flow) is None
    body = error_json(flow)
    assert body["error"]["type"] == "invalid_request_error"
    assert (body.get("type") == "error") == (url == MESSAGES_URL)


def test_overrides_impose_the_session_and_swap_the_key(world):
    session = world.session(model="imposed", sampling={"temperature": 0.25},
                            upstream={"base_url": "http://127.0.0.1:9/api/v1", "api_key_env": ENV})
    body = {**CHAT_BODY, "temperature": 1.0, "top_p": 0.5}
    proxy_auth = "Basic " + base64.b64encode(f"session:{session.model_secret}".encode()).decode()
    flow = world.send(flow_for("POST", CHAT_URL, body, {"proxy-authorization": proxy_auth}))
    sent = json.loads(flow.request.content)
    # Overlay (the default): the session's keys replace the harness's, the others stay.
    assert sent["model"] == "imposed" and sent["temperature"] == 0.25 and sent["top_p"] == 0.5
    assert sent["messages"] == CHAT_BODY["messages"]
    ex = exchange_of(flow)
    assert {o.key for o in ex.overrides} == {"model", "temperature"}
    assert ex.requested_model == "gpt-4o"
    assert flow.request.headers["authorization"] == f"Bearer {REAL}"
    assert "proxy-authorization" not in flow.request.headers
    assert (flow.request.host, flow.request.port, flow.request.path) == ("127.0.0.1", 9, "/api/v1/chat/completions")


def test_exact_sampling_drops_the_harness_decoding_keys(world):
    session = world.session(model="imposed", sampling={"temperature": 0.25}, sampling_mode="exact",
                            upstream={"base_url": "http://127.0.0.1:9/api/v1", "api_key_env": ENV})
    body = {**CHAT_BODY, "temperature": 1.0, "top_p": 0.5}
    flow = world.send(flow_for("POST", CHAT_URL, body, {"authorization": f"Bearer {session.model_secret}"}))
    sent = json.loads(flow.request.content)
    assert sent["temperature"] == 0.25 and "top_p" not in sent
    assert {o.key for o in exchange_of(flow).overrides} == {"model", "temperature", "top_p"}


def test_anthropic_key_goes_in_x_api_key(world):
    session = world.session()
    flow = world.send(flow_for("POST", MESSAGES_URL, {"model": "m", "max_tokens": 5, "messages": []},
                               {"x-api-key": session.model_secret, "authorization": "Bearer stray"}))
    assert flow.request.headers["x-api-key"] == REAL and "authorization" not in flow.request.headers


def test_a_conforming_body_is_forwarded_byte_for_byte(world):
    session = world.session(model="gpt-4o", sampling={"temperature": 0.5})
    raw = b'{"model":  "gpt-4o", "temperature": 0.5,\n "messages": [{"role": "user", "content": "hi"}]}'
    flow = world.send(flow_for("POST", CHAT_URL, raw, {"authorization": f"Bearer {session.model_secret}"}))
    assert flow.request.content == raw and exchange_of(flow).overrides == []


def test_a_side_route_gets_the_session_model_only(world):
    session = world.session(model="imposed", sampling={"temperature": 0.1})
    flow = world.send(flow_for("POST", "https://api.anthropic.com/v1/messages/count_tokens",
                               {"model": "claude", "messages": [], "temperature": 1},
                               {"x-api-key": session.model_secret}))
    assert json.loads(flow.request.content) == {"model": "imposed", "messages": [], "temperature": 1}


# --------------------------------------------------------------------------------------
# Retry and delivery

ANSWER = json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}).encode()


def _turn(world: World, session: Session, client=None, retry_count: int | None = None) -> http.HTTPFlow:
    headers = {"authorization": f"Bearer {session.model_secret}"}
    if retry_count is not None:
        headers["x-stainless-retry-count"] = str(retry_count)
    return world.send(flow_for("POST", CHAT_URL, CHAT_BODY, headers, client=client))


def test_a_flagged_retry_of_the_last_exchange_is_replayed_not_sampled(world):
    session = world.session()
    first = _turn(world, session, retry_count=0)
    assert exchange_of(first).replay_of is None and first.response is None
    assert world.answer(first, body=ANSWER) == ANSWER
    assert exchange_of(first).turn == exchange_of(first).call_id
    again = _turn(world, session, retry_count=1)
    ex = exchange_of(again)
    assert again.response is not None and again.response.content == ANSWER
    assert ex.replay_of == exchange_of(first).call_id == again.response.headers["x-interceptor-replay"]
    assert session.recorder.summary()["turns"] == 1


def test_the_same_body_unflagged_is_a_fresh_turn_and_its_retry_gets_the_new_answer(world):
    session = world.session()
    first = _turn(world, session)
    world.answer(first, body=ANSWER)
    fresh = _turn(world, session, retry_count=0)
    assert fresh.response is None and exchange_of(fresh).replay_of is None
    newer = ANSWER.replace(b"hello", b"again")
    world.answer(fresh, body=newer)
    retried = _turn(world, session, retry_count=1)
    assert retried.response.content == newer
    assert exchange_of(retried).replay_of == exchange_of(fresh).call_id != exchange_of(first).call_id
    assert session.recorder.summary()["turns"] == 2


def test_an_upstream_error_is_never_replayed(world):
    session = world.session()
    first = _turn(world, session)
    world.answer(first, status=429, body=b'{"error": {"type": "rate_limit_error", "message": "slow"}}')
    assert exchange_of(first).turn is None
    again = _turn(world, session, retry_count=1)
    assert again.response is None  # goes to the provider


@pytest.mark.parametrize(("left", "replayed"), [
    (True, True),  # the harness went away before the answer's end: an identical body is its retry
    (False, False),  # the answer was handed whole: delivered, whatever its connection does next
])
def test_an_identical_unflagged_body_is_a_retry_only_after_an_answer_the_client_left(world, left, replayed):
    session = world.session()
    first = _turn(world, session)
    if left:
        exchange_of(first).delivered = False  # what the Relay's Drain marks when the client goes first
    world.answer(first, body=ANSWER)
    assert exchange_of(first).handed is not left
    again = _turn(world, session)  # on a new client connection, as a fresh SDK client's or curl's
    assert (again.response is not None) == replayed
    if replayed:
        assert again.response.content == ANSWER and exchange_of(again).retry_reason == "undelivered"


def test_a_retry_waiting_on_an_attempt_whose_capture_raised_is_settled_not_left_waiting(world, monkeypatch):
    """Retry's answer stage raising (a bug) must still settle the exchange in flight: a retry
    coalesced on it gets the retryable 503, instead of waiting forever."""
    import asyncio

    from interceptor.addons.gateway import retry as retry_module
    session = world.session()
    first = _turn(world, session, retry_count=0)
    headers = {"authorization": f"Bearer {session.model_secret}", "x-stainless-retry-count": "1"}
    again = flow_for("POST", CHAT_URL, CHAT_BODY, headers)
    for hook in (world.claim.requestheaders, world.rewrite.request, world.collect.request):
        world.run(hook(again))
    loop = world.tctx.master.event_loop
    waiting = loop.create_task(world.retry.request(again))
    loop.run_until_complete(asyncio.sleep(0.05))
    assert not waiting.done()  # coalesced on the first attempt

    def broken(stream):
        raise RuntimeError("a bug in the capture")
    monkeypatch.setattr(retry_module, "_captured", broken)
    world.answer(first, body=ANSWER)
    loop.run_until_complete(asyncio.wait_for(waiting, 5))
    assert again.response is not None and again.response.status_code == 503
    assert again.response.headers["x-should-retry"] == "true"


def test_the_undelivered_rule_can_be_switched_off(world):
    world.tctx.configure(world.retry, intercept_retry_undelivered=False)
    session = world.session()
    first = _turn(world, session)
    exchange_of(first).delivered = False
    world.answer(first, body=ANSWER)
    assert _turn(world, session).response is None


def test_an_idempotency_key_seen_before_flags_a_retry(world):
    world.tctx.configure(world.retry, intercept_retry_headers=["Idempotency-Key"])
    session = world.session()
    headers = {"authorization": f"Bearer {session.model_secret}", "idempotency-key": "k1"}
    first = world.send(flow_for("POST", CHAT_URL, CHAT_BODY, headers))
    world.answer(first, body=ANSWER)
    again = world.send(flow_for("POST", CHAT_URL, CHAT_BODY, headers))
    assert again.response is not None and again.response.content == ANSWER


# --------------------------------------------------------------------------------------
# The stream pipeline, and the order of the script's addons


def _chat_stream(token_ids: bool) -> list[bytes]:
    extra = {"token_ids": [7]} if token_ids else {}
    chunks = [
        {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": "hi"}, "finish_reason": None, **extra}],
         **({"prompt_token_ids": [1, 2]} if token_ids else {})},
        {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [
            {"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    return [SSEEvent(data=json.dumps(c)).encode() for c in chunks] + [b"data: [DONE]\n\n"]


def test_a_stream_whose_terminal_event_was_handed_over_is_delivered_whatever_the_connection_does(world):
    """The harness was handed the terminal event, then its connection broke before the
    stream's last bytes (no relay reading on here): the answer was delivered, so the call on
    the record stays ``delivered`` and the same body again is a new sample, not a replay."""
    from interceptor.trace import read_trace
    session = world.session()
    first = _turn(world, session)
    first.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
    world.tee.responseheaders(first)
    for chunk in _chat_stream(token_ids=False):
        first.response.stream(chunk)
    assert exchange_of(first).turn and exchange_of(first).handed  # committed at [DONE], then handed on
    first.error = mflow.Error("Client disconnected.")
    world.tee.error(first)
    again = _turn(world, session)
    assert again.response is None and exchange_of(again).retry_reason is None
    world.registry.seal_all("test")
    world.registry.store.flush(timeout=10)
    trace = read_trace(session.recorder.path)
    assert trace.num_turns == 1 and [c.delivered for c in trace.calls] == [True]


def _load_script():
    spec = importlib.util.spec_from_file_location("interception_under_test", ROOT / "addons" / "interception.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_scripts_addon_order_records_tokens_strips_them_and_replays_what_the_harness_got(tmp_path, monkeypatch):
    """Every hook of the script's addon list, in its order, over a vLLM-style stream with
    token collection: the turn keeps the token ids, the harness never sees them, and a
    retry replays exactly the bytes the harness received. Listing Collect after Retry, or
    the pipeline before the addons whose request hooks plan its stages, breaks this."""
    monkeypatch.setenv(ENV, REAL)
    script = _load_script()
    addons = script.addons
    upstream = socket.create_server(("127.0.0.1", 0))  # listening is all Reach's probe needs
    base = f"http://127.0.0.1:{upstream.getsockname()[1]}/v1"
    with upstream, taddons.context(*addons) as tctx:
        tctx.configure(addons[0], intercept_trace_dir=str(tmp_path), confdir=str(tmp_path / "conf"))
        session = script.registry.create(SessionConfig(collect_tokens=True), tmp_path, "never",
                                         Upstream(base_url=base, api_key_env=ENV))

        def hook(name: str, flow: http.HTTPFlow) -> None:
            for addon in addons:
                method = getattr(addon, name, None)
                if method is not None:
                    value = method(flow)
                    if inspect.isawaitable(value):
                        tctx.master.event_loop.run_until_complete(value)

        def send(retry_count: int) -> http.HTTPFlow:
            # The secret in the proxy URL too, as run_harness hands it over: a proxy that may
            # listen beyond loopback relays only for its sessions (OpenProxyGuard).
            proxy_auth = "Basic " + base64.b64encode(f"session:{session.model_secret}".encode()).decode()
            flow = flow_for("POST", CHAT_URL, {**CHAT_BODY, "stream": True},
                            {"authorization": f"Bearer {session.model_secret}", "proxy-authorization": proxy_auth,
                             "x-stainless-retry-count": str(retry_count)})
            hook("requestheaders", flow)
            hook("request", flow)
            return flow

        flow = send(0)
        sent = json.loads(flow.request.content)
        assert sent["return_token_ids"] is True and sent["logprobs"] is True
        flow.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
        hook("responseheaders", flow)
        received = b""
        for chunk in [*_chat_stream(token_ids=True), b""]:
            out = flow.response.stream(chunk)
            received += out if isinstance(out, bytes) else b"".join(out)
        hook("response", flow)
        assert b"token_ids" not in received and b'"hi"' in received and received.endswith(b"[DONE]\n\n")
        turn = session.recorder.trace.branches[0]
        assert turn.token_ids[-1] == 7

        retry = send(1)
        assert retry.response is not None and retry.response.raw_content == received
        assert session.recorder.summary()["turns"] == 1
        script.registry.seal_all("test")
        script.registry.store.close()


def test_an_exchange_says_what_a_replay_is_in_one_place():
    ex = Exchange(session=None, route=None)  # type: ignore[arg-type]
    assert not ex.replayed
    ex.replay_of = "call-1"
    assert ex.replayed


def test_a_flow_that_errors_before_the_relay_has_it_shows_the_upstream_to_observers(world):
    """The Relay pointed the flow at its loopback server (and ``_lighten`` kept the body back),
    then mitmproxy ended the flow with an error before the relay had the request: observers
    (flow files, mitmweb, the log) see the upstream's address and the body as the harness sent
    it, no ticket, and the drain does not take the flow over (``Drain.take_over``)."""
    from interceptor.addons.gateway.transport.relay import TICKET, Relay
    session = world.session()
    flow = _turn(world, session)
    sent = (flow.request.scheme, flow.request.host, flow.request.port, flow.request.raw_content)
    relay = Relay(pipeline=None)  # type: ignore[arg-type]
    relay.port = 9  # its loopback server's, as ``running`` sets it
    relay.request(flow)
    drain = exchange_of(flow).drain
    assert drain is not None and (flow.request.host, flow.request.port) == ("127.0.0.1", 9)
    assert TICKET in flow.request.headers
    drain._lighten()  # as Fetch does for a stream it leaves to the relay
    assert flow.request.raw_content == b"" and not drain.started
    flow.error = mflow.Error("Client disconnected.")
    assert drain.take_over(flow) is False
    assert (flow.request.scheme, flow.request.host, flow.request.port, flow.request.raw_content) == sent
    assert flow.request.headers["content-length"] == str(len(sent[3]))
    assert TICKET not in flow.request.headers and not relay.holds(drain)


def test_a_session_dropped_from_memory_leaves_a_few_hundred_bytes(tmp_path, monkeypatch):
    """A proxy that serves a night of rollouts keeps, for each session beyond
    ``intercept_keep_sealed``, only what finds its trace again: its id and the file's name (the
    summary is read from the file). Measured as the Python heap's growth (tracemalloc) from
    1,000 to 5,000 dropped sessions, so one-off caches cancel (the trace writer is stopped before each
    reading; the next record starts it again):
    ~220 bytes a session; ~890 when the registry kept a ``Path`` and the store each file's
    account for the process's life."""
    import gc
    import tracemalloc
    monkeypatch.setenv(ENV, REAL)
    registry = Registry(keep_sealed=0)
    upstream = Upstream(api_key_env=ENV)

    def rollouts(n: int) -> list[str]:
        ids = []
        for _ in range(n):
            s = registry.create(SessionConfig(), tmp_path, "never", upstream)
            s.seal()
            s.release()
            registry.retire(s)
            ids.append(s.id)
        registry.store.flush(timeout=10)
        return ids

    def settled() -> int:
        registry.store.close()  # the writer thread ends, and with it what its last batch held
        gc.collect()
        # What the registry, the store, the recorder and pathlib hold: not other threads' work
        # (an earlier test's, pytest's own) that tracemalloc's total would count too.
        ours = [tracemalloc.Filter(True, f"*{part}*") for part in ("/addons/", "/trace/", "pathlib", "msgpack")]
        return sum(s.size for s in tracemalloc.take_snapshot().filter_traces(ours).statistics("filename"))

    rollouts(500)
    tracemalloc.start()
    try:
        first = rollouts(1000)
        before = settled()
        rollouts(4000)
        per_session = (settled() - before) / 4000
    finally:
        tracemalloc.stop()
        registry.store.close()
    assert per_session < 400, f"{per_session:.0f} bytes kept per dropped session"
    assert registry.get(first[0]) is None and registry.dropped(first[0]) == tmp_path / f"{first[0]}.msgpack"

"""TLS to the upstream, through a real mitmdump, the real SDKs and the strict simulator over HTTPS
(a CA and a server certificate made at test time: tests/provider/tls.py).

The proxy opens upstream connections itself for every model POST (``addons/gateway/transport/relay.py``) and for
provider feedback's second attempt (``addons/gateway/feedback.py``), both with ``upstream_tls``; the
Codex WebSocket goes through mitmproxy's own upstream connection. Each must verify the upstream
as mitmproxy would: trusted with ``ssl_verify_upstream_trusted_ca`` naming the CA, refused for a
certificate from another CA or for another hostname (one error in the dialect's shape, not
retryable, nothing sent, the call on the record, no key anywhere), accepted with ``ssl_insecure``.

Three proxies share the module (one per TLS setting), each declaring the same upstreams:
``good`` (a certificate for 127.0.0.1 from the test CA) and ``wronghost`` (from the test CA, for
another name). Each test uses its own session, and a simulator of its own where a pooled
connection from an earlier test could hide a handshake.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import openai
import pytest

from clients import KEY_ENV, REAL_KEY
from interceptor.dialects.common import PROVIDER_REJECTED
from interceptor.trace import read_trace
from mitm import MitmProcess
from provider import ProviderSimulator, Reply, TestCA
from test_feedback import ask, unknown_model
from waiting import wait_until
from wsclient import Rejected, WSClient

APIS = [(api, stream) for api in ("chat", "responses", "messages") for stream in (False, True)]


@pytest.fixture(scope="module")
def ca() -> Iterator[TestCA]:
    with TestCA() as made:
        yield made


@pytest.fixture(scope="module")
def other_ca() -> Iterator[TestCA]:
    with TestCA("another CA") as made:
        yield made


@pytest.fixture(scope="module")
def good(ca) -> Iterator[ProviderSimulator]:
    with ProviderSimulator(strict=True, tls=ca.server("127.0.0.1")) as s:
        yield s


@pytest.fixture(scope="module")
def wronghost(ca) -> Iterator[ProviderSimulator]:
    with ProviderSimulator(strict=True, tls=ca.server("upstream.invalid")) as s:
        yield s


@pytest.fixture(scope="module")
def swapping(ca) -> Iterator[ProviderSimulator]:
    """Starts with the right certificate; a test may swap it for the next connections."""
    with ProviderSimulator(strict=True, tls=ca.server("127.0.0.1")) as s:
        yield s


def _proxy(sims: dict[str, ProviderSimulator], **tls) -> MitmProcess:
    upstreams = {name: {"base_url": s.url("/v1"), "api_key_env": KEY_ENV} for name, s in sims.items()}
    return MitmProcess(options={"intercept_upstream": sims["good"].url("/v1"), "intercept_api_key_env": KEY_ENV,
                                "intercept_upstreams": json.dumps(upstreams), **tls},
                       env={KEY_ENV: REAL_KEY})


@pytest.fixture(scope="module")
def sims(good, wronghost, swapping) -> dict[str, ProviderSimulator]:
    return {"good": good, "wronghost": wronghost, "swapping": swapping}


@pytest.fixture(scope="module")
def verified(sims, ca) -> Iterator[MitmProcess]:
    with _proxy(sims, ssl_verify_upstream_trusted_ca=str(ca.path)) as p:
        yield p


@pytest.fixture(scope="module")
def wrong_ca(sims, other_ca) -> Iterator[MitmProcess]:
    with _proxy(sims, ssl_verify_upstream_trusted_ca=str(other_ca.path)) as p:
        yield p


@pytest.fixture(scope="module")
def insecure(sims, other_ca) -> Iterator[MitmProcess]:
    """Trusts another CA only, so only ``ssl_insecure`` lets it through."""
    with _proxy(sims, ssl_verify_upstream_trusted_ca=str(other_ca.path), ssl_insecure="true") as p:
        yield p


@pytest.fixture(autouse=True)
def _fresh(sims) -> None:
    for s in sims.values():
        s.clear()
        s.clear_scripts()
        s.refuse.clear()


def _session(proxy: MitmProcess, harness_env, upstream: str = "good", **config) -> dict:
    session = proxy.create_session(upstream=upstream, **config)
    harness_env(session["env"])
    return session


def _sealed(proxy: MitmProcess, session: dict):
    status, _ = proxy.api("DELETE", f"sessions/{session['id']}")
    assert status == 200
    return read_trace(session["trace_path"])


def _no_credentials(proxy: MitmProcess, session: dict, *texts: str) -> None:
    data = open(session["trace_path"], "rb").read()
    for secret in (session["model_secret"], session["state_secret"], REAL_KEY):
        assert secret.encode() not in data
        assert secret not in proxy.log()
        for text in texts:
            assert secret not in text


def _failures(sim: ProviderSimulator, count: int) -> int:
    """The simulator counts a refused handshake in its connection's thread: wait for it."""
    wait_until(lambda: sim.connections()["handshake_failures"] >= count, 5, f"{count} refused handshakes")
    return sim.connections()["handshake_failures"]


def _default_clients(session: dict):
    """The SDKs with their default retries: a refusal the SDK would retry would show here."""
    return (openai.OpenAI(api_key=session["model_secret"], timeout=30),
            anthropic.Anthropic(api_key=session["model_secret"], timeout=30))


def _refused_call(session: dict, api: str) -> Exception:
    oai, claude = _default_clients(session)
    with pytest.raises((openai.APIStatusError, anthropic.APIStatusError)) as caught:
        if api == "messages":
            claude.messages.create(model="claude-x", max_tokens=50, messages=[{"role": "user", "content": "hi"}])
        else:
            oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    return caught.value


# -- the relay (every model POST) --------------------------------------------------------------


@pytest.mark.parametrize("api,stream", APIS)
def test_the_upstream_is_verified_with_the_named_ca(verified, good, harness_env, api, stream):
    session = _session(verified, harness_env)
    before = good.connections()
    assert "first" in ask(session, api, stream, "first")
    assert "second" in ask(session, api, stream, "second")
    requests = good.model_requests()
    assert len(requests) == 2 and all(r.headers.get("x-api-key", r.headers.get("authorization", "")).endswith(REAL_KEY)
                                      for r in requests)
    after = good.connections()
    assert after["handshakes"] > before["handshakes"] or before["handshakes"] > 0  # over TLS, maybe pooled
    assert after["handshake_failures"] == 0
    trace = _sealed(verified, session)
    assert trace.num_turns == 2 and [c.status for c in trace.calls] == [200, 200] and not trace.errors


@pytest.mark.parametrize("api", ["chat", "messages"])
@pytest.mark.parametrize("case", ["wrong_ca", "wrong_host"])
def test_an_upstream_that_fails_verification_is_refused_once_in_shape(
        request, verified, good, wronghost, harness_env, api, case):
    proxy, sim, upstream = ((request.getfixturevalue("wrong_ca"), good, "good") if case == "wrong_ca"
                            else (verified, wronghost, "wronghost"))
    session = _session(proxy, harness_env, upstream)
    failed = sim.connections()["handshake_failures"]
    error = _refused_call(session, api)
    assert error.status_code == 502
    body = error.body
    if api == "messages":  # Anthropic's error shape, read by its SDK
        assert isinstance(error, anthropic.APIStatusError) and body["type"] == "error"
        message = body["error"]["message"]
    else:
        assert isinstance(error, openai.APIStatusError)
        message = body["message"]
    assert "failed TLS verification" in message and "ssl_insecure" in message, message
    if case == "wrong_host":
        assert "IP address mismatch" in message and "a name its certificate holds" in message
    else:
        assert "unable to get local issuer certificate" in message and "ssl_verify_upstream_trusted_ca" in message
    assert error.response.headers["x-should-retry"] == "false"  # the SDK's default retries did not resend
    assert sim.model_requests() == []  # nothing reached the upstream
    assert _failures(sim, failed + 1) == failed + 1  # one handshake, refused, never tried again
    trace = _sealed(proxy, session)
    assert trace.num_turns == 0 and [c.status for c in trace.calls] == [502]
    assert "failed TLS verification" in trace.calls[0].error.message
    _no_credentials(proxy, session, message, json.dumps(body))


@pytest.mark.parametrize("upstream", ["good", "wronghost"])
@pytest.mark.parametrize("api,stream", [("chat", True), ("messages", False)])
def test_ssl_insecure_accepts_any_certificate(insecure, sims, harness_env, upstream, api, stream):
    session = _session(insecure, harness_env, upstream)
    assert "hello" in ask(session, api, stream, "hello")
    assert len(sims[upstream].model_requests()) == 1
    trace = _sealed(insecure, session)
    assert trace.num_turns == 1 and not trace.errors


# -- provider feedback's second attempt ---------------------------------------------------------


def test_feedbacks_second_attempt_is_verified_with_the_named_ca(verified, good, harness_env):
    """The second attempt opens a connection of its own (urllib), not the relay's pooled one."""
    model = unknown_model() + "-tls"
    good.refuse = {model: {"temperature"}}
    session = _session(verified, harness_env, model=model, sampling={"temperature": 0.5})
    before = good.connections()["handshakes"]
    assert "first" in ask(session, "chat", False, "first")
    assert [("temperature" in r.json, r.refusal is not None) for r in good.model_requests()] == \
           [(True, True), (False, False)]
    assert good.connections()["handshakes"] > before
    trace = _sealed(verified, session)
    assert [c.status for c in trace.calls] == [400, 200] and trace.num_turns == 1


def test_feedbacks_second_attempt_refuses_a_certificate_for_another_host(verified, swapping, ca, harness_env):
    """The first attempt goes over a verified connection; then the upstream presents a
    certificate for another name to new connections: the second attempt is refused at the
    handshake, nothing is sent again, and the provider's 400 is what the harness gets."""
    model = unknown_model() + "-tls"
    wrong = ca.server("upstream.invalid")
    right = swapping.tls

    def refuse_and_swap(record) -> bool:
        if (record.json or {}).get("max_tokens") != 4000:
            return False
        swapping.tls = wrong
        return True

    swapping.script(Reply(status=400, error_type="invalid_request_error", should_retry=False,
                          error_message=f"max_tokens: 4000 > 1000, which is the maximum allowed number of output "
                                        f"tokens for {model}"), key=refuse_and_swap)
    session = _session(verified, harness_env, "swapping", model=model, sampling={"max_tokens": 4000})
    failed = swapping.connections()["handshake_failures"]
    try:
        _, claude = _default_clients(session)
        with pytest.raises(anthropic.BadRequestError) as caught:
            claude.messages.create(model="claude-x", max_tokens=100, messages=[{"role": "user", "content": "hi"}])
    finally:
        swapping.tls = right
    assert "max_tokens" in caught.value.body["error"]["message"]
    assert [r.json["max_tokens"] for r in swapping.model_requests()] == [4000]
    assert _failures(swapping, failed + 1) == failed + 1
    assert "the second attempt without the proxy's change failed (SSLCertVerificationError" in verified.log()
    trace = _sealed(verified, session)
    # One call, the refused one, with what it was sent with: no undo that never left.
    assert trace.num_turns == 0 and [c.status for c in trace.calls] == [400]
    assert not any(o.reason == PROVIDER_REJECTED for o in trace.calls[0].overrides)
    assert trace.calls[0].sampling.max_tokens == 4000
    _no_credentials(verified, session, json.dumps(caught.value.body))


def test_feedbacks_second_attempt_honours_ssl_insecure(insecure, wronghost, harness_env):
    model = unknown_model() + "-tls"
    wronghost.refuse = {model: {"temperature"}}
    session = _session(insecure, harness_env, "wronghost", model=model, sampling={"temperature": 0.5})
    assert "first" in ask(session, "messages", False, "first")
    assert [r.refusal is not None for r in wronghost.model_requests()] == [True, False]
    trace = _sealed(insecure, session)
    assert [c.status for c in trace.calls] == [400, 200]


# -- the Codex WebSocket (mitmproxy's own upstream connection) ----------------------------------


def _ws(proxy: MitmProcess, session: dict) -> WSClient:
    return WSClient("wss://api.openai.com/v1/responses", headers={"Authorization": f"Bearer {session['model_secret']}"},
                    proxy=proxy.url, cafile=str(proxy.ca_bundle))


def test_the_websocket_upstream_is_verified_by_mitmproxy(verified, wrong_ca, good, harness_env):
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    session = _session(verified, harness_env)
    with _ws(verified, session) as ws:
        ws.send_json({"type": "response.create", "model": "gpt-4o", "stream": True, "input": [user]})
        assert ws.until("response.completed")[-1]["type"] == "response.completed"
    assert [r.transport for r in good.requests][:1] == ["websocket"]

    good.clear()
    session = _session(wrong_ca, harness_env)
    failed = good.connections()["handshake_failures"]
    with pytest.raises((Rejected, ConnectionError)):
        with _ws(wrong_ca, session) as ws:
            ws.send_json({"type": "response.create", "model": "gpt-4o", "stream": True, "input": [user]})
            ws.until("response.completed")
    assert good.requests == []
    assert _failures(good, failed + 1) > failed
    _no_credentials(wrong_ca, session)

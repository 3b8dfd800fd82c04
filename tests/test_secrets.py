"""No key or secret in anything the proxy prints, saves or records, at mitmproxy's loudest.

One real mitmdump at ``flow_detail=4``, ``termlog_verbosity=debug``, writing every flow to a
file (``-w``), driven through everything that touches a secret: the control API (token in,
secrets out), each API shape through the real SDKs (the real key added on the way out),
a locally answered path, an unknown and a misused secret, a retried request answered from the
record, a dead upstream. Then every byte of stdout/stderr, the flow file and the traces is
searched for every secret, the admin token and the key."""

from __future__ import annotations

import re

import anthropic
import openai
import pytest
from mitmproxy.io import FlowReader

from clients import KEY_ENV, REAL_KEY, dead_upstream, session_clients
from provider import Reply

ENV_TOKEN = "env-given-admin-token-0123456789abcdef"


def _traffic(proxy, sim, harness_env) -> list[str]:
    """Everything that handles a secret; returns the secrets it saw."""
    sim.script(*[Reply(text=f"reply {i}") for i in range(8)])
    a = proxy.create_session(model="m-a")
    b = proxy.create_session(model="m-b", upstream="dead")
    status, env_b = proxy.api("GET", f"sessions/{b['id']}/env")
    assert status == 200
    harness_env(a["env"])
    oai, ant = session_clients(a)
    oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "one"}])
    list(oai.chat.completions.create(model="x", stream=True, messages=[{"role": "user", "content": "two"}]))
    oai.responses.create(model="x", input="three")
    with ant.messages.stream(model="x", max_tokens=20, messages=[{"role": "user", "content": "four"}]) as s:
        s.get_final_message()
    # A retry the SDK flags: answered from the record (a flow the proxy answers itself).
    oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "one"}],
                                extra_headers={"x-stainless-retry-count": "1"})
    with pytest.raises(anthropic.NotFoundError):
        ant.get("/api/event_logging/batch", cast_to=object)
    for secret in ("sk-ic-m-unknown-secret-0000000000", a["state_secret"]):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(api_key=secret, max_retries=0).chat.completions.create(
                model="x", messages=[{"role": "user", "content": "no"}])
    harness_env(b["env"])
    _, ant_b = session_clients(b)
    with pytest.raises(anthropic.APIStatusError):
        ant_b.messages.create(model="x", max_tokens=5, messages=[{"role": "user", "content": "dead"}])
    for s in (a, b):
        assert proxy.api("DELETE", f"sessions/{s['id']}")[0] == 200
    assert sim.model_requests()[0].headers["authorization"] == f"Bearer {REAL_KEY}"  # the key did go out
    return [a["model_secret"], a["state_secret"], b["model_secret"], b["state_secret"], env_b["model_secret"]]


@pytest.mark.parametrize("token_from", ["file", "environment"])
def test_nothing_secret_in_any_output_at_full_verbosity(start_proxy, sim, harness_env, tmp_path, token_from):
    flows = tmp_path / "flows.out"
    env = {"INTERCEPT_ADMIN_TOKEN": ENV_TOKEN} if token_from == "environment" else {}
    proxy = start_proxy({"flow_detail": 4, "termlog_verbosity": "debug", "save_stream_file": str(flows),
                         "intercept_upstreams": dead_upstream()}, env=env)
    token = proxy.admin_token
    default_secret = re.search(r"OPENAI_API_KEY=(\S+)",
                               (proxy.confdir / "interceptor-harness" / "default.env").read_text()).group(1)
    secrets = [*_traffic(proxy, sim, harness_env), default_secret, token, REAL_KEY]
    proxy.stop()

    output = proxy.log()
    saved = flows.read_bytes()
    traces = b"".join(p.read_bytes() for p in proxy.trace_dir.glob("*.msgpack"))
    # (Named by their first characters only: a failing assertion must not print them either.)
    for where, text in (("the log", output.encode()), ("the flow file", saved), ("a trace", traces)):
        leaked = [s[:10] + "..." for s in secrets if s.encode() in text]
        assert not leaked, f"secrets in {where}: {leaked}"
    # The run really was loud and really saved the claimed flows (else this proves nothing).
    assert "authorization: [redacted]" in output.lower() and "/v1/chat/completions" in output
    with flows.open("rb") as f:
        saved_flows = list(FlowReader(f).stream())
    assert len(saved_flows) >= 6
    assert any(f.request.headers.get("authorization") == "[redacted]" for f in saved_flows)
    if token_from == "environment":
        written = b"".join(p.read_bytes() for p in proxy.confdir.rglob("*") if p.is_file())
        assert ENV_TOKEN.encode() not in written and not (proxy.confdir / "interceptor-admin-token").exists()


def test_redact_checks_every_header_line_and_leaves_the_rest_byte_for_byte():
    """In process (addons/mitm/redact.py): one pass over the raw header lines; a repeated header's
    every value is checked on its own line, names keep their case and order, a value that is
    not UTF-8 keeps its bytes."""
    from mitmproxy import http
    from mitmproxy.test import tflow

    from interceptor.addons.mitm.redact import Redact
    from interceptor.addons.gateway.sessions.session import Registry
    from interceptor.addons.mitm.settings import Settings

    redact = Redact(Settings(Registry()))
    fields = ((b"Host", b"api.openai.com"), (b"Authorization", b"Bearer sk-any-thing"),
              (b"X-Trace", b"plain"), (b"x-trace", b"id sk-ic-m-abcdefgh0123"), (b"X-Worker", b"sk-ic-w1-s-abcdefgh0123"),
              (b"Accept", b"\xff\xfe raw"), (b"X-API-Key", b"k1"), (b"x-api-key", b"k2"))
    flow = tflow.tflow(req=http.Request.make("POST", "https://api.openai.com/v1/chat/completions", b"{}"))
    flow.request.headers.fields = fields
    redact.responseheaders(flow)
    assert flow.request.headers.fields == (
        (b"Host", b"api.openai.com"), (b"Authorization", b"[redacted]"), (b"X-Trace", b"plain"),
        (b"x-trace", b"[redacted]"), (b"X-Worker", b"[redacted]"), (b"Accept", b"\xff\xfe raw"), (b"X-API-Key", b"[redacted]"),
        (b"x-api-key", b"[redacted]"))
    untouched = ((b"Host", b"api.openai.com"), (b"Accept", b"*/*"))
    flow.request.headers.fields = untouched
    redact.responseheaders(flow)
    assert flow.request.headers.fields == untouched

"""The property of test_fuzz_bodies.py end to end, for a modest number of examples: the same
generated bodies and headers, sent through the real mitmdump to the simulator. Each is either
forwarded rewritten (the simulator saw the session's model and the real key, never the
secret) or answered 4xx in the dialect's shape with nothing forwarded; the session records
its next turn; the trace verifies."""

from __future__ import annotations

import gzip
import json
import ssl
import zlib

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from interceptor.trace import read_trace
from interceptor.trace.verify import problems
from clients import KEY_ENV, REAL_KEY
from mitm import MitmProcess
from provider import ProviderSimulator, Reply
from test_fuzz_bodies import DIALECTS, IMPOSED, bodies


@pytest.fixture(scope="module")
def rig():
    with ProviderSimulator() as sim:
        proc = MitmProcess(options={"intercept_upstream": sim.url("/v1"), "intercept_api_key_env": KEY_ENV},
                           env={KEY_ENV: REAL_KEY})
        proc.start(timeout=90)
        try:
            session = proc.create_session(model=IMPOSED, upstream={"base_url": sim.url("/v1")})
            context = ssl.create_default_context(cafile=str(proc.ca_bundle))
            with httpx.Client(proxy=proc.url, verify=context, timeout=60) as client:
                yield sim, proc, session, client
        finally:
            proc.cleanup()


def decoded(body: bytes, encoding: str | None) -> bytes:
    """What the simulator received, as the upstream would decode it (it keeps the bytes)."""
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "deflate":
        return zlib.decompress(body)
    return body


def post(client, session, dialect: str, raw: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    host, path, _ = DIALECTS[dialect]
    auth = {"x-api-key": session["model_secret"], "anthropic-version": "2023-06-01"} if dialect == "anthropic" \
        else {"authorization": f"Bearer {session['model_secret']}"}
    return client.post(f"https://{host}{path}", content=raw,
                       headers={"content-type": "application/json", **auth, **(headers or {})})


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_any_body_through_the_proxy_leaves_rewritten_or_is_refused_in_shape(rig, dialect, data):
    sim, proc, session, client = rig
    raw, headers = data.draw(bodies(dialect))
    headers = {k: v.strip() for k, v in headers.items()}  # an HTTP client sends no edge whitespace
    before = len(sim.model_requests())
    # Scripted answers: the simulator's default echoes the prompt, which it cannot do for a
    # lone surrogate (its own limit, not the proxy's).
    sim.clear_scripts()
    sim.script(Reply(text="answer"), Reply(text="next"))
    resp = post(client, session, dialect, raw, headers)
    arrived = sim.model_requests()[before:]
    assert session["model_secret"] not in resp.text
    if "x-interceptor-replay" in resp.headers:
        assert resp.status_code == 200 and not arrived  # a flagged retry of the last turn
    elif arrived:
        (req,) = arrived
        sent = decoded(req.body, req.headers.get("content-encoding"))
        assert json.loads(sent)["model"] == IMPOSED
        assert session["model_secret"] not in sent.decode("utf-8", "replace") + str(req.headers)
        assert REAL_KEY in str(req.headers)
    else:
        assert 400 <= resp.status_code < 500, resp.text
        assert resp.headers["x-should-retry"] == "false"
        body = resp.json()
        assert (body["type"] == "error") if dialect == "anthropic" else ("message" in body["error"])
    turns = proc.api("GET", f"sessions/{session['id']}")[1]["turns"]
    good = post(client, session, dialect, json.dumps(DIALECTS[dialect][2]).encode())
    assert good.status_code == 200, good.text
    assert proc.api("GET", f"sessions/{session['id']}")[1]["turns"] == turns + 1


def test_the_proxied_trace_verifies(rig):
    """Whatever the examples of this worker recorded (under xdist another worker may have run
    them, with its own proxy) folds back and verifies, and the file agrees with the summary."""
    sim, proc, session, client = rig
    status, summary = proc.api("DELETE", f"sessions/{session['id']}")
    assert status == 200
    trace = read_trace(session["trace_path"])
    assert problems(trace) == [] and trace.num_turns == summary["turns"] and len(trace.calls) == summary["calls"]

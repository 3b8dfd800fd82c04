"""The core pipeline end to end: real mitmdump, real SDKs through HTTPS_PROXY, the simulator
as the provider. Claim, rewrite, route, stream back, record."""

from __future__ import annotations

import json
from pathlib import Path
import re
import ssl
import subprocess
import sys
import threading
import time

import anthropic
import openai
import pytest

from interceptor.trace import read_trace
from clients import REAL_KEY, session_clients
from mitm import ROOT, MitmProcess
from provider import Reply, ToolCall
from waiting import wait_until

SESSION = {
    "model": "sim-imposed-model",
    "sampling": {"temperature": 0.25, "top_p": 0.9, "max_tokens": 321},
}


def _call(kind: str, oai: openai.OpenAI, ant: anthropic.Anthropic, prompt: str):
    """One request per API shape, with harness settings the session must override.
    Returns (text, usage as (input, output))."""
    if kind == "chat":
        r = oai.chat.completions.create(model="gpt-4o", temperature=1.0, max_tokens=50,
                                        messages=[{"role": "user", "content": prompt}])
        return r.choices[0].message.content, (r.usage.prompt_tokens, r.usage.completion_tokens), r.choices[0].finish_reason
    if kind == "chat-stream":
        parts, usage, finish = [], None, None
        for chunk in oai.chat.completions.create(model="gpt-4o", temperature=1.0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 messages=[{"role": "user", "content": prompt}]):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
        return "".join(parts), usage, finish
    if kind == "responses":
        r = oai.responses.create(model="gpt-4o", temperature=1.0, input=prompt)
        return r.output_text, (r.usage.input_tokens, r.usage.output_tokens), r.status
    if kind == "responses-stream":
        with oai.responses.stream(model="gpt-4o", temperature=1.0, input=prompt) as s:
            r = s.get_final_response()
        return r.output_text, (r.usage.input_tokens, r.usage.output_tokens), r.status
    if kind == "messages":
        r = ant.messages.create(model="claude-x", max_tokens=64, extra_body={"temperature": 1.0},
                                messages=[{"role": "user", "content": prompt}])
        return r.content[0].text, (r.usage.input_tokens, r.usage.output_tokens), r.stop_reason
    if kind == "messages-stream":
        with ant.messages.stream(model="claude-x", max_tokens=64, extra_body={"temperature": 1.0},
                                 messages=[{"role": "user", "content": prompt}]) as s:
            r = s.get_final_message()
        return r.content[0].text, (r.usage.input_tokens, r.usage.output_tokens), r.stop_reason
    raise AssertionError(kind)


KINDS = ["chat", "chat-stream", "responses", "responses-stream", "messages", "messages-stream"]
# The sampling names each dialect must use on the wire for the session's settings.
WIRE_MAX = {"chat": "max_completion_tokens", "responses": "max_output_tokens", "messages": "max_tokens"}


@pytest.mark.parametrize("kind", KINDS)
def test_sdk_through_proxy_matches_direct(new_session, kind, sim, proxy, harness_env, tmp_path):
    text = f"answer for {kind}"
    # The same reply direct and through the proxy: the harness must see the same content.
    sim.script(Reply(text=["ans", "wer for ", kind]), Reply(text=["ans", "wer for ", kind]))
    direct = _call(kind, openai.OpenAI(api_key="direct", base_url=sim.url("/v1"), max_retries=0),
                   anthropic.Anthropic(api_key="direct", base_url=sim.url(""), max_retries=0), "hello")
    sim.clear()

    session = new_session(**SESSION)
    harness_env(session["env"])
    oai, ant = session_clients(session)
    got = _call(kind, oai, ant, "hello")
    assert got[0] == text == direct[0]
    assert got == direct

    [seen] = sim.model_requests()
    body = seen.json
    assert body["model"] == SESSION["model"]
    assert body["temperature"] == 0.25 and body["top_p"] == 0.9
    family = kind.split("-")[0]
    assert body[WIRE_MAX[family]] == 321
    assert "max_tokens" not in body or family == "messages"
    # The real key, never the secret, anywhere in what the provider saw.
    key_header = seen.headers.get("x-api-key") if family == "messages" else seen.headers.get("authorization")
    assert key_header in (REAL_KEY, f"Bearer {REAL_KEY}")
    raw = json.dumps(dict(seen.headers)) + seen.body.decode()
    assert session["model_secret"] not in raw

    status, summary = proxy.api("DELETE", f"sessions/{session['id']}")
    assert status == 200 and summary["sealed"]
    trace = read_trace(session["trace_path"])
    [call] = trace.calls
    assert call.status == 200 and call.error is None
    assert (call.usage.input_tokens, call.usage.output_tokens) == got[1]
    assert call.finish_reason == "stop"
    assert call.model == SESSION["model"]
    assert call.requested_model in ("gpt-4o", "claude-x")
    assert {o.key for o in call.overrides} >= {"model", "temperature"}
    assert trace.num_turns == 1
    assert trace.messages[-1].text() == text
    assert session["model_secret"] not in proxy.log()
    assert session["model_secret"].encode() not in (proxy.trace_dir / f"{session['id']}.msgpack").read_bytes()
    assert REAL_KEY not in proxy.log()


def test_streaming_is_not_buffered(new_session, sim, proxy, harness_env):
    deltas = [f"d{i} " for i in range(8)]
    sim.script(Reply(text=deltas, delay=0.2))
    session = new_session()
    harness_env(session["env"])
    _, ant = session_clients(session)
    t0 = time.monotonic()
    arrivals = []
    with ant.messages.stream(model="m", max_tokens=50, messages=[{"role": "user", "content": "x"}]) as s:
        for _ in s.text_stream:
            arrivals.append(time.monotonic() - t0)
    assert len(arrivals) == len(deltas)
    # Events are 200 ms apart upstream: the first must arrive long before the last.
    assert arrivals[-1] - arrivals[0] > 1.0
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert sorted(gaps)[len(gaps) // 2] > 0.1


def test_two_sessions_at_once_keep_their_own_turns(new_session, sim, proxy, harness_env):
    a, b = new_session(), new_session()
    harness_env(a["env"])  # same proxy and CA for both; only the secret differs
    errors = []

    def run(session, tag):
        try:
            oai = openai.OpenAI(api_key=session["model_secret"], max_retries=0)
            for i in range(5):
                r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": f"{tag}-{i}"}])
                assert tag in r.choices[0].message.content
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(a, "alpha")), threading.Thread(target=run, args=(b, "beta"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for session, tag, other in ((a, "alpha", "beta"), (b, "beta", "alpha")):
        proxy.api("DELETE", f"sessions/{session['id']}")
        trace = read_trace(session["trace_path"])
        assert len(trace.calls) == 5
        texts = " ".join(n.message.text() for n in trace.nodes)
        assert tag in texts and other not in texts


@pytest.mark.parametrize("family", ["openai", "anthropic"])
@pytest.mark.parametrize("secret", ["none", "unknown", "state"])
def test_unclaimed_requests_never_leave_the_proxy(new_session, family, secret, sim, proxy, harness_env):
    session = new_session()
    harness_env(session["env"])
    key = {"none": "", "unknown": "sk-not-a-session-secret", "state": session["state_secret"]}[secret]
    if family == "openai":
        client = openai.OpenAI(api_key=key or "placeholder", max_retries=0)
        if not key:
            client = client.with_options(default_headers={"Authorization": ""})
        with pytest.raises(openai.AuthenticationError) as e:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        # What api.openai.com answers to a bad key; SDKs and harnesses branch on the code.
        assert e.value.body["type"] == "invalid_request_error" and e.value.code == "invalid_api_key"
    else:
        client = anthropic.Anthropic(api_key=key or "placeholder", max_retries=0)
        if not key:
            client = client.with_options(default_headers={"x-api-key": ""})
        with pytest.raises(anthropic.AuthenticationError) as e:
            client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["error"]["type"] == "authentication_error"
    assert e.value.response.headers["x-should-retry"] == "false"
    if secret == "state":
        assert "state secret" in str(e.value)
    assert sim.requests == []
    if key:
        assert key not in proxy.log()


def test_body_that_is_not_json_is_refused_in_dialect_shape(new_session, sim, proxy, harness_env):
    import httpx2 as httpx  # the HTTP client the SDKs themselves use

    session = new_session()
    harness_env(session["env"])
    secret = session["model_secret"]
    with httpx.Client(timeout=10) as http:  # trust_env: HTTPS_PROXY and SSL_CERT_FILE, as an SDK
        r = http.post("https://api.openai.com/v1/chat/completions", content=b"{not json",
                      headers={"authorization": f"Bearer {secret}", "content-type": "application/json"})
        assert r.status_code == 400
        assert "not valid JSON" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "invalid_request_error"
        r = http.post("https://api.anthropic.com/v1/messages", content=b"[1, 2",
                      headers={"x-api-key": secret, "content-type": "application/json"})
        assert r.status_code == 400 and r.headers["x-should-retry"] == "false"
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert sim.requests == []
    proxy.api("DELETE", f"sessions/{session['id']}")
    assert read_trace(session["trace_path"]).calls == []


def test_unreachable_upstream_is_a_502_in_dialect_shape_and_on_the_record(new_session, sim, proxy, harness_env):
    session = new_session(upstream="dead")
    harness_env(session["env"])
    _, ant = session_clients(session)
    with pytest.raises(anthropic.APIStatusError) as e:
        ant.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 502
    assert e.value.body["type"] == "error"
    proxy.api("DELETE", f"sessions/{session['id']}")
    trace = read_trace(session["trace_path"])
    [call] = trace.calls
    assert call.error is not None and call.node is None
    assert trace.num_turns == 0


@pytest.mark.parametrize("family", ["openai", "anthropic"])
def test_the_secret_in_the_proxy_url_alone_claims_the_session(family, new_session, sim, proxy, monkeypatch):
    """A harness that holds a placeholder key (or none) is claimed by the secret in
    ``HTTPS_PROXY=http://rollout:<secret>@host:port`` alone, as run_harness sets it."""
    session = new_session()
    sim.script(Reply(text="claimed by the proxy url"), Reply(text="again"))
    monkeypatch.setenv("HTTPS_PROXY", f"http://rollout:{session['model_secret']}@127.0.0.1:{proxy.port}")
    monkeypatch.setenv("SSL_CERT_FILE", str(proxy.ca_bundle))
    if family == "openai":
        client = openai.OpenAI(api_key="sk-placeholder", max_retries=0)
        text = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}]).choices[0].message.content
    else:
        client = anthropic.Anthropic(api_key="sk-placeholder", max_retries=0)
        text = client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}]).content[0].text
    assert text == "claimed by the proxy url"
    import httpx2 as httpx  # the SDKs' client: no key header at all this time

    with httpx.Client(timeout=10) as http:  # trust_env: the proxy URL and its credentials
        path = "/v1/chat/completions" if family == "openai" else "/v1/messages"
        host = "api.openai.com" if family == "openai" else "api.anthropic.com"
        r = http.post(f"https://{host}{path}", json={"model": "m", "max_tokens": 5,
                                                     "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert [r.headers.get("x-api-key") or r.headers["authorization"] for r in sim.model_requests()] == \
        ([f"Bearer {REAL_KEY}"] * 2 if family == "openai" else [REAL_KEY] * 2)
    assert proxy.api("GET", f"sessions/{session['id']}")[1]["turns"] == 2


# The fixture's message_stop, then the rest of the body only later: the end of the body comes
# well after the terminal event, as when a provider holds the connection a moment.
HELD_STREAM = (ROOT / "tests" / "fixtures" / "anthropic-messages-sse" / "basic_response.sse").read_bytes().rstrip(b"\n") \
    + b'\n\nevent: ping\ndata: {"type": "ping"}\n\n'


def test_a_streamed_turn_is_committed_before_its_terminal_event_reaches_the_harness(new_session, sim, proxy):
    """A harness that sends its next request the moment it reads ``message_stop`` must find
    the turn on the record: the Tee commits before it returns the terminal event's bytes,
    not at the end of the body."""
    import httpx2 as httpx

    sim.script(Reply(raw=HELD_STREAM, content_type="text/event-stream", delay=0.4))
    session = new_session()
    body = {"model": "m", "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(proxy=proxy.url, verify=ssl.create_default_context(cafile=proxy.ca_bundle), timeout=20) as http:
        with http.stream("POST", "https://api.anthropic.com/v1/messages", json=body,
                         headers={"x-api-key": session["model_secret"]}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert any(line.startswith("data:") and '"message_stop"' in line for line in lines)
            # message_stop read; the rest of the body is still 0.4 s away
            summary = proxy.api("GET", f"sessions/{session['id']}")[1]
            assert summary["turns"] == 1, summary
            assert any("ping" in line for line in lines)  # the body really went on afterwards


def test_non_model_paths_on_provider_hosts_are_answered_locally(new_session, sim, proxy, harness_env):
    session = new_session()
    harness_env(session["env"])
    oai, ant = session_clients(session)
    with pytest.raises(anthropic.NotFoundError):
        ant.get("/api/event_logging/batch", cast_to=object)
    with pytest.raises(openai.NotFoundError):
        oai.get("/settings/telemetry", cast_to=object)
    assert sim.requests == []


def test_sessions_file_with_unknown_field_refuses_to_start(tmp_path):
    bad = tmp_path / "sessions.json"
    bad.write_text(json.dumps([{"id": "a", "model": "m", "temprature": 0.5}]))
    proc = MitmProcess(options={"intercept_sessions": str(bad)}).start(expect_failure=True)
    try:
        assert proc.wait() != 0
        assert "temprature" in proc.log()
    finally:
        proc.cleanup()


def test_sessions_file_sessions_are_claimable(sim, start_proxy, tmp_path, harness_env):
    f = tmp_path / "sessions.json"
    f.write_text(json.dumps([{"id": "fixed-1", "model": "file-model",
                              "upstream": {"base_url": sim.url("/v1")}}]))
    proxy = start_proxy({"intercept_sessions": str(f)})
    status, listing = proxy.api("GET", "sessions")
    assert status == 200 and [s["id"] for s in listing["sessions"]] == ["fixed-1"]
    assert proxy.api("GET", "sessions/fixed-1/env", token=None)[0] == 401
    status, creds = proxy.api("GET", "sessions/fixed-1/env")
    assert status == 200 and creds["id"] == "fixed-1"
    harness_env(creds["env"])
    oai, _ = session_clients(creds)
    assert oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}]).choices[0].message.content
    [seen] = sim.model_requests()
    assert seen.json["model"] == "file-model"
    proxy.api("DELETE", "sessions/fixed-1")
    assert read_trace(creds["trace_path"]).num_turns == 1


def test_control_api_needs_the_admin_token(proxy):
    assert proxy.api("GET", "health", token=None)[0] == 200
    assert proxy.api("POST", "sessions", {}, token=None)[0] == 401
    assert proxy.api("POST", "sessions", {}, token="wrong-token-wrong-token")[0] == 401
    assert proxy.api("GET", "sessions")[1]["sessions"][0]["id"] == "default"
    assert len(proxy.api("GET", "sessions")[1]["sessions"]) == 1  # nothing was created
    status, body = proxy.api("POST", "sessions", {"sampling": {"temprature": 1}})
    assert status == 400 and "temprature" in body["error"]["message"]
    mode = (proxy.confdir / "interceptor-admin-token").stat().st_mode & 0o777
    assert mode == 0o600


def test_default_session_from_the_banner_works(sim, proxy, monkeypatch):
    """`mitmdump -s addons/interception.py` alone: the printed environment is all a harness
    needs, and the secret itself never stands in the log."""
    log = proxy.log()
    [env_file] = re.findall(r"^\S+\s+source (\S+)$", log, re.M)
    out = subprocess.run(["bash", "-c", f"source {env_file} && env"], capture_output=True, text=True, check=True).stdout
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert {"HTTPS_PROXY", "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "CODEX_API_KEY", "SSL_CERT_FILE",
            "NODE_EXTRA_CA_CERTS", "CODEX_CA_CERTIFICATE", "REQUESTS_CA_BUNDLE"} <= set(env)
    assert env["OPENAI_API_KEY"] not in log
    assert f"CA bundle for harnesses: {proxy.ca_bundle}" in log and env["SSL_CERT_FILE"] == str(proxy.ca_bundle)
    assert f"ready at http://127.0.0.1:{proxy.port};" in log
    assert (Path(env_file).stat().st_mode & 0o777) == 0o600
    for k in ("HTTPS_PROXY", "OPENAI_API_KEY", "SSL_CERT_FILE"):
        monkeypatch.setenv(k, env[k])
    r = openai.OpenAI(max_retries=0).chat.completions.create(model="m", messages=[{"role": "user", "content": "ping"}])
    assert r.choices[0].message.content
    assert len(sim.model_requests()) == 1


def test_delete_seals_and_show_reports_it(new_session, sim, proxy, harness_env):
    session = new_session(model="m1", task={"name": "t"})
    harness_env(session["env"])
    sim.script(Reply(tool_calls=[ToolCall(name="bash", arguments={"cmd": "ls"})]), Reply(text="done"))
    oai, _ = session_clients(session)
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "list files"}]
    r = oai.chat.completions.create(model="x", messages=msgs, tools=tools)
    call = r.choices[0].message.tool_calls[0]
    msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "a.txt"}]
    oai.chat.completions.create(model="x", messages=msgs, tools=tools)
    status, summary = proxy.api("GET", f"sessions/{session['id']}")
    assert status == 200 and summary["turns"] == 2 and not summary["sealed"]
    status, summary = proxy.api("DELETE", f"sessions/{session['id']}")
    assert summary["sealed"] and summary["turns"] == 2
    # A DELETE without a body seals with the default stop condition, on the answer and on disk.
    assert summary["stop_condition"] == "deleted"
    assert read_trace(session["trace_path"]).stop_condition == "deleted"
    # The proxy lets go of the sealed graph but still answers for the session.
    status, again = proxy.api("GET", f"sessions/{session['id']}")
    assert status == 200 and again["released"] and again["turns"] == 2 and again["calls"] == 2
    with pytest.raises(openai.AuthenticationError, match="sealed"):
        oai.chat.completions.create(model="x", messages=msgs)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "replay_trace.py"), "show", "--json", session["trace_path"]],
                         capture_output=True, text=True, check=True)
    shown = json.loads(out.stdout)
    assert shown["sealed"] is True and shown["turns"] == 2
    assert [c["finish_reason"] for c in shown["calls"]] == ["tool_calls", "stop"]
    assert all(c["model"] == "m1" for c in shown["calls"])
    text = subprocess.run([sys.executable, str(ROOT / "scripts" / "replay_trace.py"), "show", session["trace_path"]],
                          capture_output=True, text=True, check=True).stdout
    assert "list files" in text and "a.txt" in text and "done" in text


def _listening(port: int) -> set[str]:
    """The local addresses a TCP port listens on, from /proc/net/tcp{,6} (state 0A)."""
    found = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(name).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.rsplit(":", 1)
            if state == "0A" and int(hexport, 16) == port:
                found.add(addr)
    return found


def test_bare_start_listens_on_loopback_only_and_has_a_ca_on_a_fresh_home(tmp_path):
    """`mitmdump -s addons/interception.py` with nothing else, on a machine that never ran
    mitmproxy: loopback only (the proxy holds real keys), and the harness CA variables set."""
    home = tmp_path / "home"
    home.mkdir()
    proc = MitmProcess(options={"confdir": None, "listen_host": None}, env={"HOME": str(home)}).start()
    try:
        wait_until(lambda: _listening(proc.port) == {"0100007F"}, 10,
                   lambda: f"listening on loopback only, not {_listening(proc.port)}")
        env_file = home / ".mitmproxy" / "interceptor-harness" / "default.env"
        text = env_file.read_text()
        assert "SSL_CERT_FILE=" in text and "NODE_EXTRA_CA_CERTS=" in text
        assert (home / ".mitmproxy" / "interceptor-harness" / "ca-bundle.pem").read_text().count("BEGIN CERTIFICATE") >= 2
    finally:
        proc.cleanup()

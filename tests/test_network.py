"""Provider-side tools and the network policy: under ``strip`` every capability the
provider executes for the model leaves the request (per dialect, each removal an override
with reason ``network_policy`` naming the kind); under ``restrict`` hosted web search stays,
narrowed to the policy's domains; a request that exists only to search is answered locally;
``egress`` refuses a tunnel to a host outside the allow list.

The policy's decisions are tested on bodies in-process, then through a real mitmdump with
the real SDKs against the strict simulator."""

from __future__ import annotations

import copy
import json

import httpx2 as httpx
import pytest

from interceptor.addons.gateway.policy.network import NOTICE, REASON, SEARCH_UNAVAILABLE, NetworkPolicy, mediate
from interceptor.dialects import ANTHROPIC, CHAT, GEMINI, RESPONSES
from interceptor.trace import read_trace
from clients import session_clients
from mitm import ROOT
from provider import Reply

STRIP = NetworkPolicy(provider_tools="strip")
RESTRICT = NetworkPolicy(provider_tools="restrict", allow=["*.python.org"])

BASH = {"name": "bash", "description": "run", "input_schema": {"type": "object"}}
FN = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}
RFN = {"type": "function", "name": "bash", "parameters": {"type": "object"}}

ANTHROPIC_BODY = {
    "model": "claude-sonnet-4-5", "max_tokens": 100,
    "tools": [BASH, {"type": "web_search_20250305", "name": "web_search", "max_uses": 3,
                     "blocked_domains": ["example.com"]},
              {"type": "web_fetch_20250910", "name": "web_fetch", "allowed_domains": ["docs.python.org", "example.org"]},
              {"type": "code_execution_20250825", "name": "code_execution"}],
    "tool_choice": {"type": "tool", "name": "code_execution"},
    "mcp_servers": [{"type": "url", "url": "https://mcp.example.com/sse", "name": "x"}],
    "container": "container_011",
    "messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/secret-answer.png"}},
        {"type": "document", "source": {"type": "file", "file_id": "file_011"}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}],
}
RESPONSES_BODY = {
    "model": "gpt-5", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "look"},
        {"type": "input_image", "image_url": "https://example.com/answer.png"},
        {"type": "input_file", "file_id": "file-abc"}]}],
    "tools": [RFN, {"type": "web_search", "filters": {"allowed_domains": ["docs.python.org", "example.com"]}},
              {"type": "web_search_preview"}, {"type": "file_search", "vector_store_ids": ["vs_1"]},
              {"type": "code_interpreter", "container": {"type": "auto"}}, {"type": "image_generation"},
              {"type": "mcp", "server_label": "deepwiki", "server_url": "https://mcp.deepwiki.com/mcp"}],
    "tool_choice": {"type": "file_search"},
    "previous_response_id": "resp_from_elsewhere", "conversation": "conv_123",
}
CHAT_BODY = {
    "model": "gpt-4.1", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}],
    "tools": [FN, {"type": "web_search"}, {"type": "custom", "custom": {"name": "patch"}}],
    "tool_choice": {"type": "web_search"},
    "web_search_options": {"search_context_size": "low"},
}
GEMINI_BODY = {
    "contents": [{"role": "user", "parts": [{"text": "look"}, {"fileData": {"fileUri": "https://x/y", "mimeType": "text/plain"}}]}],
    "tools": [{"functionDeclarations": [{"name": "bash"}]}, {"googleSearch": {}}, {"codeExecution": {}},
              {"url_context": {}}],
}


def changes(body, dialect, policy=STRIP, **kw):
    body = copy.deepcopy(body)
    out = mediate(dialect, body, policy, **kw)
    assert all(o.reason == REASON for o in out.overrides)
    return body, {o.key: (o.old, o.new) for o in out.overrides}, out.search_only


def test_anthropic_strip_removes_server_tools_connectors_and_fetched_sources():
    body, seen, search_only = changes(ANTHROPIC_BODY, ANTHROPIC)
    assert body["tools"] == [BASH] and "tool_choice" not in body  # it named a removed tool
    assert "mcp_servers" not in body and "container" not in body
    content = body["messages"][0]["content"]
    assert content[0] == {"type": "text", "text": "look"} and content[3]["source"]["type"] == "base64"
    assert [c["type"] for c in content] == ["text", "text", "text", "image"]
    assert seen == {"tools.web_search": ("web_search_20250305", None), "tools.web_fetch": ("web_fetch_20250910", None),
                    "tools.code_execution": ("code_execution_20250825", None),
                    "tool_choice": ("a removed provider tool", None), "mcp_servers": ("mcp servers", None),
                    "container": ("code execution container", None),
                    "messages.0.content.1": ("image url source", "text"),
                    "messages.0.content.2": ("document file source", "text")}
    assert not search_only
    # The old values name kinds, never content: nothing of what was removed is on the record.
    assert "secret-answer" not in json.dumps(seen) and "mcp.example.com" not in json.dumps(seen)


def test_anthropic_restrict_keeps_search_narrowed_and_direct_only():
    body, seen, _ = changes(ANTHROPIC_BODY, ANTHROPIC, RESTRICT)
    search, fetch = body["tools"][1], body["tools"][2]
    assert search == {"type": "web_search_20250305", "name": "web_search", "max_uses": 3,
                      "allowed_domains": ["python.org"], "allowed_callers": ["direct"]}  # blocked_domains cannot be combined
    # Never wider than what the harness asked: its docs.python.org stays, example.org goes.
    assert fetch["allowed_domains"] == ["docs.python.org"] and fetch["allowed_callers"] == ["direct"]
    assert [t.get("name") for t in body["tools"]] == ["bash", "web_search", "web_fetch"]
    assert seen["tools.web_search"] == ("web_search_20250305", {"allowed_domains": ["python.org"],
                                                                 "allowed_callers": ["direct"]})
    assert seen["tools.code_execution"] == ("code_execution_20250825", None)
    # A harness asking only for domains outside the policy gets no search at all.
    lone = {**ANTHROPIC_BODY, "tools": [{"type": "web_search_20250305", "name": "web_search",
                                         "allowed_domains": ["example.com"]}], "tool_choice": {"type": "auto"}}
    body, seen, _ = changes(lone, ANTHROPIC, RESTRICT)
    assert "tools" not in body and seen["tools.web_search"] == ("web_search_20250305", None)
    # An allow rule that is not *.domain cannot be kept to: strip.
    body, _, _ = changes(ANTHROPIC_BODY, ANTHROPIC, NetworkPolicy(provider_tools="restrict", allow=["pypi.org"]))
    assert body["tools"] == [BASH]


def test_responses_strip_removes_hosted_tools_and_provider_state():
    body, seen, search_only = changes(RESPONSES_BODY, RESPONSES)
    assert body["tools"] == [RFN] and "tool_choice" not in body
    assert "previous_response_id" not in body and "conversation" not in body
    assert [p["type"] for p in body["input"][0]["content"]] == ["input_text"] * 3
    assert {k for k, (old, _) in seen.items() if k.startswith("tools.")} == {
        "tools.web_search", "tools.web_search_preview", "tools.file_search", "tools.code_interpreter",
        "tools.image_generation", "tools.deepwiki"}
    assert seen["previous_response_id"] == ("provider-held conversation", None) and not search_only
    # A previous_response_id this session recorded holds nothing from outside: it stays.
    body, seen, _ = changes(RESPONSES_BODY, RESPONSES, known_previous=True)
    assert body["previous_response_id"] == "resp_from_elsewhere" and "previous_response_id" not in seen


def test_responses_restrict_narrows_the_filtered_search_only():
    body, seen, _ = changes(RESPONSES_BODY, RESPONSES, RESTRICT)
    assert [t["type"] for t in body["tools"]] == ["function", "web_search"]
    assert body["tools"][1]["filters"] == {"allowed_domains": ["docs.python.org"]}
    assert seen["tools.web_search_preview"] == ("web_search_preview", None)  # no filter: it goes


def test_chat_strip_removes_search_options_and_hosted_tools():
    body, seen, _ = changes(CHAT_BODY, CHAT)
    assert body["tools"] == [FN, {"type": "custom", "custom": {"name": "patch"}}]  # the harness runs those
    assert "web_search_options" not in body and "tool_choice" not in body
    assert [p["type"] for p in body["messages"][0]["content"]] == ["text", "text", "image_url"]
    assert seen["web_search_options"] == ("web search options", None)
    assert seen["tools.web_search"] == ("web_search", None)


def test_gemini_strip_removes_googles_own_tools():
    body, seen, search_only = changes(GEMINI_BODY, GEMINI)
    assert body["tools"] == [{"functionDeclarations": [{"name": "bash"}]}]
    assert body["contents"][0]["parts"][1] == {"text": body["contents"][0]["parts"][1]["text"]}
    assert seen["tools.1.googleSearch"] == ("google search", None) and not search_only
    only = {"contents": GEMINI_BODY["contents"], "tools": [{"googleSearch": {}}]}
    body, _, search_only = changes(only, GEMINI)
    assert search_only and "tools" not in body


@pytest.mark.parametrize("dialect,body", [(ANTHROPIC, ANTHROPIC_BODY), (RESPONSES, RESPONSES_BODY),
                                          (CHAT, CHAT_BODY), (GEMINI, GEMINI_BODY)])
def test_allow_changes_nothing_and_notice_is_stable(dialect, body):
    assert changes(body, dialect, NetworkPolicy())[0] == body
    policy = NetworkPolicy(provider_tools="strip", notice=True)
    once, seen, _ = changes(body, dialect, policy)
    twice, _, _ = changes(body, dialect, policy)
    assert once == twice and NOTICE in json.dumps(once)
    assert [v for k, v in seen.items() if v[1] == NOTICE] == [("first user message", NOTICE)]


def test_a_search_only_request_is_recognised():
    search = {"model": "claude-haiku-4-5", "max_tokens": 100, "messages": [{"role": "user", "content": "q"}],
              "tools": [{"type": "web_search_20250305", "name": "web_search"}],
              "tool_choice": {"type": "tool", "name": "web_search"}}
    assert changes(search, ANTHROPIC)[2]
    # Claude Code's own WebSearch call leaves the choice to the model: still only a search.
    assert changes({**search, "tool_choice": {"type": "auto"}}, ANTHROPIC)[2]
    assert not changes({**search, "tool_choice": {"type": "none"}}, ANTHROPIC)[2]
    code = {**search, "tools": [{"type": "code_execution_20250825", "name": "code_execution"}], "tool_choice": {"type": "any"}}
    assert not changes(code, ANTHROPIC)[2]  # not a search: forwarded without the tool
    assert not changes({**search, "tools": [*search["tools"], BASH]}, ANTHROPIC)[2]
    assert not changes(search, ANTHROPIC, RESTRICT)[2]  # restricted search still searches
    responses = {"model": "gpt-5", "input": "q", "tools": [{"type": "web_search_preview"}], "tool_choice": "required"}
    assert changes(responses, RESPONSES)[2]


def test_the_policy_config_is_checked():
    with pytest.raises(ValueError, match="not both"):
        NetworkPolicy(allow=["*.python.org"], block=["evil.com"])
    with pytest.raises(ValueError, match="not a host rule"):
        NetworkPolicy(allow=["https://pypi.org/simple"])
    policy = NetworkPolicy(allow=["*.python.org", "pypi.org"])
    assert policy.allows("docs.python.org") and policy.allows("python.org") and policy.allows("pypi.org")
    assert not policy.allows("files.pythonhosted.org") and not policy.allows("evilpython.org")
    assert not NetworkPolicy(block=["*.evil.com"]).allows("a.evil.com")
    assert NetworkPolicy(block=["*.evil.com"]).allows("good.com")


# -- through the proxy -----------------------------------------------------------------------


def _call(trace):
    (call,) = trace.calls
    return {o.key: (o.old, o.new) for o in call.overrides if o.reason == REASON}


def _one_request(new_session, sim, proxy, harness_env, mode: str, send):
    """One SDK request of a session under ``mode`` (allow ["*.python.org"]): what reached the
    simulator, and the call's network overrides."""
    session = new_session(network={"provider_tools": mode, "allow": ["*.python.org"]})
    harness_env(session["env"])
    sim.script(Reply(text="done"))
    send(*session_clients(session))
    (seen,) = sim.model_requests()
    proxy.api("DELETE", f"sessions/{session['id']}")
    return seen, _call(read_trace(session["trace_path"]))


@pytest.mark.parametrize("mode", ["strip", "restrict"])
def test_anthropic_hosted_search_through_the_proxy(new_session, sim, proxy, harness_env, mode):
    seen, overrides = _one_request(new_session, sim, proxy, harness_env, mode, lambda _, anthropic: anthropic.messages.create(
        model="claude-sonnet-4-5", max_tokens=100, messages=[{"role": "user", "content": "hi"}],
        tools=[BASH, {"type": "web_search_20250305", "name": "web_search"}]))
    if mode == "strip":
        assert seen.json["tools"] == [BASH]
        assert overrides == {"tools.web_search": ("web_search_20250305", None)}
    else:
        assert seen.json["tools"][1] == {"type": "web_search_20250305", "name": "web_search",
                                         "allowed_domains": ["python.org"], "allowed_callers": ["direct"]}
        assert overrides["tools.web_search"][1]["allowed_domains"] == ["python.org"]


@pytest.mark.parametrize("mode", ["strip", "restrict"])
def test_responses_hosted_search_through_the_proxy(new_session, sim, proxy, harness_env, mode):
    seen, overrides = _one_request(new_session, sim, proxy, harness_env, mode, lambda openai, _: openai.responses.create(
        model="gpt-5", input="hi", tools=[RFN, {"type": "web_search"}]))
    if mode == "strip":
        assert seen.json["tools"] == [RFN] and overrides == {"tools.web_search": ("web_search", None)}
    else:
        assert seen.json["tools"][1] == {"type": "web_search", "filters": {"allowed_domains": ["python.org"]}}


def test_chat_hosted_search_through_the_proxy(new_session, sim, proxy, harness_env):
    session = new_session(network={"provider_tools": "strip", "notice": True})
    harness_env(session["env"])
    sim.script(Reply(text="done"))
    openai, _ = session_clients(session)
    openai.chat.completions.create(model="gpt-4.1", messages=[{"role": "user", "content": "hi"}],
                                   web_search_options={}, tools=[FN])
    (seen,) = sim.model_requests()
    assert "web_search_options" not in seen.json and seen.json["tools"] == [FN]
    assert seen.json["messages"][0]["content"] == f"hi\n\n{NOTICE}"
    proxy.api("DELETE", f"sessions/{session['id']}")
    trace = read_trace(session["trace_path"])
    assert _call(trace) == {"web_search_options": ("web search options", None),
                            "messages.0.content": ("first user message", NOTICE)}
    assert trace.branches[0].messages[0].text() == "hi"  # the record keeps what the harness said


def test_gemini_hosted_search_through_the_proxy(new_session, sim, proxy, harness_env):
    session = new_session(network={"provider_tools": "strip"})
    harness_env(session["env"])
    sim.script(Reply(text="done"))
    body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}],
            "tools": [{"functionDeclarations": [{"name": "bash", "parametersJsonSchema": {"type": "object"}}]},
                      {"googleSearch": {}}]}
    with httpx.Client(timeout=30, trust_env=True) as http:
        r = http.post("https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-pro:generateContent",
                      json=body, headers={"x-goog-api-key": session["model_secret"]})
    assert r.status_code == 200, r.text
    (seen,) = sim.model_requests()
    assert seen.json["tools"] == body["tools"][:1]
    proxy.api("DELETE", f"sessions/{session['id']}")
    assert _call(read_trace(session["trace_path"])) == {"tools.1.googleSearch": ("google search", None)}


CAPTURE = ROOT / "tests" / "fixtures" / "claude-code-requests" / "websearch-2.1.332.json"


def test_claude_codes_captured_websearch_request_is_answered_locally(new_session, sim, proxy, harness_env):
    """Claude Code 2.1.332's WebSearch call, as it sent it: its only tool is the hosted web
    search (with tool_choice auto, not forced). Under strip it exists only to search, so the
    proxy answers it in Anthropic's stream shape and nothing goes upstream."""
    session = new_session(network={"provider_tools": "strip"})
    harness_env(session["env"])
    captured = json.loads(CAPTURE.read_text())
    with httpx.Client(timeout=30, trust_env=True) as http:
        r = http.post("https://api.anthropic.com/v1/messages?beta=true", content=json.dumps(captured["body"]).encode(),
                      headers={**captured["headers"], "x-api-key": session["model_secret"]})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
    assert [e["type"] for e in events][0] == "message_start" and events[-1]["type"] == "message_stop"
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert text == SEARCH_UNAVAILABLE
    assert sim.requests == []  # nothing went upstream
    proxy.api("DELETE", f"sessions/{session['id']}")
    trace = read_trace(session["trace_path"])
    (call,) = trace.calls
    assert call.node is None and call.status == 200 and call.finish_reason == "stop" and call.stream
    assert _call(trace) == {"tools.web_search": ("web_search_20250305", None),
                            "tool_choice": ("a choice with no tool left", None)}
    assert trace.num_turns == 0  # no model sampled it: not a training sample


# -- egress ------------------------------------------------------------------------------------


def _wheel(path):
    import zipfile

    files = {"tinypkg/__init__.py": "VALUE = 1\n",
             "tinypkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
             "tinypkg-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{name},,\n" for name in files) + "tinypkg-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in {**files, "tinypkg-1.0.dist-info/RECORD": record}.items():
            z.writestr(name, text)


@pytest.fixture
def index(tmp_path):
    """A package index over HTTPS on this machine (a certificate of its own), reachable as
    ``localhost`` and as ``127.0.0.1``: one host the policy allows, one it does not."""
    import http.server
    import ssl
    import threading

    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from mitmproxy import certs

    store = certs.CertStore.from_store(tmp_path / "ca", "index", 2048)
    entry = store.get_cert("localhost", [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    (tmp_path / "cert.pem").write_bytes(entry.cert.to_pem())
    (tmp_path / "key.pem").write_bytes(entry.privatekey.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()))
    files = tmp_path / "files"
    files.mkdir()
    _wheel(files / "tinypkg-1.0-py3-none-any.whl")
    page = b'<html><body><a href="/files/tinypkg-1.0-py3-none-any.whl">tinypkg-1.0-py3-none-any.whl</a></body></html>'

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.rstrip("/") == "/simple/tinypkg":
                body, kind = page, "text/html"
            elif self.path == "/files/tinypkg-1.0-py3-none-any.whl":
                body, kind = (files / "tinypkg-1.0-py3-none-any.whl").read_bytes(), "application/octet-stream"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def _pip_download(host: str, port: int, proxy_url: str, dest) -> "subprocess.CompletedProcess":
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "pip", "download", "--isolated", "--no-cache-dir", "--no-deps", "--retries", "0",
         "--timeout", "10", "--disable-pip-version-check", "--index-url", f"https://{host}:{port}/simple",
         "--trusted-host", host, "--proxy", proxy_url, "-d", str(dest), "tinypkg"],
        capture_output=True, text=True, timeout=120)


def test_egress_outside_the_allow_list_is_refused_and_recorded(new_session, proxy, index, tmp_path):
    from urllib.parse import quote

    session = new_session(network={"allow": ["localhost", "*.python.org"], "egress": True})
    proxy_url = f"http://session:{quote(session['model_secret'], safe='')}@127.0.0.1:{proxy.port}"
    allowed = _pip_download("localhost", index, proxy_url, tmp_path / "ok")
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert (tmp_path / "ok" / "tinypkg-1.0-py3-none-any.whl").exists()
    for _ in range(2):
        refused = _pip_download("127.0.0.1", index, proxy_url, tmp_path / "no")
        assert refused.returncode != 0 and "No matching distribution" in refused.stderr, refused.stdout + refused.stderr
    assert not (tmp_path / "no").exists() or not any((tmp_path / "no").iterdir())
    # Without the session's secret on the tunnel the policy is not this session's to apply.
    other = _pip_download("127.0.0.1", index, f"http://127.0.0.1:{proxy.port}", tmp_path / "plain")
    assert other.returncode == 0, other.stdout + other.stderr
    assert proxy.log().count("egress to 127.0.0.1") == 2  # the tunnel was refused, not the package missing
    proxy.api("DELETE", f"sessions/{session['id']}")
    trace = read_trace(session["trace_path"])
    assert trace.egress == {"127.0.0.1": 2}
    assert [(e.host, e.port, e.count) for e in trace.egress_refusals] == [("127.0.0.1", index, 1), ("127.0.0.1", index, 2)]


def test_websocket_frames_are_mediated_and_their_own_chain_kept(proxy, new_session, sim):
    """Codex's transport: each response.create frame is stripped like a POST body; a frame
    chained on an answer this proxy relayed (a warm-up, a turn) keeps its chain, one chained
    on an id from elsewhere loses it."""
    from wsclient import WSClient

    session = new_session(network={"provider_tools": "strip", "notice": True})
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list the files"}]}
    tools = [RFN, {"type": "web_search"}]
    sim.script(Reply(text="one"), Reply(text="two"))
    create = {"type": "response.create", "model": "gpt-5", "stream": True}
    with WSClient("wss://api.openai.com/v1/responses", headers={"Authorization": f"Bearer {session['model_secret']}"},
                  proxy=proxy.url, cafile=str(proxy.ca_bundle)) as ws:
        ws.send_json({**create, "generate": False, "input": [user], "tools": tools})
        warm = ws.until("response.completed")[-1]["response"]["id"]
        ws.send_json({**create, "previous_response_id": warm, "input": [], "tools": tools})
        ws.until("response.completed")
        ws.send_json({**create, "previous_response_id": "resp_someone_elses", "input": [user], "tools": tools})
        ws.until("response.completed")
    frames = [r.json for r in sim.requests if r.transport == "websocket" and r.route != "websocket"]
    assert len(frames) == 3 and all(f["tools"] == [RFN] for f in frames)
    assert frames[0]["input"][0]["content"][-1] == {"type": "input_text", "text": NOTICE}
    assert frames[1]["previous_response_id"] == warm and "previous_response_id" not in frames[2]
    proxy.api("DELETE", f"sessions/{session['id']}")
    trace = read_trace(session["trace_path"])
    keys = [{o.key for o in c.overrides if o.reason == REASON} for c in trace.calls]
    assert keys == [{"tools.web_search"}, {"tools.web_search", "previous_response_id", "input.0.content"}]


def test_a_providers_400_never_undoes_the_policy():
    """Provider feedback undoes a change the provider blamed; a removal the network policy
    made is not the proxy's guess about the provider but the rollout's rule: it stays."""
    from interceptor.addons.gateway.feedback import proxy_param
    from interceptor.addons.gateway.exchange import Exchange
    from interceptor.dialects.common import undo

    body = copy.deepcopy(ANTHROPIC_BODY)
    overrides = mediate(ANTHROPIC, body, RESTRICT).overrides
    before = copy.deepcopy(body)
    assert undo(body, "tools", overrides) == [] and body == before
    ex = Exchange(session=None, route=None, overrides=overrides)
    assert proxy_param(ex, ["tools.1.allowed_callers", "tools"]) is None

"""Codex CLI (`codex exec`) through the proxy, over both its transports: the Responses API
over a WebSocket (its default: warm-up frame, then frames chained on previous_response_id)
and over SSE (a provider profile with supports_websockets = false). Its freeform `exec`
tool runs the command; both transports must leave the same trace."""

from __future__ import annotations

import shutil
import uuid

import pytest

from harness import (
    FINAL, PROMPT, SESSIONS, TOOL_OUTPUT, check_ran, check_retried_529, check_sim_saw_only_the_session,
    check_strict, check_task_trace, check_unknown_secret_fails, check_cut_retry, node_harness, normalized,
    run_harness, trace_of, when_left,
)
from harness import hproxy, hsim, sim  # noqa: F401 (this module's fixtures)
from provider import Reply, ToolCall

SESSION = {"model": "codex-session-model", "sampling": {"temperature": 0.3, "max_tokens": 2048}}
WIRE = {"temperature": 0.3, "max_output_tokens": 2048}
# Codex's `exec` tool takes JavaScript that calls its other tools.
SCRIPT = f'const r = await tools.exec_command({{cmd: "echo {TOOL_OUTPUT}"}}); text(r.output ?? JSON.stringify(r));'
SSE_PROFILE = """model_provider = "openai-https"

[model_providers.openai-https]
name = "OpenAI over HTTPS (no WebSocket)"
base_url = "https://api.openai.com/v1"
env_key = "CODEX_API_KEY"
wire_api = "responses"
supports_websockets = false
"""


def _codex() -> list[str]:
    return [node_harness("codex"), "exec", "--skip-git-repo-check", PROMPT]


def _task() -> list[Reply]:
    return [Reply(reasoning="Run it with exec.", tool_calls=[ToolCall(name="exec", arguments=SCRIPT, type="custom",
                                                                      id="call_codex_exec")]),
            Reply(text=["The answer is ", FINAL])]


def _script_task(sim) -> None:
    sim.script(*_task())


def _home(path, transport: str):
    """A fresh HOME at ``path``; over SSE with the provider profile that turns WebSockets off."""
    shutil.rmtree(path, ignore_errors=True)
    (path / ".codex").mkdir(parents=True)
    if transport == "sse":
        (path / ".codex" / "config.toml").write_text(SSE_PROFILE)
    return path


def _run(proxy, sim, tmp_path, transport: str, name: str, session: dict = SESSION):
    sid = f"codex-{name}-{uuid.uuid4().hex[:8]}"
    # The same HOME and working directory for both transports: Codex writes both into its
    # prompt, and the transports are compared.
    extra = ["--home", str(_home(tmp_path.parent / "codex-home", transport))]
    if transport == "sse":
        extra.append("--no-proxy-auth")  # also the claim by the key header alone
    result = run_harness(proxy, sim, _codex(), sid=sid, cwd=tmp_path.parent / "codex-work", session=session,
                         extra=extra)
    return result, sid


@pytest.fixture(scope="module")
def codex_runs(hproxy, hsim, tmp_path_factory):
    """The task once per transport (shared by the checks below: a Codex run is seconds)."""
    runs = {}
    for transport in ("websocket", "sse"):
        hsim.clear_scripts()
        hsim.clear()
        _script_task(hsim)
        result, sid = _run(hproxy, hsim, tmp_path_factory.mktemp(transport), transport, "task")
        runs[transport] = (result, sid, list(hsim.requests))
    return runs


@pytest.mark.parametrize("transport", ["websocket", "sse"])
def test_codex_runs_a_tool_task_through_the_proxy(codex_runs, hproxy, transport):
    result, sid, requests = codex_runs[transport]
    check_ran(result)
    # Its chatgpt.com side calls (model list, curated plugins) got answers it takes: no error.
    assert " ERROR " not in result.stdout + result.stderr, result.stderr[-2000:]
    trace = trace_of(hproxy, sid)
    check_sim_saw_only_the_session(requests, trace, SESSION, WIRE)
    check_task_trace(trace, turns=2, tool="exec")
    frames = [r for r in requests if r.route in ("responses", "responses_warmup")]
    if transport == "websocket":
        assert all(r.transport == "websocket" for r in requests)
        # The warm-up (generate: false) went through rewritten, and is no turn.
        assert [r.route for r in frames] == ["responses_warmup", "responses", "responses"]
        assert frames[2].json.get("previous_response_id")  # chained: only the new items sent
    else:
        assert all(r.transport == "http" and r.method == "POST" for r in requests)
        assert len(frames) == 2
    assert trace.tools and any(t.name == "exec" for t in trace.tools)


def test_codex_transports_give_the_same_trace(codex_runs, hproxy):
    ws, sse = (trace_of(hproxy, codex_runs[t][1]) for t in ("websocket", "sse"))
    assert normalized(ws) == normalized(sse)
    assert [(c.finish_reason, c.model, c.status) for c in ws.calls] == \
           [(c.finish_reason, c.model, c.status) for c in sse.calls]


@pytest.mark.parametrize("transport", ["websocket", "sse"])
def test_codex_retries_a_529_and_the_graph_has_one_turn(hproxy, sim, tmp_path, transport):
    sim.script(Reply(status=529, error_message="Overloaded"))
    _script_task(sim)
    result, sid = _run(hproxy, sim, tmp_path, transport, "529")
    check_ran(result)
    check_retried_529(trace_of(hproxy, sid))


def test_codex_with_an_unknown_secret_fails_and_nothing_is_recorded(hproxy, sim, tmp_path):
    check_unknown_secret_fails(hproxy, sim, _codex(), tmp_path, SESSION)


@pytest.mark.parametrize("transport", ["websocket", "sse"])
@pytest.mark.parametrize("name", list(SESSIONS))
def test_codex_against_strict_mode(hproxy, sim, tmp_path, transport, name):
    """Every session kind, over both transports, leaves requests the real API accepts."""
    _script_task(sim)
    result, sid = _run(hproxy, sim, tmp_path, transport, name, SESSIONS[name])
    check_ran(result)
    check_strict(sim)
    trace = trace_of(hproxy, sid)
    check_task_trace(trace, turns=2, tool="exec")
    bodies = [r.json for r in sim.model_requests() if r.route == "responses"]
    keys = [sorted(o.key for o in c.overrides) for c in trace.calls]
    if name in ("empty", "thinking-budget", "thinking-disabled"):
        # Nothing of Responses' to change (thinking is Anthropic's): forwarded as sent.
        assert keys == [[], []] and all(b["model"] == "gpt-6.2-sol" for b in bodies)
    elif name == "model":
        assert keys == [["model"], ["model"]] and all(b["model"] == "x" for b in bodies)
    elif name == "temperature":
        # Codex's default model is a reasoning model (models.json): no temperature for it.
        assert all("temperature" not in b for b in bodies)
        assert all(any(o.key == "temperature" and "reasoning model" in o.reason for o in c.overrides)
                   for c in trace.calls)
    elif name == "exact":
        assert all("temperature" not in b and "top_p" not in b for b in bodies)
        assert all("effort" not in (b.get("reasoning") or {}) for b in bodies)


@pytest.mark.parametrize("transport", ["websocket", "sse"])
def test_codex_on_a_chat_upstream_in_vllm_mode(sim, tmp_path, transport):
    """Codex on an OpenAI-compatible server that serves Chat Completions only. Its
    Responses requests are translated, its freeform ``exec`` tool goes as a function of one
    string (vLLM serves no other) and its call comes back freeform; over its default
    transport the proxy serves the WebSocket itself and sends each frame as a POST.
    The branch is the upstream's token ids."""
    import json

    from harness import KEY_ENV, REAL_KEY, HOSTS, MitmProcess
    from test_trace_proxy import FakeVLLM, check_branch_tokens

    sim.strict = False  # vLLM's return_token_ids and logprobs are no OpenAI parameters
    upstreams = json.dumps({"vllm": {"base_url": sim.url("/v1"), "api_key_env": KEY_ENV, "dialect": "chat"}})
    vllm = sim.default = FakeVLLM([
        Reply(reasoning="Run it with exec.", tool_calls=[ToolCall(name="exec", arguments=json.dumps({"input": SCRIPT}))]),
        Reply(text=["The answer is ", FINAL])])
    session = {**SESSION, "collect_tokens": True}
    with MitmProcess(options={"intercept_upstreams": upstreams, "intercept_hosts": HOSTS},
                     env={KEY_ENV: REAL_KEY}) as proxy:
        result, sid = _run(proxy, sim, tmp_path, transport, "vllm", session)
        check_ran(result)
        trace = trace_of(proxy, sid)
    assert {(r.method, r.route, r.transport) for r in sim.requests} == {("POST", "chat", "http")}  # only Chat
    check_task_trace(trace, turns=2, tool="exec")
    assert all((c.dialect, c.upstream_dialect) == ("responses", "chat") for c in trace.calls)
    call = trace.branches[0].messages[-3].tool_calls[0]
    assert (call.type, call.arguments) == ("custom", SCRIPT)  # as Codex got it and restated it
    tools = {t["function"]["name"]: t for t in sim.model_requests()[0].json["tools"]}
    assert set(tools["exec"]["function"]["parameters"]["properties"]) == {"input"}
    check_branch_tokens(trace, vllm)


def test_codex_socket_on_a_chat_upstream_is_as_fast_as_on_a_responses_one(sim, tmp_path):
    """Codex over its WebSocket against a Chat-only upstream (no WebSocket, no
    Responses) is served by the proxy itself: no fallback delay (Codex retries a refused
    upgrade for ~6 s before it falls back to POST), so the task takes within 1 s of the same
    task against a Responses upstream with its own WebSocket, measured here in one run (each
    twice, interleaved, the faster of each compared: a loaded machine's noise is one-sided);
    the same trace shape; the branch is the upstream's token ids."""
    import json
    import time

    from harness import KEY_ENV, REAL_KEY, HOSTS, MitmProcess
    from test_trace_proxy import FakeVLLM, check_branch_tokens

    upstreams = json.dumps({"vllm": {"base_url": sim.url("/v1"), "api_key_env": KEY_ENV, "dialect": "chat"},
                            "native": {"base_url": sim.url("/v1"), "api_key_env": KEY_ENV}})
    runs: dict[str, list] = {"native": [], "vllm": []}
    with MitmProcess(options={"intercept_upstreams": upstreams, "intercept_hosts": HOSTS},
                     env={KEY_ENV: REAL_KEY}) as proxy:
        for name in ("native", "vllm") * 2:
            sim.clear()
            sim.clear_scripts()
            sim.default = None
            if name == "native":
                sim.strict = True
                _script_task(sim)
                session = SESSION
            else:
                sim.strict = False  # vLLM's return_token_ids and logprobs are no OpenAI parameters
                vllm = sim.default = FakeVLLM([
                    Reply(reasoning="Run it with exec.",
                          tool_calls=[ToolCall(name="exec", arguments=json.dumps({"input": SCRIPT}))]),
                    Reply(text=["The answer is ", FINAL])])
                session = {**SESSION, "collect_tokens": True}
            sid = f"codex-{name}-{uuid.uuid4().hex[:8]}"
            extra = ["--home", str(_home(tmp_path / "codex-home", "websocket"))]
            start = time.monotonic()
            result = run_harness(proxy, sim, _codex(), sid=sid, cwd=tmp_path / "codex-work", session=session,
                                 extra=extra, upstream=name)
            elapsed = time.monotonic() - start
            check_ran(result)
            trace = trace_of(proxy, sid)
            check_task_trace(trace, turns=2, tool="exec")
            if name == "native":
                assert {r.transport for r in sim.requests} == {"websocket"}  # its upstream's own socket
            else:
                assert {(r.method, r.route, r.transport) for r in sim.requests} == {("POST", "chat", "http")}
                check_branch_tokens(trace, vllm)
            runs[name].append((elapsed, trace))
        log = proxy.log()
    native, chat = (min(t for t, _ in runs[n]) for n in ("native", "vllm"))
    assert chat - native < 1.0, {n: [round(t, 2) for t, _ in r] for n, r in runs.items()}
    assert "the Responses WebSocket is served by the proxy" in log
    shapes = {name: [[(m.role, [c.name for c in m.tool_calls]) for m in t.branches[0].messages] for _, t in r]
              for name, r in runs.items()}
    assert shapes["native"][0] == shapes["vllm"][0] == shapes["vllm"][1]


# A provider profile whose stream gives up after 2 s without an event (Codex's per-provider
# stream_idle_timeout_ms, https://developers.openai.com/codex/config-reference), then
# reconnects and sends the same request again (stream_max_retries).
CUT_PROFILE = """model_provider = "cut"

[model_providers.cut]
name = "OpenAI, impatient"
base_url = "https://api.openai.com/v1"
env_key = "CODEX_API_KEY"
wire_api = "responses"
supports_websockets = {websockets}
stream_idle_timeout_ms = 2000
stream_max_retries = 3
"""


# Codex 0.171.0 does not resend the same bytes: client_metadata (a map) comes with its keys in
# a new order on every attempt, and over its WebSocket with a per-attempt timestamp
# (x-codex-ws-stream-request-start-ms). The Responses dialect names it a per-attempt key
# (Dialect.identity), so Retry and WsServe know the resend as the same request.


@pytest.mark.parametrize("transport", ["websocket", "sse"])
def test_codex_retry_after_a_real_cut_gets_the_recorded_answer(hproxy, sim, tmp_path, transport):
    """Codex gives up on a stream that goes quiet for its provider's stream_idle_timeout_ms,
    reconnects and sends the request again, unflagged. The simulator holds its first answer
    after two events until the proxy has seen Codex leave, so the cut is Codex's own; the
    answer the proxy read on is what the resend gets, not a second sample. Over the
    WebSocket the upstream here serves none (the proxy serves Codex's socket, addons/gateway/transport/wsserve.py,
    and sends each frame as a POST): an upstream's own socket is relayed by mitmproxy, which
    closes it when Codex's goes, so the record has an ``incomplete_stream`` error and no
    answer to give, and the resent frame is sampled again."""
    sim.websockets = False
    sid = f"codex-cut-{transport}-{uuid.uuid4().hex[:8]}"
    left = when_left(hproxy, sid)
    first, second = _task()
    sim.script(first.replace(pause_before=2, resume=left), second)
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    (home / ".codex" / "config.toml").write_text(CUT_PROFILE.format(websockets=str(transport == "websocket").lower()))
    result = run_harness(hproxy, sim, _codex(), sid=sid, cwd=tmp_path / "work", session=SESSION,
                         extra=["--home", str(home)])
    assert left.is_set(), "the proxy never saw Codex leave its first answer"
    check_ran(result)
    requests = [r for r in sim.model_requests() if r.route == "responses"]
    assert all(r.transport == "http" for r in requests)
    check_cut_retry(requests, trace_of(hproxy, sid), turns=2)

"""Start-up that tells the truth: a proxy that cannot do its job does not start, in one line;
one that starts answers its control API on whatever port it is bound to.

Each case is a real mitmdump with the entry script (``tests/mitm.py``)."""

from __future__ import annotations

import json
import time

import pytest

from clients import KEY_ENV, REAL_KEY, session_clients
from mitm import MitmProcess, free_port
from provider import Reply

from interceptor.trace import read_trace


def _refused(tmp_path, options: dict, env: dict | None = None) -> tuple[int, str, float]:
    """Start mitmdump expecting it to refuse: (exit status, what it printed, seconds)."""
    proc = MitmProcess(options=options, env=env, workdir=tmp_path)
    started = time.monotonic()
    proc.start(timeout=20, expect_failure=True)
    try:
        code = proc.wait(20)
        return code, proc.log(), time.monotonic() - started
    finally:
        proc.cleanup()


BAD = {
    "repeated scalar": ({"intercept_model": ["a", "b"]}, "intercept_model"),
    "bad JSON": ({"intercept_sampling": "{temperature: 1"}, "intercept_sampling"),
    "bad value": ({"intercept_sampling": '{"temprature": 1}'}, "temprature"),
    "bad choice": ({"intercept_fsync": "sometimes"}, "intercept_fsync"),
    "negative interval": ({"intercept_fsync_ms": "-1"}, "intercept_fsync_ms"),
    "bad trace writes": ({"intercept_trace_writes": "disk"}, "intercept_trace_writes"),
    "unknown option": ({"intercept_modle": "x"}, "intercept_modle"),
    "removed option": ({"intercept_admin_token": "x" * 30}, "INTERCEPT_ADMIN_TOKEN"),
    "unreadable sessions file": ({"intercept_sessions": "/nonexistent/sessions.json"}, "intercept_sessions"),
    "bad upstreams JSON": ({"intercept_upstreams": "{nope"}, "intercept_upstreams"),
    "unknown upstream field": ({"intercept_upstreams": '{"a": {"base_url": "http://x/v1", "key": "K"}}'},
                               "intercept_upstreams"),
    "undeclared default upstream name": ({"intercept_upstream": "nowhere"}, "intercept_upstream"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_option_stops_mitmdump_in_one_line_naming_it(tmp_path, case):
    options, named = BAD[case]
    code, out, took = _refused(tmp_path, options)
    assert code == 1, out
    # How fast is not asserted (tests assert behaviour, and this machine's load varies by 10x):
    # refused during the script's load, it exits in 1.5-2.5 s on an idle machine; a proxy that
    # ran instead would still be running when _refused's 20 s are up, and fail there.
    del took
    lines = [line for line in out.splitlines() if "interceptor: cannot start" in line]
    assert len(lines) == 1 and named in lines[0], out
    assert "Traceback" not in out and "listening" not in out and "ready" not in out, out


def test_an_unknown_field_in_the_sessions_file_and_a_short_token_stop_it_too(tmp_path):
    bad = tmp_path / "sessions.json"
    bad.write_text(json.dumps([{"id": "a", "upstream": {"base_url": "http://127.0.0.1:1/v1", "api_key_env": "PATH"}}]))
    code, out, _ = _refused(tmp_path / "a", {"intercept_sessions": str(bad)})
    assert code == 1 and "upstream.api_key_env" in out and "Traceback" not in out, out
    code, out, _ = _refused(tmp_path / "b", {}, env={"INTERCEPT_ADMIN_TOKEN": "short"})
    assert code == 1 and "INTERCEPT_ADMIN_TOKEN" in out and "Traceback" not in out, out


@pytest.mark.parametrize("listen", [["--listen-port", "0"], "mode"], ids=["listen-port-0", "no-listen-port"])
def test_the_control_api_answers_on_the_bound_port(sim, tmp_path, harness_env, listen):
    """``--listen-port 0``, and no ``--listen-port`` at all (the port then comes from the mode,
    as with mitmdump's default 8080; a free one here, so parallel tests do not collide): the
    control API, a session's env and a claimed SDK request all use the port actually bound."""
    if listen == "mode":
        listen = ["--mode", f"regular@{free_port()}"]
    proc = MitmProcess(options={"intercept_upstream": sim.url("/v1"), "intercept_api_key_env": KEY_ENV},
                       env={KEY_ENV: REAL_KEY}, listen=listen, workdir=tmp_path)
    with proc:
        assert proc.port and f"ready at http://127.0.0.1:{proc.port};" in proc.log()
        assert proc.api("GET", "health")[0] == 200
        session = proc.create_session(model="bound")
        assert session["env"]["HTTPS_PROXY"] == f"http://127.0.0.1:{proc.port}"
        env_file = (proc.confdir / "interceptor-harness" / "default.env").read_text()
        assert f"HTTPS_PROXY=http://127.0.0.1:{proc.port}\n" in env_file
        sim.script(Reply(text="through the bound port"))
        harness_env(session["env"])
        oai, _ = session_clients(session)
        r = oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].message.content == "through the bound port"
        assert sim.model_requests()[0].json["model"] == "bound"


def test_repeated_list_options_still_add_up(start_proxy):
    proc = start_proxy({"intercept_hosts": ["api.openai.com", "api.anthropic.com", "chatgpt.com", "example.org"]})
    assert proc.api("GET", "health")[0] == 200


def test_a_port_taken_before_mitmdump_binds_it_is_retried_on_another(monkeypatch):
    """tests/mitm.py: free_port's port can be taken by anything before mitmdump binds it (a
    whole-suite error once, with several suites on one machine): the start tries another."""
    import socket

    import mitm

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real = mitm.free_port
    monkeypatch.setattr(mitm, "free_port", lambda: ports.pop(0) if ports else real())
    proc = mitm.MitmProcess()
    try:
        proc.start(timeout=60)
        assert proc.port != taken.getsockname()[1]
        assert proc.api("GET", "health", token=None)[0] == 200
    finally:
        proc.cleanup()
        taken.close()


@pytest.mark.parametrize("writes", ["loop", "thread"])
def test_health_says_who_writes_the_trace_and_either_way_records_every_turn(start_proxy, sim, harness_env, writes):
    """``intercept_trace_writes``: the event loop writes each record of a healthy file
    (the default) or the writer thread writes them all; health says which, so a benchmark
    knows what it measured, and the trace is whole either way."""
    proc = start_proxy({"intercept_trace_writes": writes})
    status, body = proc.api("GET", "health")
    assert status == 200 and body["trace_writes"] == writes
    session = proc.create_session(model="written")
    harness_env(session["env"])
    oai, _ = session_clients(session)
    history = []
    for k in range(3):
        sim.script(Reply(text=f"answer {k}"))
        history.append({"role": "user", "content": f"question {k}"})
        r = oai.chat.completions.create(model="x", messages=history)
        history.append({"role": "assistant", "content": r.choices[0].message.content})
    assert proc.api("DELETE", f"sessions/{session['id']}")[0] == 200
    trace = read_trace(session["trace_path"])
    assert trace.num_turns == 3 and [trace.nodes[c.node].message.text() for c in trace.calls] == [
        f"answer {k}" for k in range(3)]
    assert proc.api("GET", "health")[1]["trace_writes"] == writes


def test_without_a_default_session_nothing_records_but_the_sessions_asked_for(start_proxy, sim, harness_env):
    """``intercept_default_session=false`` (what the Python API's proxies set): no default trace,
    no environment file, the banner says where sessions come from, and a session made through
    the control API records as ever."""
    proc = start_proxy({"intercept_default_session": "false"})
    assert "no default session (intercept_default_session=false)" in proc.log()
    assert not (proc.confdir / "interceptor-harness" / "default.env").exists()
    assert proc.api("GET", "sessions")[1]["sessions"] == []
    session = proc.create_session(id="asked")
    sim.script(Reply(text="recorded"))
    harness_env(session["env"])
    oai, _ = session_clients(session)
    oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
    proc.api("DELETE", "sessions/asked")
    assert sorted(p.name for p in proc.trace_dir.glob("*.msgpack")) == ["asked.msgpack"]
    assert read_trace(proc.trace_dir / "asked.msgpack").num_turns == 1

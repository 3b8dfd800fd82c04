"""Real harness CLIs through the multi-worker front: HAProxy in front of two real
mitmdump workers (scripts/serve.py), Claude Code and Codex CLI run at the same time, each as a
session the front's control API put on its own worker.

Nothing but the provider is a stand-in: the sessions are made through the front's one
address, each harness gets the environment its session's answer holds (the front in
``HTTPS_PROXY`` with the model secret as userinfo, which is all the front routes a CONNECT
by), Codex talks the Responses API over its WebSocket (a CONNECT the front routes, then TLS and
the upgrade inside the tunnel, which the front only splices), and the simulator is strict.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

from harness import (
    FINAL, PROMPT, TOOL_OUTPUT, check_ran, check_sim_saw_only_the_session, check_strict, check_task_trace,
    direct_env, node_harness, run_harness,
)
from interceptor.client import Proxy
from interceptor.client.proxy import call
from interceptor.trace import read_trace
from provider import ProviderSimulator, Reply, ToolCall
from test_harness_codex import SCRIPT as CODEX_EXEC
from test_workers import _verify
from test_workers import front, msim  # noqa: F401 (this module's own: a front with 2 workers, a strict simulator)

CLAUDE = {"model": "claude-front-model", "sampling": {"max_tokens": 4096}}
CODEX = {"model": "codex-front-model", "sampling": {"temperature": 0.3, "max_tokens": 2048}}
CLAUDE_WIRE = {"max_tokens": 4096}
CODEX_WIRE = {"temperature": 0.3, "max_output_tokens": 2048}


def _by_model(model: str):
    return lambda r: bool(r.json) and r.json.get("model") == model


def _script(sim: ProviderSimulator) -> None:
    """Each harness's task, keyed by the model its session imposes: the two run at once."""
    sim.clear_scripts()
    sim.clear()
    sim.script(
        Reply(reasoning="The user wants a command run.",
              tool_calls=[ToolCall(name="Bash", arguments={"command": f"echo {TOOL_OUTPUT}", "description": "Print"})]),
        Reply(text=["The answer is ", FINAL]),
        key=_by_model(CLAUDE["model"]))
    sim.script(
        Reply(reasoning="Run it with exec.", tool_calls=[ToolCall(name="exec", arguments=CODEX_EXEC, type="custom",
                                                                 id="call_codex_exec")]),
        Reply(text=["The answer is ", FINAL]),
        key=_by_model(CODEX["model"]))


def _start(command: list[str], session, home: Path, cwd: Path) -> subprocess.Popen:
    home.mkdir(parents=True)
    cwd.mkdir(parents=True)
    env = direct_env({"env": session.env}, session.secret, home)
    return subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_claude_code_and_codex_at_once_each_on_its_own_worker(front, msim, tmp_path):
    claude, codex = node_harness("claude"), node_harness("codex")
    _script(msim)
    proxy = Proxy.attach(front.url, front.admin_token)
    a = proxy.session(upstream="sim", agent={"command": "claude"}, **CLAUDE)
    b = proxy.session(upstream="sim", agent={"command": "codex"}, **CODEX)
    # two sessions in a row through the front's control API: one on each worker
    wa, wb = a.id.split("-")[0], b.id.split("-")[0]
    assert {wa, wb} == {"w1", "w2"}
    # what each harness must carry: the front's address with the model secret as userinfo
    for s in (a, b):
        url = urlsplit(s.env["HTTPS_PROXY"])
        assert (url.hostname, url.port, url.password) == ("127.0.0.1", front.port, s.secret)
        assert s.env["ANTHROPIC_API_KEY"] == s.env["CODEX_API_KEY"] == s.secret

    runs = {
        "claude": _start([claude, "-p", PROMPT, "--allowedTools", "Bash"], a, tmp_path / "claude-home",
                         tmp_path / "claude-work"),
        "codex": _start([codex, "exec", "--skip-git-repo-check", PROMPT], b, tmp_path / "codex-home",
                        tmp_path / "codex-work"),
    }
    results = {}
    try:
        for name, proc in runs.items():
            out, err = proc.communicate(timeout=180)
            results[name] = (proc.returncode, out, err)
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for name, (code, out, err) in results.items():
        assert code == 0 and FINAL in out, f"{name} exit {code}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"

    # every connection either harness opened reached the worker holding its secret: none was
    # refused (a harness that retries a 407 from the wrong worker could still finish its task)
    for w in front.workers:
        refused = [line for line in w.log_path.read_text(errors="replace").splitlines()
                   if "interceptor: refused" in line or "<< 407" in line]
        assert not refused, (w.tag, refused[:5])
    # each worker knows only its own session
    for s, tag, other in ((a, wa, b), (b, wb, a)):
        status, listed = call(front.url, front.admin_token, "GET", f"sessions?worker={tag}")
        ids = [x["id"] for x in listed["sessions"]]
        assert status == 200 and s.id in ids and other.id not in ids, listed
        assert all(i.startswith(f"{tag}-") for i in ids), ids  # (and the worker's default session)
        assert s.summary()["turns"] == 2

    a.close(reward=1.0)
    b.close(reward=0.0)
    # one folder, each file named by its worker (each worker also has its default session's)
    assert a.trace_path.parent == b.trace_path.parent == front.trace_dir
    names = [p.name for p in front.trace_dir.glob("*.msgpack")]
    assert {f"{a.id}.msgpack", f"{b.id}.msgpack"} <= set(names) and all(n[:3] in ("w1-", "w2-") for n in names)

    requests = msim.requests
    # Claude Code's over HTTPS, Codex's over its WebSocket (the upgrade, then its frames): Codex
    # kept the socket through the front, with no fallback to HTTPS after a failed upgrade
    claude_requests = [r for r in requests if r.transport == "http"]
    codex_requests = [r for r in requests if r.transport == "websocket"]
    assert len(claude_requests) + len(codex_requests) == len(requests)
    assert all(r.route == "messages" and r.stream for r in claude_requests)  # nothing else was forwarded
    assert [r.route for r in codex_requests if r.is_model_request or r.route == "responses_warmup"] == \
        ["responses_warmup", "responses", "responses"]
    check_strict(msim)
    for s, session, wire, tool, reqs, dialect in (
            (a, CLAUDE, CLAUDE_WIRE, "Bash", claude_requests, "anthropic"),
            (b, CODEX, CODEX_WIRE, "exec", codex_requests, "responses")):
        trace = read_trace(s.trace_path)
        assert trace.sealed
        check_task_trace(trace, turns=2, tool=tool)
        # the simulator saw the session's imposed model on every request of that harness
        check_sim_saw_only_the_session(reqs, trace, session, wire)
        # the worker's trace holds its own session's turns and nothing of the other's
        assert {c.dialect for c in trace.calls} == {dialect}
        assert {c.model for c in trace.calls} == {session["model"]}
        other = CODEX if s is a else CLAUDE
        assert other["model"].encode() not in s.trace_path.read_bytes()
        verified = _verify(s.trace_path)
        assert verified.returncode == 0, verified.stdout + verified.stderr


def test_run_harness_through_the_front(front, msim, tmp_path):
    """The manual's shortest way (docs/harnesses/index.md), ``run_harness.py --proxy <front>``: its session lands on a worker,
    the id it asked for tagged with that worker's name, and the task runs as on one proxy."""
    _script(msim)
    result = run_harness(front, None, [node_harness("claude"), "-p", PROMPT, "--allowedTools", "Bash"],
                         sid="rh-claude", cwd=tmp_path / "work", session=CLAUDE, upstream="sim")
    check_ran(result)
    summary = json.loads((tmp_path / "work" / "summary.json").read_text())
    tag, _, sid = summary["id"].partition("-")
    assert tag in ("w1", "w2") and sid == "rh-claude"
    trace = read_trace(front.trace_dir / f"{summary['id']}.msgpack")
    assert trace.sealed
    check_task_trace(trace, turns=2, tool="Bash")
    check_sim_saw_only_the_session(msim.requests, trace, CLAUDE, CLAUDE_WIRE)

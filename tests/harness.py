"""What the real-harness tests (tests/test_harness_*.py) share: where the harnesses are, one
proxy and one simulator per test module, a run through scripts/run_harness.py, and the
checks every harness's task must pass.

The harnesses are the acceptance test of the product, so nothing about them is faked: the
npm packages pinned in tests/harnesses (installed by `make test-deps`) and mini-swe-agent
from the `harness` extra. A harness that is not installed fails its tests with what to run; only
a machine without Node.js/npm skips the Node harnesses, and says so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from interceptor.trace import Trace, read_trace
from clients import KEY_ENV, REAL_KEY
from mitm import ROOT, MitmProcess
from provider import ProviderSimulator, RequestRecord
from waiting import wait_until

# The pinned harnesses; `make test-latest` points INTERCEPT_HARNESS_BIN at the @latest ones.
NODE_BIN = Path(os.environ.get("INTERCEPT_HARNESS_BIN") or ROOT / "tests" / "harnesses" / "node_modules" / ".bin")
RUN_HARNESS = ROOT / "scripts" / "run_harness.py"
# Codex asks chatgpt.com for its model list with the key it holds; intercepted, it is
# answered locally at once instead of failing slowly through retries (no network here).
HOSTS = ["api.openai.com", "api.anthropic.com", "chatgpt.com", "generativelanguage.googleapis.com"]

FINAL = "FINAL-ANSWER-42"
TOOL_OUTPUT = "hello-from-tool"
PROMPT = f"Run `echo {TOOL_OUTPUT}` and then tell me the answer."


def node_harness(name: str) -> str:
    """Path of an npm-installed harness CLI; skips only when Node.js/npm are absent."""
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{name} is an npm package and {' and '.join(missing)} is not installed here; "
                    "install Node.js >= 18 with npm, then `make test-deps`")
    exe = NODE_BIN / name
    if not exe.exists():
        pytest.fail(f"{exe} is missing: run `make test-deps` (npm ci in tests/harnesses)")
    return str(exe)


def mini_harness() -> str:
    exe = Path(sys.executable).with_name("mini")
    if not exe.exists():
        pytest.fail(f"{exe} is missing: mini-swe-agent comes with the harness extra (`make test-deps`)")
    return str(exe)


@pytest.fixture(scope="module")
def hsim() -> Iterator[ProviderSimulator]:
    """Strict: the harnesses' requests, as the proxy rewrites them, must be ones the real
    APIs accept (tests/provider/strict.py)."""
    with ProviderSimulator(strict=True) as s:
        yield s


@pytest.fixture(scope="module")
def hproxy(hsim: ProviderSimulator) -> Iterator[MitmProcess]:
    """One mitmdump per module (each run is its own session, so runs cannot mix); starting
    one per test would double the harness tests' time."""
    proc = MitmProcess(options={"intercept_upstream": hsim.url("/v1"), "intercept_api_key_env": KEY_ENV,
                                "intercept_hosts": HOSTS}, env={KEY_ENV: REAL_KEY})
    proc.start()
    yield proc
    proc.cleanup()


@pytest.fixture
def sim(hsim: ProviderSimulator) -> ProviderSimulator:
    """The module's simulator, emptied for this test (overrides conftest's per-test one)."""
    hsim.clear_scripts()
    hsim.clear()
    hsim.default = None
    hsim.websockets = True
    hsim.strict = True
    hsim.refuse.clear()
    return hsim


def run_harness(proxy: MitmProcess, sim: ProviderSimulator | None, command: list[str], *, sid: str, cwd: Path,
                session: dict, extra: list[str] = (), timeout: float = 120,
                upstream: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The harness run as a user runs it: scripts/run_harness.py against the module's proxy,
    its session's upstream the simulator (or the declared upstream named ``upstream``);
    ``env``: more variables for the harness (run_harness.py passes its own environment on)."""
    cwd.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, str(RUN_HARNESS), "--proxy", proxy.url, f"--admin-token={proxy.admin_token}",
            "--id", sid, "--upstream", upstream or sim.url("/v1"), "--cwd", str(cwd),
            "--timeout", str(int(timeout - 15)), "--summary-json", str(cwd / "summary.json")]
    if session.get("model"):
        args += ["--model", session["model"]]
    if session.get("sampling"):
        args += ["--sampling", json.dumps(session["sampling"])]
    rest = {k: v for k, v in session.items() if k not in ("model", "sampling")}
    if rest:
        args += ["--session", json.dumps(rest)]
    return subprocess.run([*args, *extra, "--", *command], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout, cwd=cwd,
                          env={**os.environ, **env} if env else None)


LEFT = "the client left before the answer's end"  # addons/gateway/transport/relay.py Drain._left, at the default verbosity


def when_left(proxy: MitmProcess, sid: str, timeout: float = 90) -> threading.Event:
    """Set once the proxy logs that session ``sid``'s harness left an answer before its end.
    A scripted answer held on it (``Reply(pause_before=..., resume=...)``, or a ``sim.default``
    that waits on it before its status line) goes on only after the harness's own timeout cut
    it for real: the order is the harness's, no sleep of the test decides it."""
    left = threading.Event()
    line = f"session {sid!r}: {LEFT}"

    def watch() -> None:
        try:
            wait_until(lambda: line in proxy.log(), timeout, line)
        except AssertionError:
            return  # never set: the test waiting on it fails on its own timeout
        left.set()

    threading.Thread(target=watch, name=f"when-left-{sid}", daemon=True).start()
    return left


def check_cut_retry(requests: list[RequestRecord], trace: Trace, *, turns: int) -> None:
    """The harness left its first answer before the end and sent the same request again: the
    upstream saw that request once, its call is on the record as undelivered, the retry got
    its answer from the record (a replay, or coalesced on it while the proxy read it on)
    and committed nothing, and the graph did not fork."""
    def asked(r: RequestRecord) -> dict:
        # What the model is asked: the JSON, without Codex's client_metadata (ids, and over its
        # WebSocket a per-attempt timestamp), whose keys come in a new order on every attempt.
        return {k: v for k, v in r.json.items() if k != "client_metadata"}

    assert [asked(r) == asked(requests[0]) for r in requests].count(True) == 1, "the upstream was asked again"
    cut, retry, *rest = trace.calls
    assert cut.node is not None and not cut.delivered and cut.status == 200, cut
    assert retry.replay_of == cut.id and retry.node is None and retry.delivered, retry
    assert all(c.replay_of is None and c.delivered and c.node is not None for c in rest), rest
    assert trace.num_turns == turns == len(rest) + 1 and len(trace.branches) == 1 and not trace.errors


def direct_env(session: dict, secret: str, home: Path) -> dict[str, str]:
    """A harness environment built by hand from a session's env, with ``secret`` as the key
    (for runs run_harness would not make, such as one with an unknown secret)."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update(session["env"])
    for name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "CODEX_API_KEY"):
        env[name] = secret
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    env.update(HOME=str(home), CODEX_HOME=str(home / ".codex"), CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
               MSWEA_CONFIGURED="true", LITELLM_LOCAL_MODEL_COST_MAP="True")
    return env


def trace_of(proxy: MitmProcess, sid: str) -> Trace:
    return read_trace(proxy.trace_dir / f"{sid}.msgpack")


def output_of(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def check_ran(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n" \
                                   f"--- stderr\n{result.stderr[-3000:]}"
    assert FINAL in result.stdout, result.stdout[-3000:]
    assert "run_harness:" in result.stderr and "(sealed)" in result.stderr  # the summary


SECRET_PREFIX = "sk-ic-"  # every session secret starts so (addons/gateway/sessions/session.py new_secret)


def check_sim_saw_only_the_session(requests: list[RequestRecord], trace: Trace, session: dict, wire: dict) -> None:
    """Only the session's model and settings, only the real key, never a session secret, and
    nothing that was not claimed: every request that reached the simulator went through
    Rewrite (only it adds the real key), and each is one call of the trace."""
    assert requests, "nothing reached the simulator"
    for r in requests:
        auth = r.headers.get("x-api-key") or r.headers.get("authorization", "").removeprefix("Bearer ")
        assert auth == REAL_KEY, (r.method, r.path, auth)
        assert SECRET_PREFIX not in r.body.decode(errors="replace") + str(r.headers.items_raw())
    models = [r for r in requests if r.route in ("messages", "chat", "responses", "responses_warmup")]
    assert models
    for r in models:
        assert r.json["model"] == session["model"], r.json.get("model")
        for key, value in wire.items():
            assert r.json.get(key) == value, (key, r.json.get(key))
    answered = [r for r in models if r.route != "responses_warmup"]
    assert len(answered) == len(trace.calls)


def check_task_trace(trace: Trace, *, turns: int, tool: str) -> None:
    """One branch; the tool call and its result as separate nodes; usage on every call."""
    assert len(trace.branches) == 1, [len(b.messages) for b in trace.branches]
    assert trace.num_turns == turns and len(trace.calls) == turns and not trace.errors
    messages = trace.branches[0].messages
    calls = [i for i, m in enumerate(messages) if m.role == "assistant" and m.tool_calls]
    assert calls, [m.role for m in messages]
    first = calls[0]
    assert messages[first].tool_calls[0].name == tool
    result = messages[first + 1]
    assert result.role == "tool" and result.tool_call_id == messages[first].tool_calls[0].id
    assert TOOL_OUTPUT in result.text()
    for call in trace.calls:
        assert call.usage is not None and call.usage.input_tokens > 0 and call.usage.output_tokens > 0
        assert call.status == 200 and call.error is None


def normalized(trace: Trace) -> list[dict]:
    """Messages as comparable across two runs: tool timings and reasoning blobs vary."""
    out = []
    for m in trace.branches[0].messages:
        d = m.model_dump(exclude={"reasoning"})
        out.append(json.loads(re.sub(r"Wall time [0-9.]+ seconds", "Wall time N seconds", json.dumps(d))))
    return out


def check_retried_529(trace: Trace) -> None:
    """The simulator answered the first request 529 and the harness retried it: the failed
    exchange is a call on the record with its error and no node, the retry is the turn."""
    assert [c.status for c in trace.calls] == [529, 200, 200]
    assert trace.calls[0].error is not None and trace.calls[0].node is None
    assert trace.num_turns == 2 and len(trace.branches) == 1


def check_unknown_secret_fails(proxy: MitmProcess, sim: ProviderSimulator, command: list[str], tmp_path: Path,
                               session: dict, **env: str) -> None:
    """The harness run by hand with a secret no session has: it fails showing the proxy's
    401 text, nothing reaches the simulator, and the (valid, unused) session records nothing."""
    created = proxy.create_session(**session)
    home = tmp_path / "home"
    home.mkdir()
    result = subprocess.run(command, env={**direct_env(created, "sk-ic-m-unknown-secret", home), **env},
                            cwd=tmp_path, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=90)
    assert result.returncode != 0 or FINAL not in result.stdout
    assert "unknown session secret" in output_of(result), output_of(result)[-2000:]
    assert sim.requests == []
    assert proxy.api("GET", f"sessions/{created['id']}")[1]["calls"] == 0



# The sessions every harness is run with against strict mode: nothing set (the
# harness's requests forwarded byte for byte), a model only, one sampling key laid over the
# harness's, Anthropic thinking on with a budget and off, and exact mode.
SESSIONS = {
    "empty": {},
    "model": {"model": "x"},
    "temperature": {"sampling": {"temperature": 0.5}},
    "thinking-budget": {"sampling": {"thinking": {"type": "enabled", "budget_tokens": 1024}}},
    "thinking-disabled": {"sampling": {"thinking": {"type": "disabled"}}},
    "exact": {"sampling_mode": "exact", "sampling": {"temperature": 0.5, "top_p": 0.9}},
}


def check_strict(sim: ProviderSimulator) -> None:
    """Nothing strict mode refused reached the harness, and every request the simulator saw
    passes every rule (checked again here, not only by the refusal log)."""
    from provider import strict

    assert not sim.refusals(), [(r.json.get("model"), r.refusal) for r in sim.refusals()]
    for r in sim.model_requests():
        assert strict.check(r.route, r.json, sim.refuse, frame=r.transport == "websocket") is None, r.json


def check_history_recognised(requests: list[RequestRecord], dialect, key: str) -> None:
    """A harness's own bytes, as the simulator saw them (a session whose overrides leave the
    message list alone forwards its text as sent): each request after the first is
    recognised up to where the previous one's list stops matching (the whole of it, or all
    but the element a cache_control marker moved off), and what is recognised parses as a
    full parse does (trace/prefix.py)."""
    from interceptor.addons.gateway.rewrite import prepare
    from interceptor.addons.gateway.sessions.session import SessionConfig
    from interceptor.trace.prefix import Prefixes

    prefixes = Prefixes()
    previous = None
    for r in requests:
        path = r.path.split("?")[0]
        fast = prepare(r.body, dialect, "model", SessionConfig(), path, prefixes=prefixes)
        full = prepare(r.body, dialect, "model", SessionConfig(), path)
        assert fast.refusal is None and fast.request == full.request and fast.listed.lead == 1
        if previous is not None:
            items = r.json[key]
            same = next((j for j, (a, b) in enumerate(zip(previous, items)) if a != b), min(len(previous), len(items)))
            assert same and fast.listed.known == same, (fast.listed.known, same, len(previous))
        prefixes.remember(fast.listed, fast.request.messages, list(range(len(fast.request.messages))))
        previous = r.json[key]

"""A harness re-run against a replay of its own trace, with no model at all.

Each harness runs a tool task live against the simulator, then again with the simulator
stopped against a session whose upstream is the first run's trace: the same exit status and
final output, the tool really run again (its output is in the replayed prompts), and a replay
trace that ``replay_trace.py diff`` finds equal to its source. The second run is a new
process with a fresh HOME, new session and request ids, a new billing header: matching
holds because it is on the canonical conversation, not the bytes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest

from clients import KEY_ENV, REAL_KEY
from harness import FINAL, HOSTS, PROMPT, TOOL_OUTPUT, check_ran, node_harness, output_of, run_harness
from interceptor.trace import Trace, read_trace
from interceptor.trace.match import Ignore
from mitm import ROOT, MitmProcess
from provider import ProviderSimulator

REPLAY_TRACE = ROOT / "scripts" / "replay_trace.py"
# Codex reports each command's run time in the tool output it sends back.
WALL_TIME = r"Wall time: [0-9.]+ seconds|Wall time [0-9.]+ seconds"


@pytest.fixture
def live_sim():
    with ProviderSimulator(strict=True) as s:
        yield s


def _proxy(**options) -> MitmProcess:
    return MitmProcess(options={"intercept_hosts": HOSTS, **options}, env={KEY_ENV: REAL_KEY}).start()


def _record(sim, command, script, tmp_path: Path, session: dict, extra=()) -> tuple[subprocess.CompletedProcess, Path]:
    """The live run; returns its result and a copy of its trace (the proxy's folder goes)."""
    live = _proxy(intercept_upstream=sim.url("/v1"), intercept_api_key_env=KEY_ENV)
    try:
        script(sim)
        sid = f"live-{uuid.uuid4().hex[:8]}"
        result = run_harness(live, sim, command, sid=sid, cwd=_fresh(tmp_path / "work"), session=session,
                             extra=list(extra))
        check_ran(result)
        source = tmp_path / "source.msgpack"
        shutil.copyfile(live.trace_dir / f"{sid}.msgpack", source)
    finally:
        live.cleanup()
    return result, source


def _fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def _replayer(source: Path, **declared) -> MitmProcess:
    return _proxy(intercept_upstreams=json.dumps({"yesterday": {"replay": str(source), **declared}}))


def _replay(proxy, command, tmp_path, session: dict, extra=()) -> tuple[subprocess.CompletedProcess, Trace]:
    sid = f"replay-{uuid.uuid4().hex[:8]}"
    result = run_harness(proxy, None, command, sid=sid, cwd=_fresh(tmp_path / "work"), session=session,
                         extra=list(extra), upstream="yesterday")
    return result, read_trace(proxy.trace_dir / f"{sid}.msgpack")


def _tool_calls(trace: Trace) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for m in trace.branches[0].messages if m.role == "assistant" for c in m.tool_calls]


def _diff(a: Path, b: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPLAY_TRACE), "diff", str(a), str(b)],
                          capture_output=True, text=True, timeout=60)


@contextmanager
def replayed(sim: ProviderSimulator, command: list[str], script, tmp_path: Path, session: dict, *,
             rules: list[str] = (), extra=lambda: ()):
    """The task live, then again with the simulator stopped against a replay of its trace,
    checked (``check_replayed``); yields (live result, source, replay result, replay trace,
    replay proxy) for the harness's own checks. ``extra()`` gives run_harness's extra
    arguments, called once per run."""
    live, source = _record(sim, command, script, tmp_path, session, extra())
    sim.stop()
    sim.clear()
    replayer = _replayer(source)
    try:
        again, trace = _replay(replayer, command, tmp_path, {**session, "replay": {"ignore": list(rules)}}, extra())
        check_replayed(live, source, again, trace, replayer.trace_dir / f"{trace.id}.msgpack", sim)
        yield live, source, again, trace, replayer
    finally:
        replayer.cleanup()


def check_replayed(live: subprocess.CompletedProcess, source: Path, again: subprocess.CompletedProcess,
                   trace: Trace, replay_path: Path, sim: ProviderSimulator, final: str = FINAL) -> None:
    check_ran(again)
    assert again.returncode == live.returncode
    assert final in live.stdout and final in again.stdout
    original = read_trace(source)
    assert trace.num_turns == original.num_turns and not trace.errors
    assert [c.replayed_from.call for c in trace.calls] == [c.id for c in original.calls]
    # The tool ran again: its output (made by this run) is in the replayed prompt.
    assert _tool_calls(trace) == _tool_calls(original) and _tool_calls(trace)
    results = [m for m in trace.branches[0].messages if m.role == "tool"]
    assert results and TOOL_OUTPUT in results[0].text()
    assert sim.requests == [], "the simulator was stopped: nothing may have tried it"
    found = _diff(source, replay_path)
    assert found.returncode == 0 and found.stdout.startswith("equal:"), found.stdout + found.stderr


# -- Claude Code -------------------------------------------------------------------------

CLAUDE_SESSION = {"model": "claude-session-model", "sampling": {"max_tokens": 4096}}
# Claude Code names its memory folder under HOME in its system prompt, and run_harness gives
# each run a fresh temporary HOME: the one rule this harness's replay needs.
TEMP_HOME = r"run-harness-[A-Za-z0-9_]+"


def _claude(prompt: str = PROMPT) -> list[str]:
    return [node_harness("claude"), "-p", prompt, "--allowedTools", "Bash"]


def test_claude_code_replays_its_trace_without_a_model(live_sim, tmp_path):
    from test_harness_claude import _script_task

    with replayed(live_sim, _claude(), _script_task, tmp_path, CLAUDE_SESSION, rules=[TEMP_HOME]) as run:
        live, source, again, _, replayer = run
        assert again.stdout == live.stdout  # claude -p prints the final answer only

        # The task edited: the first request misses, naming the turn and the message.
        session = {**CLAUDE_SESSION, "replay": {"ignore": [TEMP_HOME]}}
        edited, missed = _replay(replayer, _claude(PROMPT.replace("tell me", "tell us")), tmp_path, session)
        assert edited.returncode != 0 and FINAL not in edited.stdout
        text = output_of(edited)
        original = read_trace(source)
        assert "no recorded turn matches this request" in text, text[-3000:]
        assert f"call {original.calls[0].id}" in text and "(user) differs" in text and "tell us" in text
        assert missed.num_turns == 0 and missed.calls and all(c.error.type == "replay_miss" for c in missed.calls)


def test_claude_code_on_miss_upstream_continues_against_the_model(live_sim, tmp_path):
    from test_harness_claude import _script_task

    _, source = _record(live_sim, _claude(), _script_task, tmp_path, CLAUDE_SESSION)
    live_sim.clear()
    replayer = _replayer(source, on_miss="upstream", base_url=live_sim.url("/v1"), api_key_env=KEY_ENV)
    try:
        _script_task(live_sim)
        edited, trace = _replay(replayer, _claude(PROMPT.replace("tell me", "tell us")), tmp_path, CLAUDE_SESSION)
        check_ran(edited)
        assert len(live_sim.model_requests()) == 2  # every turn parted from the record: asked anew
        assert trace.num_turns == 2 and all(c.replayed_from is None for c in trace.calls)
        assert _diff(source, replayer.trace_dir / f"{trace.id}.msgpack").returncode == 1
    finally:
        replayer.cleanup()


# -- Codex, over its WebSocket and over SSE ----------------------------------------------

@pytest.mark.parametrize("transport", ["websocket", "sse"])
def test_codex_replays_its_trace_without_a_model(live_sim, tmp_path, transport):
    from test_harness_codex import SESSION, _codex, _home, _script_task

    def fresh_home():  # the same path each run, made anew: Codex writes it into its prompt
        return ["--home", str(_home(tmp_path / "codex-home", transport))]

    with replayed(live_sim, _codex(), _script_task, tmp_path, SESSION, rules=[WALL_TIME], extra=fresh_home) as run:
        trace, replayer = run[3], run[4]
        assert all(c.stream for c in trace.calls)
        log = replayer.log()
        if transport == "websocket":
            # The socket was the proxy's own: the warm-up and two turns asked on it, no POST.
            assert "<< 101 Switching Protocols" in log and "POST https://api.openai.com/v1/responses" not in log
            assert log.count("-> WebSocket text message ->") == 3
            assert "response.create frame not understood" not in log
        else:
            assert "POST https://api.openai.com/v1/responses" in log and "WebSocket" not in log


# -- Gemini CLI ----------------------------------------------------------------------------

# Gemini CLI's shell tool reports the process group it ran the command in.
PGID = r"Process Group PGID: \d+"
# Gemini CLI lists its built-in skills in the order its file search (node-glob, unsorted)
# returns them, which varies from run to run: in the system prompt's block, and as the
# activate_skill tool's enum of names (CI saw the two swapped between record and replay).
SKILLS = [r"<available_skills>[\s\S]*?</available_skills>", r"skill-creator|antigravity-support"]


def test_gemini_cli_replays_its_trace_without_a_model(live_sim, tmp_path):
    from test_harness_gemini import SESSION, _script_task

    # -m: a fixed model skips the CLI's routing call (a classifier it asks first on "auto").
    gemini = [node_harness("gemini"), "-p", PROMPT, "--yolo", "-m", "gemini-2.5-flash"]
    with replayed(live_sim, gemini, _script_task, tmp_path, SESSION, rules=[TEMP_HOME, PGID, *SKILLS]) as run:
        live, source, again, trace, replayer = run
        assert all(c.dialect == "gemini" and c.stream for c in trace.calls)
        assert again.stdout == live.stdout  # gemini -p prints the final answer only
        # Without the rule the second turn misses, in Gemini's own error shape, naming the PGID.
        edited, missed = _replay(replayer, gemini, tmp_path, {**SESSION, "replay": {"ignore": [TEMP_HOME, *SKILLS]}})
        assert edited.returncode != 0 and FINAL not in edited.stdout
        text = output_of(edited)
        assert '"status":"INVALID_ARGUMENT"' in text and "message 3 (tool) differs" in text, text[-3000:]
        assert "Process Group PGID" in text and f"call {read_trace(source).calls[1].id}" in text
        assert missed.num_turns == 1 and missed.calls[-1].error.type == "replay_miss"
    _skills_in_the_other_order_match(trace)


def _skills_in_the_other_order_match(trace: Trace) -> None:
    """What SKILLS is for, without waiting for the file search to swap them: the recorded
    system prompt and activate_skill tool with the two skills the other way round are the
    same request under the rules, and another one without them."""
    system = trace.branches[0].messages[0]
    assert system.role == "system" and isinstance(system.content, str)
    blocks = re.findall(r"  <skill>[\s\S]*?</skill>", system.content)
    assert len(blocks) == 2, blocks
    swapped = system.model_copy(update={"content": system.content.replace(blocks[0], "\0").replace(
        blocks[1], blocks[0]).replace("\0", blocks[1])})
    tools = trace.tool_sets[trace.calls[0].tool_set]
    skill = next(t for t in tools if t.name == "activate_skill")
    enum = next(p["enum"] for p in skill.parameters["properties"].values() if "enum" in p)
    assert sorted(enum) == ["antigravity-support", "skill-creator"]
    params = json.loads(json.dumps(skill.parameters).replace(json.dumps(enum), json.dumps(enum[::-1])))
    other = [t.model_copy(update={"parameters": params}) if t is skill else t for t in tools]
    rules, bare = Ignore.parse([TEMP_HOME, PGID, *SKILLS]), Ignore.parse([TEMP_HOME, PGID])
    assert rules.message(swapped, 0) == rules.message(system, 0) and rules.tools(other) == rules.tools(tools)
    assert bare.message(swapped, 0) != bare.message(system, 0) and bare.tools(other) != bare.tools(tools)


# -- mini-swe-agent ------------------------------------------------------------------------

def test_mini_swe_agent_replays_its_trace_without_a_model(live_sim, tmp_path):
    from test_harness_mini import SESSION, _mini, _script_task

    with replayed(live_sim, _mini(), _script_task, tmp_path, SESSION) as run:
        assert not any(c.stream for c in run[3].calls)

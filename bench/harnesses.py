"""Real harnesses, direct to the simulator vs through the proxy, side by side in one run.

    .venv/bin/python bench/harnesses.py [--repeats 5] [--harness claude --harness codex-ws ...]

Each harness runs the scripted task of tests/test_harness_*.py (a tool call, its result, a
final answer) `--repeats` times per path after one warm-up run:

- **direct**: the harness pointed at the simulator by its own base-URL setting
  (`ANTHROPIC_BASE_URL`; a Codex provider profile with `base_url`, WebSocket on or off;
  `OPENAI_BASE_URL` for mini-swe-agent's litellm), no proxy;
- **proxy**: as `scripts/run_harness.py` runs it (its environment-building code), a
  session per run on one mitmdump started up front, so proxy start-up is not counted.

Reported: median (min-max) wall time of the harness process; for the proxy path, per turn,
the time to first byte of a streamed turn as the proxy saw it (from the request reaching
the proxy to the upstream's first byte, read from the trace) and the request's own path
through the proxy (from reaching the proxy to reaching the simulator, both clocks this
machine's). Prints markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mitm import MitmProcess  # noqa: E402
from provider import ProviderSimulator, Reply, ToolCall  # noqa: E402

from interceptor.trace import read_trace  # noqa: E402

# run_harness's own environment-building code, loaded from its file (scripts/ is not a package).
_spec = importlib.util.spec_from_file_location("run_harness", ROOT / "scripts" / "run_harness.py")
run_harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_harness)
harness_env = run_harness.harness_env

KEY_ENV = "BENCH_PROVIDER_KEY"
KEY = "sk-bench-real-key"
FINAL = "FINAL-ANSWER-42"
PROMPT = "Run `echo hello-from-tool` and then tell me the answer."
NODE_BIN = ROOT / "tests" / "harnesses" / "node_modules" / ".bin"
CODEX_SCRIPT = 'const r = await tools.exec_command({cmd: "echo hello-from-tool"}); text(r.output ?? JSON.stringify(r));'


def codex_profile(base_url: str, websockets: bool) -> str:
    return (f'model_provider = "bench"\n\n[model_providers.bench]\nname = "bench"\nbase_url = "{base_url}"\n'
            f'env_key = "CODEX_API_KEY"\nwire_api = "responses"\nsupports_websockets = {str(websockets).lower()}\n')


def replies(name: str) -> list[Reply]:
    if name == "claude":
        call = ToolCall(name="Bash", arguments={"command": "echo hello-from-tool", "description": "Print"})
        return [Reply(reasoning="Run it.", tool_calls=[call]), Reply(text=["The answer is ", FINAL])]
    if name.startswith("codex"):
        call = ToolCall(name="exec", arguments=CODEX_SCRIPT, type="custom")
        return [Reply(reasoning="Run it.", tool_calls=[call]), Reply(text=["The answer is ", FINAL])]
    submit = f"echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && echo {FINAL}"
    return [Reply(text="Run it.", tool_calls=[ToolCall(name="bash", arguments={"command": "echo hello-from-tool"})]),
            Reply(text="Submit.", tool_calls=[ToolCall(name="bash", arguments={"command": submit})])]


def command(name: str) -> list[str]:
    if name == "claude":
        return [str(NODE_BIN / "claude"), "-p", PROMPT, "--allowedTools", "Bash"]
    if name.startswith("codex"):
        return [str(NODE_BIN / "codex"), "exec", "--skip-git-repo-check", PROMPT]
    return [str(Path(sys.executable).with_name("mini")), "-m", "openai/gpt-4o", "-t", PROMPT, "-y", "--exit-immediately"]


def fresh_home(workdir: Path) -> Path:
    home = workdir / "home"
    shutil.rmtree(home, ignore_errors=True)
    (home / ".codex").mkdir(parents=True)
    return home


def direct_env(name: str, sim: ProviderSimulator, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update(HOME=str(home), CODEX_HOME=str(home / ".codex"), CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
               MSWEA_CONFIGURED="true", LITELLM_LOCAL_MODEL_COST_MAP="True", ANTHROPIC_API_KEY=KEY,
               OPENAI_API_KEY=KEY, CODEX_API_KEY=KEY, ANTHROPIC_BASE_URL=sim.base_url,
               OPENAI_BASE_URL=sim.url("/v1"))
    if name.startswith("codex"):
        (home / ".codex" / "config.toml").write_text(codex_profile(sim.url("/v1"), name == "codex-ws"))
    return env


def proxy_env(name: str, proxy: MitmProcess, sim: ProviderSimulator, home: Path) -> tuple[dict[str, str], str]:
    session = proxy.create_session(id=f"bench-{name}-{uuid.uuid4().hex[:8]}",
                                   upstream={"base_url": sim.url("/v1")})
    args = SimpleNamespace(api_key_env=KEY_ENV, no_proxy_auth=False)
    env = harness_env(session, args, home, dict(os.environ))
    if name == "codex-sse":
        (home / ".codex" / "config.toml").write_text(codex_profile("https://api.openai.com/v1", False))
    return env, session["id"]


def run_once(name: str, path: str, sim: ProviderSimulator, proxy: MitmProcess,
             workdir: Path) -> tuple[float, list[float], list[float]]:
    """Wall time; per streamed turn the TTFB at the proxy; per turn the time from the
    request reaching the proxy to it reaching the simulator (the proxy's own request path)."""
    sim.clear()
    sim.clear_scripts()
    sim.script(*replies(name))
    home = fresh_home(workdir)
    sid = None
    if path == "direct":
        env = direct_env(name, sim, home)
    else:
        env, sid = proxy_env(name, proxy, sim, home)
    started = time.perf_counter()
    result = subprocess.run(command(name), env=env, cwd=workdir, capture_output=True, text=True,
                            stdin=subprocess.DEVNULL, timeout=180)
    elapsed = time.perf_counter() - started
    if result.returncode != 0 or FINAL not in result.stdout:
        raise RuntimeError(f"{name} {path} failed ({result.returncode}):\n{result.stdout[-1500:]}\n{result.stderr[-1500:]}")
    ttfb: list[float] = []
    forward: list[float] = []
    if sid is not None:
        proxy.api("DELETE", f"sessions/{sid}")
        trace = read_trace(proxy.trace_dir / f"{sid}.msgpack")
        ttfb = [(c.first_byte_at - c.started_at) * 1000 for c in trace.calls if c.stream and c.first_byte_at]
        arrived = [r.time for r in sim.requests if r.route in ("messages", "chat", "responses")]
        forward = [(t - c.started_at) * 1000 for t, c in zip(arrived, trace.calls)]
    return elapsed, ttfb, forward


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--harness", action="append", choices=["claude", "codex-ws", "codex-sse", "mini"])
    args = parser.parse_args()
    names = args.harness or ["claude", "codex-ws", "codex-sse", "mini"]
    rows = []
    with ProviderSimulator() as sim, tempfile.TemporaryDirectory(prefix="bench-harness-") as tmp:
        proxy = MitmProcess(options={"intercept_upstream": sim.url("/v1"), "intercept_api_key_env": KEY_ENV,
                                     "intercept_hosts": ["api.openai.com", "api.anthropic.com", "chatgpt.com"]},
                            env={KEY_ENV: KEY})
        proxy.start()
        try:
            for name in names:
                times: dict[str, list[float]] = {"direct": [], "proxy": []}
                ttfb_by_turn: dict[int, list[float]] = {}
                forward_by_turn: dict[int, list[float]] = {}
                for i in range(args.repeats + 1):  # run 0 warms caches up and is not counted
                    for path in ("direct", "proxy"):
                        elapsed, ttfb, forward = run_once(name, path, sim, proxy, Path(tmp))
                        if i:
                            times[path].append(elapsed)
                            for turn, ms in enumerate(ttfb):
                                ttfb_by_turn.setdefault(turn, []).append(ms)
                            for turn, ms in enumerate(forward):
                                forward_by_turn.setdefault(turn, []).append(ms)
                print(f"{name}: direct {spread(times['direct'])} s, proxy {spread(times['proxy'])} s", file=sys.stderr)
                per_turn = lambda d: ", ".join(f"{spread(v, '{:.1f}')}" for _, v in sorted(d.items()))  # noqa: E731
                rows.append((name, spread(times["direct"]), spread(times["proxy"]),
                             f"{statistics.median(times['proxy']) - statistics.median(times['direct']):+.2f}",
                             per_turn(ttfb_by_turn) or "(not streamed)", per_turn(forward_by_turn)))
        finally:
            proxy.cleanup()
    print(f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, {platform.system()} {platform.release()}; load average "
          f"{os.getloadavg()[0]:.1f}; {args.repeats} runs per path after one warm-up.\n")
    print("| harness | direct, s | through the proxy, s | difference of medians, s "
          "| TTFB at the proxy, turn 1, turn 2, ms | request path through the proxy, turn 1, turn 2, ms |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

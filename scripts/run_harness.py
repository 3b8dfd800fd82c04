#!/usr/bin/env python3
"""Run one agent harness through the proxy as one session, and say what happened.

    python scripts/run_harness.py [--model M] [--sampling JSON] \\
        [--upstream URL --api-key-env NAME] [--proxy URL] -- <harness command...>

    python scripts/run_harness.py --model gpt-5 -- codex exec --skip-git-repo-check "fix the test"
    python scripts/run_harness.py --upstream http://127.0.0.1:8000/v1 --model Qwen/Qwen3-8B \\
        --sampling '{"temperature": 0.7}' -- claude -p "..." --allowedTools Bash

Starts a proxy on a free port (or uses the one at ``--proxy``), registers a session through
the control API, runs the command with that session's environment (the proxy, the session
secret in every key variable the known harnesses read, the CA variables) and an isolated
HOME (a fresh temporary one unless ``--home DIR`` or ``--keep-home``), seals the session when
the command exits, prints a one-screen summary on stderr and exits with the command's status.

Why each piece:

- The secret also goes into the proxy URL (``http://session:<secret>@host:port``; off with
  ``--no-proxy-auth``), so the proxy knows a connection's session from its CONNECT, before
  any TLS: the only way to name a harness that rejects the CA, which otherwise hangs silently
  (the summary and a warning at once say so).
- The harness never holds a real key or a base URL: inherited ``*_BASE_URL`` variables,
  ``ANTHROPIC_AUTH_TOKEN`` and the ``--api-key-env`` variable are removed from its
  environment. An isolated HOME keeps its own settings, logins and caches out of the rollout.
- A tool server needs the task and state routes and the state secret, which the harness must
  never hold (the model could write its own score): ``--tool-server-env FILE`` writes them
  (mode 0600, removed when the run ends) for the server's own launch config to read.
- ``--tool-hooks`` gives Claude Code command hooks around every tool call
  (``python -m interceptor.scripts.tool_hook``) that ask the proxy's tool route (``POST
  /_interceptor/tool``: the session's request hooks); the proxy enforces the answer at the
  model boundary too.
- ``--isolate`` runs the harness in a network namespace of its own whose only way out is
  the proxy (``interceptor.client.isolate``): a program that ignores ``HTTPS_PROXY`` gets a
  connection error, and the session's egress policy holds for everything that leaves. It
  refuses to start, and says why, where the kernel cannot make the namespace.
- ``chatgpt.com`` is one of the proxy's default hosts: Codex's model-list request is answered
  locally (404), so nothing leaves and Codex does not wait on retries.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from interceptor.client import InterceptorError, isolate
from interceptor.dialects import default_hosts
from interceptor.client.proxy import (
    PROXY_VARIABLES, TOKEN_VARIABLE, call, free_port, mitmdump_bin, stop_process, with_userinfo)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "addons" / "interception.py"
# Would send the harness around the proxy, or hand it a credential of its own.
BYPASS_VARIABLES = ("OPENAI_BASE_URL", "OPENAI_API_BASE", "ANTHROPIC_BASE_URL", "ANTHROPIC_AUTH_TOKEN",
                    "CODEX_BASE_URL")
# Point outside an isolated HOME.
HOME_VARIABLES = ("CODEX_HOME", "CLAUDE_CONFIG_DIR", "MSWEA_GLOBAL_CONFIG_DIR", "XDG_CONFIG_HOME",
                  "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME")
# Harmless for every harness, needed by some; set unless the caller set them.
HARNESS_DEFAULTS = {
    # Claude Code: no telemetry, error reporting or update checks (they would leave
    # through the proxy untouched, or stall without a network).
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    # mini-swe-agent: skip its first-run set-up questions (an isolated HOME is a first run).
    "MSWEA_CONFIGURED": "true",
    # litellm (mini-swe-agent): use the bundled model price list instead of downloading it.
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    # mini-swe-agent: a model name litellm's price list does not know (any name the session
    # imposes, a vLLM model) is a cost-lookup error that ends the run; count it as free.
    "MSWEA_COST_TRACKING": "ignore_errors",
    # Gemini CLI: run in the rollout's folder without asking to trust it; no telemetry.
    "GEMINI_CLI_TRUST_WORKSPACE": "true",
    "GEMINI_TELEMETRY_ENABLED": "false",
}
# Where `make test-deps` installs the harness CLIs (claude, codex, gemini).
NODE_BIN = ROOT / "tests" / "harnesses" / "node_modules" / ".bin"
# What a harness run as another user (--user) inherits of this environment; nothing else.
USER_VARIABLES = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TERM", "TZ")
CA_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "CODEX_CA_CERTIFICATE")
DEFAULT_TIMEOUT = 3600.0


class Failure(Exception):
    """Something the user must fix before a harness can run; the message says what."""


# -- the proxy ------------------------------------------------------------------------------


# One definition each, interceptor.client's (the evaluator's API): the raw control-API call,
# a free port, the mitmdump to run, the proxy URL with a session's secret.
control_api = call


class Proxy:
    """Either a mitmdump this script started (and stops), or one already running."""

    def __init__(self, url: str, token: str, proc: subprocess.Popen | None = None,
                 log_path: Path | None = None) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.proc = proc
        self.log_path = log_path

    @classmethod
    def start(cls, workdir: Path, trace_dir: Path, hosts: list[str], options: list[str],
              timeout: float = 30.0) -> Proxy:
        port = free_port()
        token = secrets.token_urlsafe(32)
        confdir = workdir / "conf"
        confdir.mkdir(parents=True, exist_ok=True)
        cmd = [mitmdump_bin(), "--listen-host", "127.0.0.1", "--listen-port", str(port), "-s", str(SCRIPT),
               "--set", f"confdir={confdir}", "--set", f"intercept_trace_dir={trace_dir}",
               "--set", "termlog_verbosity=info",
               "--set", "intercept_default_session=false"]  # the run's own session is the only one
        for host in hosts:
            cmd += ["--set", f"intercept_hosts={host}"]
        for option in options:
            cmd += ["--set", option]
        log_path = workdir / "mitmdump.log"
        env = {k: v for k, v in os.environ.items() if k not in PROXY_VARIABLES}
        env[TOKEN_VARIABLE] = token  # never on its command line, which every user can read
        with open(log_path, "wb") as log:
            # Its own session: a ^C at the terminal is for the harness, not for the proxy that
            # must still seal the session and answer for the summary.
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, cwd=workdir, start_new_session=True)
        proxy = cls(f"http://127.0.0.1:{port}", token, proc, log_path)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise Failure(f"mitmdump exited with {proc.returncode} at start:\n{proxy.log_tail()}")
            if proxy.healthy():
                return proxy
            time.sleep(0.05)
        proxy.stop()
        raise Failure(f"mitmdump did not answer within {timeout:.0f}s:\n{proxy.log_tail()}")

    def healthy(self, timeout: float = 0.5) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/_interceptor/health", timeout=timeout) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def api(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        try:
            return control_api(self.url, self.token, method, path, body)
        except (InterceptorError, OSError) as e:
            raise Failure(f"the proxy at {self.url} does not answer: {e}") from e

    def stop(self) -> None:
        stop_process(self.proc)  # SIGTERM: it seals every open session on the way out

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None:
            return ""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def admin_token(args: argparse.Namespace) -> str:
    if args.admin_token:
        return args.admin_token
    if os.environ.get(TOKEN_VARIABLE):
        return os.environ[TOKEN_VARIABLE]
    path = Path(os.path.expanduser(args.confdir or "~/.mitmproxy")) / "interceptor-admin-token"
    try:
        return path.read_text().strip()
    except OSError as e:
        raise Failure(f"no admin token for {args.proxy}: pass --admin-token, set INTERCEPT_ADMIN_TOKEN, "
                      f"or --confdir of that proxy (could not read {path}: {e.strerror})") from e


# -- the session and the harness's environment ----------------------------------------------


def session_config(args: argparse.Namespace) -> dict[str, Any]:
    config: dict[str, Any] = {}
    if args.session:
        try:
            config = json.loads(args.session)
        except ValueError as e:
            raise Failure(f"--session is not JSON: {e}") from e
        if not isinstance(config, dict):
            raise Failure("--session must be a JSON object (a session config)")
    if args.id:
        config["id"] = args.id
    if args.model:
        config["model"] = args.model
    if args.sampling:
        try:
            config["sampling"] = json.loads(args.sampling)
        except ValueError as e:
            raise Failure(f"--sampling is not JSON: {e}") from e
    if args.upstream:
        # A URL this script declared to the proxy it started, or one the running proxy's
        # operator declared; a name of a declared upstream as it is.
        config["upstream"] = {"base_url": args.upstream} if "://" in args.upstream else args.upstream
    config.setdefault("agent", {}).setdefault("command", Path(args.command[0]).name)
    return config


def tool_server_env(proxy_url: str, session: dict[str, Any]) -> dict[str, str]:
    """What a tool server needs to reach the task and state routes (README "Task state")."""
    base = f"{proxy_url.rstrip('/')}/_interceptor"
    return {"INTERCEPT_TASK_URL": f"{base}/task", "INTERCEPT_STATE_URL": f"{base}/state",
            "INTERCEPT_STOP_URL": f"{base}/stop", "INTERCEPT_STATE_SECRET": session["state_secret"]}


def write_env_file(path: Path, env: dict[str, str]) -> None:
    """``NAME=value`` lines (a dotenv file, shell-quoted), readable by this user only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # an existing file keeps its mode through O_CREAT
        f.write("".join(f"{k}={shlex.quote(v)}\n" for k, v in env.items()))


TOOL_HOOK = [sys.executable, "-m", "interceptor.scripts.tool_hook"]
TOOL_HOOK_TIMEOUT = 600  # seconds Claude Code waits for it: the evaluator's hooks may be slow


def write_tool_hooks(home: Path) -> None:
    """Claude Code's PreToolUse/PostToolUse command hooks, pointing at the proxy's tool route
    (interceptor.scripts.tool_hook), merged into the harness HOME's ~/.claude/settings.json
    (the user's settings: Claude Code honours an output replacement from there)."""
    path = home / ".claude" / "settings.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        settings = json.loads(path.read_text()) if path.exists() else {}
    except ValueError as e:
        raise Failure(f"{path} is not JSON: {e}") from e
    if not isinstance(settings, dict) or not isinstance(settings.get("hooks", {}), dict):
        raise Failure(f"{path}: not a Claude Code settings object with a hooks object")
    command = " ".join(shlex.quote(part) for part in TOOL_HOOK)
    hooks = settings.setdefault("hooks", {})
    for event in ("PreToolUse", "PostToolUse"):
        hooks.setdefault(event, []).append(
            {"matcher": "*", "hooks": [{"type": "command", "command": command, "timeout": TOOL_HOOK_TIMEOUT}]})
    path.write_text(json.dumps(settings, indent=1))


def harness_env(session: dict[str, Any], args: argparse.Namespace, home: Path | None,
                base: dict[str, str]) -> dict[str, str]:
    drop = set(PROXY_VARIABLES) | set(BYPASS_VARIABLES)
    if home is not None:
        drop |= set(HOME_VARIABLES)
    key_env = (session.get("upstream") or {}).get("api_key_env") or args.api_key_env
    if key_env:
        drop.add(key_env)  # the real key stays with the proxy
    env = {k: v for k, v in base.items() if k not in drop}
    env.update(session["env"])
    if not args.no_proxy_auth:
        env["HTTPS_PROXY"] = env["https_proxy"] = with_userinfo(session["env"]["HTTPS_PROXY"], session["model_secret"])
    for k, v in HARNESS_DEFAULTS.items():
        env.setdefault(k, v)
    if home is not None:
        env["HOME"] = str(home)
        (home / ".codex").mkdir(parents=True, exist_ok=True)
        env["CODEX_HOME"] = str(home / ".codex")  # Codex refuses a CODEX_HOME that does not exist
    return env


# -- running ------------------------------------------------------------------------------------


def find_command(cmd: list[str]) -> list[str]:
    """The command, its program found on PATH or where `make test-deps` put the harness CLIs."""
    program = cmd[0]
    if "/" in program or shutil.which(program):
        return cmd
    local = NODE_BIN / program
    if local.exists():
        return [str(local), *cmd[1:]]
    raise Failure(f"{program}: not found on PATH, nor in {NODE_BIN.relative_to(ROOT)} (where `make test-deps` "
                  "installs claude, codex and gemini); give its path or install it")


def run(cmd: list[str], env: dict[str, str], cwd: str | None, proxy: Proxy, session_id: str,
        timeout: float | None, user: pwd.struct_passwd | None = None) -> tuple[int, str | None]:
    """The command's exit status (128 + signal if killed), and why it was stopped (``timeout``,
    ``interrupt``) if it was. Warns on stderr the moment the proxy sees the harness reject its CA.
    A ^C reaches the harness too (same process group); a second one terminates it."""
    as_user = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []} if user else {}
    try:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, **as_user)
    except OSError as e:
        raise Failure(f"cannot run {cmd[0]!r}: {e.strerror}") from e

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    started = time.monotonic()
    warned = False
    stopped: str | None = None
    progress = sys.stderr.isatty()  # a terminal gets a live line; a pipe or a file nothing extra
    try:
        while True:
            try:
                code = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            except KeyboardInterrupt:
                if stopped == "interrupt":  # a second ^C: do not wait for it any longer
                    proc.terminate()
                stopped = "interrupt"  # the harness got the same SIGINT; let it finish
                continue
            if not warned or progress:
                try:
                    status, summary = proxy.api("GET", f"sessions/{session_id}")
                except Failure:
                    status, summary = 0, None
                if progress and status == 200:
                    print("\r\033[K" + progress_line(summary, time.monotonic() - started), end="",
                          file=sys.stderr, flush=True)
                if not warned and status == 200 and (summary or {}).get("tls_rejections"):
                    warned = True
                    print(f"run_harness: the harness rejected the proxy's TLS certificate: it does not trust "
                          f"the CA (it may hang retrying). {TLS_ADVICE}", file=sys.stderr, flush=True)
            if timeout and time.monotonic() - started > timeout:
                stopped = "timeout"
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                code = proc.wait()
                break
    finally:
        signal.signal(signal.SIGTERM, previous)
        if progress:
            print("\r\033[K", end="", file=sys.stderr, flush=True)
    return (128 - code if code < 0 else code), stopped


def progress_line(summary: dict[str, Any], elapsed: float) -> str:
    """What a terminal sees while the harness runs: turns, tokens, the last call's outcome."""
    turns, calls, last = summary.get("turns", 0), summary.get("calls", 0), summary.get("last_call") or {}
    line = (f"run_harness: {elapsed:.0f}s · {turns} turn{'' if turns == 1 else 's'} · "
            f"{calls} call{'' if calls == 1 else 's'} · tokens {summary.get('input_tokens', 0):,} in, "
            f"{summary.get('output_tokens', 0):,} out")
    if last:
        line += f" · last call {last.get('status') or '-'} {last.get('error') or last.get('finish_reason') or ''}".rstrip()
    return line


TLS_ADVICE = ("The session's env points NODE_EXTRA_CA_CERTS, CODEX_CA_CERTIFICATE, SSL_CERT_FILE and "
              "REQUESTS_CA_BUNDLE at the CA bundle; a harness that reads none of them needs its own setting.")


def trace_details(path: str) -> dict[str, Any]:
    """Models and error lines from the sealed trace, when it is readable from here."""
    try:
        from interceptor.trace import read_trace
    except ImportError:
        return {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trace = read_trace(path)
    except Exception:  # a remote proxy's path, or a file still being written: counts suffice
        return {}
    errors = []
    for call in trace.calls:
        if call.error is not None:
            status = f"{call.status} " if call.status else ""
            errors.append(f"{status}{call.error.type}: {call.error.message}"[:160])
    return {"models": sorted({c.model for c in trace.calls if c.model}), "error_lines": errors,
            "branches": len(trace.branches)}


def summary_text(cmd: list[str], code: int, stopped: str | None, elapsed: float, summary: dict[str, Any],
                 details: dict[str, Any]) -> str:
    name = Path(cmd[0]).name
    head = f"run_harness: {name} exited with {code} after {elapsed:.1f}s"
    if stopped == "timeout":
        head += " (killed: --timeout)"
    elif stopped == "interrupt":
        head += " (interrupted)"
    lines = [head]
    sealed = "sealed" if summary.get("sealed") else "NOT sealed"
    lines.append(f"  session  {summary.get('id')} ({sealed})  trace {summary.get('trace_path')}")
    lines.append(f"  turns {summary.get('turns', 0)}  calls {summary.get('calls', 0)}  "
                 f"errors {summary.get('errors', 0)}  tokens in {summary.get('input_tokens', 0):,} "
                 f"out {summary.get('output_tokens', 0):,}"
                 + (f"  branches {details['branches']}" if "branches" in details else ""))
    if details.get("models"):
        lines.append(f"  models   {', '.join(details['models'])}")
    shown = details.get("error_lines", [])[:5]
    for line in shown:
        lines.append(f"  error    {line}")
    if len(details.get("error_lines", [])) > len(shown):
        lines.append(f"  ...      {len(details['error_lines']) - len(shown)} more errors in the trace")
    rejections = summary.get("tls_rejections", 0)
    if rejections:
        lines.append(f"  TLS      the harness rejected the proxy's certificate {rejections} time(s): it does not "
                     f"trust the CA. {TLS_ADVICE}")
    elif not summary.get("calls") and code != 0:
        lines.append("  note     no model request reached the proxy: check that the harness honours "
                     "HTTPS_PROXY and talks to a provider host the proxy intercepts")
    if summary.get("store_error"):
        lines.append(f"  STORE    {summary['store_error']}")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="run_harness.py", usage="%(prog)s [options] -- <harness command...>",
        description="Run one agent harness through the proxy as one session; see the module docstring.")
    parser.add_argument("--model", help="model imposed on every request")
    parser.add_argument("--sampling", help='sampling imposed on every request, a JSON object: {"temperature": 0.7}')
    parser.add_argument("--upstream", help="upstream base URL with its version prefix (http://127.0.0.1:8000/v1); "
                                           "unset: the provider the harness addressed")
    parser.add_argument("--api-key-env", help="name of the variable, in this environment, holding the real key")
    parser.add_argument("--session", help="more session config as JSON (task, agent, info, collect_tokens)")
    parser.add_argument("--id", help="session id (names the trace file)")
    parser.add_argument("--proxy", help="use the proxy at this URL instead of starting one")
    parser.add_argument("--admin-token", help="control API token of --proxy (else $INTERCEPT_ADMIN_TOKEN, "
                                              "else <confdir>/interceptor-admin-token)")
    parser.add_argument("--confdir", help="mitmproxy confdir of --proxy (default ~/.mitmproxy)")
    parser.add_argument("--trace-dir", default="traces", help="where a proxy this script starts writes traces")
    parser.add_argument("--host", action="append", default=[],
                        help="another provider host for a proxy this script starts (repeatable)")
    parser.add_argument("--set", dest="options", action="append", default=[], metavar="NAME=VALUE",
                        help="another mitmdump option for a proxy this script starts (repeatable)")
    parser.add_argument("--home", help="HOME for the harness (created if missing) instead of a fresh temporary one")
    parser.add_argument("--keep-home", action="store_true", help="run the harness with this HOME")
    parser.add_argument("--cwd", help="working directory of the harness")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help=f"stop the harness after this many seconds (exit 124; default {DEFAULT_TIMEOUT:.0f}, 0: never)")
    parser.add_argument("--user", help="run the harness as this Unix user (needs root): it can then read neither the "
                                       "proxy's token, nor its keys, nor its environment")
    parser.add_argument("--isolate", action="store_true",
                        help="run the harness in a network namespace whose only way out is the proxy (root, or "
                             "unprivileged user namespaces); refuse to start where it cannot be made")
    parser.add_argument("--no-proxy-auth", action="store_true",
                        help="keep the secret out of the proxy URL (then a CA rejection cannot be tied to the session)")
    parser.add_argument("--summary-json", help="also write the summary as JSON to this file")
    parser.add_argument("--tool-hooks", action="store_true",
                        help="Claude Code: PreToolUse/PostToolUse hooks that ask the proxy's tool route (the "
                             "session's request hooks) before and after each tool call")
    parser.add_argument("--tool-server-env", metavar="FILE",
                        help="write the task/state URLs and the state secret a tool server needs to FILE (mode 0600; "
                             "never in the harness's environment), removed when the run ends")
    if "--" in argv:
        cut = argv.index("--")
        args = parser.parse_args(argv[:cut])
        args.command = argv[cut + 1:]
    else:
        args = parser.parse_args(argv)
        args.command = []
    if not args.command:
        parser.error("give the harness command after --, e.g. -- claude -p 'hello'")
    if args.home and args.keep_home:
        parser.error("--home and --keep-home exclude each other")
    if args.tool_hooks and args.keep_home:
        parser.error("--tool-hooks writes the harness's settings into its own HOME; --keep-home would change yours")
    if args.user and args.keep_home:
        parser.error("--user runs the harness with a HOME of its own; --keep-home would share yours")
    if args.isolate and args.no_proxy_auth:
        parser.error("--isolate binds every connection to the session by the secret in the proxy URL; "
                     "--no-proxy-auth would leave it out")
    return args


def check_upstream(session: dict[str, Any], args: argparse.Namespace) -> None:
    """Before the harness starts: the upstream has its key and answers (one clear line if not),
    rather than a harness retrying a dead upstream silently for minutes."""
    up = session.get("upstream") or {}
    if up.get("api_key_env") and not up.get("key_set"):
        where = "this environment" if not args.proxy else "the proxy's environment"
        raise Failure(f"upstream {up.get('name')!r}: its key variable {up['api_key_env']} is not set in {where}")
    url = up.get("base_url")
    if not url:
        return  # the provider host the harness addresses
    # A connection, not a request: nothing reaches the upstream's logs or its rate limits.
    u = urlsplit(url)
    try:
        socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout=10).close()
    except OSError as e:
        raise Failure(f"upstream {up.get('name')!r} at {url} does not answer ({e.strerror or e}); "
                      "the harness was not started")


def user_home(user: pwd.struct_passwd, home: Path, env: dict[str, str]) -> dict[str, str]:
    """A harness run as ``user``: its own HOME (owned by it) and a copy of the CA bundle there
    (the proxy's folders need not be readable by it)."""
    clean = dict(env)
    bundle = env.get("SSL_CERT_FILE")
    if bundle and os.path.exists(bundle):
        copy = home / "interceptor-ca-bundle.pem"
        shutil.copyfile(bundle, copy)
        clean.update({k: str(copy) for k in CA_VARIABLES})
    clean.update(HOME=str(home), USER=user.pw_name, LOGNAME=user.pw_name)
    for path in (home, *home.rglob("*")):
        os.chown(path, user.pw_uid, user.pw_gid)
    home.chmod(0o700)
    return clean


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="run-harness-") as tmp:
        workdir = Path(tmp)
        proxy: Proxy | None = None
        session: dict[str, Any] | None = None
        code, stopped, started = 2, None, time.monotonic()
        try:
            user = None
            if args.user:
                if os.geteuid() != 0:
                    raise Failure("--user needs root (to run the harness as another user)")
                try:
                    user = pwd.getpwnam(args.user)
                except KeyError:
                    raise Failure(f"--user {args.user}: no such user") from None
            command = find_command(args.command)
            if args.isolate:
                try:
                    isolate.check()  # before a proxy or a session: never run unisolated
                except isolate.IsolationUnavailable as e:
                    raise Failure(f"--isolate: {e}") from None
            if args.proxy:
                if args.api_key_env:
                    raise Failure("--api-key-env is for a proxy this script starts; the running proxy's operator "
                                  "declared its upstreams and their keys: pick one with --upstream NAME or its base URL")
                proxy = Proxy(args.proxy, admin_token(args))
                if not proxy.healthy(timeout=10):
                    raise Failure(f"no proxy answers at {args.proxy}/_interceptor/health")
            else:
                if args.api_key_env and not os.environ.get(args.api_key_env):
                    raise Failure(f"--api-key-env {args.api_key_env}: the variable is not set here, so the "
                                  "upstream would get no key")
                hosts = [*default_hosts(), *args.host]
                options = list(args.options)
                if args.upstream and "://" in args.upstream:
                    options.append(f"intercept_upstream={args.upstream}")  # declares the upstream 'default'
                if args.api_key_env:
                    options.append(f"intercept_api_key_env={args.api_key_env}")
                proxy = Proxy.start(workdir / "proxy", Path(args.trace_dir).resolve(), hosts, options)
            status, created = proxy.api("POST", "sessions", session_config(args))
            if status != 201:
                message = ((created.get("error") or {}).get("message") if isinstance(created, dict) else created) or created
                raise Failure(f"the proxy refused the session ({status}): {message}")
            session = created
            try:
                check_upstream(session, args)
            except Failure:
                proxy.api("DELETE", f"sessions/{session['id']}", {"stop_condition": "harness_not_started"})
                session = None
                raise
            if args.tool_server_env:
                write_env_file(Path(args.tool_server_env), tool_server_env(proxy.url, session))
            home = None
            if user is not None:
                home = Path(args.home).resolve() if args.home else Path(tempfile.mkdtemp(prefix="run-harness-home-"))
                home.mkdir(parents=True, exist_ok=True)
            elif not args.keep_home:
                home = Path(args.home).resolve() if args.home else workdir / "home"
                home.mkdir(parents=True, exist_ok=True)
            if args.tool_hooks:
                write_tool_hooks(home)
            # Run as another user, the harness inherits only a few variables of this environment
            # (which may hold keys of its own); else all but the ones that would bypass the proxy.
            base = dict(os.environ) if user is None else {k: v for k, v in os.environ.items() if k in USER_VARIABLES}
            env = harness_env(session, args, home, base)
            cwd = args.cwd
            if user is not None:
                env = user_home(user, home, env)
                cwd = cwd or str(home)
            if args.isolate:  # the harness drops to --user inside, after the namespace is made
                command = isolate.command(command, proxy.url, user=(user.pw_uid, user.pw_gid) if user else None)
            started = time.monotonic()
            code, stopped = run(command, env, cwd, proxy, session["id"], args.timeout,
                                None if args.isolate else user)
            if stopped == "timeout":
                code = 124
            if user is not None and not args.home:
                shutil.rmtree(home, ignore_errors=True)
            return code
        except KeyboardInterrupt:
            stopped, code = "interrupt", 130
            return code
        except (Failure, InterceptorError) as e:  # the client's: no mitmdump, no answer
            print(f"run_harness: {e}", file=sys.stderr)
            return 2
        finally:
            try:
                if session is not None and proxy is not None:
                    finish(args, proxy, session, code, stopped, time.monotonic() - started)
            finally:
                if args.tool_server_env and session is not None:
                    Path(args.tool_server_env).unlink(missing_ok=True)  # its secret opens nothing now
                if proxy is not None:
                    proxy.stop()


def finish(args: argparse.Namespace, proxy: Proxy, session: dict[str, Any], code: int, stopped: str | None,
           elapsed: float) -> None:
    """Seal the session and print the summary: always, an interrupt or a dead proxy included."""
    try:
        status, summary = proxy.api("DELETE", f"sessions/{session['id']}")
    except Failure as e:
        print(f"run_harness: {e}", file=sys.stderr)
        status, summary = 0, None
    if status != 200:
        summary = {"id": session["id"], "trace_path": session["trace_path"]}
    text = summary_text(args.command, code, stopped, elapsed, summary, trace_details(session["trace_path"]))
    print(text, file=sys.stderr, flush=True)
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps({**summary, "exit_status": code, "elapsed": elapsed,
                                                       "timed_out": stopped == "timeout",
                                                       "interrupted": stopped == "interrupt"}))


if __name__ == "__main__":
    sys.exit(main())

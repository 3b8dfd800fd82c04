"""The synchronous client: a proxy started or attached to, and its sessions.

    with Proxy(upstreams={"vllm": {"base_url": "http://127.0.0.1:8000/v1", "api_key_env": "VLLM_KEY"}}) as proxy:
        session = proxy.session(model="Qwen/Qwen3-8B", sampling={"temperature": 0.7}, upstream="vllm")
        subprocess.run(["claude", "-p", "..."], env={**os.environ, **session.env})
        summary = session.close(reward=1.0)
        trace = session.trace()

A started proxy is a real ``mitmdump -s addons/interception.py`` on a free loopback port
with its own confdir (CA, admin token) and trace folder; leaving the ``with`` block, by
return or by exception, stops it by its PID (SIGTERM seals every open session; SIGKILL after
15 s). ``Proxy.attach(url, admin_token)`` talks to one that is already running.

Session configs are validated here with the proxy's own ``SessionConfig`` before anything is
sent, so a typo fails in the evaluator's process with the message the proxy would give; fields
this version's model does not know (``hooks``, ``limits`` while the proxy lacks them) are
passed through for the proxy to accept or refuse, and a refusal raises ``BadRequest`` with
its message.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import BaseModel, ValidationError

import interceptor.addons
from interceptor.addons.gateway.sessions.session import SealConfig, SessionConfig
from interceptor.addons.mitm.settings import format_validation_error
from interceptor.client import isolate
from interceptor.client.errors import BadRequest, ProxyUnavailable, error_for
from interceptor.trace import Trace, read_trace

SCRIPT = Path(interceptor.addons.__file__).resolve().parent / "interception.py"
# An ambient proxy would route the control API (and mitmdump's own upstream traffic) elsewhere.
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy",
                   "NO_PROXY", "no_proxy")
TOKEN_FILE = "interceptor-admin-token"  # as addons/mitm/settings.py writes it
TOKEN_VARIABLE = "INTERCEPT_ADMIN_TOKEN"  # as addons/mitm/settings.py reads it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mitmdump_bin() -> str:
    """The mitmdump beside this Python (a venv), else the one on PATH."""
    exe = Path(sys.executable).with_name("mitmdump")
    found = str(exe) if exe.exists() else shutil.which("mitmdump")
    if not found:
        raise ProxyUnavailable("mitmdump not found: run with the project's Python (.venv/bin/python) "
                               "or put mitmproxy on PATH")
    return found


def call(url: str, token: str | None, method: str, path: str, body: Any = None,
         timeout: float = 15) -> tuple[int, Any]:
    """One raw call of the control API: (status, JSON answer, or the text of a non-JSON one).
    Raises ``ProxyUnavailable`` when nothing answers at ``url``."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"{url.rstrip('/')}/_interceptor/{path.lstrip('/')}", data=data, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (urllib.error.URLError, OSError) as e:
        raise ProxyUnavailable(f"the proxy at {url} does not answer: {getattr(e, 'reason', e)}") from e
    try:
        return status, json.loads(raw or b"null")
    except ValueError:
        return status, raw.decode(errors="replace")[:500]


def stop_process(proc: subprocess.Popen | None, sig: int = signal.SIGTERM) -> None:
    """Stop a process this program started, by its PID: ``sig`` (SIGTERM: a mitmdump seals every
    open session on the way out), then SIGKILL if it is still there after 15 s."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def with_userinfo(proxy_url: str, secret: str) -> str:
    """``http://session:<secret>@host:port``: the proxy knows the session of a connection from
    its CONNECT, before any TLS, so even a harness that rejects the CA is tied to its session."""
    u = urlsplit(proxy_url)
    netloc = f"session:{quote(secret, safe='')}@{u.hostname}" + (f":{u.port}" if u.port else "")
    return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))


def _plain(value: Any) -> Any:
    return value.model_dump(mode="json", exclude_unset=True) if isinstance(value, BaseModel) else value


class Proxy:
    """A proxy this process starts (``Proxy(...)`` then ``with``/``start()``) or one it attaches
    to (``Proxy.attach``). See the module docstring.

    ``upstreams``: name -> ``{"base_url", "api_key_env", "dialect"}`` (the proxy's
    ``intercept_upstreams``), the operator's upstreams that sessions pick by name. ``env``:
    more environment for mitmdump (the real keys live there, never in a session). ``hosts``: the provider hosts to intercept (the proxy's default when
    unset). ``options``: more mitmdump options, ``{"intercept_fsync": "seal"}``; a list value
    repeats the option. ``trace_dir``: where traces go (a fresh temporary folder, kept, when
    unset). ``workdir``: confdir and log (a temporary folder, removed at stop, when unset).
    """

    def __init__(self, *, upstreams: dict[str, dict[str, Any]] | None = None, env: dict[str, str] | None = None,
                 hosts: list[str] | None = None, options: dict[str, Any] | None = None,
                 trace_dir: str | os.PathLike | None = None, workdir: str | os.PathLike | None = None,
                 start_timeout: float = 30.0) -> None:
        self.upstreams = dict(upstreams or {})
        self.env = dict(env or {})
        self.hosts = list(hosts) if hosts is not None else None
        self.options = dict(options or {})
        self.trace_dir = Path(trace_dir).resolve() if trace_dir is not None else None
        self.workdir = Path(workdir).resolve() if workdir is not None else None
        self.start_timeout = start_timeout
        self.url: str | None = None
        self.admin_token: str | None = None
        self.proc: subprocess.Popen | None = None
        self._own_workdir = False

    @classmethod
    def attach(cls, url: str, admin_token: str | None = None, *,
               confdir: str | os.PathLike | None = None) -> Proxy:
        """A running proxy. The token: ``admin_token``, else ``$INTERCEPT_ADMIN_TOKEN``, else
        the file the proxy wrote in ``confdir`` (default ``~/.mitmproxy``)."""
        proxy = cls()
        proxy.url = url.rstrip("/")
        proxy.admin_token = admin_token or os.environ.get(TOKEN_VARIABLE) or _token_from(confdir)
        proxy.health()  # fail now, not at the first session
        return proxy

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> Proxy:
        if self.url is not None:
            return self
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="interceptor-proxy-"))
            self._own_workdir = True
        if self.trace_dir is None:
            self.trace_dir = Path(tempfile.mkdtemp(prefix="interceptor-traces-"))
        confdir = self.workdir / "conf"
        confdir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        token = "ic-admin-" + secrets.token_urlsafe(32)
        # No default session: every rollout opens its own, and none records beside them.
        opts: dict[str, Any] = {"confdir": confdir, "intercept_trace_dir": self.trace_dir,
                                "intercept_default_session": False, "termlog_verbosity": "info"}
        if self.hosts is not None:
            opts["intercept_hosts"] = self.hosts
        if self.upstreams:
            opts["intercept_upstreams"] = json.dumps(self.upstreams)
        opts.update(self.options)
        cmd = [mitmdump_bin(), "--listen-host", "127.0.0.1", "--listen-port", str(port), "-s", str(SCRIPT)]
        for name, value in opts.items():
            for item in value if isinstance(value, (list, tuple)) else [value]:
                cmd += ["--set", f"{name}={str(item).lower() if isinstance(item, bool) else item}"]
        env = {k: v for k, v in os.environ.items() if k not in PROXY_VARIABLES}
        env.update(self.env)
        env[TOKEN_VARIABLE] = token  # never on its command line, which every user can read
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=self.workdir)
        atexit.register(self.stop)  # an evaluator that dies without leaving `with` leaves no proxy
        self.url, self.admin_token = f"http://127.0.0.1:{port}", token
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ProxyUnavailable(f"mitmdump exited with {self.proc.returncode} at start:\n{self.log_tail()}")
            try:
                self.health(timeout=0.5)
                return
            except ProxyUnavailable:
                time.sleep(0.05)
        raise ProxyUnavailable(f"mitmdump did not answer within {self.start_timeout:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        """Stop a proxy this object started (by PID: SIGTERM, which seals every open session,
        then SIGKILL after 15 s). An attached proxy is left running."""
        atexit.unregister(self.stop)
        stop_process(self.proc)
        if self._own_workdir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)  # its confdir holds the CA's private key
            self._own_workdir = False

    def __enter__(self) -> Proxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def log_path(self) -> Path:
        assert self.workdir is not None, "the proxy was not started by this process"
        return self.workdir / "mitmdump.log"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except (OSError, AssertionError):
            return ""

    # -- the control API --------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, timeout: float = 40) -> Any:
        """One control-API call; an error answer raises its typed ``ControlError``."""
        if self.url is None:
            raise ProxyUnavailable("the proxy is not started: use `with Proxy(...)` or .start()")
        status, answer = call(self.url, self.admin_token, method, path, body, timeout=timeout)
        if status >= 400:
            raise error_for(status, answer)
        return answer

    def health(self, timeout: float = 5) -> dict[str, Any]:
        return self.request("GET", "health", timeout=timeout)

    def sessions(self) -> list[dict[str, Any]]:
        """The summaries of the proxy's sessions."""
        return self.request("GET", "sessions")["sessions"]

    def session(self, *, model: str | None = None, sampling: Any = None, upstream: Any = None,
                hooks: Any = None, limits: Any = None, task: dict[str, Any] | None = None,
                agent: dict[str, Any] | None = None, **more: Any) -> Session:
        """A new session (one rollout). Arguments left ``None`` are not sent (the proxy's
        defaults apply); ``more`` takes the config's other fields (``id``, ``info``,
        ``collect_tokens``). ``upstream`` names a declared upstream (``"vllm"``, or
        ``{"base_url": ...}`` equal to a declared one's); the proxy resolves it."""
        config = {k: _plain(v) for k, v in dict(model=model, sampling=sampling, upstream=upstream, hooks=hooks,
                                                   limits=limits, task=task, agent=agent, **more).items()
                  if v is not None}
        validate_session_config(config)
        answer = self.request("POST", "sessions", config)
        return Session(self, answer, config)

    def claim(self, session_id: str) -> Session:
        """A session the proxy made itself (a sessions file, the default session): its
        secrets and environment, handed out by ``GET sessions/<id>/env``."""
        return Session(self, self.request("GET", f"sessions/{quote(session_id, safe='')}/env"), {})

    # -- an upstream's weights: versions and pauses (docs/async-rl.md) ------------------------

    def upstream(self, name: str) -> dict[str, Any]:
        """A declared upstream as the proxy sees it: its weights ``version``, whether it is
        ``paused``, and how many requests are ``held`` and ``in_flight``."""
        return self.request("GET", f"upstreams/{quote(name, safe='')}")

    def set_version(self, upstream: str, version: int | str) -> dict[str, Any]:
        """Declare the weights version ``upstream`` serves from now on: every call sent after
        it is stamped with it, and every live session of it gets a ``version`` record."""
        return self.request("PUT", f"upstreams/{quote(upstream, safe='')}/version", {"version": version})

    def pause(self, upstream: str, timeout: float = 60) -> dict[str, Any]:
        """Hold new requests to ``upstream``; answers once the requests already sent finished
        (``drained``) or after ``timeout`` seconds (``running`` lists those still running)."""
        return self.request("POST", f"upstreams/{quote(upstream, safe='')}/pause", {"timeout": timeout},
                            timeout=timeout + 15)

    def resume(self, upstream: str) -> dict[str, Any]:
        """Release the requests held for ``upstream``, in arrival order (``released``: how many)."""
        return self.request("POST", f"upstreams/{quote(upstream, safe='')}/resume")

    @contextlib.contextmanager
    def paused(self, upstream: str, *, timeout: float = 60, version: int | str | None = None) -> Iterator[dict[str, Any]]:
        """``with proxy.paused("vllm", version=8) as drain: swap()``: the upstream paused and
        drained for the block (``drain`` is the pause's answer: check ``drain["drained"]``),
        resumed when it ends, however it ends. ``version``: declared when the block ends
        without an exception, before the held requests go, so they are stamped with it."""
        answer = self.pause(upstream, timeout)
        try:
            yield answer
            if version is not None:
                self.set_version(upstream, version)
        finally:
            self.resume(upstream)


def validate_session_config(config: dict[str, Any]) -> None:
    """Check the fields the proxy's ``SessionConfig`` knows, as the proxy will; raise
    ``BadRequest`` with the message the proxy would answer."""
    known = {k: v for k, v in config.items() if k in SessionConfig.model_fields}
    try:
        SessionConfig.model_validate(known)
    except ValidationError as e:
        raise BadRequest(400, f"bad session config: {format_validation_error(e)}") from None


def _token_from(confdir: str | os.PathLike | None) -> str:
    path = Path(os.path.expanduser(confdir or "~/.mitmproxy")) / TOKEN_FILE
    try:
        return path.read_text().strip()
    except OSError as e:
        raise ProxyUnavailable(f"no admin token: pass admin_token, set INTERCEPT_ADMIN_TOKEN, or the proxy's "
                               f"confdir (could not read {path}: {e.strerror})") from e


class Session:
    """One rollout on a proxy: what a harness needs (``env``), and its end (``close``).

    ``env`` holds only the session's variables (the proxy URL with the secret in it, the
    secret in every key variable the known harnesses read, the CA bundle variables): give a
    subprocess ``{**os.environ, **session.env}``, a sandbox just ``session.env``. An SDK in
    this process takes ``secret``, ``proxy_url`` and ``ssl_context()`` instead, since one
    process can hold many sessions but only one ``os.environ``.
    """

    def __init__(self, proxy: Proxy, answer: dict[str, Any], config: dict[str, Any]) -> None:
        self.proxy = proxy
        self.config = config
        self.id: str = answer["id"]
        self.secret: str = answer["model_secret"]
        self.state_secret: str = answer["state_secret"]
        self.trace_path = Path(answer["trace_path"])
        env = dict(answer["env"])
        self.proxy_url = with_userinfo(env["HTTPS_PROXY"], self.secret)
        env["HTTPS_PROXY"] = env["https_proxy"] = self.proxy_url
        self.env: dict[str, str] = env
        self.ca_bundle: str | None = env.get("SSL_CERT_FILE")
        self.result: dict[str, Any] | None = None  # the footer's summary, once closed

    def __repr__(self) -> str:  # never the secrets
        return f"<Session {self.id} on {self.proxy.url}{' closed' if self.closed else ''}>"

    @property
    def closed(self) -> bool:
        return self.result is not None

    def ssl_context(self) -> ssl.SSLContext:
        """Trusts the proxy's CA (and the system roots it was bundled with)."""
        return ssl.create_default_context(cafile=self.ca_bundle)

    def isolated(self, cmd: list[str], *, user: tuple[int, int] | None = None) -> list[str]:
        """``cmd`` wrapped to run in a network namespace whose only way out is this proxy
        (``interceptor.client.isolate``); run it as ``cmd``, with ``{**os.environ, **env}``.
        ``user``: (uid, gid) to run it as, when this process is root. Raises
        ``isolate.IsolationUnavailable`` with the kernel's reason where the namespace cannot
        be made, so nothing runs unisolated."""
        isolate.check()
        return isolate.command(cmd, self.proxy.url, user=user)

    def summary(self) -> dict[str, Any]:
        """The proxy's live summary: turns, calls, errors, tokens, sealed."""
        return self.proxy.request("GET", f"sessions/{quote(self.id, safe='')}")

    def state(self) -> dict[str, Any]:
        """The task state the rollout's tool servers keep (README "Tool servers: task and
        state"), read with the admin token: what a grader scores before ``close``."""
        return self.proxy.request("GET", f"sessions/{quote(self.id, safe='')}/state")

    def update_state(self, patch: dict[str, Any]) -> int:
        """Merge ``patch`` into the task state (RFC 7396: null removes a key); the new version."""
        return self.proxy.request("PATCH", f"sessions/{quote(self.id, safe='')}/state", patch)["version"]

    def close(self, reward: float | None = None, metrics: dict[str, Any] | None = None,
              stop_condition: str | None = None, *, rewards: dict[str, Any] | None = None,
              info: dict[str, Any] | None = None) -> dict[str, Any]:
        """Seal the trace with what the evaluator knows (``rewards``: name -> ``{"score",
        "weight"}``, whose weighted sum is the reward when ``reward`` is not given) and return
        the footer's summary. The trace file is complete when this returns. Closing twice
        returns the first result."""
        if self.result is not None:
            return self.result
        body = {k: _plain(v) for k, v in dict(reward=reward, metrics=metrics, stop_condition=stop_condition,
                                                 rewards=rewards, info=info).items() if v is not None}
        try:
            SealConfig.model_validate(body)
        except ValidationError as e:
            raise BadRequest(400, f"bad DELETE body: {format_validation_error(e)}") from None
        self.result = self.proxy.request("DELETE", f"sessions/{quote(self.id, safe='')}", body or None)
        return self.result

    def trace(self) -> Trace:
        """The trace read back from its file (this machine's path of it)."""
        return read_trace(self.trace_path)

    def export(self, out: str | os.PathLike | Any, format: str = "atif", *, capture_content: bool = False) -> int:
        """The trace in a format other tools read, to ``out`` (a path or an open text file):
        ``atif``, an ATIF trajectory document, or ``otel``, OTLP JSON of OpenTelemetry GenAI
        spans (messages on them with ``capture_content``); the trajectories or spans written.
        Needs the ``export`` extra."""
        from interceptor.trace.interchange import write_trace
        return write_trace(self.trace(), format, os.fspath(out) if isinstance(out, (str, os.PathLike)) else out,
                           capture_content=capture_content)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if not self.closed:
            self.close(stop_condition="error" if exc_type is not None else None)

"""A real ``mitmdump`` process for tests and benchmarks.

Started on a free port with its own confdir and trace dir, stopped by PID. The proxy under
test is always the real entry script; only the provider is simulated.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import tempfile
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from interceptor.trace.store import UNPACKABLE
from interceptor.client.proxy import PROXY_VARIABLES, free_port, mitmdump_bin, stop_process  # one definition of each
from interceptor.client.proxy import call as control_api
from waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "addons" / "interception.py"


@dataclass
class MitmProcess:
    """``script=False`` runs bare mitmdump (for benchmarks' side-by-side baseline);
    ``program="mitmweb"`` runs mitmweb instead (pass its web_* options)."""

    options: dict[str, Any] = field(default_factory=dict)
    script: bool = True
    # More scripts after the entry script (test-only ones such as tests/faults.py).
    extra_scripts: list[Path] = field(default_factory=list)
    script_path: Path = SCRIPT  # another checkout's entry script (bench/failclosed.py's "before")
    program: str = "mitmdump"
    env: dict[str, str] | None = None
    workdir: Path | None = None
    # Instead of ``--listen-port <free port>``: these arguments, and the port is read from the
    # banner (``--listen-port 0``, ``--mode regular@<port>``).
    listen: list[str] | None = None
    port: int = 0
    # its own session (and so its own autogroup CPU share), as scripts/serve.py starts workers
    new_session: bool = False
    proc: subprocess.Popen | None = None
    _tmp: tempfile.TemporaryDirectory | None = None
    # Every process started and not yet stopped: a failing test's report shows their logs'
    # tails (tests/conftest.py), since a fixture's log is gone once it cleans up.
    live: ClassVar[weakref.WeakValueDictionary] = weakref.WeakValueDictionary()  # id -> process

    def start(self, timeout: float = 30.0, expect_failure: bool = False) -> MitmProcess:
        """Start it and wait until it answers. ``free_port`` hands out a port that is free
        when asked; something else on the machine may take it before mitmdump binds it (seen
        with several suites at once): that one failure is retried on another port."""
        for attempt in range(3):
            try:
                return self._start_once(timeout, expect_failure)
            except RuntimeError as e:
                if self.listen is not None or attempt == 2 or "address already in use" not in str(e).lower():
                    raise
                self.stop()

    def _start_once(self, timeout: float, expect_failure: bool) -> MitmProcess:
        if self.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="mitm-")
            self.workdir = Path(self._tmp.name)
        self.port = free_port() if self.listen is None else 0
        self.confdir.mkdir(parents=True, exist_ok=True)
        opts = {"confdir": str(self.confdir), "connection_strategy": "lazy", "listen_host": "127.0.0.1",
                "termlog_verbosity": "info" if self.script else "warn"}
        if self.script:
            opts["intercept_trace_dir"] = str(self.trace_dir)
        opts.update(self.options)
        program = str(Path(mitmdump_bin()).with_name(self.program))
        cmd = [program, *(["--listen-port", str(self.port)] if self.listen is None else self.listen)]
        if self.script:
            cmd += ["-s", str(self.script_path)]
            for extra in self.extra_scripts:
                cmd += ["-s", str(extra)]
        for k, v in opts.items():
            if v is None:  # left to the script's and mitmproxy's own defaults
                continue
            if isinstance(v, (list, tuple)):
                for item in v:
                    cmd += ["--set", f"{k}={item}"]
            else:
                cmd += ["--set", f"{k}={v}"]
        env = dict(os.environ)
        for k in PROXY_VARIABLES:
            env.pop(k, None)
        env.update(self.env or {})
        self.log_path = self.workdir / f"mitmdump-{self.port}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir,
                                     start_new_session=self.new_session)
        MitmProcess.live[id(self)] = self

        def settled() -> bool:  # exited (what expect_failure wants) or ready (what it does not)
            if self.proc.poll() is not None:
                if expect_failure:
                    return True
                raise RuntimeError(f"mitmdump exited with {self.proc.returncode}:\n{self.log()}")
            if self._ready():
                if expect_failure:
                    raise RuntimeError(f"mitmdump started but was expected to fail:\n{self.log()}")
                return True
            return False

        try:
            wait_until(settled, timeout, lambda: f"mitmdump ready:\n{self.log()}")
        except AssertionError:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        if not self.port:
            found = re.search(r"interceptor: ready at http://[^:]+:(\d+)", self.log())
            if not found:
                return False
            self.port = int(found.group(1))
        if not self.script:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return True
            except OSError:
                return False
        try:
            with urllib.request.urlopen(f"{self.url}/_interceptor/health", timeout=0.5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait(self, timeout: float = 30.0) -> int:
        assert self.proc
        return self.proc.wait(timeout)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        MitmProcess.live.pop(id(self), None)
        stop_process(self.proc, sig)
        if getattr(self, "_log", None):
            self._log.close()

    def cleanup(self) -> None:
        self.stop()
        log = self.log() if self.script else ""
        if self._tmp:
            self._tmp.cleanup()
        # INTERCEPT_TEST_STRICT_PACK (tests/conftest.py): a record that could not be packed
        # was not written; whichever test made it, the proxy's user must hear of it.
        assert UNPACKABLE not in log, next(line for line in log.splitlines() if UNPACKABLE in line)

    def memory(self) -> dict[str, int]:
        """The process's resident memory now (``VmRSS``) and at its peak (``VmHWM``), bytes."""
        assert self.proc
        out = {}
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(value.split()[0]) * 1024
        return out

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    # -- paths and the control API -------------------------------------------------------

    @property
    def confdir(self) -> Path:
        assert self.workdir
        return self.workdir / "conf"

    @property
    def trace_dir(self) -> Path:
        assert self.workdir
        return self.workdir / "traces"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ca_bundle(self) -> Path:
        return self.confdir / "interceptor-harness" / "ca-bundle.pem"

    @property
    def admin_token(self) -> str:
        given = (self.env or {}).get("INTERCEPT_ADMIN_TOKEN")  # then never written
        return given or (self.confdir / "interceptor-admin-token").read_text().strip()

    def api(self, method: str, path: str, body: Any = None, token: str | None = "admin") -> tuple[int, Any]:
        return control_api(self.url, self.admin_token if token == "admin" else token, method, path, body)

    def create_session(self, **config: Any) -> dict[str, Any]:
        status, body = self.api("POST", "sessions", config)
        assert status == 201, (status, body)
        return body

    def __enter__(self) -> MitmProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()

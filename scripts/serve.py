#!/usr/bin/env python3
"""More than one core: one address in front of N mitmdump workers, each session on one worker.

    python scripts/serve.py --workers 2 [--listen-host 127.0.0.1] [--listen-port 8080] \\
        [--trace-dir ./traces] [--confdir ~/.mitmproxy] [--set intercept_upstreams=...]

mitmproxy is one Python process, one core. This starts N workers (``mitmdump -s
addons/interception.py`` on loopback ports, one per core by default) and HAProxy in front of
them on the one address harnesses and orchestrators use. All workers share the confdir (one
CA, one admin token) and the trace folder.

How the front knows a session's worker, without knowing any session: each worker is started
with a tag (``intercept_worker=w1``) that starts every session id (``w1-<id>``) and every
secret it mints (``sk-ic-w1-m-...``). So the front's rules are fixed at start, N prefixes;
it keeps no table a restart or a reload could lose, the workers share no state, and workers
writing one folder can never pick the same file name.

- ``POST /_interceptor/sessions`` goes to any worker whose health check passes (round robin):
  the session lives there for its life, and its answer names the front in ``HTTPS_PROXY``
  with the secret as userinfo (``intercept_front``).
- A harness's CONNECT (or proxied plain request) goes to the worker its
  ``Proxy-Authorization`` secret names. No secret, or one that names no worker: the front
  answers 407 itself and forwards nothing (a CONNECT is refused before any TLS, so the
  dialect's error shape is not possible there); a well-formed secret no live session holds
  gets the worker's own 407 (OpenProxyGuard enforces behind a front).
- ``/_interceptor/sessions/<id>...`` goes to the worker the id names; ``task``, ``state``
  and ``stop`` to the worker the state secret (``Authorization: Bearer``) names, ``tool`` to
  the one the model secret names; ``?worker=wN`` picks a
  worker for ``health`` and the session list (a list without it is a 400: each worker
  lists its own).
- A worker that dies (``kill -9``) loses its in-flight turns and its sessions (they live in
  its memory; their traces up to the last whole record stand and verify); the front answers
  503 for them, the other workers serve on, and this script starts the worker again on the
  same port for new sessions (``--no-restart``: not).

HAProxy is Debian's package (``make haproxy`` unpacks it into .venv without touching the
system); ``--haproxy`` or ``$INTERCEPT_HAPROXY`` names another binary. SIGTERM or Ctrl-C
stops the front first (no new connections), then the workers (which seal their sessions).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from interceptor.addons.gateway.sessions.state import TOOL_SERVER_ROUTES
from interceptor.dialects import secret_places
from interceptor.dialects.base import place_of
from interceptor.client.proxy import (PROXY_VARIABLES, SCRIPT, TOKEN_FILE, TOKEN_VARIABLE, call, free_port,
                                      mitmdump_bin)

HAPROXY_VARIABLE = "INTERCEPT_HAPROXY"
RESTART_PAUSE = 5.0  # seconds between two starts of one worker
REFUSAL = ("This proxy serves only its sessions: put the session's model secret in the proxy URL, "
           "HTTPS_PROXY=http://session:<secret>@host:port (the env a session's POST answers has it)")


def haproxy_bin() -> str | None:
    """``$INTERCEPT_HAPROXY``, else the one ``make haproxy`` put beside this Python, else PATH's."""
    named = os.environ.get(HAPROXY_VARIABLE)
    if named:
        return named
    local = Path(sys.executable).with_name("haproxy")
    return str(local) if local.exists() else shutil.which("haproxy")


def secret_rules() -> list[str]:
    """The front's reading of a control request's secret (``txn.bearer``), from every place a
    dialect reads a harness's key (``interceptor.dialects.secret_places``), the first found."""
    rules = []
    for place in secret_places():
        name, scheme = place_of(place)
        if name.startswith("?"):
            fetch, test = f"urlp({name[1:]})", ""
        elif scheme:
            fetch, test = f"req.hdr({name}),word(2,' ')", f" {{ req.hdr({name}),word(1,' '),lower -m str {scheme} }}"
        else:
            fetch, test = f"req.hdr({name})", ""
        unset = " !{ var(txn.bearer) -m found }" if rules else ""
        rules.append(f"    http-request set-var(txn.bearer) {fetch} if control{unset}{test}")
    return rules


def haproxy_config(host: str, port: int, workers: dict[str, int], threads: int = 1) -> str:
    """The front's whole configuration: N fixed prefixes, no state (see the module docstring)."""
    front = f"{host}:{port}"
    tags = list(workers)
    # the tool servers' routes (state secret) and the tool route (addons/mitm/toolroute.py: the model
    # secret, where any dialect reads a key or in Proxy-Authorization): by whichever secret came
    tool_routes = " ".join(f"/_interceptor/{r}" for r in (*TOOL_SERVER_ROUTES, "tool"))
    secret_prefixes = " ".join(f"sk-ic-{t}-" for t in tags)
    bad_list = json.dumps({"error": {"status": 400, "message": (
        f"each worker lists its own sessions: GET /_interceptor/sessions?worker=<{'|'.join(tags)}>")}})
    lines = [
        "global",
        f"    nbthread {threads}",
        "    log stderr format raw local0 notice",
        "defaults",
        "    mode http",
        "    log global",
        # Per-request lines are info, below the notice level above: none by default. Raised, they
        # name the path without its query (where a Gemini key could stand), never a header.
        "    log-format \"%ci:%cp [%tr] %ft %b/%s %TR/%Tw/%Tc/%Tr/%Ta %ST %B %tsc %HM %HPO\"",
        "    timeout connect 5s",
        "    timeout http-request 60s",
        "    timeout http-keep-alive 60s",
        # a model answer may take minutes, an agent's tunnel lives as long as the harness
        "    timeout client 1h",
        "    timeout server 1h",
        "    timeout tunnel 1h",
        "    retries 2",
        # never one worker connection for two clients: a worker admits a connection once by
        # its secret (OpenProxyGuard), and a shared one would admit the second client too
        "    http-reuse never",
        # A CONNECT's tunnel (TLS the front never reads) forwarded by the kernel (splice(2))
        # where HAProxy's heuristics find it pays: less of the front's CPU per relayed SSE
        # event (bench/workers.py, docs/benchmarks.md). HAProxy 2.6's configuration manual,
        # "option splice-auto": correct from Linux 2.6.29 on.
        "    option splice-auto",
        "",
        "frontend interceptor",
        f"    bind {front}",
        "    acl control url_beg /_interceptor/",
        "    http-request set-var(txn.scheme) req.hdr(proxy-authorization),word(1,' '),lower",
        "    http-request set-var(txn.secret) req.hdr(proxy-authorization),word(2,' '),b64dec,field(2,:) "
        "if { var(txn.scheme) -m str basic }",
        "    http-request set-var(txn.secret) req.hdr(proxy-authorization),word(2,' ') "
        "if { var(txn.scheme) -m str bearer }",
        *secret_rules(),
        "    http-request set-var(txn.bearer) var(txn.secret) if control !{ var(txn.bearer) -m found }",
        f"    acl routable var(txn.secret) -m beg {secret_prefixes}",
        f"    http-request return status 407 content-type text/plain string \"{REFUSAL}\" "
        "hdr proxy-authenticate 'Basic realm=\"llm-interceptor\"' if !control !routable",
        f"    http-request return status 400 content-type application/json string '{bad_list}' "
        "if control METH_GET { path /_interceptor/sessions /_interceptor/sessions/ } !{ urlp(worker) -m found }",
        # the worker's control API answers requests addressed to the front (intercept_front)
        f"    http-request set-header host {front} if control",
    ]
    for tag in tags:
        lines += [
            f"    use_backend {tag} if control {{ path_beg /_interceptor/sessions/{tag}- }}",
            f"    use_backend {tag} if control {{ path {tool_routes} }} "
            f"{{ var(txn.bearer) -m beg sk-ic-{tag}- }}",
            f"    use_backend {tag} if control {{ urlp(worker) -m str {tag} }}",
            f"    use_backend {tag} if !control {{ var(txn.secret) -m beg sk-ic-{tag}- }}",
        ]
    lines += ["    default_backend any", "", "backend any", "    balance roundrobin", "    option httpchk",
              f"    http-check send meth GET uri /_interceptor/health ver HTTP/1.1 hdr host {front}",
              "    http-check expect status 200"]
    lines += [f"    server {tag} 127.0.0.1:{p} check inter 1s fall 1 rise 1" for tag, p in workers.items()]
    for tag, p in workers.items():
        lines += ["", f"backend {tag}",
                  f"    http-error status 503 content-type text/plain string \"worker {tag}, which holds this "
                  "session, is not running: its in-flight turns are lost; start a new session\"",
                  f"    server {tag} 127.0.0.1:{p}"]
    return "\n".join(lines) + "\n"


@dataclass
class Worker:
    tag: str
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    starts: int = 0
    started_at: float = 0.0


class Deployment:
    """The front and its workers, started and stopped by PID (tests and benches use it too)."""

    def __init__(self, workers: int, *, listen_host: str = "127.0.0.1", listen_port: int = 0,
                 trace_dir: str | os.PathLike = "traces", confdir: str | os.PathLike = "~/.mitmproxy",
                 log_dir: str | os.PathLike | None = None, options: list[str] | None = None,
                 env: dict[str, str] | None = None, haproxy: str | None = None, front_threads: int = 1,
                 restart: bool = True, start_timeout: float = 120.0) -> None:
        if workers < 1:
            raise ValueError("--workers must be at least 1")
        self.listen_host = listen_host
        self.port = listen_port or free_port()
        self.trace_dir = Path(os.path.expanduser(trace_dir)).resolve()
        self.confdir = Path(os.path.expanduser(confdir)).resolve()
        self.log_dir = Path(log_dir).resolve() if log_dir else self.confdir / "interceptor-serve"
        self.options = list(options or [])
        self.env = dict(env or {})
        self.haproxy = haproxy or haproxy_bin()
        self.front_threads = front_threads
        self.restart = restart
        self.start_timeout = start_timeout
        self.workers = [Worker(f"w{i}", free_port(), self.log_dir / f"w{i}.log") for i in range(1, workers + 1)]
        self.front: subprocess.Popen | None = None
        self.admin_token: str | None = None
        self.token_path: Path | None = None
        self._stopping = threading.Event()
        self._watch: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.listen_host in ("0.0.0.0", "") else self.listen_host
        return f"http://{host}:{self.port}"

    # -- start ------------------------------------------------------------------------------

    def start(self) -> Deployment:
        if not self.haproxy:
            raise RuntimeError("haproxy not found: run `make haproxy` (Debian's package, unpacked into .venv), "
                               f"install Debian's haproxy, or name one with --haproxy / ${HAPROXY_VARIABLE}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        self._prepare_confdir()
        try:
            for w in self.workers:
                self._start_worker(w)
            for w in self.workers:
                self._wait_worker(w)
            self._start_front()
        except BaseException:
            self.stop()
            raise
        self._watch = threading.Thread(target=self._supervise, name="serve-supervisor", daemon=True)
        self._watch.start()
        return self

    def _prepare_confdir(self) -> None:
        """One CA and one admin token for every worker, made before any starts (N workers
        making a CA at once would each make their own)."""
        from mitmproxy import certs  # only here: the module docstring must not need mitmproxy

        self.confdir.mkdir(parents=True, exist_ok=True)
        certs.CertStore.from_store(self.confdir, "mitmproxy", 2048)
        token = os.environ.get(TOKEN_VARIABLE)
        if token:
            self.admin_token = token
        else:
            self.admin_token = "ic-admin-" + secrets.token_urlsafe(32)
            self.token_path = self.confdir / TOKEN_FILE
            fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.admin_token + "\n")

    def _start_worker(self, w: Worker) -> None:
        cmd = [mitmdump_bin(), "--listen-host", "127.0.0.1", "--listen-port", str(w.port), "-s", str(SCRIPT),
               "--set", f"confdir={self.confdir}", "--set", "connection_strategy=lazy",
               "--set", f"intercept_trace_dir={self.trace_dir}", "--set", f"intercept_worker={w.tag}",
               "--set", f"intercept_front=http://{self.url.split('://', 1)[1]}"]
        for opt in self.options:
            cmd += ["--set", opt]
        env = {k: v for k, v in os.environ.items() if k not in PROXY_VARIABLES}
        env.update(self.env)
        env[TOKEN_VARIABLE] = self.admin_token or ""  # never on a command line (ps)
        with open(w.log_path, "ab") as log:
            # Its own session: Ctrl-C at a terminal reaches serve.py alone, which stops the front
            # before the workers; and the kernel's autogroup scheduler gives each worker its own
            # share of the CPU, as a service manager's units get (one group for all would cap N
            # workers at one process's share on a busy machine).
            w.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                      start_new_session=True)
        w.starts += 1
        w.started_at = time.monotonic()

    def _wait_worker(self, w: Worker) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if w.proc.poll() is not None:
                raise RuntimeError(f"worker {w.tag} exited with {w.proc.returncode} at start; see {w.log_path}")
            try:
                status, _ = call(f"http://127.0.0.1:{w.port}", None, "GET", "health", timeout=1)
                if status == 200:
                    return
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            time.sleep(0.1)
        raise RuntimeError(f"worker {w.tag} did not answer within {self.start_timeout:.0f}s; see {w.log_path}")

    def _start_front(self) -> None:
        cfg = self.log_dir / "haproxy.cfg"
        cfg.write_text(haproxy_config(self.listen_host, self.port, {w.tag: w.port for w in self.workers},
                                      self.front_threads))
        check = subprocess.run([self.haproxy, "-c", "-q", "-f", str(cfg)], capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"haproxy refused {cfg}: {check.stderr or check.stdout}")
        with open(self.log_dir / "haproxy.log", "ab") as log:
            self.front = subprocess.Popen([self.haproxy, "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.front.poll() is not None:
                raise RuntimeError(f"haproxy exited with {self.front.returncode}; see {self.log_dir / 'haproxy.log'}")
            try:
                if call(self.url, None, "GET", "health", timeout=1)[0] == 200:
                    return
            except Exception:  # noqa: BLE001 - not listening yet, or no worker checked yet
                pass
            time.sleep(0.1)
        raise RuntimeError("the front did not answer its health check within 30 s")

    # -- run --------------------------------------------------------------------------------

    def _supervise(self) -> None:
        while not self._stopping.wait(0.5):
            if self.front is not None and self.front.poll() is not None:
                print(f"serve: haproxy exited with {self.front.returncode}; stopping", file=sys.stderr, flush=True)
                self.stop()
                return
            for w in self.workers:
                with self._lock:
                    if self._stopping.is_set() or w.proc is None or w.proc.poll() is None:
                        continue
                    if self.restart and time.monotonic() - w.started_at < RESTART_PAUSE:
                        continue  # one that dies at start (its port taken) is not restarted in a busy loop
                    print(f"serve: worker {w.tag} (pid {w.proc.pid}) exited with {w.proc.returncode}; its sessions "
                          f"are gone{', starting it again' if self.restart else ''}", file=sys.stderr, flush=True)
                    if self.restart:
                        self._start_worker(w)

    def wait(self) -> int:
        """Until the front dies or ``stop``; the front's status."""
        while not self._stopping.wait(1):
            pass
        return self.front.returncode or 0 if self.front else 0

    def stop(self) -> None:
        """The front first (nothing new arrives), then every worker by PID: SIGTERM seals its
        sessions; SIGKILL after 15 s."""
        self._stopping.set()
        with self._lock:
            procs = ([self.front] if self.front else []) + [w.proc for w in self.workers if w.proc]
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
                    if p is self.front:
                        _wait(p)
            for p in procs:
                _wait(p)

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _wait(p: subprocess.Popen) -> None:
    try:
        p.wait(15)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="mitmdump workers (default: one per core)")
    ap.add_argument("--listen-host", default="127.0.0.1", help="the front's address (default 127.0.0.1)")
    ap.add_argument("--listen-port", type=int, default=8080, help="the front's port (default 8080; 0: a free one)")
    ap.add_argument("--trace-dir", default="./traces", help="every worker's trace folder (shared storage in a cluster)")
    ap.add_argument("--confdir", default="~/.mitmproxy", help="shared by the workers: CA, admin token")
    ap.add_argument("--log-dir", default=None, help="worker and front logs, haproxy.cfg (default <confdir>/interceptor-serve)")
    ap.add_argument("--set", dest="options", action="append", default=[], metavar="OPTION=VALUE",
                    help="a mitmdump option for every worker (repeatable), e.g. intercept_upstreams=...")
    ap.add_argument("--haproxy", default=None, help=f"the haproxy binary (default ${HAPROXY_VARIABLE}, .venv's, PATH's)")
    ap.add_argument("--front-threads", type=int, default=1, help="haproxy threads (default 1: it only routes)")
    ap.add_argument("--no-restart", action="store_true", help="leave a worker that died down")
    args = ap.parse_args(argv)
    dep = Deployment(args.workers, listen_host=args.listen_host, listen_port=args.listen_port,
                     trace_dir=args.trace_dir, confdir=args.confdir, log_dir=args.log_dir, options=args.options,
                     haproxy=args.haproxy, front_threads=args.front_threads, restart=not args.no_restart)
    signal.signal(signal.SIGTERM, lambda *_: dep._stopping.set())
    try:
        dep.start()
    except (RuntimeError, ValueError) as e:
        print(f"serve: cannot start: {e}", file=sys.stderr)
        return 1
    print(f"serve: ready at {dep.url} with {len(dep.workers)} workers "
          f"({', '.join(f'{w.tag} pid {w.proc.pid}' for w in dep.workers)}); traces in {dep.trace_dir}", flush=True)
    print(f"serve: control API token: {dep.token_path or '$' + TOKEN_VARIABLE}; logs in {dep.log_dir}", flush=True)
    try:
        dep.wait()
    except KeyboardInterrupt:
        pass
    dep.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

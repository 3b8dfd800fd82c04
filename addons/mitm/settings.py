"""The ``intercept_*`` options, parsed once, and the proxy-wide set-up that follows from them.

Like mitmproxy's own addons, each option is validated in ``configure`` and a bad value is an
``OptionsError`` saying what is wrong. At start-up that is not enough: mitmdump loads a script
in a background task, so an error there leaves a proxy that claims nothing (a repeated scalar
option made the script vanish without a word; a bad value printed a traceback and then
"listening"). So until the proxy runs, any problem with an ``intercept_*`` option (a bad,
repeated or unknown one, an unreadable sessions file) ends mitmdump with one line on stderr
naming it and exit status 1, before any server is announced.

This addon also imposes what the proxy needs to work at all (``connection_strategy=lazy``,
TLS interception for provider hosts, loopback listening) so that
``mitmdump -s addons/interception.py`` alone is a working recorder.

What it writes, and for whom (see the README's threat model):

- ``<confdir>/interceptor-harness/``: what a harness is given (the CA bundle, the default
  session's env file); nothing in it opens the control API or holds a provider key;
- ``<confdir>/interceptor-admin-token`` (mode 0600): the control API's token, unless the proxy
  was given one in ``INTERCEPT_ADMIN_TOKEN``, which is then never written anywhere.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import re
import secrets
import shlex
import ssl
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

from mitmproxy import certs, ctx, exceptions
from mitmproxy.proxy import mode_specs
from pydantic import TypeAdapter, ValidationError

from interceptor.addons.gateway.policy.hookload import HookSet, load_hooks
from interceptor.addons.gateway.policy.hookpool import TIMEOUT as HOOK_TIMEOUT
from interceptor.addons.gateway.sessions.session import HooksConfig, Registry, Session, SessionConfig
from interceptor.addons.gateway.sessions.state import DEFAULT_MAX_BYTES as DEFAULT_STATE_MAX
from interceptor.addons.gateway.sessions.upstream import DEFAULT, KNOWN, Upstream, format_validation_error, parse_upstreams, pick
from interceptor.addons.gateway.sizes import size_option
from interceptor.dialects import default_hosts, key_variables
from interceptor.trace.hooks import HookError
from interceptor.trace.messages import Sampling
from interceptor.trace.store import FSYNC_INTERVAL, FSYNC_POLICIES, TRACE_WRITES, TraceExistsError
from interceptor.trace.tokens import warm as warm_estimator

__all__ = ["Settings", "format_validation_error"]

log = logging.getLogger(__name__)

DEFAULT_HOSTS = default_hosts()  # every dialect's hosts (interceptor.dialects.REGISTRY)
# No model API takes a request near this size; a larger body is refused unread (BodyCap).
MAX_BODY = 64 << 20
TOKEN_FILE = "interceptor-admin-token"
TOKEN_VARIABLE = "INTERCEPT_ADMIN_TOKEN"
HARNESS_DIR = "interceptor-harness"
BUNDLE_FILE = "ca-bundle.pem"
ENV_FILE = "default.env"
KEY_VARIABLES = key_variables()
CA_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "CODEX_CA_CERTIFICATE")
_SYSTEM_ROOTS = (
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
)
PREFIX = "intercept_"
_REMOVED = {
    "intercept_admin_token": "it was removed: a token on the command line is readable by every user (ps); "
                             f"give the proxy {TOKEN_VARIABLE} in its environment instead",
}


class Settings:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.hosts: frozenset[str] = frozenset(DEFAULT_HOSTS)
        self.trace_dir = Path("traces")
        self.fsync = "turn"
        self.max_body = MAX_BODY  # bytes; 0: no limit (BodyCap)
        self.state_max_bytes = DEFAULT_STATE_MAX  # the task state's largest size (addons/gateway/sessions/state.py)
        self.admin_token: str | None = None
        self.token_path: Path | None = None  # None: the token came from the environment
        self.file_configs: list[SessionConfig] | None = None
        self.default_hooks: HooksConfig | None = None  # intercept_hooks
        self.default_config = SessionConfig(id="default")
        self.upstreams: dict[str, Upstream] = {}
        self._declared: dict[str, Upstream] = {}  # from intercept_upstreams
        self._default_upstream: Upstream | None = None  # from the default session's options
        self.bundle_path: Path | None = None
        self.started = False
        self.started_at = time.time()
        self._rebind = False
        self.ready = False  # the servers are bound and the banner is out (health says so)
        self._pending: dict[str, Any] = {}  # intercept_* values mitmproxy deferred, applied in configure
        self._applying = False  # applying them: a check across options waits for all of them
        self._merged_hosts_said = False
        self._imposed_allow: set[str] = set()
        self.front: tuple[str, int] | None = None  # intercept_front: (host, port) of the front

    def load(self, loader) -> None:
        # mitmproxy defers a --set for an option not yet known and converts it when the option
        # is added, raising (silently, in the script's load task) on a repeated scalar: take
        # ours now and apply them in the first configure, where an error can be reported.
        deferred = loader.master.options.deferred
        for name in [n for n in deferred if n.startswith(PREFIX)]:
            self._pending[name] = deferred.pop(name)
        loader.add_option(
            "intercept_hosts", Sequence[str], [],
            "More hosts whose model traffic is claimed, rewritten and recorded, added to every dialect's own "
            f"({', '.join(DEFAULT_HOSTS)}); repeat --set for several. To claim only these, also set "
            "intercept_default_hosts=false. TLS is intercepted for claimed hosts (and upstream hosts) only; "
            "every other host passes through untouched.",
        )
        loader.add_option(
            "intercept_default_hosts", bool, True,
            "Claim every dialect's own provider hosts, plus intercept_hosts. false: claim only intercept_hosts "
            "(replacing the built-in list is asked for by name, never by one --set).",
        )
        loader.add_option("intercept_trace_dir", str, "./traces", "One trace file per session: <dir>/<session id>.msgpack.")
        loader.add_option("intercept_sessions", Optional[str], None, "A JSON file with a list of session configs, loaded at start.")
        loader.add_option(
            "intercept_default_session", bool, True,
            "Without intercept_sessions, make one default session at start (its environment file named in "
            "the banner). false: none; sessions come from the control API only (the Python API's proxies).",
        )
        loader.add_option(
            "intercept_upstreams", Optional[str], None,
            "Upstreams sessions may pick by name: inline JSON or a JSON file, "
            '{"name": {"base_url": ..., "api_key_env": ..., "dialect": ...}}; known providers by name: '
            f'["{"\", \"".join(KNOWN)}"].',
        )
        loader.add_option("intercept_upstream", Optional[str], None,
                          "Default session: upstream base URL incl. version prefix (http://127.0.0.1:8000/v1), "
                          "or the name of a declared upstream. A URL declares the upstream 'default'.")
        loader.add_option("intercept_api_key_env", Optional[str], None,
                          "Default session: name of the proxy-side env variable holding the real key of intercept_upstream.")
        loader.add_option("intercept_model", Optional[str], None, "Default session: model imposed on every request.")
        loader.add_option("intercept_sampling", Optional[str], None, 'Default session: sampling as a JSON object, e.g. {"temperature": 0.7}.')
        loader.add_option("intercept_max_body", str, "64m",
                          "Largest request body a claimed request may carry (k/m/g suffixes, 0: no "
                          "limit); a larger one is answered 413 in the dialect's shape and never forwarded.")
        loader.add_option("intercept_state_max_bytes", str, "1m",
                          "Largest task state a tool server may write (k/m/g suffixes, 0: no limit); "
                          "a larger PUT or PATCH is answered 413 and changes nothing.")
        loader.add_option(
            "intercept_open_proxy", bool, False,
            "Listening beyond loopback, relay for clients without a session secret too (an open proxy). "
            "Off: every connection must present one in Proxy-Authorization (407 otherwise).",
        )
        loader.add_option(
            "intercept_worker", Optional[str], None,
            "This proxy is one worker behind a front (scripts/serve.py): its tag (w1, w2, ...), which starts "
            "every session id and secret it makes so the front routes by them. Needs intercept_front.",
        )
        loader.add_option(
            "intercept_front", Optional[str], None,
            "With intercept_worker: the front's address (http://host:port) that harnesses and orchestrators use; "
            "named in every environment handed out, and the control API's address.",
        )
        loader.add_option("intercept_keep_sealed", int, 1000,
                          "Sealed sessions kept in memory (summaries); older ones are dropped and their "
                          "summaries read from their trace files.")
        loader.add_option("intercept_hooks", Optional[str], None,
                          'Hooks for sessions whose config has no "hooks": a module (pkg.mod), a file (path/hooks.py), '
                          'or a JSON object {"module": ..., "config": {...}}.')
        loader.add_option("intercept_hook_timeout", int, round(HOOK_TIMEOUT),
                          "Seconds a session's hook may take before it is a hook_error, for sessions whose config "
                          'has no "hook_timeout" (a plain hook past it runs on in its thread; the exchange goes on).')
        loader.add_option("intercept_rewrite_keep_bytes", str, "64k",
                          "How much of a message's original content a request hook's rewrite record keeps "
                          "(k/m suffixes; 0: none, only its digest and size).")
        loader.add_option("intercept_fsync", str, "turn", "When trace files are fsynced: after each turn's records (grouped, intercept_fsync_ms), "
                          "at the seal, or never.",
                          choices=FSYNC_POLICIES)
        loader.add_option("intercept_fsync_ms", int, round(FSYNC_INTERVAL * 1000),
                          "Under intercept_fsync turn: the longest a written turn waits for its fsync, in milliseconds, "
                          "so one fsync covers every record of the file written meanwhile (0: one per write). The "
                          "footer is fsynced at once.")
        loader.add_option("intercept_trace_writes", str, "loop",
                          "Who writes a trace record into the page cache: the event loop that made it (loop; a write "
                          "slower than 50 ms hands every later one to the thread), or always "
                          "the writer thread (thread). Opening, fsync and retries are always the thread's.",
                          choices=TRACE_WRITES)

    def configure(self, updated: set[str]) -> None:
        try:
            if self._pending:
                self._apply_pending()
            self._configure(updated)
        except exceptions.OptionsError as e:
            if self.started or not _is_real_master():
                raise
            _refuse_to_start(str(e))

    def _apply_pending(self) -> None:
        """The deferred ``intercept_*`` values, one option at a time so the error names it."""
        pending, self._pending = self._pending, {}
        self._applying = True
        try:
            self._set_pending(pending)
        finally:
            self._applying = False

    def _set_pending(self, pending: dict[str, Any]) -> None:
        o = ctx.options
        for name, value in pending.items():
            if name not in o:
                why = _REMOVED.get(name, "no such option (a typo?); `mitmdump -s addons/interception.py --options | grep intercept_` lists them")
                raise exceptions.OptionsError(f"{name}: {why}")
            values = getattr(value, "val", None)
            if values is None:  # set programmatically, already converted
                o.update(**{name: value})
            else:
                o.set(*[f"{name}={v}" for v in values])

    def _configure(self, updated: set[str]) -> None:
        o = ctx.options
        if self.admin_token is None and TOKEN_VARIABLE in os.environ:
            token = os.environ.pop(TOKEN_VARIABLE)  # not handed on to anything this process starts
            if len(token) < 16:
                raise exceptions.OptionsError(f"{TOKEN_VARIABLE} must be at least 16 characters")
            self.admin_token = token
        if updated & {"intercept_hosts", "intercept_default_hosts"}:
            hosts = [h.strip().lower() for h in o.intercept_hosts if h.strip()]
            bad = [h for h in hosts if not re.fullmatch(r"[a-z0-9.-]+", h)]
            if bad:
                raise exceptions.OptionsError(f"intercept_hosts: not a host name: {', '.join(bad)}")
            if not o.intercept_default_hosts and not hosts and not self._applying:  # (both may be pending)
                raise exceptions.OptionsError("intercept_default_hosts=false needs intercept_hosts: the hosts to "
                                              "claim instead of the built-in ones")
            self.hosts = frozenset(hosts) | (frozenset(DEFAULT_HOSTS) if o.intercept_default_hosts else frozenset())
        if "intercept_trace_dir" in updated:
            self.trace_dir = Path(os.path.expanduser(o.intercept_trace_dir))
            try:
                self.trace_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise exceptions.OptionsError(f"intercept_trace_dir: cannot create {self.trace_dir}: {e}") from e
        if "intercept_max_body" in updated:
            self.max_body = size_option("intercept_max_body", o.intercept_max_body)
        if "intercept_state_max_bytes" in updated:
            self.state_max_bytes = size_option("intercept_state_max_bytes", o.intercept_state_max_bytes)
        if "intercept_rewrite_keep_bytes" in updated:
            self.registry.rewrite_keep_bytes = size_option("intercept_rewrite_keep_bytes", o.intercept_rewrite_keep_bytes)
        if "intercept_hook_timeout" in updated:
            if not 1 <= o.intercept_hook_timeout <= 86400:
                raise exceptions.OptionsError(
                    f"intercept_hook_timeout must be between 1 and 86400 seconds (a day), got {o.intercept_hook_timeout}")
            self.registry.hook_timeout = float(o.intercept_hook_timeout)
        if "intercept_keep_sealed" in updated:
            if o.intercept_keep_sealed < 0:
                raise exceptions.OptionsError(f"intercept_keep_sealed must be 0 or more, got {o.intercept_keep_sealed}")
            self.registry.keep_sealed = o.intercept_keep_sealed
        if updated & {"intercept_worker", "intercept_front"}:
            self._configure_worker(o.intercept_worker, o.intercept_front)
        if "intercept_fsync" in updated:
            if o.intercept_fsync not in FSYNC_POLICIES:  # mitmproxy lists choices, it does not check them
                raise exceptions.OptionsError(
                    f"intercept_fsync must be one of {', '.join(FSYNC_POLICIES)}, got {o.intercept_fsync!r}")
            self.fsync = o.intercept_fsync
        if "intercept_fsync_ms" in updated:
            if not 0 <= o.intercept_fsync_ms <= 60_000:
                raise exceptions.OptionsError(
                    f"intercept_fsync_ms must be between 0 and 60000 (a minute), got {o.intercept_fsync_ms}")
            self.registry.store.fsync_interval = o.intercept_fsync_ms / 1000
        if "intercept_trace_writes" in updated:
            if o.intercept_trace_writes not in TRACE_WRITES:
                raise exceptions.OptionsError(
                    f"intercept_trace_writes must be one of {', '.join(TRACE_WRITES)}, got {o.intercept_trace_writes!r}")
            self.registry.store.write_on_loop = o.intercept_trace_writes == "loop"
        if "intercept_upstreams" in updated:
            try:
                self._declared = parse_upstreams(o.intercept_upstreams) if o.intercept_upstreams else {}
            except ValueError as e:
                raise exceptions.OptionsError(f"intercept_upstreams: {e}") from e
        if updated & {"intercept_upstreams", "intercept_upstream", "intercept_api_key_env",
                      "intercept_model", "intercept_sampling"}:
            self.default_config, self._default_upstream = self._default_config()
            self.upstreams = dict(self._declared)
            if self._default_upstream is not None:
                self.upstreams[DEFAULT] = self._default_upstream
        if "intercept_hooks" in updated:
            self.default_hooks = self._default_hooks(o.intercept_hooks)
        if "intercept_sessions" in updated and o.intercept_sessions:
            self.file_configs = self._load_sessions_file(o.intercept_sessions)
        self._impose_proxy_settings(updated)
        if self.started and "intercept_sessions" in updated and self.file_configs:
            self._create_sessions(self.file_configs)

    def _configure_worker(self, worker: str | None, front: str | None) -> None:
        """Each value checked here; that they go together is checked at start (``running``):
        mitmproxy applies a command line's options one at a time."""
        if self.started and worker != self.registry.worker:
            raise exceptions.OptionsError("intercept_worker cannot change while the proxy runs: "
                                          "its sessions' ids and secrets name it")
        if worker and not re.fullmatch(r"w[0-9]{1,4}", worker):
            raise exceptions.OptionsError(f"intercept_worker: a tag such as w1 or w12, got {worker!r}")
        self.registry.worker, self.front = worker or None, None
        if front:
            u = urlsplit(front)
            try:
                port = u.port
            except ValueError:
                port = None
            if u.scheme != "http" or not u.hostname or not port or u.path not in ("", "/") or u.username:
                raise exceptions.OptionsError(f"intercept_front: the front's address as http://host:port, got {front!r}")
            self.front = (u.hostname, port)

    def _default_config(self) -> tuple[SessionConfig, Upstream | None]:
        o = ctx.options
        sampling = Sampling()
        if o.intercept_sampling:
            try:
                raw = json.loads(o.intercept_sampling)
                sampling = Sampling.model_validate(raw)
            except ValueError as e:
                detail = format_validation_error(e) if isinstance(e, ValidationError) else str(e)
                raise exceptions.OptionsError(f"intercept_sampling: {detail}") from e
        implicit = None
        ref: str | None = None
        url = o.intercept_upstream
        if url and "://" not in url:  # the name of a declared upstream
            if o.intercept_api_key_env:
                raise exceptions.OptionsError(
                    f"intercept_api_key_env: upstream {url!r} is declared with its own key variable; drop this option")
            if url not in self._declared:
                raise exceptions.OptionsError(
                    f"intercept_upstream: no upstream {url!r} is declared in intercept_upstreams "
                    f"(declared: {', '.join(sorted(self._declared)) or 'none'})")
            ref = url
        elif url or o.intercept_api_key_env:
            if DEFAULT in self._declared:
                raise exceptions.OptionsError(
                    f"intercept_upstream: the upstream {DEFAULT!r} is declared in intercept_upstreams already")
            try:
                implicit = Upstream(name=DEFAULT, base_url=url, api_key_env=o.intercept_api_key_env)
            except ValidationError as e:
                field = "intercept_api_key_env" if any(err["loc"] == ("api_key_env",) for err in e.errors()) else "intercept_upstream"
                raise exceptions.OptionsError(f"{field}: {format_validation_error(e)}") from e
        config = SessionConfig(id="default", model=o.intercept_model, sampling=sampling,
                               upstream=ref)  # type: ignore[arg-type]  (a name validates as a ref)
        return config, implicit

    def pick_upstream(self, config: SessionConfig) -> Upstream | None:
        """The declared upstream a session config names; ValueError naming the field if none."""
        return pick(config.upstream, self.upstreams)

    def pick_hooks(self, config: SessionConfig) -> tuple[HookSet | None, dict[str, Any]]:
        """The hooks a session runs (its own, else ``intercept_hooks``; ``null`` is none),
        loaded; HookError (a ValueError) naming ``hooks: <module>:<function>`` if unusable."""
        chosen = config.hooks if "hooks" in config.model_fields_set else self.default_hooks
        if chosen is None:
            return None, {}
        return load_hooks(chosen.module), chosen.config

    def _default_hooks(self, value: str | None) -> HooksConfig | None:
        if not value:
            return None
        try:
            chosen = HooksConfig.model_validate_json(value) if value.lstrip().startswith("{") \
                else HooksConfig(module=value)
        except ValidationError as e:
            raise exceptions.OptionsError(f"intercept_hooks: {format_validation_error(e)}") from e
        try:
            load_hooks(chosen.module)  # a broken module stops the proxy at start, not a rollout later
        except HookError as e:
            raise exceptions.OptionsError(f"intercept_hooks: {e}") from e
        return chosen

    def create_session(self, config: SessionConfig, file_stem: str | None = None) -> Session:
        hooks, hooks_config = self.pick_hooks(config)
        return self.registry.create(config, self.trace_dir, self.fsync, self.pick_upstream(config), file_stem,
                                    hooks=hooks, hooks_config=hooks_config)

    def _load_sessions_file(self, name: str) -> list[SessionConfig]:
        path = Path(os.path.expanduser(name))
        try:
            raw = json.loads(path.read_text())
        except OSError as e:
            raise exceptions.OptionsError(f"intercept_sessions: cannot read {path}: {e.strerror or e}") from e
        except ValueError as e:
            raise exceptions.OptionsError(f"intercept_sessions: {path} is not JSON: {e}") from e
        try:
            configs = TypeAdapter(list[SessionConfig]).validate_python(raw)
        except ValidationError as e:
            raise exceptions.OptionsError(f"intercept_sessions: {path}: {format_validation_error(e)}") from e
        ids = [c.id for c in configs if c.id]
        dup = {i for i in ids if ids.count(i) > 1}
        if dup:
            raise exceptions.OptionsError(f"intercept_sessions: duplicate session id {', '.join(sorted(dup))}")
        for i, c in enumerate(configs):
            try:
                self.pick_upstream(c)
                self.pick_hooks(c)
            except ValueError as e:
                raise exceptions.OptionsError(f"intercept_sessions: {path}: [{i}].{e}") from e
        return configs

    def _impose_proxy_settings(self, updated: set[str]) -> None:
        """What the proxy cannot work without; see the module docstring."""
        o = ctx.options
        changes: dict[str, Any] = {}
        if o.connection_strategy != "lazy":
            # eager connects to the provider on CONNECT, before any addon can answer a claim
            # or redirect the flow to the session's upstream.
            changes["connection_strategy"] = "lazy"
        ours = sorted(self.hosts)
        if o.ignore_hosts:
            # mitmproxy takes one of the two lists. With the user's ignore_hosts, every host
            # not ignored is intercepted: fine, as long as no provider host is ignored.
            ignored = sorted({h for h in ours for pat in o.ignore_hosts if re.search(pat, f"{h}:443")})
            if ignored:
                raise exceptions.OptionsError(
                    f"ignore_hosts: it matches {', '.join(ignored)}, whose requests must be claimed "
                    "(they carry session secrets and get the real key); narrow the pattern")
            if not self._merged_hosts_said:
                self._merged_hosts_said = True
                log.info("interceptor: ignore_hosts is set, so every host it does not match is intercepted (TLS), "
                         "provider hosts included")
        else:
            # The user's own allow_hosts stay; ours are added (and replaced when intercept_hosts
            # changes), and the log says so once.
            allow = {rf"^{re.escape(h)}(:\d+)?$" for h in ours}
            user = {p for p in o.allow_hosts if p not in self._imposed_allow}
            self._imposed_allow = allow - user
            merged = sorted(user | allow)
            if user - allow and not self._merged_hosts_said:
                self._merged_hosts_said = True
                log.info(f"interceptor: allow_hosts: kept your {', '.join(sorted(user - allow))} and added the "
                         "provider hosts")
            if list(o.allow_hosts) != merged:
                changes["allow_hosts"] = merged
        if not self.started and o.listen_host == "":
            changes["listen_host"] = "127.0.0.1"  # the proxy holds real keys
            self._rebind = True
        if changes:
            o.update(**changes)

    def running(self) -> None:
        if self.started:
            return
        if (self.registry.worker is None) != (self.front is None):
            why = "intercept_worker and intercept_front go together (scripts/serve.py sets both)"
            if not _is_real_master():
                raise exceptions.OptionsError(why)
            _refuse_to_start(why)
        self.started = True
        if self._rebind:
            # mitmproxy loads a script while its servers are already binding, so the
            # loopback default above came too late for them: restart them on it. (Pass
            # --listen-host to bind right from the start; `make run` does.)
            ctx.options.update(server=False)
            ctx.options.update(server=True)
        confdir = Path(os.path.expanduser(ctx.options.confdir))
        confdir.mkdir(parents=True, exist_ok=True)
        harness_dir = confdir / HARNESS_DIR
        harness_dir.mkdir(exist_ok=True)
        if self.admin_token is None:
            # Prefixed: a bare token_urlsafe starts with "-" one time in 64, and then reads as
            # an option to every command line it is pasted into.
            self.admin_token = "ic-admin-" + secrets.token_urlsafe(32)
            self.token_path = confdir / TOKEN_FILE
            _write_private(self.token_path, self.admin_token + "\n")
        self.bundle_path = self._write_ca_bundle(harness_dir)
        # The token estimator's BPE table is slow to build: never on the event loop.
        threading.Thread(target=warm_estimator, name="interceptor-warm", daemon=True).start()
        default = None
        if self.file_configs:
            try:
                self._create_sessions(self.file_configs)
            except TraceExistsError as e:
                why = f"intercept_sessions: {e}"
                if not _is_real_master():
                    raise exceptions.OptionsError(why) from e
                _refuse_to_start(why)
            log.info(f"interceptor: {len(self.file_configs)} session(s) from {ctx.options.intercept_sessions}")
        elif ctx.options.intercept_default_session:
            # (milliseconds: two starts within a second must not share, and so rename, a file)
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(self.started_at)) + f".{int(self.started_at * 1000) % 1000:03d}Z"
            # Its own file per start, never an earlier one's: a name taken already (two proxies
            # started within a millisecond on one folder) takes the next free one, since
            # nobody chose it and the banner names the file.
            for n in itertools.count(1):
                try:
                    default = self.create_session(self.default_config,
                                                  file_stem=f"default-{stamp}" + (f"-{n}" if n > 1 else ""))
                    break
                except TraceExistsError:
                    continue
        asyncio.get_running_loop().create_task(self._announce(default, harness_dir))

    async def _announce(self, default: Session | None, harness_dir: Path) -> None:
        """Once the servers are bound (their port is what the env must name, ``--listen-port 0``
        included): the banner, and ``ready`` for the health check."""
        for _ in range(500):
            if self.bound_address(wait=True):
                break
            await asyncio.sleep(0.02)
        else:
            log.warning("interceptor: the proxy server is not listening yet; the env names its configured port")
        exposed = exposed_hosts()
        if not exposed:
            log.info("interceptor: listening on loopback only")
        elif ctx.options.intercept_open_proxy:
            log.warning(f"interceptor: OPEN PROXY: listening on {', '.join(exposed)} with intercept_open_proxy=true: "
                        "anyone who can reach the port can relay through it to any host")
        else:
            log.info(f"interceptor: listening on {', '.join(exposed)}: every connection must present a session "
                     "secret in Proxy-Authorization (HTTPS_PROXY=http://session:<secret>@host:port), else 407")
        log.info(f"interceptor: claiming model traffic to: {', '.join(sorted(self.hosts))}"
                 + ("" if ctx.options.intercept_default_hosts else " (only these: intercept_default_hosts=false)"))
        if default is not None:
            self._banner(default, harness_dir)
        elif not self.file_configs:
            log.info(f"interceptor: ready at {self.proxy_url()}; no default session (intercept_default_session=false): "
                     f"sessions come from the control API; its token: {self.token_path or '$' + TOKEN_VARIABLE}")
        self.ready = True

    def bound_address(self, wait: bool = False) -> tuple[str, int] | None:
        """The (host, port) the proxy's first server is bound to, None before it is. With
        ``wait``, a server still on its pre-script address (see ``_rebind``) counts as not bound."""
        server = ctx.master.addons.get("proxyserver")
        addrs = server.listen_addrs() if server else []
        if not addrs:
            return None
        host, port = addrs[0][0], addrs[0][1]
        if wait and self._rebind and host not in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
            return None
        return host, port

    def _create_sessions(self, configs: list[SessionConfig]) -> None:
        """All or none: if a session's trace file exists already (a night's run restarted on
        the same folder), ``TraceExistsError`` naming every such file, and none is made. Not
        a new file name: the evaluator's tools read ``<dir>/<id>.msgpack`` and would take the
        earlier run's trace for this one's (or never find this one's); whether to move the
        old files or pick another ``intercept_trace_dir`` is theirs to say."""
        todo = [c for c in configs if not (c.id and self.registry.get(self.registry.session_id(c.id)))]
        taken = [str(path) for c in todo if c.id and os.path.lexists(
            path := self.registry.trace_file(self.trace_dir, self.registry.session_id(c.id)))]
        if taken:
            raise TraceExistsError(f"a trace is never overwritten, and {', '.join(taken)} "
                                   f"exist{'s' if len(taken) == 1 else ''} already: move "
                                   f"{'it' if len(taken) == 1 else 'them'} away, or set another "
                                   f"intercept_trace_dir")
        for config in todo:
            self.create_session(config)

    def done(self) -> None:
        self.registry.seal_all("proxy_shutdown")
        self.registry.store.close()

    # -- what a harness needs -------------------------------------------------------------

    def proxy_url(self) -> str:
        if self.front:  # behind a front: the one address harnesses and orchestrators know
            host, port = self.front
            return f"http://{f'[{host}]' if ':' in host else host}:{port}"
        bound = self.bound_address()
        host = ctx.options.listen_host or (bound[0] if bound else "127.0.0.1")
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        port = bound[1] if bound else (ctx.options.listen_port or 8080)
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{port}"

    def harness_env(self, session: Session) -> dict[str, str]:
        url = self.proxy_url()
        if self.front or (exposed_hosts() and not ctx.options.intercept_open_proxy):
            # Every connection must then present the secret (OpenProxyGuard): in the proxy URL.
            # Behind a front, that is also how the front knows the worker of a connection.
            url = url.replace("http://", f"http://session:{session.model_secret}@", 1)
        env = {"HTTPS_PROXY": url, "https_proxy": url}
        env.update({k: session.model_secret for k in KEY_VARIABLES})
        if self.bundle_path:
            env.update({k: str(self.bundle_path) for k in CA_VARIABLES})
        return env

    def _write_ca_bundle(self, harness_dir: Path) -> Path | None:
        """mitmproxy's CA plus the system roots: clients that replace their trust store with
        the file (``SSL_CERT_FILE``, ``REQUESTS_CA_BUNDLE``) must still reach every host the
        proxy passes through untouched. Written to the harness folder, readable by all: a
        harness under another user must be able to trust it."""
        confdir = harness_dir.parent
        ca = confdir / "mitmproxy-ca-cert.pem"
        if not ca.exists():
            # On a fresh confdir mitmproxy makes its CA only when its TLS addon starts, which
            # can be after this script: make it now, as that addon would (it then loads it).
            passphrase = ctx.options.cert_passphrase
            certs.CertStore.from_store(confdir, "mitmproxy", ctx.options.key_size,
                                       passphrase.encode() if passphrase else None)
        if not ca.exists():
            log.warning(f"interceptor: no CA certificate at {ca}; harness CA variables are not set")
            return None
        parts = [ca.read_text()]
        for candidate in (*_SYSTEM_ROOTS, ssl.get_default_verify_paths().cafile):
            if candidate and os.path.isfile(candidate):
                parts.append(Path(candidate).read_text())
                break
        bundle = harness_dir / BUNDLE_FILE
        # Whole or not at all: workers sharing a confdir (scripts/serve.py) write it while
        # harnesses of the others read it.
        tmp = bundle.with_name(f".{BUNDLE_FILE}.{os.getpid()}")
        tmp.write_text("\n".join(parts))
        os.chmod(tmp, 0o644)
        os.replace(tmp, bundle)
        return bundle

    def _banner(self, session: Session, harness_dir: Path) -> None:
        """The ready-to-paste environment of the default session, and what the proxy is. The
        session's secret goes to an env file of mode 0600 in the harness folder, never into a
        log line; ``source`` of it is all a harness needs."""
        env = self.harness_env(session)
        env_file = harness_dir / ENV_FILE
        _write_private(env_file, "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()))
        up = session.upstream
        where = (f"upstream {up.name!r} ({up.base_url or 'the provider host the harness addresses'}"
                 f"{', key from $' + up.api_key_env if up.api_key_env else ', no key'})"
                 if up else "the provider host the harness addresses, no key")
        lines = [
            f"interceptor: ready at {self.proxy_url()}; default session {session.id!r} records to {session.trace_path}",
            f"interceptor: default session goes to {where}",
            f"interceptor: control API token: {self.token_path or '$' + TOKEN_VARIABLE + ' (not written)'}",
            f"interceptor: CA bundle for harnesses: {self.bundle_path}",
            "interceptor: point a harness at the proxy with:",
            f"  source {shlex.quote(str(env_file))}",
        ]
        for line in lines:
            log.info(line)


LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost", "::ffff:127.0.0.1"})


def exposed_hosts() -> list[str]:
    """The addresses the proxy listens on beyond loopback ("" is every interface)."""
    out = []
    for spec in ctx.options.mode:
        try:
            host = mode_specs.ProxyMode.parse(spec).listen_host(ctx.options.listen_host)
        except ValueError:
            continue
        if host not in LOOPBACK:
            out.append(host or "0.0.0.0")
    return out


def _is_real_master() -> bool:
    """mitmdump or mitmweb, not mitmproxy's test master (whose errors a test wants raised)."""
    return type(ctx.master).__module__.startswith("mitmproxy.tools")


def _refuse_to_start(message: str) -> None:
    """One line, exit status 1, before any server is announced. ``os._exit``: this runs in
    mitmproxy's script-loading task, where an exception is logged with a traceback and
    then ignored, and nothing has been written that an orderly exit would flush."""
    print(f"interceptor: cannot start: {message}", file=sys.stderr, flush=True)
    os._exit(1)


def _write_private(path: Path, text: str) -> None:
    """Mode 0600, and whole or not at all (another worker may write the same file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)

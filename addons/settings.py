"""The ``intercept_*`` options, parsed once, and the proxy-wide set-up that follows from them.

Like mitmproxy's own addons, each option is validated in ``configure`` and a bad value is an
``OptionsError`` saying what is wrong; during start-up that error makes mitmdump refuse to
start (its ``errorcheck`` addon exits on any error logged before ``running``), so a broken
sessions file never turns into a proxy that claims nothing.

This addon also imposes what the proxy needs to work at all (``connection_strategy=lazy``,
TLS interception only for provider hosts, loopback listening) so that
``mitmdump -s addons/interception.py`` alone is a working recorder.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shlex
import threading
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from mitmproxy import certs, ctx, exceptions
from pydantic import TypeAdapter, ValidationError

from interceptor.addons.session import Registry, Session, SessionConfig, UpstreamConfig
from interceptor.trace.messages import Sampling
from interceptor.trace.tokens import warm as warm_estimator

log = logging.getLogger(__name__)

# chatgpt.com: Codex asks it for its model list with the key it holds (the session secret);
# a host that receives a secret must be intercepted, so that request is answered locally.
DEFAULT_HOSTS = ["api.openai.com", "api.anthropic.com", "chatgpt.com"]
FSYNC_POLICIES = ("never", "turn", "seal")
TOKEN_FILE = "interceptor-admin-token"
BUNDLE_FILE = "interceptor-ca-bundle.pem"
SECRET_FILE = "interceptor-default-secret"
ENV_FILE = "interceptor-default.env"
KEY_VARIABLES = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "CODEX_API_KEY")
CA_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "CODEX_CA_CERTIFICATE")
_SYSTEM_ROOTS = (
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
)


def format_validation_error(err: ValidationError) -> str:
    """One line per problem, naming the field, e.g. ``upstream.bogus: Extra inputs ...``."""
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(root)"
        lines.append(f"{where}: {e['msg']}")
    return "; ".join(lines)


class Settings:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.hosts: frozenset[str] = frozenset(DEFAULT_HOSTS)
        self.trace_dir = Path("traces")
        self.fsync = "turn"
        self.admin_token: str | None = None
        self.file_configs: list[SessionConfig] | None = None
        self.default_config = SessionConfig()
        self.bundle_path: Path | None = None
        self.started = False
        self._rebind = False

    def load(self, loader) -> None:
        loader.add_option(
            "intercept_hosts", Sequence[str], list(DEFAULT_HOSTS),
            "Provider hosts whose model traffic is claimed, rewritten and recorded. "
            "TLS is intercepted for these hosts only; every other host passes through untouched.",
        )
        loader.add_option("intercept_trace_dir", str, "./traces", "One trace file per session: <dir>/<session id>.msgpack.")
        loader.add_option("intercept_sessions", Optional[str], None, "A JSON file with a list of session configs, loaded at start.")
        loader.add_option(
            "intercept_admin_token", Optional[str], None,
            "Bearer token for the control API. Unset: a random one is written (mode 0600) to <confdir>/interceptor-admin-token.",
        )
        loader.add_option("intercept_upstream", Optional[str], None, "Default session: upstream base URL incl. version prefix, e.g. http://127.0.0.1:8000/v1.")
        loader.add_option("intercept_api_key_env", Optional[str], None, "Default session: name of the proxy-side env variable holding the real key.")
        loader.add_option("intercept_model", Optional[str], None, "Default session: model imposed on every request.")
        loader.add_option("intercept_sampling", Optional[str], None, 'Default session: sampling as a JSON object, e.g. {"temperature": 0.7}.')
        loader.add_option("intercept_fsync", str, "turn", "When trace files are fsynced: never, turn (after each turn's records) or seal.")

    def configure(self, updated: set[str]) -> None:
        o = ctx.options
        if "intercept_hosts" in updated:
            hosts = [h.strip().lower() for h in o.intercept_hosts if h.strip()]
            bad = [h for h in hosts if not re.fullmatch(r"[a-z0-9.-]+", h)]
            if bad:
                raise exceptions.OptionsError(f"intercept_hosts: not a host name: {', '.join(bad)}")
            self.hosts = frozenset(hosts)
        if "intercept_trace_dir" in updated:
            self.trace_dir = Path(os.path.expanduser(o.intercept_trace_dir))
            try:
                self.trace_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise exceptions.OptionsError(f"intercept_trace_dir: cannot create {self.trace_dir}: {e}") from e
        if "intercept_fsync" in updated:
            if o.intercept_fsync not in FSYNC_POLICIES:
                raise exceptions.OptionsError(
                    f"intercept_fsync must be one of {', '.join(FSYNC_POLICIES)}, got {o.intercept_fsync!r}"
                )
            self.fsync = o.intercept_fsync
        if "intercept_admin_token" in updated and o.intercept_admin_token is not None:
            if len(o.intercept_admin_token) < 16:
                raise exceptions.OptionsError("intercept_admin_token must be at least 16 characters")
            self.admin_token = o.intercept_admin_token
        if updated & {"intercept_upstream", "intercept_api_key_env", "intercept_model", "intercept_sampling"}:
            self.default_config = self._default_config()
        if "intercept_sessions" in updated and o.intercept_sessions:
            self.file_configs = self._load_sessions_file(o.intercept_sessions)
        self._impose_proxy_settings(updated)
        if self.started and "intercept_sessions" in updated and self.file_configs:
            self._create_sessions(self.file_configs)

    def _default_config(self) -> SessionConfig:
        o = ctx.options
        sampling = Sampling()
        if o.intercept_sampling:
            try:
                raw = json.loads(o.intercept_sampling)
                sampling = Sampling.model_validate(raw)
            except ValueError as e:
                detail = format_validation_error(e) if isinstance(e, ValidationError) else str(e)
                raise exceptions.OptionsError(f"intercept_sampling: {detail}") from e
        try:
            upstream = UpstreamConfig(base_url=o.intercept_upstream, api_key_env=o.intercept_api_key_env)
        except ValidationError as e:
            raise exceptions.OptionsError(f"intercept_upstream: {format_validation_error(e)}") from e
        return SessionConfig(id="default", model=o.intercept_model, sampling=sampling, upstream=upstream)

    def _load_sessions_file(self, name: str) -> list[SessionConfig]:
        path = Path(os.path.expanduser(name))
        try:
            raw = json.loads(path.read_text())
        except OSError as e:
            raise exceptions.OptionsError(f"intercept_sessions: cannot read {path}: {e}") from e
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
        return configs

    def _impose_proxy_settings(self, updated: set[str]) -> None:
        """What the proxy cannot work without; see the module docstring."""
        o = ctx.options
        changes: dict[str, Any] = {}
        if o.connection_strategy != "lazy":
            # eager connects to the provider on CONNECT, before any addon can answer a claim
            # or redirect the flow to the session's upstream.
            changes["connection_strategy"] = "lazy"
        allow = sorted(rf"^{re.escape(h)}(:\d+)?$" for h in self.hosts)
        if list(o.allow_hosts) != allow:
            changes["allow_hosts"] = allow
        if not self.started and o.listen_host == "":
            changes["listen_host"] = "127.0.0.1"  # the proxy holds real keys
            self._rebind = True
        if changes:
            o.update(**changes)

    def running(self) -> None:
        if self.started:
            return
        self.started = True
        if self._rebind:
            # mitmproxy loads a script while its servers are already binding, so the
            # loopback default above came too late for them: restart them on it. (Pass
            # --listen-host to bind right from the start; `make run` does.)
            ctx.options.update(server=False)
            ctx.options.update(server=True)
        confdir = Path(os.path.expanduser(ctx.options.confdir))
        confdir.mkdir(parents=True, exist_ok=True)
        if self.admin_token is None:
            # Prefixed: a bare token_urlsafe starts with "-" one time in 64, and then reads as
            # an option to every command line it is pasted into.
            self.admin_token = "ic-admin-" + secrets.token_urlsafe(32)
            _write_private(confdir / TOKEN_FILE, self.admin_token + "\n")
        self.bundle_path = self._write_ca_bundle(confdir)
        # The token estimator's BPE table takes ~0.3 s to build: never on the event loop.
        threading.Thread(target=warm_estimator, name="interceptor-warm", daemon=True).start()
        if self.file_configs:
            self._create_sessions(self.file_configs)
            log.info(f"interceptor: {len(self.file_configs)} session(s) from {ctx.options.intercept_sessions}")
        else:
            session = self.registry.create(self.default_config, self.trace_dir, self.fsync)
            self._banner(session)

    def _create_sessions(self, configs: list[SessionConfig]) -> None:
        for config in configs:
            if config.id and self.registry.get(config.id):
                continue
            self.registry.create(config, self.trace_dir, self.fsync)

    def done(self) -> None:
        self.registry.seal_all("proxy_shutdown")
        self.registry.store.close()

    # -- what a harness needs -------------------------------------------------------------

    def proxy_url(self) -> str:
        host = ctx.options.listen_host or "127.0.0.1"
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1"
        return f"http://{host}:{ctx.options.listen_port or 8080}"

    def harness_env(self, session: Session) -> dict[str, str]:
        env = {"HTTPS_PROXY": self.proxy_url(), "https_proxy": self.proxy_url()}
        env.update({k: session.model_secret for k in KEY_VARIABLES})
        if self.bundle_path:
            env.update({k: str(self.bundle_path) for k in CA_VARIABLES})
        return env

    def _write_ca_bundle(self, confdir: Path) -> Path | None:
        """mitmproxy's CA plus the system roots: clients that replace their trust store with
        the file (``SSL_CERT_FILE``, ``REQUESTS_CA_BUNDLE``) must still reach every host the
        proxy passes through untouched."""
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
        bundle = confdir / BUNDLE_FILE
        bundle.write_text("\n".join(parts))
        return bundle

    def _banner(self, session: Session) -> None:
        """The ready-to-paste environment of the default session. The secret itself goes to
        files of mode 0600 beside the CA and the log names them: a secret never stands in a
        log line, and ``source`` of the env file (or the exports below) is all a harness needs."""
        confdir = Path(os.path.expanduser(ctx.options.confdir))
        env = self.harness_env(session)
        secret_file = confdir / SECRET_FILE
        env_file = confdir / ENV_FILE
        _write_private(secret_file, session.model_secret + "\n")
        _write_private(env_file, "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()))
        lines = [
            f"interceptor: ready; default session {session.id!r} records to {session.trace_path}",
            f"interceptor: CA certificate: {confdir / 'mitmproxy-ca-cert.pem'}",
            "interceptor: point a harness at the proxy with:",
            f"  source {shlex.quote(str(env_file))}",
            "interceptor: or, variable by variable:",
        ]
        for k, v in env.items():
            if k == "https_proxy":
                continue
            value = f'"$(cat {shlex.quote(str(secret_file))})"' if v == session.model_secret else shlex.quote(v)
            lines.append(f"  export {k}={value}")
        for line in lines:
            log.info(line)


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)

"""Shared fixtures: the provider simulator, a real mitmdump with the entry script, and the
real SDK clients pointed at it with ``HTTPS_PROXY`` and nothing else (default base URLs)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from mitm import MitmProcess
from provider import ProviderSimulator

REAL_KEY = "sk-real-provider-key-for-tests-0123456789"
KEY_ENV = "INTERCEPT_TEST_PROVIDER_KEY"


def dead_upstream() -> str:
    """intercept_upstreams declaring ``dead``: an upstream nothing listens on (a free port)."""
    from mitm import free_port

    return json.dumps({"dead": {"base_url": f"http://127.0.0.1:{free_port()}/v1", "api_key_env": KEY_ENV}})


@pytest.fixture(autouse=True)
def _no_ambient_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(k, raising=False)


@pytest.fixture
def sim() -> Iterator[ProviderSimulator]:
    with ProviderSimulator() as s:
        yield s


@pytest.fixture
def start_proxy(sim: ProviderSimulator):
    """Start a proxy whose default session goes to the simulator; returns the process."""
    started: list[MitmProcess] = []

    def start(options: dict | None = None, env: dict | None = None, **kw) -> MitmProcess:
        opts = {"intercept_upstream": sim.url("/v1"), "intercept_api_key_env": KEY_ENV,
                "intercept_upstreams": dead_upstream()}
        opts.update(options or {})
        proc = MitmProcess(options=opts, env={KEY_ENV: REAL_KEY, **(env or {})}, **kw)
        started.append(proc)
        return proc.start()

    yield start
    for p in started:
        p.cleanup()


@pytest.fixture
def proxy(start_proxy) -> MitmProcess:
    return start_proxy()


@pytest.fixture
def new_session(proxy: MitmProcess, sim: ProviderSimulator):
    """Create a session through the control API whose upstream is the simulator."""

    def create(**config) -> dict:
        config.setdefault("upstream", {"base_url": sim.url("/v1")})
        return proxy.create_session(**config)

    return create


@pytest.fixture
def harness_env(monkeypatch: pytest.MonkeyPatch):
    """Apply a session's ``env`` (as the control API returns it) to this process, so the
    SDKs made afterwards go through the proxy exactly as a harness would."""

    def apply(env: dict[str, str]) -> None:
        for k, v in env.items():
            monkeypatch.setenv(k, v)

    return apply


def session_clients(session: dict):
    """openai and anthropic clients for a session: default base URLs, the session secret as
    the key, the proxy and CA from the environment (``harness_env`` must be applied first)."""
    import anthropic
    import openai

    assert os.environ.get("HTTPS_PROXY"), "apply the session env first"
    secret = session["model_secret"]
    return (
        openai.OpenAI(api_key=secret, max_retries=0, timeout=30),
        anthropic.Anthropic(api_key=secret, max_retries=0, timeout=30),
    )

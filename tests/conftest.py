"""Shared fixtures: the provider simulator, a real mitmdump with the entry script, and the
real SDK clients pointed at it with ``HTTPS_PROXY`` and nothing else (default base URLs)."""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterator

# Before anything imports interceptor.trace, and inherited by every proxy the tests start
# (directly or through run_harness): a value msgpack cannot pack is an error, not a string
# in the file (trace/store.py STRICT_PACK).
os.environ["INTERCEPT_TEST_STRICT_PACK"] = "1"

import pytest

from clients import KEY_ENV, REAL_KEY, dead_upstream
from interceptor.client.proxy import PROXY_VARIABLES
from interceptor.trace import Store
from interceptor.trace import store as store_module
from mitm import MitmProcess
from provider import ProviderSimulator

# Which tests are which, to run a part of the suite (docs/development/testing.md): `proxy` tests
# start a real mitmdump (through a fixture, MitmProcess or run_harness), `harness` tests also
# run a real harness CLI; everything else is the fast in-process part.
PROXY_FIXTURES = {"proxy", "start_proxy", "new_session", "mproxy", "hproxy"}
RUNS_PROXIES = {"test_run_harness.py"}  # through scripts/run_harness.py


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        name = item.path.name
        if name.startswith("test_harness_"):
            item.add_marker(pytest.mark.harness)
        if (name.startswith("test_harness_") or name in RUNS_PROXIES or PROXY_FIXTURES & set(item.fixturenames)
                or "MitmProcess" in vars(item.module)):
            item.add_marker(pytest.mark.proxy)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed test's report ends with the last lines of every mitmdump still running: a
    module-scoped proxy that stopped answering is otherwise gone, log and all, by the time
    anyone looks."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.when in ("setup", "call"):
        for proc in list(MitmProcess.live.values()):
            tail = "\n".join(proc.log().splitlines()[-80:])
            report.sections.append((f"mitmdump on port {proc.port} (last 80 lines)", tail))


@pytest.fixture(autouse=True)
def _no_ambient_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in PROXY_VARIABLES:
        monkeypatch.delenv(k, raising=False)


@pytest.fixture(autouse=True)
def _stores_stopped(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every trace Store a test makes (directly, through a Recorder helper, or through the
    addons in-process) is drained and stopped when the test ends, and its exit hook removed:
    a writer thread left running writes into the next test's time, and hundreds of tests
    would pile up exit hooks until the interpreter ends. (A module-scoped fixture's store
    lives as long as its module: it closes it itself.)"""
    made: list[Store] = []
    init = Store.__init__
    monkeypatch.setattr(store_module, "STRICT_PACK", True)  # whatever imported the store first

    def tracked(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Store, "__init__", tracked)
    yield
    for s in made:
        s.close()
        atexit.unregister(s._atexit)


@pytest.fixture
def sim() -> Iterator[ProviderSimulator]:
    """Strict (tests/provider/strict.py): what reaches it must be what the real APIs accept."""
    with ProviderSimulator(strict=True) as s:
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

"""Chain (addons/chain.py): mitmproxy dispatching to one ``Chain`` of steps does exactly what it
did walking the same steps listed as one script's addons: the same hooks of the same steps in
the same order, an exception ending that hook's walk there, ``load``/``configure``/``done``
called synchronously, a Guard's fault kept on the flow as before."""

from __future__ import annotations

import asyncio
import logging

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from mitmproxy import command, hooks
from mitmproxy.proxy.layers.http import HttpRequestHeadersHook, HttpRequestHook, HttpResponseHook
from mitmproxy.proxy.server_hooks import ClientConnectedHook
from mitmproxy.test import taddons, tflow

from interceptor.addons.chain import Chain
from interceptor.addons.gate import FAULT_KEY, Fault, Guard

FLOW = ("requestheaders", "request", "response")
OTHER = ("load", "configure", "done", "client_connected")
SYNC_ONLY = ("load", "configure", "done")  # mitmproxy calls these without an event loop


class Boom(RuntimeError):
    pass


class Listed:
    """The old wiring: the steps as the sub-addons of one object, as mitmproxy's Script holds a
    script's module and the module its ``addons`` list."""

    def __init__(self, steps):
        self.addons = steps


def make_step(i: int, spec: dict[str, tuple[bool, bool]], log: list) -> object:
    """A step with the hooks in ``spec`` (name -> (async, raises)); each call is logged."""

    def hook(name: str, is_async: bool, raises: bool):
        def record(*args):
            log.append((i, name))
            if raises:
                raise Boom(f"step {i} {name}")
        if is_async:
            async def ahook(self, *args):
                await asyncio.sleep(0)
                record(*args)
            return ahook
        return lambda self, *args: record(*args)

    cls = type(f"Step{i}", (), {name: hook(name, a, r) for name, (a, r) in spec.items()})
    step = cls()
    step.name = f"step{i}"
    return step


hook_spec = st.tuples(st.booleans(), st.booleans())
step_spec = st.tuples(
    st.booleans(),  # guarded
    st.dictionaries(st.sampled_from(FLOW + OTHER), hook_spec, max_size=len(FLOW + OTHER)),
)


def run(wiring: str, specs, caplog) -> tuple[list, list, list]:
    """Every kind of event through mitmproxy's AddonManager; what ran, what mitmproxy logged as
    an addon error, and the faults left on the flows."""
    log: list = []
    steps = []
    for i, (is_guarded, spec) in enumerate(specs):
        # load runs at registration, outside mitmproxy's safecall: a raising one is a start-up failure
        spec = {n: (False if n in SYNC_ONLY else a, r and n != "load") for n, (a, r) in spec.items()}
        step = make_step(i, spec, log)
        steps.append(Guard(step) if is_guarded else step)
    addon = Chain(steps) if wiring == "chain" else Listed(steps)
    caplog.clear()
    flows = []
    with caplog.at_level(logging.ERROR), taddons.context(addon) as tctx:
        try:
            loop = tctx.master.event_loop
            tctx.master.addons.trigger(hooks.ConfigureHook({"x"}))
            loop.run_until_complete(tctx.master.addons.handle_lifecycle(ClientConnectedHook(tflow.tclient_conn())))
            for event in (HttpRequestHeadersHook, HttpRequestHook, HttpResponseHook):
                f = tflow.tflow(resp=event is HttpResponseHook)
                flows.append(f)
                loop.run_until_complete(tctx.master.addons.handle_lifecycle(event(f)))
            tctx.master.addons.trigger(hooks.DoneHook())
        finally:
            tctx.master._legacy_log_events.uninstall()  # several masters in one test: no stale handler
    errors = [r.getMessage().split("\n")[0] for r in caplog.records if r.levelno >= logging.ERROR]
    faults = [f.metadata.get(FAULT_KEY) for f in flows]
    return log, errors, faults


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(step_spec, min_size=1, max_size=6))
def test_the_chain_runs_what_the_listed_steps_ran_in_the_same_order(specs, caplog):
    listed = run("listed", specs, caplog)
    chained = run("chain", specs, caplog)
    assert chained == listed


def test_an_exception_ends_that_hooks_walk_and_mitmproxy_logs_it(caplog):
    log, errors, faults = run("chain", [(False, {"request": (False, False)}),
                                         (False, {"request": (True, True), "response": (False, False)}),
                                         (False, {"request": (False, False), "response": (True, False)})], caplog)
    assert [e for e in log if e[1] in FLOW] == [(0, "request"), (1, "request"), (1, "response"), (2, "response")]
    assert any("Addon error: step 1 request" in e for e in errors)


def test_a_guarded_fault_stays_on_the_flow_and_later_request_hooks_are_skipped(caplog):
    log, errors, faults = run("chain", [(True, {"request": (False, True)}), (True, {"request": (True, False)}),
                                         (False, {"request": (False, False)})], caplog)
    assert [e for e in log if e[1] == "request"] == [(0, "request"), (2, "request")]
    assert faults[1] == Fault("Step0.request", "raised Boom")
    assert not any("Addon error" in e for e in errors)  # the Guard caught it, as before


def test_sync_hooks_stay_sync_and_a_single_step_hook_is_the_steps_own():
    class A:
        def configure(self, updated): ...
        async def request(self, flow): ...

    class B:
        def configure(self, updated): ...
        def request(self, flow): ...

    a = A()
    chain = Chain([a, B()])
    assert not asyncio.iscoroutinefunction(chain.configure)
    assert asyncio.iscoroutinefunction(chain.request)
    assert Chain([a]).configure == a.configure
    assert not hasattr(chain, "response")  # no step has it: mitmproxy finds nothing to call


def test_a_hook_replaced_on_a_guarded_addon_takes_effect():
    """tests/faults.py injects its faults so, after the Chain was built."""
    class A:
        def request(self, flow):
            flow.metadata["ran"] = "original"

    a = A()
    chain = Chain([Guard(a)])
    a.request = lambda flow: flow.metadata.__setitem__("ran", "replaced")
    f = tflow.tflow()
    chain.request(f)
    assert f.metadata["ran"] == "replaced"


def test_sub_addons_and_commands_are_refused_not_dropped():
    class Parent:
        addons: list = []

    class Commanding:
        @command.command("chain.test")
        def go(self) -> None: ...

    with pytest.raises(TypeError, match="sub-addons"):
        Chain([Guard(Parent())])
    with pytest.raises(TypeError, match="commands"):
        Chain([Commanding()])


def test_the_script_is_one_chain_of_its_steps():
    from test_addons import _load_script

    script = _load_script()
    (chain,) = script.addons
    assert isinstance(chain, Chain) and chain.steps == script.steps
    with taddons.context(chain) as tctx:  # mitmproxy registers it under one name
        assert tctx.master.addons.get("interceptor") is chain

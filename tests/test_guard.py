"""The guard (addons/mitm/gate.py ``guard``) through mitmproxy's own AddonManager: a fault in a
guarded flow hook stays on the flow, the later addons' request hooks skip that flow, the
rest run, and mitmproxy logs no "Addon error" (an error it logs ends the script's walk for
that hook: the Gate would not run). The guard touches only the addon object it is given."""

from __future__ import annotations

import asyncio
import logging

from hypothesis import HealthCheck, given, settings, strategies as st
from mitmproxy.addonmanager import AddonManager
from mitmproxy.proxy.layers.http import HttpRequestHeadersHook, HttpRequestHook, HttpResponseHook
from mitmproxy.test import taddons, tflow

from interceptor.addons.gateway.faults import FAULT_KEY, Fault
from interceptor.addons.mitm.gate import GUARDED, guard, guarded

EVENTS = {"requestheaders": HttpRequestHeadersHook, "request": HttpRequestHook, "response": HttpResponseHook}
REQUEST_SIDE = ("requestheaders", "request")


class Boom(RuntimeError):
    pass


class Script:
    """Stands for a loaded script: mitmproxy holds its addons as the module's sub-addons."""

    def __init__(self, addons):
        self.addons = addons


def make_step(i: int, spec: dict[str, tuple[bool, bool]], log: list) -> object:
    """Step ``i`` with the hooks in ``spec`` (name -> (async, raises)); each call is logged."""

    def hook(name: str, is_async: bool, raises: bool):
        def record(flow):
            log.append((i, name, flow.id))
            if raises:
                raise Boom(f"step {i} {name}")
        if is_async:
            async def ahook(self, flow):
                await asyncio.sleep(0)
                record(flow)
            return ahook
        return lambda self, flow: record(flow)

    return type(f"Step{i}", (), {name: hook(name, a, r) for name, (a, r) in spec.items()})()


def run(steps: list, caplog) -> tuple[list, list]:
    """One flow through each event; the errors mitmproxy logged and the flows."""
    caplog.clear()
    flows = []
    with caplog.at_level(logging.ERROR), taddons.context(Script(steps)) as tctx:
        loop = tctx.master.event_loop
        try:
            for name, event in EVENTS.items():
                f = tflow.tflow(resp=name == "response")
                flows.append(f)
                loop.run_until_complete(tctx.master.addons.handle_lifecycle(event(f)))
        finally:
            loop.run_until_complete(tctx.master.done())  # its log handlers go with it: several masters here
    errors = [r.getMessage().split("\n")[0] for r in caplog.records if r.levelno >= logging.ERROR]
    return errors, flows


hook_spec = st.tuples(st.booleans(), st.booleans())  # (async, raises)
step_spec = st.dictionaries(st.sampled_from(list(EVENTS)), hook_spec, max_size=len(EVENTS))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(step_spec, min_size=1, max_size=6))
def test_guarded_steps_keep_the_first_fault_and_skip_only_later_request_hooks(specs, caplog):
    log: list = []
    errors, flows = run(guarded([make_step(i, spec, log) for i, spec in enumerate(specs)]), caplog)
    assert not any("Addon error" in e for e in errors)
    for f, name in zip(flows, EVENTS):
        expected, fault = [], None
        for i, spec in enumerate(specs):
            if name not in spec or (fault is not None and name in REQUEST_SIDE):
                continue
            expected.append((i, name, f.id))
            if spec[name][1] and fault is None:
                fault = Fault(f"Step{i}.{name}", "raised Boom")
        assert [e for e in log if e[2] == f.id] == expected
        assert f.metadata.get(FAULT_KEY) == fault


def test_without_the_guard_mitmproxy_logs_the_error_and_skips_the_rest_of_the_script(caplog):
    """Why the guard exists: unguarded, the later addons' hook (the Gate's) never runs."""
    log: list = []
    errors, flows = run([make_step(0, {"request": (False, True)}, log), make_step(1, {"request": (False, False)}, log)],
                        caplog)
    assert [e[:2] for e in log] == [(0, "request")]
    assert any("Addon error: step 0 request" in e for e in errors)


def test_the_guard_is_set_on_the_addon_object_and_nothing_else():
    class A:
        def request(self, flow):
            flow.metadata["ran"] = "original"

        async def response(self, flow):
            flow.metadata["answered"] = True

        def configure(self, updated):
            pass

    a = A()
    assert guard(a) is a and guard(a) is a  # twice: guarded once
    assert getattr(a.request, GUARDED) == "A.request" and a.request.__wrapped__.__func__ is A.request
    assert not hasattr(a.request.__wrapped__, GUARDED)
    assert asyncio.iscoroutinefunction(a.response)
    assert A.request.__qualname__ == "test_the_guard_is_set_on_the_addon_object_and_nothing_else.<locals>.A.request"
    assert a.configure.__func__ is A.configure  # not a flow hook: the addon's own
    assert set(vars(a)) == {"request", "response"}
    with taddons.context(a) as tctx:
        assert not set(vars(tctx.master.addons)) & set(vars(AddonManager))  # mitmproxy's methods are its own


def test_a_hook_replaced_inside_the_guard_takes_effect_and_stays_guarded():
    """tests/faults.py injects its faults so, into the running proxy's guarded hooks."""
    class A:
        def request(self, flow):
            flow.metadata["ran"] = "original"

    a = guard(A())

    def replaced(flow):
        flow.metadata["ran"] = "replaced"
        raise Boom("injected")

    a.request.__wrapped__ = replaced
    f = tflow.tflow()
    a.request(f)
    assert f.metadata["ran"] == "replaced"
    assert f.metadata[FAULT_KEY] == Fault("A.request", "raised Boom")

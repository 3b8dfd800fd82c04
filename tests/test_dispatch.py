"""Dispatch (addons/dispatch.py): mitmproxy's ``trigger_event`` from plans does what mitmproxy's
own walk over every addon does: the same hooks of the same addons in the same order (sub-addons
included), an exception logged as mitmproxy logs it and ending only that addon's branch,
``AddonHalt`` ending the walk, ``OptionsError`` reaching the caller, falsy and module-valued
hook attributes skipped, a non-callable one an "Addon error" at its place; and a plan made
again when addons are registered, removed or reordered. Then, against a real mitmdump: one of
mitmproxy's own addons (``modify_headers``) still acts on a claimed request with the plans, and
``intercept_fast_dispatch false`` leaves mitmproxy's walk in place."""

from __future__ import annotations

import asyncio
import json
import logging
import types

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from mitmproxy import addonmanager, exceptions, hooks
from mitmproxy.proxy.layers.http import HttpRequestHook, HttpResponseHook
from mitmproxy.test import taddons, tflow

from interceptor.addons.dispatch import Planned, install, uninstall


EVENTS = ("request", "response", "update")
# What a hook attribute of an addon can be: a sync or async method (raising or not, halting
# the walk), nothing, or what mitmproxy's walk skips or refuses.
KINDS = ("sync", "async", "raises", "async_raises", "halt", "none", "module", "not_callable")


class Boom(RuntimeError):
    pass


def make_addon(path: str, spec: dict[str, str], log: list, children: list) -> object:
    attrs: dict = {}
    for name, kind in spec.items():
        def hook(self, *args, name=name, kind=kind):
            log.append((path, name))
            if kind in ("raises", "async_raises"):
                raise Boom(f"{path} {name}")
            if kind == "halt":
                raise exceptions.AddonHalt()

        if kind in ("sync", "raises", "halt"):
            attrs[name] = hook
        elif kind in ("async", "async_raises"):
            async def ahook(self, *args, hook=hook):
                await asyncio.sleep(0)
                hook(self, *args)
            attrs[name] = ahook
        elif kind == "none":
            attrs[name] = None
        elif kind == "module":
            attrs[name] = types.ModuleType(name)
        else:
            attrs[name] = 5
    attrs["__repr__"] = lambda self: f"A{path}"  # the same in both runs' error messages
    addon = type(f"A{path}", (), attrs)()
    addon.name = f"a{path}"
    if children:
        addon.addons = children
    return addon


spec_st = st.dictionaries(st.sampled_from(EVENTS), st.sampled_from(KINDS), max_size=len(EVENTS))
tree_st = st.lists(st.tuples(spec_st, st.lists(spec_st, max_size=2)), min_size=1, max_size=6)


async def walk(manager, events) -> list:
    """Each event through ``trigger_event``; the OptionsError it let through, if any."""
    out = []
    for e in events:
        try:
            await manager.trigger_event(e)
        except exceptions.OptionsError as err:
            out.append(str(err))
    return out


def run(tree, planned: bool, caplog) -> tuple[list, list, list]:
    log: list = []
    caplog.clear()
    with caplog.at_level(logging.ERROR), taddons.context() as tctx:
        manager = tctx.master.addons
        for i, (spec, kids) in enumerate(tree):
            children = [make_addon(f"{i}.{j}", k, log, []) for j, k in enumerate(kids)]
            manager.add(make_addon(str(i), spec, log, children))
        if planned:
            assert isinstance(install(manager), Planned)
        f = tflow.tflow(resp=True)
        events = [HttpRequestHook(f), HttpResponseHook(f), hooks.UpdateHook([f]), HttpRequestHook(f)]
        try:
            passed = tctx.master.event_loop.run_until_complete(walk(manager, events))
        finally:
            tctx.master._legacy_log_events.uninstall()  # several masters in one test: no stale handler
    return log, addon_errors(caplog), passed


def addon_errors(caplog) -> list:
    """Each "Addon error" logged, with the function its traceback starts in for a hook's own
    exception (mitmproxy's starts in the hook; for a hook that is not callable, in its own
    code, which is not the point here)."""
    out = []
    for r in caplog.records:
        if r.getMessage().startswith("Addon error"):
            etype, _, tb = r.exc_info or (None, None, None)
            out.append((r.getMessage(), tb.tb_frame.f_code.co_name if etype is Boom else None))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=tree_st)
def test_plans_walk_as_mitmproxy_does(tree, caplog):
    own = run(tree, False, caplog)
    planned = run(tree, True, caplog)
    assert planned == own


def test_errors_are_logged_with_the_traceback(caplog):
    """One case spelt out: the raising hook logged as mitmproxy's safecall logs it, the next
    child of that addon skipped, the next addon called."""
    log: list = []
    with caplog.at_level(logging.ERROR), taddons.context() as tctx:
        manager = tctx.master.addons
        manager.add(make_addon("0", {"request": "raises"}, log, [make_addon("0.0", {"request": "sync"}, log, [])]))
        manager.add(make_addon("1", {"request": "async"}, log, []))
        install(manager)
        try:
            tctx.master.event_loop.run_until_complete(manager.trigger_event(HttpRequestHook(tflow.tflow())))
        finally:
            tctx.master._legacy_log_events.uninstall()
    assert log == [("0", "request"), ("1", "request")]
    assert addon_errors(caplog) == [("Addon error: 0 request", "hook")]  # the traceback starts in the hook


def test_a_plan_is_made_again_when_addons_change():
    log: list = []
    with taddons.context() as tctx:
        manager = tctx.master.addons
        first = make_addon("0", {"request": "sync"}, log, [])
        manager.add(first)
        planned = install(manager)
        assert install(manager) is planned  # a reloaded script finds it installed
        f = tflow.tflow()

        def fire() -> list:
            log.clear()
            tctx.master.event_loop.run_until_complete(manager.trigger_event(HttpRequestHook(f)))
            return [p for p, _ in log]

        assert fire() == ["0"]
        manager.add(make_addon("1", {"request": "sync"}, log, []))  # register
        assert fire() == ["0", "1"]
        manager.remove(first)
        assert fire() == ["1"]
        # A sub-addon list changed in place, then a configure (as the script loader reorders
        # its scripts in its configure hook): the next event sees the new order.
        holder = make_addon("2", {}, log, [make_addon("2.0", {"request": "sync"}, log, [])])
        manager.add(holder)
        assert fire() == ["1", "2.0"]
        holder.addons.insert(0, make_addon("2.1", {"request": "sync"}, log, []))
        manager.trigger(hooks.ConfigureHook(set()))
        assert fire() == ["1", "2.1", "2.0"]
        uninstall(manager)
        assert "trigger_event" not in manager.__dict__
        assert fire() == ["1", "2.1", "2.0"]
        tctx.master._legacy_log_events.uninstall()


def test_a_log_record_keeps_the_plans(monkeypatch, caplog):
    """mitmproxy triggers ``add_log`` for every log record (its handler, ``call_soon_threadsafe``:
    a streamed answer's "Streaming response from ..." line, once a stream): the plans are kept,
    where each hook of the next turn walked the whole chain again. A configure still remakes them."""
    import interceptor.addons.dispatch as dispatch

    made: list[str] = []
    real = dispatch.plan_for
    monkeypatch.setattr(dispatch, "plan_for", lambda chain, name: made.append(name) or real(chain, name))
    log: list = []
    with caplog.at_level(logging.INFO), taddons.context() as tctx:
        manager = tctx.master.addons
        manager.add(make_addon("0", {"request": "sync", "add_log": "sync"}, log, []))
        install(manager)
        loop = tctx.master.event_loop
        try:
            fire = lambda: loop.run_until_complete(manager.trigger_event(HttpRequestHook(tflow.tflow())))  # noqa: E731
            fire()
            assert made == ["request"]
            log.clear()
            logging.getLogger("mitmproxy.proxy.layers.http").info("Streaming response from 127.0.0.1.")
            loop.run_until_complete(asyncio.sleep(0.01))  # the handler's call_soon_threadsafe runs
            assert ("0", "add_log") in log  # the record did reach the addons by ``trigger``
            fire()
            assert made == ["request"]
            manager.trigger(hooks.ConfigureHook(set()))
            fire()
            assert made == ["request", "request"]
        finally:
            tctx.master._legacy_log_events.uninstall()


def test_not_installed_on_another_manager():
    class Other(addonmanager.AddonManager):
        pass

    with taddons.context() as tctx:
        other = Other(tctx.master)
        assert install(other) is None
        assert "trigger_event" not in other.__dict__
        tctx.master._legacy_log_events.uninstall()


def test_not_installed_under_another_mitmproxy(monkeypatch):
    """Another major version of mitmproxy may walk its addons otherwise: its own walk stays."""
    from mitmproxy import version

    monkeypatch.setattr(version, "VERSION", "13.0.0")
    with taddons.context() as tctx:
        assert install(tctx.master.addons) is None
        assert "trigger_event" not in tctx.master.addons.__dict__
        tctx.master._legacy_log_events.uninstall()


INSTALLED = "mitmproxy's hook dispatch goes by plans"
URL = "https://api.openai.com/v1/chat/completions"


@pytest.mark.parametrize("fast", [True, False])
def test_mitmproxys_own_addons_still_act(start_proxy, sim, fast):
    """``modify_headers`` (one of mitmproxy's addons, a ``request`` hook) adds a header to a
    claimed request, with the plans and without them; the log says which dispatch runs."""
    proxy = start_proxy({"intercept_fast_dispatch": str(fast).lower(),
                         "modify_headers": "/~q/x-added-by-mitmproxy/yes"})
    s = proxy.create_session(upstream={"base_url": sim.url("/v1")})
    with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=30) as c:
        for k in range(3):
            body = {"model": "gpt-4o", "messages": [{"role": "user", "content": f"turn {k}"}]}
            r = c.post(URL, content=json.dumps(body).encode(), headers={
                "authorization": f"Bearer {s['model_secret']}", "content-type": "application/json"})
            assert r.status_code == 200, r.text
    seen = [req.headers.get("x-added-by-mitmproxy") for req in sim.model_requests()]
    assert seen == ["yes"] * 3
    assert (INSTALLED in proxy.log()) is fast

"""Dispatch: mitmproxy's walk over its addons for each flow event, done from a plan.

For every event of every flow (``requestheaders``, ``request``, ``responseheaders``,
``response``, and the ``update`` mitmproxy sends after each) mitmproxy's ``AddonManager``
walks all of its ~40 addons: per addon a ``contextlib`` context manager, a coroutine, two
nested generators (``traverse`` and ``_iter_hooks``), a ``getattr`` that mostly finds nothing,
and the event's arguments rebuilt by ``dataclasses.fields`` for each hook found. Profiled on
sequential 20 KB JSON turns, that walk was over a third of bare mitmdump's own CPU per request
and the same share of this proxy's (issue 16, docs/benchmarks.md "mitmproxy's dispatch from a
plan"). ``Chain`` already made the script's own two dozen addons one addon of that walk; this
makes the walk itself cheap: for each hook name, the addons that implement it are found once
(a plan), and an event calls just those.

What stays exactly as mitmproxy's ``trigger_event`` does it:

- the addons in chain order, each top-level addon with its sub-addons (``addons``) in
  ``traverse`` order; a hook attribute that is falsy or a module is skipped, one that is not
  callable raises ``AddonManagerError`` at its place in the walk;
- an exception in a hook is logged as mitmproxy's ``safecall`` logs it ("Addon error", the
  traceback) and skips the rest of that top-level addon's branch, not the later addons;
  ``AddonHalt`` ends the walk; ``OptionsError`` propagates;
- sync and async hooks alike (an awaitable result is awaited in place).

When the plan is made again: after ``register``, ``remove`` or ``clear`` (a script loaded,
reloaded or unloaded registers and removes its module), after every synchronous ``trigger``
(``configure`` among them: the script loader reorders its scripts there) but the log's, and
whenever the chain list is another or has another length. The log's is ``add_log``, which
mitmproxy's log handler triggers for every log record (``mitmproxy/log.py``: "Streaming
response from ..." once a streamed answer, the connection lines, this script's own lines);
its handlers (deprecated since mitmproxy 9) have no reason to reorder addons, and one that
registers or removes one makes the plan again anyway. Made again after each of those, every
hook of the next streamed turn walked the whole chain again: 0.1-0.2 ms a stream (issue 16,
docs/benchmarks.md "Each stream's work and each event's, at a provider's pace"). Only ``trigger_event`` (the flow events, through
``handle_lifecycle``) uses the plan; mitmproxy's other entry points are left as they are.
A hook method replaced on an addon instance after the plan was made is not seen until the
plan is made again (as for ``Chain``); mitmproxy's own addons never do that.

Applied only to mitmproxy 12's own ``AddonManager`` class (the one this mirrors: a subclass or
another major version may walk differently); otherwise, or with ``intercept_fast_dispatch
false``, mitmproxy's own walk is left in place.
"""

from __future__ import annotations

import inspect
import logging
import sys
import types
from collections.abc import Callable
from typing import Any

from mitmproxy import addonmanager, ctx, exceptions, hooks, version
from mitmproxy.log import AddLogHook

log = logging.getLogger(__name__)

# A plan: per top-level addon that has the hook, its (addon, hook) pairs in traverse order;
# ``None`` as a hook: not callable, raise mitmproxy's AddonManagerError there.
Plan = list[list[tuple[Any, Callable | None]]]


def plan_for(chain: list, name: str) -> Plan:
    """The hooks ``name`` of ``chain``'s addons as mitmproxy's walk would find them."""
    plan: Plan = []
    for top in chain:
        found = []
        for a in addonmanager.traverse([top]):
            func = getattr(a, name, None)
            if not func or isinstance(func, types.ModuleType):
                continue
            found.append((a, func if callable(func) else None))
            if not callable(func):
                break  # mitmproxy's walk raises here; nothing after it in this branch runs
        if found:
            plan.append(found)
    return plan


def _log_addon_error() -> None:
    """What mitmproxy's ``safecall`` logs for an exception in a hook: its except clause,
    without its context manager around every branch (part of the cost this module removes)."""
    etype, value, tb = sys.exc_info()
    tb = addonmanager.cut_traceback(tb, "trigger_event")  # starts in the hook, as mitmproxy's does
    addonmanager.logger.error(f"Addon error: {value}", exc_info=(etype, value, tb))


class Planned:
    """The plans of one AddonManager, and the ``trigger_event`` that uses them."""

    def __init__(self, manager: addonmanager.AddonManager) -> None:
        self.manager = manager
        self.plans: dict[str, Plan] = {}
        self.key: tuple[int, int] = (0, -1)

    def invalidate(self) -> None:
        self.plans = {}

    def plan(self, name: str) -> Plan:
        chain = self.manager.chain
        key = (id(chain), len(chain))
        if key != self.key:
            self.plans, self.key = {}, key
        plan = self.plans.get(name)
        if plan is None:
            plan = self.plans[name] = plan_for(chain, name)
        return plan

    async def trigger_event(self, event: hooks.Hook) -> None:
        plan = self.plan(event.name)
        if not plan:
            return
        args = event.args()
        for branch in plan:
            try:
                for a, func in branch:
                    if func is None:
                        raise exceptions.AddonManagerError(f"Addon handler {event.name} ({a}) not callable")
                    res = func(*args)
                    if res is not None and inspect.isawaitable(res):
                        await res
            except exceptions.AddonHalt:
                return
            except exceptions.OptionsError:
                raise
            except Exception:  # noqa: BLE001 - mitmproxy's safecall: logged, the next addon goes on
                _log_addon_error()


def install(manager: addonmanager.AddonManager) -> Planned | None:
    """Make ``manager``'s ``trigger_event`` use plans; the Planned, or None where this does not
    apply (another AddonManager than mitmproxy 12's). Idempotent: a reloaded script finds the
    one installed and only makes it plan again."""
    current = manager.__dict__.get("trigger_event")
    planned = getattr(current, "__self__", None)
    if isinstance(planned, Planned):
        planned.invalidate()
        return planned
    if (type(manager) is not addonmanager.AddonManager or not version.VERSION.startswith("12.")
            or not hasattr(addonmanager, "traverse") or not hasattr(addonmanager, "cut_traceback")):
        return None
    planned = Planned(manager)

    def invalidating(method: Callable) -> Callable:
        def call(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            finally:
                if not (args and args[0].__class__ is AddLogHook):  # the log's (the module docstring)
                    planned.invalidate()
        call.__name__ = method.__name__
        return call

    for name in ("register", "remove", "clear", "trigger"):
        setattr(manager, name, invalidating(getattr(manager, name)))
    manager.trigger_event = planned.trigger_event
    return planned


def uninstall(manager: addonmanager.AddonManager) -> None:
    """mitmproxy's own walk again."""
    for name in ("register", "remove", "clear", "trigger", "trigger_event"):
        manager.__dict__.pop(name, None)


class Dispatch:
    """The step that installs the plans once mitmproxy runs (``intercept_fast_dispatch``)."""

    installed = False

    def load(self, loader) -> None:
        loader.add_option(
            "intercept_fast_dispatch", bool, True,
            "Dispatch each flow event only to the mitmproxy addons that implement it, found once "
            "(the same order and error handling as mitmproxy's walk over every addon); false: "
            "mitmproxy's own walk.")

    def running(self) -> None:
        self._apply()

    def configure(self, updated) -> None:
        if "intercept_fast_dispatch" in updated:
            self._apply()

    def _apply(self) -> None:
        try:
            manager = ctx.master.addons
        except AttributeError:  # not running under a master (in-process tests)
            return
        if not ctx.options.intercept_fast_dispatch:
            uninstall(manager)
        elif install(manager) is None:
            log.info("interceptor: mitmproxy's AddonManager is not the one the fast dispatch knows; "
                     "its own walk stays")
        elif not self.installed:
            self.installed = True
            log.info("interceptor: mitmproxy's hook dispatch goes by plans (intercept_fast_dispatch)")

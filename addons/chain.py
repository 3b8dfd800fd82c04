"""Chain: the script's addons as one addon for mitmproxy, each hook a precomputed list.

mitmproxy dispatches every event (each flow's ``requestheaders``, ``request``,
``responseheaders``, ``response`` and the ``update`` after each, every connection event) by
walking every addon it knows: a context manager, a coroutine and a generator per addon, and a
``getattr`` for the hook that mostly finds nothing (for a ``Guard``, a Python-level
``__getattr__`` raising ``AttributeError``). With this script's two dozen addons listed one by
one that walk cost more per request than several of the hooks it found (issue 16,
docs/benchmarks.md "The hook dispatch"). Listed as one ``Chain``, mitmproxy sees one addon,
and each hook is the list of the steps that implement it, found once at start.

What stays exactly as it was, because mitmproxy's own walk did the same:

- the steps run in list order, each hook of each step (guarded or not) as before;
- an exception in one step's hook skips the later steps' same hook and reaches mitmproxy (it
  logs "Addon error"): the script's addons were one branch of mitmproxy's walk, and an
  exception ended that branch; ``OptionsError`` from ``configure`` reaches the option
  change that caused it;
- a hook is sync when all its steps' are (mitmproxy calls ``load``, ``configure`` and ``done``
  synchronously), else one coroutine awaiting the async steps in their place;
- a step's hook is looked up on the step once; a ``Guard`` looks its addon's hook up at each
  call, so replacing a hook on an addon instance (tests/faults.py) still takes effect.

What a step cannot have here: sub-addons (``addons``) and commands, which mitmproxy only finds
by walking; ``Chain`` refuses them at construction rather than dropping them silently.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from mitmproxy import hooks

from interceptor.addons.gate import Guard

# The modules that define mitmproxy's hooks register them in ``hooks.all_hooks`` on import.
from mitmproxy import addonmanager  # noqa: F401 - load
from mitmproxy.proxy import layers, server_hooks  # noqa: F401 - connection, HTTP, TLS, WebSocket, TCP, UDP, DNS, QUIC hooks


def _hooks_of(step: Any) -> dict[str, Callable]:
    found = {}
    for name in hooks.all_hooks:
        func = getattr(step, name, None)
        if callable(func):
            found[name] = func
    return found


def _dispatcher(name: str, funcs: list[Callable]) -> Callable:
    if len(funcs) == 1:
        return funcs[0]
    if not any(inspect.iscoroutinefunction(f) for f in funcs):
        def dispatch(*args):
            for f in funcs:
                f(*args)
    else:
        async def dispatch(*args):
            for f in funcs:
                res = f(*args)
                if res is not None and inspect.isawaitable(res):
                    await res
    dispatch.__name__ = dispatch.__qualname__ = f"Chain.{name}"
    return dispatch


class Chain:
    """One addon for mitmproxy; ``steps`` in order (see the module docstring)."""

    name = "interceptor"

    def __init__(self, steps: list[Any]) -> None:
        self.steps = list(steps)
        table: dict[str, list[Callable]] = {}
        for step in self.steps:
            inner = step.addon if isinstance(step, Guard) else step
            if hasattr(inner, "addons"):
                raise TypeError(f"{type(inner).__name__}: a step of the Chain cannot have sub-addons")
            for attr in dir(type(inner)):
                if hasattr(getattr(type(inner), attr, None), "command_name"):
                    raise TypeError(f"{type(inner).__name__}.{attr}: a step of the Chain cannot have commands")
            for name, func in _hooks_of(step).items():
                table.setdefault(name, []).append(func)
        for name, funcs in table.items():
            setattr(self, name, _dispatcher(name, funcs))

"""The evaluator's code at the model boundary; users import it as ``interceptor.hooks``.

A hooks module is plain Python that a session names (``"hooks": {"module": ...}``). Its
functions are marked with ``@intercept`` (may rewrite what passes) or ``@stop`` (returns a
bool: true ends the rollout), and say by their annotation where they sit::

    from interceptor.hooks import HookContext, Request, intercept, stop

    @intercept(priority=10)
    def hide_answer(request: Request, ctx: HookContext) -> Request | None:
        ...  # change the content of new tool results; None = unchanged

    @stop(name="budget")
    def enough(ctx: HookContext) -> bool:   # only ctx: runs between turns
        return ctx.num_turns >= ctx.config.get("turns", 10)

One parameter annotated ``Request`` or ``Response`` (``interceptor.trace``'s) picks the
boundary; a parameter annotated ``HookContext`` (or named ``ctx``) gets the context. Hooks
run in ``(-priority, name)`` order; a plain function runs in one of its session's threads (it
may block), an ``async def`` on the proxy's loop (it must not). Whatever a hook raises, or a
hook that does not return within the session's ``hook_timeout``, is a ``hook_error``.

This module imports nothing of the proxy: a hooks file can be imported and unit-tested alone.
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from interceptor.trace.messages import Message, Request, Response

__all__ = ["HookContext", "HookError", "HookSpec", "intercept", "stop", "spec_of"]

_MARK = "__interceptor_hook__"
Kind = Literal["intercept", "stop"]
Boundary = Literal["request", "response", "between"]


class HookError(ValueError):
    """A hooks module that cannot be used; the message names ``hooks: <module>:<function>``."""


@dataclass
class HookContext:
    """What a hook knows about the rollout it runs in. ``messages`` is the current branch as
    the graph holds it (the conversation so far, before this request's new messages), as
    copies: changing them changes nothing.
    ``state`` is a copy of the task state as the tool servers last wrote it (changing it
    changes nothing: only the state routes write it), so a stop can end the rollout on it.
    ``tool_phase`` is ``before`` or ``after`` when the tool route asks (a harness's tool
    call, ``POST /_interceptor/tool``), else None."""

    session_id: str
    task: dict[str, Any] = field(default_factory=dict)
    agent: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)  # the session's hooks config
    dialect: str = ""
    call_id: str = ""
    endpoint: str = ""
    num_turns: int = 0
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    messages: list[Message] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    tool_phase: Literal["before", "after"] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def num_total_tokens(self) -> int:
        return self.num_input_tokens + self.num_output_tokens

    def record_metric(self, name: str, value: Any) -> None:
        """A number (or any msgpack-able value) for the footer's ``metrics``; a later value
        of the same name replaces the earlier one."""
        if not isinstance(name, str) or not name:
            raise ValueError("a metric needs a non-empty name")
        self.metrics[name] = value


@dataclass(frozen=True)
class HookSpec:
    """One hook as the loader read it."""

    fn: Callable[..., Any]
    kind: Kind
    boundary: Boundary
    priority: int
    name: str
    wants_ctx: str | None  # the keyword the context is passed as
    value_arg: str | None  # the keyword the Request/Response is passed as
    is_async: bool

    @property
    def order(self) -> tuple[int, str]:
        return (-self.priority, self.name)


def _mark(kind: Kind, priority: int, name: str | None):
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise TypeError(f"priority must be an int, got {priority!r}")

    def decorate(fn):
        setattr(fn, _MARK, (kind, priority, name))
        return fn

    return decorate


def intercept(priority: int = 0):
    """Mark a hook that may rewrite a ``Request`` (before it is sent) or a ``Response``
    (before the harness sees it). Returning ``None`` means unchanged."""
    if callable(priority):  # used bare: @intercept
        return _mark("intercept", 0, None)(priority)
    return _mark("intercept", priority, None)


def stop(priority: int = 0, name: str | None = None):
    """Mark a stop condition: return true to end the rollout. ``name`` is the condition the
    harness and the trace see (``rollout stopped: <name>``); default, the function's name."""
    if callable(priority):  # used bare: @stop
        return _mark("stop", 0, None)(priority)
    return _mark("stop", priority, name)


def spec_of(fn: Callable[..., Any], where: str) -> HookSpec | None:
    """The hook ``fn`` declares, or None if it is not marked. ``where`` prefixes errors
    (``hooks: <module>:<function>``)."""
    mark = getattr(fn, _MARK, None)
    if mark is None:
        return None
    kind, priority, name = mark
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # an annotation that does not resolve
        raise HookError(f"{where}: annotations do not resolve ({type(e).__name__}: {e})") from e
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as e:
        raise HookError(f"{where}: no signature ({e})") from e
    boundary: Boundary | None = None
    value_arg = ctx_arg = None
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise HookError(f"{where}: parameter {p.name!r}: use plain named parameters")
        hint = hints.get(p.name)
        if hint in (Request, Response):
            if value_arg is not None:
                raise HookError(f"{where}: takes both {value_arg!r} and {p.name!r}; a hook sits at one boundary")
            value_arg, boundary = p.name, "request" if hint is Request else "response"
        elif hint is HookContext or (hint is None and p.name == "ctx"):
            ctx_arg = p.name
        elif p.default is p.empty:
            raise HookError(f"{where}: parameter {p.name!r} must be annotated Request, Response "
                            f"(interceptor.trace) or HookContext")
    if boundary is None:
        if kind == "intercept":
            raise HookError(f"{where}: an intercept hook needs a parameter annotated Request or Response")
        if ctx_arg is None:
            raise HookError(f"{where}: a stop needs a Request, a Response or a HookContext parameter")
        boundary = "between"
    return HookSpec(fn=fn, kind=kind, boundary=boundary, priority=priority,
                    name=name or fn.__name__, wants_ctx=ctx_arg, value_arg=value_arg,
                    is_async=inspect.iscoroutinefunction(fn))

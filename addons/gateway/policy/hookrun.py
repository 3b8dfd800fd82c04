"""Run a session's stop hooks for one model request, off the event loop when they block.

A plain function runs in one of the session's own threads (an evaluator's check may read
files or call a grader); an ``async def`` in a task of its own on the loop (``addons/gateway/policy/hookpool.py``).
Hooks run in ``(-priority, name)`` order and the first true stop wins. Anything a hook raises,
``BaseException`` included, a hook that does not return within the session's limit, or a stop
that returns a non-bool, is a ``HookFailure`` naming the hook: the caller applies the session's
``on_hook_error``. Only a cancellation of the proxy's own task passes as what it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from interceptor.addons.gateway.policy.hookpool import HookPool, Late, Raised, Stuck
from interceptor.trace.hooks import HookContext, HookSpec
from interceptor.trace.messages import Message, ReadOnly, Request

if TYPE_CHECKING:
    from interceptor.addons.gateway.exchange import Exchange
    from interceptor.addons.gateway.sessions.session import Session


class HookFailure(Exception):
    """A hook raised or broke its contract; ``str()`` is one line naming it."""

    def __init__(self, spec: HookSpec, reason: str) -> None:
        super().__init__(f"hook {spec.name}: {reason}")
        self.spec = spec


def context(ex: Exchange, endpoint: str) -> HookContext:
    """What a hook sees of the rollout at a model request; see ``HookContext``."""
    return session_context(ex.session, dialect=ex.dialect.name, call_id=ex.call_id, endpoint=endpoint)


class _Context(HookContext):
    """A ``HookContext`` whose ``messages`` are copied from the graph when a hook first reads
    them (``Handed.branch``), not for every hook call: most hooks never look, and copying
    and checking the whole branch every turn would cost what the conversation's length costs."""

    def __init__(self, branch: Callable[[], list[Message]], pool: HookPool, **fields: Any) -> None:
        self._branch: Callable[[], list[Message]] | None = branch
        self._pool = pool  # the session's: where its hooks run (``call``)
        super().__init__(**fields)

    @property  # type: ignore[override]
    def messages(self) -> list[Message]:
        if self._branch is not None:
            self._messages, self._branch = self._branch(), None
        return self._messages

    @messages.setter
    def messages(self, value: list[Message]) -> None:
        self._messages = value
        if value:  # set by hand: that list, not the graph's
            self._branch = None


def session_context(session: Session, messages: list[Message] | None = None, **where: Any) -> HookContext:
    """What a hook sees of the rollout: ``messages`` the branch it is about (the current one
    by default, copies of the graph's: a hook that changed one in place changed the trace),
    ``where`` the request's dialect, call and endpoint, or the tool route's phase."""
    trace = session.recorder.trace
    hooks = session.config.hooks
    # The branch as it is now, taken here on the event loop (a plain hook reads its context in
    # a worker thread, while the loop may be committing): a list that only grows, and its
    # length now. Its copies are made only on reading.
    shared, n = trace.messages_now() if messages is None else (messages, len(messages))
    return _Context(
        lambda: session.handed.branch(shared[:n]), session.hook_pool,
        session_id=session.id, task=dict(session.config.task), agent=dict(session.config.agent),
        info=dict(session.config.info), config=dict(hooks.config) if hooks else {},
        num_turns=trace.num_turns, num_input_tokens=trace.num_input_tokens,
        num_output_tokens=trace.num_output_tokens,
        state=session.task_state.snapshot(), **where)


def effective_request(ex: Exchange) -> Request | None:
    """The canonical request with the session's model and sampling laid over it: what the
    upstream will be asked."""
    if ex.request is None or ex.body is None:
        return ex.request
    try:
        sampling = ex.dialect.sampling(ex.body)
    except Exception:  # noqa: BLE001 - the harness's own settings then
        sampling = ex.request.sampling
    # Where the model lives is the dialect's (a body key, or the path: then the session's).
    model = ex.dialect.requested_model(ex.body, "") or ex.session.config.model or ex.request.model
    return ex.request.model_copy(update={"model": model, "sampling": sampling})


_SHARED = HookPool()  # for a context not made by ``session_context`` (a test's own)


async def call(spec: HookSpec, ctx: HookContext, value: Any = None) -> Any:
    """One hook's result, in the session's pool (the module docstring); HookFailure otherwise."""
    kwargs: dict[str, Any] = {}
    if spec.value_arg is not None:
        kwargs[spec.value_arg] = value
    if spec.wants_ctx is not None:
        kwargs[spec.wants_ctx] = ctx
    pool = ctx._pool if isinstance(ctx, _Context) else _SHARED
    try:
        if spec.is_async:
            return await pool.run_async(spec.fn, **kwargs)
        return await pool.run_sync(spec.fn, **kwargs)
    except Raised as e:
        if isinstance(e.raised, ReadOnly):  # it changed a message the conversation holds: says which
            raise HookFailure(spec, str(e.raised)) from e.raised
        raise HookFailure(spec, str(e)) from e.raised
    except (Late, Stuck) as e:
        raise HookFailure(spec, str(e)) from None


async def first_stop(specs: tuple[HookSpec, ...], ctx: HookContext, value: Any = None) -> str | None:
    """The name of the first stop hook that returns true, or None."""
    for spec in specs:
        result = await call(spec, ctx, value)
        if result is None or result is False:
            continue
        if result is True:
            return spec.name
        raise HookFailure(spec, f"a stop must return a bool, got {type(result).__name__}")
    return None

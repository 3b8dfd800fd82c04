"""Gate: a claimed flow leaves only when every step that must touch it completed; any error
in any addon on it answers the harness in the dialect's shape and forwards nothing.

mitmproxy runs a script's addons as one branch of its dispatch: an exception in one hook is
logged ("Addon error"), the rest of the script's addons are skipped for that hook, and the
flow carries on as if they had not been there. For this proxy that is fail open: a body that
made Rewrite raise went to the real provider with the harness's model and the session secret
as its key. So the mechanism has two halves, and no addon needs a try/except of its own:

- ``guard`` wraps each flow hook of one of this project's addons, on that addon object, so
  that an exception in it is caught and kept on the flow as a ``Fault`` (which addon, which
  hook, which exception type); mitmproxy still sees and calls the addon itself. The hooks
  after it still run, except the request-side hooks of the addons after it (their input is
  half made); the Gate always runs.
- ``Gate``, listed last, refuses what is not ready. A provider-host flow about to leave
  without an answer must carry an ``Exchange`` whose required steps are all marked done
  (``Exchange.done``: set by each step as its last act) and no fault; else it is answered
  500 in the dialect's shape, ``x-should-retry: false``, with a message naming the step (never
  the exception's text, which may quote the request), and the exchange is one error call on
  the record. A fault on the response side (the provider already answered) replaces the
  answer with the same error: the harness never sees an answer the record may not have.
  WebSocket frames: a client frame the relay did not vet (``Socket.passed``) or that faulted
  is dropped and answered with an error frame; so is a server frame whose handling faulted.
"""

from __future__ import annotations

import inspect
import logging
import traceback
from typing import Any

from mitmproxy import http

from interceptor.addons.gateway.answers import error_response
from interceptor.addons.gateway.exchange import Exchange, Step, exchange_of
from interceptor.addons.gateway.faults import FAULT_KEY, Fault, fault_of
from interceptor.addons.mitm.settings import Settings
from interceptor.addons.gateway.record import commit
from interceptor.addons.gateway.transport.wsrelay import WS_KEY, Socket, WsRelay
from interceptor.dialects import host_dialect
from interceptor.trace.messages import ResponseError

log = logging.getLogger(__name__)

# Hooks whose first argument is the flow. An exception in any other hook (connection events)
# concerns no flow and is left to mitmproxy.
FLOW_HOOKS = frozenset({
    "http_connect", "requestheaders", "request", "responseheaders", "response", "error",
    "websocket_start", "websocket_message", "websocket_end",
})
# Before the flow is forwarded: after a fault here, later addons' hooks are not run on it.
REQUEST_HOOKS = frozenset({"http_connect", "requestheaders", "request"})
STEP_OWNERS = {Step.REWRITTEN: "Rewrite", Step.DECIDED: "Retry", Step.ADMITTED: "Stops"}
REFUSED = "x-interceptor-fault"  # on the Gate's own answers: the step that failed
GUARDED = "fault_step"  # on a guarded hook: the step its faults name ("Rewrite.request")


def guard(addon: Any) -> Any:
    """``addon`` itself, each flow hook of it guarded (see the module docstring): the guarded
    hook is set on this instance, so mitmproxy finds it as it finds any addon's hook, under the
    addon's own name, beside its options and commands; the class and mitmproxy are untouched.
    The original hook is the guarded one's ``__wrapped__``, looked up at each call, so a test
    can replace it there (tests/faults.py). Guarding an addon twice guards it once."""
    for hook in FLOW_HOOKS:
        method = getattr(addon, hook, None)
        if callable(method) and not isinstance(getattr(method, GUARDED, None), str):
            setattr(addon, hook, _guarded(f"{type(addon).__name__}.{hook}", hook in REQUEST_HOOKS, method))
    return addon


def guarded(addons: list[Any]) -> list[Any]:
    return [guard(a) for a in addons]


def _guarded(step: str, skip_after_fault: bool, method: Any) -> Any:
    def failed(flow: Any, e: BaseException) -> None:
        if not hasattr(flow, "metadata"):
            raise e
        flow.metadata.setdefault(FAULT_KEY, Fault(step, f"raised {type(e).__name__}"))
        # The exception's text may quote the request (a secret, a body): frames only.
        frames = "".join(traceback.format_tb(e.__traceback__))
        log.error(f"interceptor: {step} raised {type(e).__name__}; the Gate answers the "
                  f"flow with an error\n{frames}")

    if inspect.iscoroutinefunction(method):
        async def hook(flow, *args):
            if skip_after_fault and FAULT_KEY in flow.metadata:
                return
            try:
                await hook.__wrapped__(flow, *args)
            except Exception as e:  # noqa: BLE001 - the mechanism: see the module docstring
                failed(flow, e)
    else:
        def hook(flow, *args):
            if skip_after_fault and FAULT_KEY in flow.metadata:
                return
            try:
                hook.__wrapped__(flow, *args)
            except Exception as e:  # noqa: BLE001 - the mechanism: see the module docstring
                failed(flow, e)
    hook.__wrapped__ = method
    hook.__name__ = method.__name__
    hook.__qualname__ = f"guarded {step}"
    setattr(hook, GUARDED, step)
    return hook


def required(ex: Exchange, flow: http.HTTPFlow) -> Step:
    """What must have happened to a claimed flow before it may leave: always the rewrite
    (model, sampling, credential, route); for a model POST also the retry decision and the
    admission (a stopped rollout or a limit reached is answered by Stops itself)."""
    steps = Step.REWRITTEN
    if ex.route.kind == "model" and flow.request.method == "POST":
        steps |= Step.DECIDED | Step.ADMITTED
    return steps


class Gate:
    """Listed last and never guarded itself: it is the mechanism."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    # -- HTTP, request side ----------------------------------------------------------------

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live or flow.metadata.get("interceptor_control"):
            return
        ex = exchange_of(flow)
        fault = fault_of(flow)
        if ex is None:
            if fault is not None or flow.request.host.lower() in self.settings.hosts:
                # A provider host that no step claimed or answered: never forward it.
                fault = fault or Fault("Claim", "did not complete")
                flow.response = error_response(host_dialect(flow.request.host.lower()), 500, fault.message())
                flow.response.headers[REFUSED] = fault.step
            return
        missing = required(ex, flow) & ~ex.done
        if fault is None and not missing:
            return
        fault = fault or Fault("+".join(STEP_OWNERS[s] for s in missing), "did not complete")
        self._refuse(flow, ex, fault)

    # -- HTTP, response side ---------------------------------------------------------------

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        ex, fault = exchange_of(flow), fault_of(flow)
        if ex is None or fault is None or flow.response is None:
            return
        # Read the answer whole instead of streaming it on, so it can be replaced in ``response``.
        flow.response.stream = False
        self._record(flow, ex, fault)

    def response(self, flow: http.HTTPFlow) -> None:
        ex, fault = exchange_of(flow), fault_of(flow)
        if ex is None or fault is None or flow.response is None or REFUSED in flow.response.headers:
            return
        if ex.turn:
            return  # the record has this answer as a turn (the fault came after): deliver it
        self._refuse(flow, ex, fault)

    def error(self, flow: http.HTTPFlow) -> None:
        ex, fault = exchange_of(flow), fault_of(flow)
        if ex is not None and fault is not None:
            self._record(flow, ex, fault)

    def _refuse(self, flow: http.HTTPFlow, ex: Exchange, fault: Fault) -> None:
        flow.response = error_response(ex.dialect, 500, fault.message())
        ex.answered_here = True
        flow.response.headers[REFUSED] = fault.step
        self._record(flow, ex, fault)

    @staticmethod
    def _record(flow: http.HTTPFlow, ex: Exchange, fault: Fault) -> None:
        if ex.route.kind == "model":  # side routes (token counts, model lists) are never recorded
            commit(ex, flow, None, ResponseError(type="internal_error", message=fault.message(), status=500),
                   status=500)
        ex.committed = True

    # -- WebSocket frames ------------------------------------------------------------------

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        sock = flow.metadata.get(WS_KEY)
        if not isinstance(sock, Socket) or flow.websocket is None or not flow.websocket.messages:
            return
        fault = flow.metadata.pop(FAULT_KEY, None)
        message = flow.websocket.messages[-1]
        if message.dropped or message.injected:
            return
        if message.from_client and fault is None and sock.passed is message:
            return
        if not message.from_client and fault is None:
            return
        fault = fault or Fault("WsRelay", "did not complete")
        upgrade = sock.upgrade
        pending = sock.pending
        sock.pending = None
        ex = pending.ex if pending is not None and not pending.warmup else None
        if ex is None and message.from_client:
            ex = Exchange(session=upgrade.session, route=upgrade.route, raw_body=message.content, stream=True)
        if ex is not None and not ex.committed:
            commit(ex, flow, None, ResponseError(type="internal_error", message=fault.message(), status=500),
                   status=500)
        WsRelay.refuse(flow, message, upgrade.dialect, fault.message(), status=500)

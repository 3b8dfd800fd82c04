"""A fault: an exception in one of the proxy's steps, kept on the flow instead of raised.

mitmproxy would log an exception in a hook and carry the flow on as if the addon had not been
there (fail open), so every step that raises leaves a ``Fault`` on the flow instead (the guard
on the mitmproxy side, the answer's pipeline here), and the Gate answers it in the dialect's
shape. A fault names the step and the exception's type only: the exception's text may quote
the request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FAULT_KEY = "interceptor_fault"


@dataclass(frozen=True, slots=True)
class Fault:
    step: str  # "Rewrite.request", or the addon of a step that never completed
    what: str  # "raised RecursionError" (the exception's type only), "did not complete"

    def message(self) -> str:
        return (f"the interceptor failed while preparing this exchange ({self.step} {self.what}); "
                f"nothing was forwarded. This is a bug in the proxy, not in the request: "
                f"report it with the proxy's log")


def fault_of(flow: Any) -> Fault | None:
    fault = flow.metadata.get(FAULT_KEY)
    return fault if isinstance(fault, Fault) else None

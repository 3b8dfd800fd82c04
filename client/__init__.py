"""The evaluator's Python API: start a proxy (or attach to one), open a session per rollout,
hand its environment to a harness, seal it with a reward, read the trace back.

    from interceptor.client import Proxy, AsyncProxy

Why a folder of its own, ``client/`` mapped to ``interceptor.client``: it is a library for
the evaluator's process, not a command-line tool (``scripts/``) and not an addon (mitmproxy
puts ``addons/`` on its own ``sys.path``, and nothing there should run outside the proxy).
It validates session configs with the proxy's own models (``interceptor.addons.gateway.sessions.session``),
so in the dependency rule it stands where scripts do: trace <- dialects <- addons <- client
<- scripts (``run_harness.py`` is one of its users).
"""

from interceptor.client.aio import AsyncProxy, AsyncSession
from interceptor.client.errors import (
    BadRequest,
    Conflict,
    ControlError,
    Gone,
    InterceptorError,
    NotFound,
    ProxyUnavailable,
    Unauthorized,
    Unavailable,
)
from interceptor.client.proxy import Proxy, Session

__all__ = [
    "AsyncProxy", "AsyncSession", "BadRequest", "Conflict", "ControlError", "Gone",
    "InterceptorError", "NotFound", "Proxy", "ProxyUnavailable", "Session", "Unauthorized",
    "Unavailable",
]

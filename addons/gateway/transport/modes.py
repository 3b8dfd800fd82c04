"""Which of mitmproxy's modes the proxy's own upstream connections may serve.

In mitmproxy's regular mode a flow's address is the upstream's own, so the gateway may connect
to it itself; in upstream-proxy and other modes it is not the gateway's to probe or connect to,
and the exchange is left to mitmproxy.
"""

from __future__ import annotations

from mitmproxy import ctx
from mitmproxy.proxy import mode_specs


def regular_mode() -> bool:
    """mitmproxy's default mode only, on any listener (``regular``, ``regular@8080``,
    ``regular@127.0.0.1:8080``): the flow's address is the upstream's own (in upstream-proxy
    and other modes it is not the proxy's to probe or connect to). An addon that asks per
    request asks in ``configure``: each read of an unset option is a deep copy of its default
    (mitmproxy's OptManager), and each parse of a spec is more work again."""
    specs = list(ctx.options.mode)
    try:
        return bool(specs) and all(isinstance(mode_specs.ProxyMode.parse(s), mode_specs.RegularMode) for s in specs)
    except ValueError:  # mitmproxy refuses such a mode at start; nothing is relayed meanwhile
        return False

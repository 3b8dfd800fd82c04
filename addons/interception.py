"""The script mitmdump loads: ``mitmdump -s addons/interception.py``.

It only wires the addons together, in the order a request travels through them (mitmproxy
calls each hook in list order): Settings (options, sessions), Control (the proxy's own API),
TlsGuard (a harness that rejects the CA is named), Claim (which session), Rewrite (model,
sampling, key, upstream),
Reach (a dead upstream answers in the dialect's shape), WsRelay (Codex's Responses
WebSocket, frame by frame), Tee (stream back, record).
The code lives in ``interceptor.addons.*``; mitmproxy puts this folder on ``sys.path`` while
loading the script, which is why nothing here may share a name with a module it imports.
"""

from interceptor.addons.claim import Claim
from interceptor.addons.collect import Collect
from interceptor.addons.control import Control
from interceptor.addons.reach import Reach
from interceptor.addons.retry import Retry
from interceptor.addons.rewrite import Rewrite
from interceptor.addons.session import Registry
from interceptor.addons.settings import Settings
from interceptor.addons.tee import Tee
from interceptor.addons.tlsguard import TlsGuard
from interceptor.addons.wsrelay import WsRelay

registry = Registry()
settings = Settings(registry)

addons = [
    settings,
    Control(registry, settings),
    TlsGuard(registry, settings),  # before Claim, which takes the CONNECT's Proxy-Authorization
    Claim(registry, settings),
    Rewrite(),
    Reach(),
    WsRelay(),  # before Tee: a WebSocket's frames are its exchanges, not the upgrade
    Tee(),
    Collect(),  # after Tee (which records the tokens), before Retry (which keeps what the harness got)
    Retry(),  # last: its capture sees the bytes the harness received
]

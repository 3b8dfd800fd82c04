"""The script mitmdump loads: ``mitmdump -s addons/interception.py``.

It only wires the addons together, in the order a request travels through them (mitmproxy
calls each hook in list order):

- Settings: the ``intercept_*`` options, sessions, what the proxy imposes on itself;
- Control: the proxy's own API under ``/_interceptor/``;
- OpenProxyGuard: listening beyond loopback, only a session's connections are relayed (407);
- TlsGuard: names a harness that rejects the CA (it would hang silently);
- Claim: which session a request belongs to, or a 401 in the dialect's shape;
- BodyCap: a request over ``intercept_max_body`` gets 413 before its body is read whole;
- Rewrite: the session's model, sampling, key and upstream;
- Reach: a dead upstream answers 502 in the dialect's shape, on the record;
- WsRelay: Codex's Responses WebSocket, frame by frame;
- Tee: the answer streamed back untouched while the turn is assembled and committed;
- Collect: token ids and logprobs from a vLLM upstream for the trace, not the harness;
- Retry: a retried request gets the recorded answer, never a second sample;
- Gate: a claimed flow leaves only when every step completed; any addon's exception on it
  answers in the dialect's shape and forwards nothing (each addon above is ``guarded``);
- Annotate, Status: what the proxy did, on each flow (mitmweb) and in a status line;
- Redact: no key or secret in what mitmproxy prints, saves or shows (last: after every addon
  that still needs them, before mitmproxy's own dumper, save and view).

The code lives in ``interceptor.addons.*``; mitmproxy puts this folder on ``sys.path`` while
loading the script, which is why nothing here may share a name with a module it imports.
Editing this file while mitmdump runs makes mitmproxy reload it, which starts a new registry:
live sessions are forgotten (their traces on disk stay whole).
"""

from interceptor.addons.annotate import Annotate
from interceptor.addons.bodycap import BodyCap
from interceptor.addons.claim import Claim
from interceptor.addons.collect import Collect
from interceptor.addons.control import Control
from interceptor.addons.gate import Gate, guarded
from interceptor.addons.openproxy import OpenProxyGuard
from interceptor.addons.reach import Reach
from interceptor.addons.redact import Redact
from interceptor.addons.retry import Retry
from interceptor.addons.rewrite import Rewrite
from interceptor.addons.session import Registry
from interceptor.addons.settings import Settings
from interceptor.addons.status import Status
from interceptor.addons.tee import Tee
from interceptor.addons.tlsguard import TlsGuard
from interceptor.addons.wsrelay import WsRelay

registry = Registry()
settings = Settings(registry)

addons = guarded([
    settings,
    Control(registry, settings),
    OpenProxyGuard(registry),  # before TlsGuard and Claim, which read (and remove) Proxy-Authorization
    TlsGuard(registry, settings),  # before Claim, which takes the CONNECT's Proxy-Authorization
    Claim(registry, settings),
    BodyCap(settings),  # right after Claim: a body over intercept_max_body is never read whole
    Rewrite(),
    Reach(),
    WsRelay(),  # before Tee: a WebSocket's frames are its exchanges, not the upgrade
    Tee(),
    Collect(),  # after Tee (which records the tokens), before Retry (which keeps what the harness got)
    Retry(),  # last step: its capture sees the bytes the harness received
]) + [
    Gate(settings),  # after every step, and never guarded: it is what answers their faults
    Annotate(), Status(registry),  # observers after the Gate (they see its answers too); never raise
    Redact(settings),  # last, unguarded (it fails closed itself): after everything that needs a secret
]

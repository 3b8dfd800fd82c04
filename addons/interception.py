"""The script mitmdump loads: ``mitmdump -s addons/interception.py``.

It only wires the addons together, in the order a request travels through them: mitmproxy
calls each hook in list order, so the order is part of the behaviour (the comment on each
entry says what must come before it), and what each addon guarantees is in its own module.
Every request step is ``guarded``: an exception in one answers in the dialect's shape and
forwards nothing (the Gate, after them all). The answer's stages run in the pipeline's order
(``pipeline.py``), whatever the order of this list. Redact comes last, after every addon that
still needs a secret and before mitmproxy's own dumper, save and view.
``tests/test_addons.py`` runs the whole list in process and fails if its order breaks a turn.

mitmproxy sees this list as it is, each addon under its class's name in lower case
(``ctx.master.addons.get("claim")``), with its options and commands; its own dispatch calls
every hook. The guard (``gate.py``) sets each guarded addon's flow hooks on the addon object
itself; nothing of mitmproxy's is replaced.

The code lives in ``interceptor.addons.*``; mitmproxy puts this folder on ``sys.path`` while
loading the script, which is why nothing here may share a name with a module it imports.
Editing this file while mitmdump runs makes mitmproxy reload it, which starts a new registry:
live sessions are forgotten (their traces on disk stay whole).
"""

from interceptor.addons.mitm.annotate import Annotate
from interceptor.addons.mitm.bodycap import BodyCap
from interceptor.addons.mitm.claim import Claim
from interceptor.addons.gateway.answer.collect import Collect
from interceptor.addons.mitm.conns import AcceptErrors, ClientTimeouts
from interceptor.addons.mitm.control import Control
from interceptor.addons.mitm.egress import Egress
from interceptor.addons.gateway.feedback import Feedback, Refused
from interceptor.addons.mitm.gate import Gate, guarded
from interceptor.addons.mitm.openproxy import OpenProxyGuard
from interceptor.addons.gateway.policy.pause import Pause
from interceptor.addons.mitm.reach import Reach
from interceptor.addons.gateway.replay import Replay
from interceptor.addons.mitm.redact import Redact
from interceptor.addons.gateway.transport.relay import Fetch, Relay
from interceptor.addons.gateway.retry import Retry
from interceptor.addons.gateway.rewrite import Rewrite
from interceptor.addons.gateway.sessions.session import Registry
from interceptor.addons.mitm.settings import Settings
from interceptor.addons.mitm.status import Status
from interceptor.addons.gateway.policy.stops import Stops
from interceptor.addons.gateway.answer.tee import Tee
from interceptor.addons.mitm.tlsguard import TlsGuard
from interceptor.addons.mitm.tuning import RuntimeTuning
from interceptor.addons.gateway.transport.wsrelay import WsRelay
from interceptor.addons.gateway.transport.wsserve import WsServe

registry = Registry()
settings = Settings(registry)
collect = Collect()
retry = Retry()
wsserve = WsServe(settings.bound_address)
refused = Refused()  # what providers refused per model: Feedback learns it, Rewrite and WsRelay apply it
tee = Tee(strip=collect, capture=retry)  # the answer's pipeline: its stages' order is its own
reach = Reach()
relay = Relay(tee.pipeline, reach.reached)

addons = guarded([
    settings,
    ClientTimeouts(),  # before every request step: a request's body timer ends as its request hook begins
    AcceptErrors(),
    Control(registry, settings),
    OpenProxyGuard(registry),  # before TlsGuard and Claim, which read (and remove) Proxy-Authorization
    TlsGuard(registry, settings),  # before Claim, which takes the CONNECT's Proxy-Authorization
    Egress(registry, settings),  # before Claim, which takes the CONNECT's Proxy-Authorization
    Claim(registry, settings),
    BodyCap(settings),  # right after Claim: a body over intercept_max_body is never read whole
    wsserve,  # before Rewrite, which refuses a translated session's upgrade; its response hook before WsRelay's
    Rewrite(refused),
    reach,
    collect,  # after Rewrite: adds its keys to the rewritten body
    retry,  # after Rewrite, which keeps the raw body the digest is of
    WsRelay(refused, wsserve),  # before Tee: a WebSocket's frames are its exchanges, not the upgrade
    Feedback(refused),  # before Tee: a 400 for a parameter the proxy set is undone and sent once more
    Replay(),  # after Retry and WsRelay: answers from a replay source's trace
    Stops(),  # after retry's decision: a replayed or coalesced retry is never refused
    # After Retry, Replay and Stops: a replayed or coalesced retry is answered from the record and
    # never waits for a paused upstream, nor is a refused request held to be refused; before the
    # relay, so nothing of a held request has left. Its answer hooks before Tee's: a stale answer is
    # replaced before the pipeline reads it.
    Pause(registry.weights),
    relay,  # the last request step before the Gate: the flow is pointed at the relay (or the Gate refuses it)
    tee,
]) + [
    Gate(settings),  # after every step, and never guarded: it is what answers their faults
    Annotate(), Status(registry),  # observers after the Gate (they see its answers too); never raise
    Fetch(relay),  # after the Gate and Annotate's look at it: every exchange sent from the request hook
    RuntimeTuning(registry),  # ``running``: after the addons above have started; its hooks only look
    Redact(settings),  # last, unguarded (it fails closed itself): after everything that needs a secret
]

"""The script mitmdump loads: ``mitmdump -s addons/interception.py``.

It only wires the addons together, in the order a request travels through them (mitmproxy
calls each hook in list order):

- Settings: the ``intercept_*`` options, sessions, what the proxy imposes on itself;
- ClientTimeouts: a client connection that sends no request, or no whole request body, in
  time is closed (never while an answer is made or sent); AcceptErrors: out of file
  descriptors, one log line per interval instead of a traceback per failed accept;
- Control: the proxy's own API under ``/_interceptor/``;
- OpenProxyGuard: listening beyond loopback, only a session's connections are relayed (407);
- TlsGuard: names a harness that rejects the CA (it would hang silently);
- Egress: a session's tunnel to a host outside its network allow list is refused (403);
- Claim: which session a request belongs to, or a 401 in the dialect's shape;
- BodyCap: a request over ``intercept_max_body`` gets 413 before its body is read whole;
- WsServe: Codex's WebSocket answered by the proxy itself when the upstream serves none (a
  Chat upstream, a Responses upstream over HTTP only): each frame goes upstream as a POST;
- Rewrite: the session's model, sampling, key and upstream;
- Reach: a dead upstream answers 502 in the dialect's shape, on the record;
- Collect: asks a vLLM upstream for token ids and logprobs, for the trace, not the harness;
- Retry: a retried request gets the recorded answer, never a second sample;
- WsRelay: Codex's Responses WebSocket, frame by frame;
- Feedback: a 400 blaming a parameter the proxy set: that change undone, sent once more,
  remembered for the model;
- Replay: a session whose upstream is a trace gets its recorded answers (HTTP and frames);
- Relay: a model POST goes out on the proxy's own upstream connection, so an answer the
  harness stops reading is still read to its end, recorded, and replayed to its retry;
- Tee: the answer on its way back, one pipeline built in one place (``pipeline.py``): the
  turn assembled and committed, Collect's token fields stripped, Retry's capture of what
  the harness received, in that order whatever the order of this list;
- Stops: a stopped rollout's requests (limits, stop hooks) are refused in the dialect's shape;
- Gate: a claimed flow leaves only when every step completed; any addon's exception on it
  answers in the dialect's shape and forwards nothing (each addon above is ``guarded``);
- Annotate, Status: what the proxy did, on each flow (mitmweb) and in a status line;
- Fetch: the Relay's last request step, after the Gate and Annotate's look at the flow: the
  exchange is sent from the request hook; an answer that is not a stream, read whole, is
  handed to mitmproxy (no loopback hop to the relay's server); a stream takes the hop, the
  request's head only, its body gone upstream already;
- RuntimeTuning: the collector and glibc's allocator set for a long-running proxy (start-up
  frozen, dead flows collected by their bodies' bytes, the heap kept and trimmed after seals),
  behind one deployment switch, ``intercept_runtime_tuning``; no request depends on it;
- Redact: no key or secret in what mitmproxy prints, saves or shows (last: after every addon
  that still needs them, before mitmproxy's own dumper, save and view).

mitmproxy sees this list as it is, each addon under its class's name in lower case
(``ctx.master.addons.get("claim")``), with its options and commands; its own dispatch calls
every hook. The guard (``gate.py``) sets each guarded addon's flow hooks on the addon object
itself; nothing of mitmproxy's is replaced.

The request hooks run in list order; the answer's stages run in the pipeline's order. The
in-process test of the whole list (``tests/test_addons.py``) fails if the list is in an
order that breaks a turn.

The code lives in ``interceptor.addons.*``; mitmproxy puts this folder on ``sys.path`` while
loading the script, which is why nothing here may share a name with a module it imports.
Editing this file while mitmdump runs makes mitmproxy reload it, which starts a new registry:
live sessions are forgotten (their traces on disk stay whole).
"""

from interceptor.addons.annotate import Annotate
from interceptor.addons.bodycap import BodyCap
from interceptor.addons.claim import Claim
from interceptor.addons.collect import Collect
from interceptor.addons.conns import AcceptErrors, ClientTimeouts
from interceptor.addons.control import Control
from interceptor.addons.egress import Egress
from interceptor.addons.feedback import Feedback, Refused
from interceptor.addons.gate import Gate, guarded
from interceptor.addons.openproxy import OpenProxyGuard
from interceptor.addons.reach import Reach
from interceptor.addons.replay import Replay
from interceptor.addons.redact import Redact
from interceptor.addons.relay import Fetch, Relay
from interceptor.addons.retry import Retry
from interceptor.addons.rewrite import Rewrite
from interceptor.addons.session import Registry
from interceptor.addons.settings import Settings
from interceptor.addons.status import Status
from interceptor.addons.stops import Stops
from interceptor.addons.tee import Tee
from interceptor.addons.tlsguard import TlsGuard
from interceptor.addons.tuning import RuntimeTuning
from interceptor.addons.wsrelay import WsRelay
from interceptor.addons.wsserve import WsServe

registry = Registry()
settings = Settings(registry)
collect = Collect()
retry = Retry()
wsserve = WsServe(settings)
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
    relay,  # the last request step before the Gate: the flow is pointed at the relay (or the Gate refuses it)
    tee,
]) + [
    Gate(settings),  # after every step, and never guarded: it is what answers their faults
    Annotate(), Status(registry),  # observers after the Gate (they see its answers too); never raise
    Fetch(relay),  # after the Gate and Annotate's look at it: every exchange sent from the request hook
    RuntimeTuning(registry),  # ``running``: after the addons above have started; its hooks only look
    Redact(settings),  # last, unguarded (it fails closed itself): after everything that needs a secret
]

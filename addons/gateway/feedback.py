"""Feedback: a 400 naming a parameter the proxy set or changed is the proxy's to fix, once.

The model table (``dialects/models.json``) cannot know every model: a session may name one
nobody's table has, and a provider may start refusing a parameter any day. When the upstream
answers a model request 400 and blames a parameter (the dialect reads which:
``Dialect.refused_parameters``) that the proxy itself set, changed or removed, nothing was
sampled, so the proxy undoes that one change (the harness's value back, or the key gone when
the harness had not sent it), sends the request once more, and remembers the refusal for that
model for the rest of its life (``Refused``, read by Rewrite and WsRelay through
``Plan.drop_refused``, so the next request is right the first time). Both attempts are on the
record: the refused one as an error call with its own overrides, the second as the exchange
itself, its overrides saying ``provider_rejected``. A 400 about anything the harness sent
itself, or a second 400, reaches the harness as the provider sent it.

The second attempt is sent from here (urllib in a worker thread), not by mitmproxy, which
cannot send a flow's request twice; so its answer is read whole and a stream reaches the
harness in one piece (the stream pipeline assembles it as it would have streamed). The flow's
credential headers were blanked by Redact once the first attempt was sent, so the key is
placed anew by the dialect (``put_key``), read from the proxy's environment as Rewrite reads
it, and never written back onto the flow. Not done here: a WebSocket frame's refusal (Codex)
is passed through, though a learned rule applies to later frames; a session collecting vLLM
token ids is passed through too (its strip stage works on a live stream only), and so is a
translated exchange (the upstream's error is in another dialect than the harness's).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading
import urllib.error
import urllib.request
from typing import Any

from mitmproxy import ctx, http

from interceptor.addons.gateway.exchange import Exchange, exchange_of
from interceptor.addons.gateway.record import commit
from interceptor.addons.gateway.transport.client import upstream_tls
from interceptor.dialects.common import NETWORK_POLICY, PROVIDER_REJECTED, related, undo
from interceptor.trace.ids import new_id

log = logging.getLogger(__name__)

HOP_BY_HOP = {"transfer-encoding", "connection", "keep-alive", "content-length", "host", "proxy-connection"}
TIMEOUT = 600.0  # as long as a model may think before its first byte


class Refused:
    """Parameters the provider refused, per (dialect, model), for the proxy's lifetime.
    Written from the event loop, read from Rewrite's worker threads: a lock and frozensets."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_model: dict[tuple[str, str], frozenset[str]] = {}

    def get(self, dialect: str, model: Any) -> frozenset[str]:
        return self._by_model.get((dialect, str(model)), frozenset())

    def add(self, dialect: str, model: Any, key: str) -> None:
        with self._lock:
            old = self._by_model.get((dialect, str(model)), frozenset())
            self._by_model[(dialect, str(model))] = old | {key}


def proxy_param(ex: Exchange, names: list[str]) -> str | None:
    """The first parameter the provider blamed that one of the proxy's overrides touched.
    The model is the session's to choose, never undone."""
    for name in names:
        if name != "model" and any(o.key != "model" and not o.key.startswith("header:")
                                   and o.reason != NETWORK_POLICY and related(o.key, name) for o in ex.overrides):
            return name
    return None


def _opener(options: Any) -> urllib.request.OpenerDirector:
    """No proxy from the environment (the proxy is the one sending); TLS as the relay's."""
    return urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                       urllib.request.HTTPSHandler(context=upstream_tls(options)))


def _send(options: Any, request: http.Request) -> tuple[int, list[tuple[str, str]], bytes]:
    opener = _opener(options)  # in the worker thread: loading the CA bundle stays off the loop
    out = urllib.request.Request(request.url, data=request.raw_content, method=request.method)
    for name, value in request.headers.items(multi=True):
        if name.lower() not in HOP_BY_HOP:
            out.add_header(name, value)
    try:
        with opener.open(out, timeout=TIMEOUT) as answer:
            return answer.status, list(answer.headers.items()), answer.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, list(e.headers.items()), e.read()


class Feedback:
    def __init__(self, refused: Refused) -> None:
        self.refused = refused

    async def response(self, flow: http.HTTPFlow) -> None:
        ex = exchange_of(flow)
        if (ex is None or ex.route.kind != "model" or ex.committed or ex.resent or ex.body is None
                or ex.collect is not None or ex.translation is not None or flow.response is None
                or flow.response.status_code != 400
                or flow.websocket is not None):
            return
        try:
            error = json.loads(flow.response.get_content(strict=False) or b"null")
        except ValueError:
            return
        param = proxy_param(ex, ex.dialect.refused_parameters(error))
        if param is None:
            return  # the harness's own request: the provider's answer passes through
        ex.resent = True
        model = ex.dialect.requested_model(ex.body, flow.request.path)
        body = copy.deepcopy(ex.body)
        undone = undo(body, param, ex.overrides)
        if not undone:
            return
        self.refused.add(ex.dialect.name, model, param)  # the provider said so, whatever happens next
        again = flow.request.copy()
        again.content = json.dumps(body, ensure_ascii=False).encode()
        ex.dialect.put_key(again.headers, again.query, ex.session.upstream_key())
        try:
            status, headers, data = await asyncio.to_thread(_send, getattr(ctx, "options", None), again)
        except Exception as e:  # noqa: BLE001 - the second attempt never arrived: the first answer stands
            # ... as the one call on the record, with what it was sent with (the exchange is untouched).
            reason = getattr(e, "reason", None)  # urllib's URLError wraps the TLS or socket error
            log.warning(f"interceptor: session {ex.session.id!r}: {model} refused {param}; the second attempt "
                        f"without the proxy's change failed ({type(reason or e).__name__}: {reason or e}), so the "
                        "refusal reaches the harness")
            return
        log.info(f"interceptor: session {ex.session.id!r}: {model} refused {param} ({PROVIDER_REJECTED}); "
                 "sent once more without the proxy's change, and remembered for this model")
        self._record_rejected(ex, flow, error)
        ex.overrides = [*ex.overrides, *undone]
        ex.body = body
        response = http.Response.make(status, b"", [])
        response.headers = http.Headers([(k.encode(), v.encode()) for k, v in headers if k.lower() not in HOP_BY_HOP])
        response.raw_content = data
        response.headers["content-length"] = str(len(data))
        flow.response = response
        # What a flow file or mitmweb shows is what got this answer (credentials still blank).
        flow.request.content = again.content

    @staticmethod
    def _record_rejected(ex: Exchange, flow: http.HTTPFlow, error: Any) -> None:
        """The refused attempt: an error call of its own, with the overrides it was sent with."""
        rejected = copy.copy(ex)
        rejected.call_id = new_id()
        rejected.overrides = list(ex.overrides)
        commit(rejected, flow, None, ex.dialect.response_error(400, error))


"""Redact: no key or secret leaves the proxy in its output, at any verbosity.

The proxy holds provider keys, session secrets and the control API's token, and mitmproxy is
built to show everything: ``flow_detail`` prints headers and bodies, ``-w`` and
``save_stream_file`` write whole flows, mitmweb displays them. So, listed last (after every
addon that still needs them, before mitmproxy's dumper, save and view, which come after the
script):

- a claimed flow's credential headers (and any header or query value holding a known secret)
  are replaced by ``[redacted]`` once the request has been sent (``responseheaders``,
  ``error``), or when the proxy answered it itself (``response``);
- the control API's flows (the admin token in, session secrets out) are never handed to
  those addons at all: their hooks are halted here, and one log line says what was asked;
- our typed per-flow state (which holds the session, and so its secrets) is replaced by a
  plain summary before the flow is saved (mitmproxy deep-copies ``flow.metadata`` into flow files);
- every log record, ours and mitmproxy's, is scrubbed as it is made.

What counts as a secret: anything shaped like a session secret (``sk-ic-m-``/``sk-ic-s-``, and a
worker's ``sk-ic-<worker>-m-``/``-s-`` behind a front) or a generated admin token (``ic-admin-``), the admin token given in the environment, and the
current value of every declared upstream's key variable.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from mitmproxy import exceptions, http

from interceptor.addons.gateway.exchange import Exchange
from interceptor.addons.mitm.settings import Settings
from interceptor.dialects import credential_headers

log = logging.getLogger(__name__)

REDACTED = "[redacted]"
# Credential headers are redacted whatever they hold (a harness may send a real key of its own):
# every dialect's (the dialects are the one list), and the proxy URL's own.
CREDENTIAL_HEADERS = ("proxy-authorization", *credential_headers())
CREDENTIAL_FIELDS = frozenset(h.encode() for h in CREDENTIAL_HEADERS)  # as mitmproxy keeps them: bytes
REDACTED_BYTES = REDACTED.encode()
SHAPED = re.compile(r"(?:sk-ic-(?:[A-Za-z0-9_]+-)?[ms]-|ic-admin-)[A-Za-z0-9_-]+")
PLAIN = (str, int, float, bool, type(None), list, dict, bytes)
MIN_SECRET = 8  # a shorter "key" (a placeholder such as "x") would redact half of every line


class Secrets:
    """The strings that must never be shown; ``scrub`` replaces them in any text."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._exact: tuple[str, ...] = ()
        self._seen: tuple[Any, ...] = ()

    def exact(self) -> tuple[str, ...]:
        # Recomputed only when what it derives from changed (cheap identity checks per call).
        s = self.settings
        key = (s.admin_token, tuple(s.upstreams.values()))
        if key != self._seen:
            values = {s.admin_token or ""} | {up.key() or "" for up in s.upstreams.values()}
            self._exact = tuple(sorted((v for v in values if len(v) >= MIN_SECRET), key=len, reverse=True))
            self._seen = key
        return self._exact

    def scrub(self, text: str) -> str:
        for value in self.exact():
            if value in text:
                text = text.replace(value, REDACTED)
        if "ic-" in text:
            text = SHAPED.sub(REDACTED, text)
        return text

    def holds(self, text: str) -> bool:
        """Whether ``scrub`` would change ``text``, without making the scrubbed copy."""
        return any(value in text for value in self.exact()) or ("ic-" in text and SHAPED.search(text) is not None)


class Redact:
    def __init__(self, settings: Settings) -> None:
        self.secrets = Secrets(settings)
        self._factory = None

    # -- log lines --------------------------------------------------------------------------

    def load(self, loader) -> None:
        previous = logging.getLogRecordFactory()
        secrets = self.secrets

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = previous(*args, **kwargs)
            try:
                message = record.getMessage()
            except Exception:  # a broken format string is logging's to report, not ours
                return record
            clean = secrets.scrub(message)
            if clean != message:
                record.msg, record.args = clean, ()
            if record.exc_info:
                text = logging.Formatter().formatException(record.exc_info)
                record.exc_text = secrets.scrub(text)
            return record

        self._factory = (previous, factory)
        logging.setLogRecordFactory(factory)

    def done(self) -> None:
        if self._factory and logging.getLogRecordFactory() is self._factory[1]:
            logging.setLogRecordFactory(self._factory[0])

    # -- flows --------------------------------------------------------------------------------

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get("interceptor_control"):
            raise exceptions.AddonHalt  # see the module docstring: no dumper, save or view

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get("interceptor_control"):
            raise exceptions.AddonHalt
        self._clean(flow, metadata=False)  # it has been sent

    def response(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get("interceptor_control"):
            status = flow.response.status_code if flow.response else "-"
            log.info(f"interceptor: control {flow.request.method} {flow.request.path.split('?')[0]} -> {status}")
            raise exceptions.AddonHalt
        # A WebSocket's state is still needed for its frames: made plain at its end.
        self._clean(flow, metadata=flow.websocket is None)

    def error(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get("interceptor_control"):
            raise exceptions.AddonHalt
        self._clean(flow, metadata=True)

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        self._clean(flow, metadata=True)

    def http_connect(self, flow: http.HTTPFlow) -> None:
        self._clean(flow, metadata=False)  # the CONNECT's Proxy-Authorization (Claim has read it)

    def _clean(self, flow: http.HTTPFlow, *, metadata: bool) -> None:
        """Fail closed: a flow this cannot clean is not handed to the dumper, save or view."""
        try:
            self._redact_request(flow)
            if metadata:
                self._plain_metadata(flow)
        except Exception as e:  # noqa: BLE001 - see the docstring
            log.error(f"interceptor: could not redact a flow ({type(e).__name__}); it is not shown or saved")
            raise exceptions.AddonHalt from None

    def _redact_request(self, flow: http.HTTPFlow) -> None:
        # One pass over the raw fields: looking each name up again (``headers[name]``) scans
        # every field per name, twice over per flow. Each value of a repeated
        # header is checked and redacted on its own line, but only when all the values joined
        # hold a secret: one value holding one makes the whole hold it, and most flows' hold
        # none, so one check stands for a dozen (each looks for every secret). No secret holds
        # a newline.
        headers = flow.request.headers
        fields = headers.fields
        holds = self.secrets.holds
        suspect = holds(b"\n".join(v for _, v in fields).decode("utf-8", "surrogateescape"))
        dirty = [i for i, (k, v) in enumerate(fields) if v != REDACTED_BYTES and (
            k.lower() in CREDENTIAL_FIELDS or (suspect and holds(v.decode("utf-8", "surrogateescape"))))]
        if dirty:
            clean = list(fields)
            for i in dirty:
                clean[i] = (clean[i][0], REDACTED_BYTES)
            headers.fields = tuple(clean)
        if "?" in flow.request.path and self.secrets.holds(flow.request.path):
            query = flow.request.query
            for name in list(query.keys()):
                if self.secrets.holds(query[name]):
                    query[name] = REDACTED

    @staticmethod
    def _plain_metadata(flow: http.HTTPFlow) -> None:
        """What a saved flow keeps of the addons' state: which session and call, nothing else
        (an object there would also fail to serialize)."""
        for name, value in list(flow.metadata.items()):
            if isinstance(value, PLAIN):
                continue
            if isinstance(value, Exchange):
                flow.metadata[name] = {"session": value.session.id, "call_id": value.call_id}
            else:
                flow.metadata[name] = type(value).__name__

"""The upstream client: one aiohttp ``ClientSession`` on one ``TCPConnector``, shared by every
session, through which the relay sends each model request it owns.

It sends the harness's request as mitmproxy has it and hands back the upstream's answer as the
upstream sent it, because the harness and the record must see the provider, not a library:
no header the harness did not send (``skip_auto_headers``; a request's own framing is its
body's length), no cookie kept, no redirect followed, no status raised, the body's content
encoding untouched (``auto_decompress=False``). A request is sent once: aiohttp retries a
pooled connection that closed under it only for idempotent methods, never a model POST.
TLS is ``upstream_tls``, what mitmproxy verifies its own upstreams against; the context goes
with each request, so a connection verified under options that changed since is never reused
(aiohttp pools per host, port and TLS context). A connection whose answer was not read to its
end is closed, never pooled (aiohttp's rule; ``Sent.close``). Only a connect has a timeout: an
answer may take as long as the model does (the Drain's ``intercept_drain_timeout`` bounds one
the harness left).
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from typing import Any

import aiohttp
import certifi
from yarl import URL

CONNECT_TIMEOUT = 30.0
IDLE = 60.0  # seconds an idle upstream connection is kept for reuse
# Connections open at once per address, shared by every session: more than the sessions that run
# at once, so none waits for another's answer to end (a wait counts against CONNECT_TIMEOUT).
PER_HOST = 1024
MAX_HEAD = 1 << 20  # an answer's status line or header field accepted (far above aiohttp's default)
# aiohttp adds these when the request has none; the harness's request goes as it is.
SKIP = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")
# The request's framing is the relay's (the body is whole); the ticket is the relay's own header.
NOT_SENT = {b"content-length", b"transfer-encoding"}

# What ends an exchange with the upstream early: its connection, or its answer's framing.
BROKE = (OSError, aiohttp.ClientError, asyncio.TimeoutError)


@dataclass(eq=False)
class Target:
    scheme: str
    host: str
    port: int

    def where(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def url(self, target: bytes) -> URL:
        """The request target (path and query) at this address, as the harness wrote it
        (``encoded``: not quoted again)."""
        path, _, query = target.decode("ascii", "surrogateescape").partition("?")
        return URL.build(scheme=self.scheme, host=self.host, port=self.port, path=path, query_string=query,
                         encoded=True)


class Unsendable(ValueError):
    """The request cannot be sent as the harness sent it; nothing was sent."""


def _fields(headers, leave: set[bytes]) -> list[tuple[str, str]]:
    """The request's headers in order, without the framing and ``leave`` (bytes as read).
    aiohttp takes header values as text and writes them as UTF-8 (a byte that is not UTF-8
    would be dropped or re-encoded), so a value that is not UTF-8 text is refused
    (``Unsendable``, naming the header, never its value: it may be a credential)."""
    out = []
    for k, v in headers:
        if k.lower() in leave:
            continue
        try:
            out.append((k.decode("ascii"), v.decode("utf-8")))
        except UnicodeDecodeError:
            raise Unsendable(f"the request's {k.decode('latin-1')!r} header is not UTF-8 text, which the proxy's "
                             "upstream client cannot send byte for byte; nothing was sent") from None
    return out


class Client:
    """The pool: made in the running loop (``start``), closed at the proxy's end (``close``)."""

    def __init__(self) -> None:
        self.session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        if self.session is None:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=PER_HOST, keepalive_timeout=IDLE)
            self.session = aiohttp.ClientSession(
                connector=connector, cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
                skip_auto_headers=SKIP, raise_for_status=False, max_line_size=MAX_HEAD, max_field_size=MAX_HEAD,
                timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT, sock_read=None))

    async def close(self) -> None:
        if self.session is not None:
            session, self.session = self.session, None
            await session.close()

    async def send(self, target: Target, method: bytes, path: bytes, headers, body: bytes, leave: set[bytes],
                   tls: ssl.SSLContext | None) -> aiohttp.ClientResponse:
        """Send the request; the answer once its head arrived (informational ones skipped).
        Raises ``aiohttp.ClientConnectorError`` (and its certificate error) if the upstream
        could not be reached, another of ``BROKE`` if it did not answer."""
        self.start()
        # One turn of the loop first: a close the upstream sent to a pooled connection (its idle
        # timeout) that has arrived but not been read yet marks it closed, so it is not used.
        await asyncio.sleep(0)
        kw: dict[str, Any] = {"ssl": tls} if tls is not None else {}
        return await self.session.request(method.decode("ascii"), target.url(path),
                                          headers=_fields(headers, NOT_SENT | leave), data=body,
                                          allow_redirects=False, **kw)


def answer_head(resp: aiohttp.ClientResponse) -> bytes:
    """The upstream's status line and headers as it sent them (framing headers included: the
    body goes on in the same framing)."""
    lines = [b"HTTP/%d.%d %d %s\r\n" % (resp.version.major, resp.version.minor, resp.status, reason(resp))]
    lines += [k + b": " + v + b"\r\n" for k, v in resp.raw_headers]
    lines.append(b"\r\n")
    return b"".join(lines)


def reason(resp: aiohttp.ClientResponse) -> bytes:
    return (resp.reason or "").encode("utf-8", "surrogateescape")


def chunked(resp: aiohttp.ClientResponse) -> bool:
    return any(k.lower() == b"transfer-encoding" and b"chunked" in v.lower() for k, v in resp.raw_headers)


def close_delimited(method: bytes, resp: aiohttp.ClientResponse) -> bool:
    """The answer's body ends with the connection (RFC 9112 section 6.3: no length, not chunked,
    and a body allowed)."""
    if resp.status in (204, 304) or method == b"HEAD":
        return False
    return not chunked(resp) and not any(k.lower() == b"content-length" for k, _ in resp.raw_headers)


def keeps(version: tuple[int, int], headers) -> bool:
    """HTTP/1.1 and no ``Connection: close`` among these (name, value) byte pairs."""
    return tuple(version) >= (1, 1) and not any(k.lower() == b"connection" and b"close" in v.lower()
                                                for k, v in headers)


def upstream_tls(options: Any) -> ssl.SSLContext:
    """TLS to a provider verified as mitmproxy verifies its upstreams (``ssl_insecure``,
    ``ssl_verify_upstream_trusted_ca``, ``ssl_verify_upstream_trusted_confdir``, else certifi,
    mitmproxy's own default), for every connection the proxy opens itself: the relay's and
    provider feedback's second attempt. Loads a CA bundle: build it off the event loop or once."""
    tls = ssl.create_default_context(cafile=getattr(options, "ssl_verify_upstream_trusted_ca", None)
                                     or certifi.where())
    if getattr(options, "ssl_verify_upstream_trusted_confdir", None):
        tls.load_verify_locations(capath=options.ssl_verify_upstream_trusted_confdir)
    if getattr(options, "ssl_insecure", False):
        tls.check_hostname = False
        tls.verify_mode = ssl.CERT_NONE
    tls.set_alpn_protocols(["http/1.1"])
    return tls


NAME_MISMATCH = {62, 64}  # OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH


def tls_refusal(where: str, error: ssl.SSLCertVerificationError) -> str:
    """What the harness and the record are told when an upstream's certificate is refused."""
    reason = (error.verify_message or str(error)).rstrip(".")
    if error.verify_code in NAME_MISMATCH:
        fix = "declare the upstream by a name its certificate holds, or set ssl_insecure"
    else:
        fix = "trust the CA that signed its certificate with ssl_verify_upstream_trusted_ca, or set ssl_insecure"
    return f"the session's upstream {where} failed TLS verification ({reason}): {fix}"


def unreached(where: str, error: BaseException) -> tuple[str, bool] | None:
    """The words for a request that could not reach the upstream, and whether a retry may
    help (a refused certificate fails the same way again: the operator must act); None if it
    was reached."""
    if isinstance(error, aiohttp.ClientConnectorCertificateError):
        cert = error.certificate_error
        if isinstance(cert, ssl.SSLCertVerificationError):
            return tls_refusal(where, cert), False
    if isinstance(error, aiohttp.ClientConnectorError):
        return f"the session's upstream {where} is unreachable ({error.strerror or type(error.os_error).__name__})", True
    if isinstance(error, aiohttp.ConnectionTimeoutError):
        return f"the session's upstream {where} is unreachable (TimeoutError)", True
    return None

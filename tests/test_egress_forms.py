"""The egress policy holds on every way out: a session whose ``network.egress`` allow list
names no host of this machine gets 403 and an ``egress`` record for any request form that
would reach one (CONNECT, absolute-form, origin-form with a Host, a WebSocket upgrade, a
request later on a connection that showed the secret once), whatever the host's spelling
(case, trailing dot, IP literals in any notation, IPv6, userinfo, IDNA).

The "forbidden" server is a listener on loopback that marks every answer it gives: a request
reaches it only if the proxy let it through, and the client sees that in the answer it got.
Raw sockets, because the odd forms are what no HTTP client sends. A real mitmdump.
"""

from __future__ import annotations

import base64
import socket
import ssl
import threading
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from interceptor.trace import read_trace
from mitm import MitmProcess
from test_state_writes import simulated_proxy

MARK = b"x-forbidden-listener: reached"


class Forbidden:
    """A plain HTTP server on 127.0.0.1 and ::1 (one port) that answers every request with
    ``MARK`` and counts the connections it accepted."""

    def __init__(self) -> None:
        self.accepted = 0
        self.socks: list[socket.socket] = []
        v4 = socket.create_server(("127.0.0.1", 0))
        self.port = v4.getsockname()[1]
        self.socks.append(v4)
        try:
            self.socks.append(socket.create_server(("::1", self.port), family=socket.AF_INET6))
        except OSError:
            pass  # no IPv6 loopback here: its spellings then reach nothing either way
        for s in self.socks:
            threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _serve(conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            conn.sendall(b"HTTP/1.1 200 OK\r\n" + MARK + b"\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")

    def close(self) -> None:
        for s in self.socks:
            s.close()


@pytest.fixture(scope="module")
def forbidden() -> Iterator[Forbidden]:
    f = Forbidden()
    yield f
    f.close()


@pytest.fixture(scope="module")
def eproxy() -> Iterator[MitmProcess]:
    yield from simulated_proxy()


@pytest.fixture(scope="module")
def restricted(eproxy) -> dict:
    return eproxy.create_session(network={"allow": ["*.allowed.invalid"], "egress": True})


def _host_spellings(port: int) -> list[str]:
    """Authorities that name this machine's loopback (where Forbidden listens)."""
    hosts = ["127.0.0.1", "localhost", "LocalHost", "LOCALHOST.", "localhost.", "127.0.0.1.", "127.1",
             "2130706433", "0x7f000001", "0177.0.0.1", "[::1]", "[::ffff:127.0.0.1]", "[0:0:0:0:0:0:0:1]",
             "ｌｏｃａｌｈｏｓｔ", "allowed.invalid@127.0.0.1", "x.allowed.invalid:1@localhost"]
    return [f"{h}:{port}" for h in hosts] + [f"{h}:0{port}" for h in ("127.0.0.1", "localhost")]


def _read_answer(sock: socket.socket) -> bytes:
    """One answer: its head and its ``content-length`` body (b"" if the proxy closed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def _exchange(sock: socket.socket, request: bytes) -> bytes:
    sock.sendall(request)
    return _read_answer(sock)


def _credential(secret: str) -> str:
    return "Basic " + base64.b64encode(f"session:{secret}".encode()).decode()


FORMS = ("connect", "absolute", "origin", "websocket-absolute", "websocket-origin", "h2")


def _request(form: str, authority: str, scheme: str, host_header: str, auth: str | None) -> bytes:
    lines = []
    if form == "connect":
        lines.append(f"CONNECT {authority} HTTP/1.1")
        lines.append(f"Host: {authority}")
    else:
        target = f"{scheme}://{authority}/p" if form.endswith("absolute") else "/p"
        lines.append(f"GET {target} HTTP/1.1")
        lines.append(f"Host: {host_header if form.endswith('absolute') else authority}")
        if form.startswith("websocket"):
            lines += ["Upgrade: websocket", "Connection: Upgrade", "Sec-WebSocket-Version: 13",
                      "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=="]
    if auth:
        lines.append(f"Proxy-Authorization: {auth}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _through_tunnel(sock: socket.socket) -> bytes:
    return _exchange(sock, b"GET / HTTP/1.1\r\nHost: tunnel\r\n\r\n")


@pytest.mark.parametrize("form", FORMS)
def test_every_form_to_a_loopback_listener_is_refused(form, eproxy, restricted, forbidden):
    """The plain case of each form: 403 from the proxy, the listener never reached."""
    head = _send(eproxy, form, f"127.0.0.1:{forbidden.port}", "http", "x.allowed.invalid",
                 _credential(restricted["model_secret"]), earlier=False)
    assert MARK not in head, f"{form} reached the listener: {head!r}"
    assert head.startswith(b"HTTP/1.1 403"), head


def _send(proxy: MitmProcess, form: str, authority: str, scheme: str, host_header: str, auth: str,
          *, earlier: bool) -> bytes:
    """One request through the proxy on a new connection; its answer's head (for a CONNECT
    the proxy let through, the tunnelled request's). ``earlier``: the credential goes on a
    first request on the same connection (itself refused: a second ``egress`` record), not
    on this one."""
    if form == "h2":
        return _send_h2(proxy, authority, scheme, auth, earlier=earlier)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=15) as sock:
        if earlier:
            first = _exchange(sock, _request("absolute", "blocked.invalid:9", "http", "blocked.invalid", auth))
            assert first.startswith(b"HTTP/1.1 403"), first
        head = _exchange(sock, _request(form, authority, scheme, host_header, None if earlier else auth))
        if form == "connect" and head.startswith(b"HTTP/1.1 200"):
            return _through_tunnel(sock)
        return head


def _send_h2(proxy: MitmProcess, authority: str, scheme: str, auth: str, *, earlier: bool) -> bytes:
    """HTTP/2 to the proxy itself (TLS, ALPN h2): the destination is the ``:authority``. The
    answer as an HTTP/1.1-looking head, for the same checks."""
    import h2.config
    import h2.connection
    import h2.events

    context = ssl.create_default_context(cafile=str(proxy.ca_bundle))
    context.check_hostname = False
    context.set_alpn_protocols(["h2"])
    with context.wrap_socket(socket.create_connection(("127.0.0.1", proxy.port), timeout=15),
                             server_hostname="proxy.invalid") as sock:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        requests = [("blocked.invalid:9", auth), (authority, None)] if earlier else [(authority, auth)]
        answer = b""
        for i, (target, credential) in enumerate(requests):
            stream = 1 + 2 * i
            headers = [(":method", "GET"), (":scheme", scheme.lower()), (":authority", target), (":path", "/p")]
            conn.send_headers(stream, headers + ([("proxy-authorization", credential)] if credential else []),
                              end_stream=True)
            sock.sendall(conn.data_to_send())
            status, head, body, ended = b"", [], b"", False
            while not ended:
                try:
                    data = sock.recv(65536)
                except ConnectionResetError:
                    data = b""
                if not data:  # closed or reset by the proxy: nothing went anywhere
                    return b""
                for ev in conn.receive_data(data):
                    if isinstance(ev, h2.events.ResponseReceived) and ev.stream_id == stream:
                        head = [b"%s: %s" % (k, v) for k, v in ev.headers if not k.startswith(b":")]
                        status = dict(ev.headers)[b":status"]
                    elif isinstance(ev, h2.events.DataReceived) and ev.stream_id == stream:
                        body += ev.data
                        conn.acknowledge_received_data(ev.flow_controlled_length, stream)
                    elif isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset)) and ev.stream_id == stream:
                        ended = True
                sock.sendall(conn.data_to_send())
            answer = b"HTTP/1.1 " + status + b"\r\n" + b"\r\n".join(head) + b"\r\n\r\n" + body
        return answer


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_any_form_and_spelling_is_refused_and_recorded(data, eproxy, restricted, forbidden):
    """Whatever the form and the spelling: the listener answers nothing; every request the
    proxy could parse is a 403 with its ``egress`` record (one per refusal), and one it could
    not parse goes nowhere either."""
    form = data.draw(st.sampled_from(FORMS), "form")
    authority = data.draw(st.sampled_from(_host_spellings(forbidden.port)), "authority")
    scheme = data.draw(st.sampled_from(["http", "HTTP", "Http"]), "scheme")
    host_header = data.draw(st.sampled_from(["x.allowed.invalid", "api.openai.com", authority]), "host")
    earlier = form != "connect" and data.draw(st.booleans(), "credential on an earlier request")
    before, accepted = _egress_count(eproxy, restricted), forbidden.accepted
    head = _send(eproxy, form, authority, scheme, host_header, _credential(restricted["model_secret"]),
                 earlier=earlier)
    assert MARK not in head and forbidden.accepted == accepted, f"reached the listener: {head!r}"
    status = head[9:12]
    event(f"{form} {status.decode() or 'closed'}")
    # mitmproxy's HTTP/2 layer ends (or resets) the connection on an authority it cannot read (IDNA)
    assert status in (b"403", b"400") or (form == "h2" and head == b""), head
    if status == b"403":
        assert b"outside this rollout's network allow list" in head, head
        assert _egress_count(eproxy, restricted) == before + 1 + earlier


def _egress_count(proxy: MitmProcess, session: dict) -> int:
    status, summary = proxy.api("GET", f"sessions/{session['id']}")
    assert status == 200
    return sum(summary.get("egress", {}).values())


def test_other_sessions_and_allowed_hosts_are_not_refused(eproxy, forbidden):
    """The policy is its session's: the same request with an unrestricted session's secret,
    or with none, reaches the listener (so a 403 above is the policy, not the form)."""
    free = eproxy.create_session()
    for auth in (_credential(free["model_secret"]), None):
        for form in FORMS:
            head = _send(eproxy, form, f"127.0.0.1:{forbidden.port}", "http", "127.0.0.1", auth, earlier=False)
            assert MARK in head, (form, head)
    allowed = eproxy.create_session(network={"allow": ["localhost"], "egress": True})
    head = _send(eproxy, "absolute", f"localhost:{forbidden.port}", "http", "localhost",
                 _credential(allowed["model_secret"]), earlier=False)
    assert MARK in head, head


def test_refusals_are_on_the_trace(eproxy, forbidden):
    session = eproxy.create_session(network={"allow": ["*.allowed.invalid"], "egress": True})
    for form in FORMS:
        _send(eproxy, form, f"LOCALHOST.:{forbidden.port}", "http", "x", _credential(session["model_secret"]),
              earlier=False)
    eproxy.api("DELETE", f"sessions/{session['id']}")
    trace = read_trace(session["trace_path"])
    assert trace.egress == {"localhost": len(FORMS)}
    assert {(e.host, e.port) for e in trace.egress_refusals} == {("localhost", forbidden.port)}


def test_a_host_shaped_like_a_secret_is_not_written(eproxy):
    """The refused host goes into the trace: a rollout cannot smuggle a secret there by
    naming it as a host."""
    session = eproxy.create_session(network={"allow": ["*.allowed.invalid"], "egress": True})
    secret = session["model_secret"]
    for authority in (f"{secret}.invalid:443", f"{eproxy.admin_token}.x:443"):
        head = _send(eproxy, "connect", authority, "http", "x", _credential(secret), earlier=False)
        assert head.startswith(b"HTTP/1.1 403"), head
    eproxy.api("DELETE", f"sessions/{session['id']}")
    raw = open(session["trace_path"], "rb").read().lower()
    assert secret.lower().encode() not in raw and eproxy.admin_token.lower().encode() not in raw
    assert len(read_trace(session["trace_path"]).egress_refusals) == 2

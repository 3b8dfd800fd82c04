"""Client connections: what a client cannot do to the proxy by how it holds a connection.

- A connection that sends no request (idle, or a head that never ends) is closed after
  ``intercept_client_idle_timeout``; one whose request body never ends after
  ``intercept_client_body_timeout``. Never while an answer is being produced or sent, nor an
  open WebSocket: those can be silent for minutes.
- Out of file descriptors, the proxy keeps serving the sessions it has and says so once, not
  once per failed accept; once descriptors are free it accepts again.
- A client that half-closes after its request: what mitmproxy 12 does with it (it ends the
  connection), and a record that says what happened.

Real mitmdump, raw sockets, the strict simulator. A test waits for the proxy's close (recv
returns b""), bounded by a socket timeout far above the configured one.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import resource
import socket

import pytest
from mitmproxy import exceptions
from mitmproxy.test import taddons

from interceptor.addons.mitm.conns import AcceptErrors, ClientTimeouts
from interceptor.trace import read_trace
from provider import Reply
from waiting import wait_until
from wsclient import WSClient

BOUND = 20.0  # seconds a test waits for what a 1 s timeout makes happen
BODY = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}


def _head(session: dict, length: int, *, close: bool = False) -> bytes:
    return (b"POST http://api.openai.com/v1/chat/completions HTTP/1.1\r\nHost: api.openai.com\r\n"
            b"Authorization: Bearer %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
            % (session["model_secret"].encode(), length, b"Connection: close\r\n" if close else b""))


def _request(session: dict, *, stream: bool = False, close: bool = False) -> bytes:
    body = json.dumps({**BODY, **({"stream": True} if stream else {})}).encode()
    return _head(session, len(body), close=close) + body


def _connect(proxy) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=BOUND)


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the proxy closes the connection (socket.timeout if it never does)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _read_answer(sock: socket.socket) -> bytes:
    """One HTTP/1.1 answer on a kept-alive connection: its head and its body (by its length or
    its chunked end)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "closed before the answer's head"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        while not body.endswith(b"0\r\n\r\n"):
            chunk = sock.recv(65536)
            assert chunk, "closed mid-answer"
            body += chunk
    else:
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(body) < length:
            chunk = sock.recv(65536)
            assert chunk, "closed mid-answer"
            body += chunk
    return head + b"\r\n\r\n" + body


def _calls(session: dict):
    try:
        return read_trace(session["trace_path"]).calls
    except Exception:  # noqa: BLE001 - a record being written
        return []


def _session(proxy, sim) -> dict:
    return proxy.create_session(upstream={"base_url": sim.url("/v1")})


@pytest.fixture
def short(start_proxy):
    """A proxy whose client timeouts are 1 s."""
    return start_proxy({"intercept_client_idle_timeout": 1, "intercept_client_body_timeout": 1})


def test_an_idle_connection_is_closed(short):
    with _connect(short) as s:
        assert _read_all(s) == b""
    wait_until(lambda: "no request within intercept_client_idle_timeout" in short.log(), BOUND, "the close logged")


def test_a_head_that_never_ends_is_closed(short, sim):
    session = _session(short, sim)
    with _connect(short) as s:
        s.sendall(_head(session, 10)[:40])  # the request line's start, never its end
        assert _read_all(s) == b""


def test_a_kept_alive_connection_is_closed_once_idle(short, sim):
    session = _session(short, sim)
    with _connect(short) as s:
        s.sendall(_request(session))
        assert b" 200 " in _read_answer(s).split(b"\r\n", 1)[0]
        assert _read_all(s) == b""  # then nothing comes, and the proxy closes it


def test_a_body_that_never_ends_is_closed_and_recorded_as_the_clients(short, sim):
    session = _session(short, sim)
    with _connect(short) as s:
        s.sendall(_head(session, 1000) + b'{"model":')
        assert _read_all(s) == b""
    wait_until(lambda: "request body within intercept_client_body_timeout" in short.log(), BOUND, "the close logged")
    calls = wait_until(lambda: _calls(session), BOUND, "the exchange's record")
    assert [c.error.type for c in calls] == ["client_disconnected"], calls
    assert not sim.requests  # nothing was forwarded


def test_a_slow_answer_is_never_cut_by_the_client_timeouts(short, sim):
    """The model thinking (a JSON answer late, a stream silent between events) is longer than
    both timeouts: the harness gets every byte."""
    session = _session(short, sim)
    sim.script(Reply(text="late", first_byte_delay=2.5), Reply(text=["a", "b"], delay=2.5))
    with _connect(short) as s:
        s.sendall(_request(session))
        assert b'"content": "late"' in _read_answer(s)
        s.sendall(_request(session, stream=True))
        answer = _read_answer(s)
    assert b"data: [DONE]" in answer and b'"content":"a"' in answer and b'"content":"b"' in answer


def test_an_open_websocket_is_not_idle(short, sim):
    """Codex keeps its WebSocket open for the whole rollout, silent between turns."""
    session = _session(short, sim)
    sim.script(Reply(text="one"), Reply(text="two"))
    with WSClient("wss://api.openai.com/v1/responses", headers={"Authorization": f"Bearer {session['model_secret']}"},
                  proxy=short.url, cafile=str(short.ca_bundle), timeout=BOUND) as ws:
        for _ in range(2):
            ws.send_json({"type": "response.create", "model": "gpt-4o", "input": "hi", "stream": True})
            ws.until("response.completed")
            # Silent for longer than the idle timeout: a connection opened now, as idle, is
            # closed first; the WebSocket then still carries the next turn.
            with _connect(short) as probe:
                assert _read_all(probe) == b""


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts the proxy's descriptors in /proc")
def test_out_of_descriptors_the_open_sessions_are_served_and_the_log_says_it_once(start_proxy, sim):
    proxy = start_proxy()
    session = _session(proxy, sim)
    # A live session's stream, started before the descriptors run out, paced past it.
    sim.script(Reply(text=["a", "b", "c", "d"], delay=[0.1, 0.1, 3.0, 0.1]))
    live = _connect(proxy)
    live.sendall(_request(session, stream=True))
    first = live.recv(65536)
    assert b" 200 " in first.split(b"\r\n", 1)[0]
    pid = proxy.proc.pid
    limit = _fds(pid) + 4
    before = resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, resource.prlimit(pid, resource.RLIMIT_NOFILE)[1]))
    extra = []
    try:
        for _ in range(20):  # past the limit: the kernel completes them, the proxy cannot accept them
            extra.append(_connect(proxy))
        wait_until(lambda: "out of file descriptors" in proxy.log(), BOUND, "the proxy saying it ran out")
        answer = first
        while not answer.endswith(b"0\r\n\r\n"):
            chunk = live.recv(65536)
            assert chunk, "the live stream was cut"
            answer += chunk
        assert b"data: [DONE]" in answer
        log = proxy.log()
        assert log.count("out of file descriptors") == 1, log[-3000:]
        assert "Traceback" not in log and "Too many open files" not in log.replace("(Too many open files)", "")
    finally:
        live.close()
        for s in extra:
            s.close()
        resource.prlimit(pid, resource.RLIMIT_NOFILE, before)
    # Descriptors free again: the log says so, and new connections are accepted.
    wait_until(lambda: "accepting connections again" in proxy.log(), BOUND, "the proxy saying it accepts again")
    with _connect(proxy) as s:
        s.sendall(b"GET /_interceptor/health HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nConnection: close\r\n\r\n" % proxy.port)
        assert b" 200 " in _read_all(s).split(b"\r\n", 1)[0]


@pytest.mark.parametrize("relay", [True, False], ids=["relay", "no-relay"])
def test_a_client_that_half_closes_after_its_request_is_recorded_truthfully(start_proxy, sim, relay):
    """mitmproxy 12's HTTP/1 server ends a connection whose client sent FIN while it waits for
    the answer (``Http1Server.wait``, after https://github.com/httpwg/http-core/issues/22, whose
    outcome says a half-close does not mean the client lost interest); no hook can keep it, so
    the client gets nothing. The record says what happened: the turn undelivered when the relay
    read it, the client's disconnection otherwise, never the upstream's."""
    proxy = start_proxy({} if relay else {"intercept_drain_timeout": 0})
    session = _session(proxy, sim)
    sim.script(Reply(text="hello", first_byte_delay=0.5))
    with _connect(proxy) as s:
        s.sendall(_request(session, close=True))
        s.shutdown(socket.SHUT_WR)
        _read_all(s)
    calls = wait_until(lambda: _calls(session), BOUND, "the exchange's record")
    assert len(calls) == 1
    call = calls[0]
    if relay:
        assert call.error is None and call.delivered is False
    else:
        assert call.error is not None and call.error.type == "client_disconnected", call.error


# -- in process ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["intercept_client_idle_timeout", "intercept_client_body_timeout"])
def test_a_negative_timeout_is_refused(name):
    with taddons.context(ClientTimeouts()) as tctx, pytest.raises(exceptions.OptionsError, match=name):
        tctx.configure(tctx.master.addons.get("clienttimeouts"), **{name: -1})


def test_only_failed_accepts_are_folded_everything_else_reaches_the_handler_before(caplog):
    """The handler mitmproxy installed is wrapped, not replaced: any other report reaches it;
    a burst of failed accepts is one line; ``done`` puts the handler back."""

    async def run() -> tuple[list[dict], object]:
        loop = asyncio.get_running_loop()
        seen: list[dict] = []

        def before(_loop, context):
            seen.append(context)
        loop.set_exception_handler(before)
        errors = AcceptErrors()
        errors.running()
        listener = socket.socket()
        try:
            for _ in range(500):
                loop.call_exception_handler({"message": "socket.accept() out of system resource", "socket": listener,
                                             "exception": OSError(errno.EMFILE, "Too many open files")})
            loop.call_exception_handler({"message": "something else", "exception": OSError(errno.EMFILE, "x")})
            loop.call_exception_handler({"message": "no exception at all"})
        finally:
            listener.close()
        errors.done()
        return seen, loop.get_exception_handler()

    with caplog.at_level(logging.INFO, logger="interceptor.addons.mitm.conns"):
        seen, after = asyncio.run(run())
    assert [c["message"] for c in seen] == ["something else", "no exception at all"]
    assert after.__name__ == "before"
    lines = [r.getMessage() for r in caplog.records if "file descriptors" in r.getMessage()]
    assert len(lines) == 1 and "out of file descriptors" in lines[0], lines

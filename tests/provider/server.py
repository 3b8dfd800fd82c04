"""The provider simulator: a plain-HTTP server speaking OpenAI Chat Completions, OpenAI
Responses and Anthropic Messages, scripted per request.

Why a hand-written HTTP/1.1 writer on `ThreadingHTTPServer`: tests need control below
the JSON level — chunked transfer encoding with one chunk per SSE event written the
moment it is ready, a connection dropped before the terminating chunk, compressed
streams flushed event by event, status lines like 529 — and the standard library gives
exactly that without a new dependency. One thread per connection keeps a stalled or
vanished client from holding up anyone else.

    with ProviderSimulator() as sim:
        sim.script(Reply(text="hi"), Reply(status=429))
        client = openai.OpenAI(base_url=sim.url("/v1"), api_key="k")
        ...
        assert sim.model_requests()[0].json["model"] == "gpt-4o"
"""

from __future__ import annotations

import http
import json
import os
import pathlib
import secrets
import socket
import ssl
import threading
import time
import traceback
import uuid
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Sequence
from urllib.parse import parse_qs, urlsplit

from . import anthropic_messages, errors, gemini, openai_chat, openai_responses, responses_ws, strict, tokens, wire
from .records import Headers, RequestRecord
from .reply import Reply
from .tls import ServerCert
from .turn import Turn, random_id

Matcher = Callable[[RequestRecord], bool]
DefaultReply = Reply | Callable[[RequestRecord], Reply] | None

_MODULES = {"chat": openai_chat, "responses": openai_responses, "messages": anthropic_messages}

_SSE = "text/event-stream; charset=utf-8"
_JSON = "application/json"

# The model list both `GET /v1/models` shapes answer with (plus the default model).
DEFAULT_MODELS = ("gpt-4o-2024-08-06", "gpt-5", "claude-sonnet-4-5-20250929", "claude-opus-4-5-20251101")


def route_of(method: str, path: str) -> str | None:
    """Which endpoint a request is for. Suffix matching, so `/v1/...`, `/...` and a
    prefixed base URL (`/openai/v1/...`) all work, as SDK base URLs vary."""
    path = path.rstrip("/")
    route = gemini.route_of(method, path)
    if route is not None:
        return route
    if method == "POST":
        for suffix, route in (
            ("/chat/completions", "chat"),
            ("/responses/input_tokens", "input_tokens"),
            ("/responses", "responses"),
            ("/messages/count_tokens", "count_tokens"),
            ("/messages", "messages"),
        ):
            if path.endswith(suffix):
                return route
    if method == "GET":
        if path.endswith("/models"):
            return "models"
        if "/models/" in path:
            return "model"
    return None


def family_of(route: str | None, headers: Headers) -> str:
    """"anthropic", "openai" or "gemini": decides error shapes and response headers."""
    if route is not None and route.startswith("gemini"):
        return "gemini"
    if route in ("messages", "count_tokens"):
        return "anthropic"
    if route in ("chat", "responses", "input_tokens"):
        return "openai"
    return "anthropic" if ("anthropic-version" in headers or "x-api-key" in headers) else "openai"


def key_of(headers: Headers, query: dict[str, list[str]] | None = None) -> str | None:
    """What a string script key matches: `x-sim-key`, else the API key as sent."""
    if "x-sim-key" in headers:
        return headers["x-sim-key"]
    google = gemini.key_of(headers, query or {})
    if google:
        return google
    if "x-api-key" in headers:
        return headers["x-api-key"]
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return None


class ProviderSimulator:
    """A running simulator; see the module docstring.

    Scripts: `script(*replies, key=...)` queues replies; each model request (chat,
    responses, messages) takes one: first from the queue of its string key (header
    `x-sim-key`, else its API key), then from the first predicate script whose
    predicate accepts it, then from the unkeyed queue, else `default` (a Reply template,
    a callable `record -> Reply`, or None for an echo of the last user message).
    Side routes (count_tokens, input_tokens, models) never consume a reply.

    Through the proxy the API key the simulator sees is the proxy's real key, not the
    session secret: key a script by `x-sim-key` set by the client, or by a predicate
    such as `lambda r: r.json.get("model") == "model-of-session-a"`.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        default: DefaultReply = None,
        default_model: str = "sim-model",
        models: Sequence[str] = DEFAULT_MODELS,
        quiet: bool = True,
        strict: bool = False,
        tls: ServerCert | None = None,
    ) -> None:
        # Strict mode (tests/provider/strict.py): refuse what the real APIs refuse. `refuse`
        # adds per-model refused parameters ({"model": {"temperature"}}).
        self.strict = strict
        self.refuse: dict[str, set[str]] = {}
        # Responses over HTTP with `store`: response id -> every input and output item up
        # to it, what `previous_response_id` refers to on the real server.
        self.stored: dict[str, list[Any]] = {}
        # `GET /v1/responses` upgrades to a WebSocket (Codex's default transport) unless
        # this is False, when it answers 404 as an upstream without the transport would.
        self.websockets = True
        self.websocket_deflate = True
        # Seconds an idle kept-alive connection is kept open before the simulator closes it
        # (uvicorn's timeout_keep_alive is 5 s, vLLM's server inherits it); None: never.
        self.keep_alive: float | None = None
        # The weights version this "inference server" says it serves, in `x-weights-version` on
        # every model answer (an RL stack's router reports it so); None: no such header.
        self.weights_version: str | int | None = None
        self.host = host
        self._port = port
        self.default = default
        self.default_model = default_model
        self.models = list(models)
        self.quiet = quiet
        # HTTPS (tests/provider/tls.py): the certificate each new connection's handshake
        # presents; may be swapped while running (a connection made after it sees the new one).
        self.tls = tls
        self._contexts: dict[tuple[Any, Any], ssl.SSLContext] = {}
        # What the simulator's socket saw: TCP connections accepted, TLS handshakes completed
        # and failed (a client that refused the certificate), connections closed before a
        # ClientHello (a reachability probe, addons/mitm/reach.py), and connections it closed
        # (for any reason: its keep-alive timeout, a hang-up, the client's close).
        self.accepted = 0
        self.closed = 0
        self.handshakes = 0
        self.handshake_failures = 0
        self.probes = 0
        self._lock = threading.Condition()
        self._requests: list[RequestRecord] = []
        self._unkeyed: deque[Reply] = deque()
        self._keyed: dict[str, deque[Reply]] = {}
        self._predicates: list[tuple[Matcher, deque[Reply]]] = []
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> ProviderSimulator:
        if self._server is not None:
            return self
        self._server = _Server((self.host, self._port), _Handler)
        self._server.sim = self
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="provider-simulator", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> ProviderSimulator:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the simulator is not running; use start() or `with`")
        return self._server.server_address[1]

    @property
    def base_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def url(self, path: str = "") -> str:
        return self.base_url + ("/" + path.lstrip("/") if path else "")

    # -- scripting -----------------------------------------------------------

    def script(self, *replies: Reply | dict, key: str | Matcher | None = None) -> None:
        """Queue replies (FIFO). `key`: None (any request), a string (matched against
        `x-sim-key` or the API key) or a predicate over the RequestRecord."""
        items = [r if isinstance(r, Reply) else Reply.from_dict(r) for r in replies]
        for reply in items:
            _check(reply)
        with self._lock:
            self._queue_for(key).extend(items)

    def script_exchange_file(self, path: str | os.PathLike, key: str | Matcher | None = None) -> list[Reply]:
        """Queue every response of an `anthropic-exchanges/*.json` capture, in order,
        sent as it was (status, headers, body bytes)."""
        exchanges = json.loads(pathlib.Path(path).read_text())
        replies = [Reply.from_exchange(e) for e in exchanges]
        self.script(*replies, key=key)
        return replies

    def pending(self, key: str | Matcher | None = None) -> int:
        """Replies still queued for `key` (None: the unkeyed queue)."""
        with self._lock:
            return len(self._queue_for(key))

    def clear_scripts(self) -> None:
        with self._lock:
            self._unkeyed.clear()
            self._keyed.clear()
            self._predicates.clear()

    def _queue_for(self, key: str | Matcher | None) -> deque[Reply]:
        if key is None:
            return self._unkeyed
        if isinstance(key, str):
            return self._keyed.setdefault(key, deque())
        for predicate, queue in self._predicates:
            if predicate is key:
                return queue
        queue: deque[Reply] = deque()
        self._predicates.append((key, queue))
        return queue

    def _take(self, record: RequestRecord) -> Reply:
        with self._lock:
            reply = None
            if record.key is not None and self._keyed.get(record.key):
                reply = self._keyed[record.key].popleft()
            if reply is None:
                for predicate, queue in self._predicates:
                    if queue and predicate(record):
                        reply = queue.popleft()
                        break
            if reply is None and self._unkeyed:
                reply = self._unkeyed.popleft()
        if reply is None:
            default = self.default
            reply = default(record) if callable(default) else (default or Reply())
        if reply.is_empty:
            reply = reply.replace(text=_echo(record))
        return reply

    # -- the request log -------------------------------------------------------

    @property
    def requests(self) -> list[RequestRecord]:
        """A snapshot of every request received so far, in arrival order."""
        with self._lock:
            return list(self._requests)

    def refusals(self) -> list[RequestRecord]:
        """The requests strict mode refused (each with its `refusal`)."""
        return [r for r in self.requests if r.refusal is not None]

    def model_requests(self) -> list[RequestRecord]:
        """Only the requests that asked for a model answer (chat, responses, messages)."""
        return [r for r in self.requests if r.is_model_request]

    def clear(self) -> None:
        """Forget the request log (scripts stay; see clear_scripts)."""
        with self._lock:
            self._requests.clear()

    def wait_for_requests(self, count: int, timeout: float = 5.0, *, model_only: bool = True) -> list[RequestRecord]:
        """Block until `count` (model) requests arrived; for clients in other processes."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                found = [r for r in self._requests if r.is_model_request or not model_only]
                if len(found) >= count:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(found)} of {count} requests arrived within {timeout}s")
                self._lock.wait(left)

    def connections(self) -> dict[str, int]:
        """The socket-level counts: accepted, handshakes, handshake_failures, probes, closed."""
        with self._lock:
            return {"accepted": self.accepted, "handshakes": self.handshakes,
                    "handshake_failures": self.handshake_failures, "probes": self.probes, "closed": self.closed}

    def _count(self, what: str) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)

    def _tls_context(self) -> ssl.SSLContext | None:
        cert = self.tls
        if cert is None:
            return None
        with self._lock:
            made = self._contexts.get((cert.cert, cert.key))
            if made is None:
                made = self._contexts[(cert.cert, cert.key)] = cert.context()
            return made

    def _log(self, record: RequestRecord) -> None:
        with self._lock:
            self._requests.append(record)
            self._lock.notify_all()


def _check(reply: Reply) -> None:
    """Fail at script time, in the test, not later inside a server thread."""
    if reply.raw is not None and isinstance(reply.raw, os.PathLike):
        if not pathlib.Path(reply.raw).is_file():
            raise FileNotFoundError(reply.raw)
    Turn({}, reply, default_model="check")  # validates token_ids/logprobs alignment


def _echo(record: RequestRecord) -> str:
    last = gemini.last_user_text(record.json) if record.route == "gemini" else tokens.last_user_text(record.json)
    if not last:
        return "Hello from the provider simulator."
    return "You said: " + (last if len(last) <= 200 else last[:200] + "...")


# ============================================================================ HTTP


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    # socketserver's default backlog is 5: hundreds of connections at once (a proxy's pool
    # filling up, bench/scale.py) would be reset, which no provider's edge does.
    request_queue_size = 1024
    sim: ProviderSimulator

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hangs up mid-stream is normal here, not an error to print.
        import sys

        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError, socket.timeout)) or self.sim.quiet:
            return
        super().handle_error(request, client_address)

    def process_request(self, request: Any, client_address: Any) -> None:
        self.sim._count("accepted")
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        super().shutdown_request(request)  # the socket is closed: the client can see it
        self.sim._count("closed")

    def finish_request(self, request: Any, client_address: Any) -> None:
        """In the connection's own thread: the TLS handshake (if any), then HTTP."""
        tls = self.sim._tls_context()
        if tls is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(10)
        try:
            if not request.recv(1, socket.MSG_PEEK):
                self.sim._count("probes")  # closed before a ClientHello: addons/mitm/reach.py's probe
                return
            request = tls.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            self.sim._count("handshake_failures")  # e.g. the client refused the certificate
            request.close()
            return
        self.sim._count("handshakes")
        request.settimeout(None)
        try:
            super().finish_request(request, client_address)
        finally:
            request.close()


class _Cut(Exception):
    """Raised to stop a response on purpose (Reply.cut_after)."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "cloudflare"  # what both providers' edges announce
    sys_version = ""
    # Small writes (headers, then one SSE event at a time) must not wait for the client's
    # delayed ACK: without this every answer stalls ~40 ms (Nagle), which would swamp any
    # latency measured through the proxy.
    disable_nagle_algorithm = True
    server: _Server

    def version_string(self) -> str:
        return self.server_version

    def handle_one_request(self) -> None:
        # Waiting for a request: the idle timeout (read at each wait: a test may set it later);
        # BaseHTTPRequestHandler closes the connection when it runs out.
        self.connection.settimeout(self.server.sim.keep_alive)
        super().handle_one_request()

    def parse_request(self) -> bool:
        self.connection.settimeout(None)  # a request arrived: no timeout while it is served
        return super().parse_request()

    def log_message(self, format: str, *args: Any) -> None:
        if not self.server.sim.quiet:
            super().log_message(format, *args)

    def do_POST(self) -> None:
        self._serve()

    do_GET = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_POST

    # -- reading ---------------------------------------------------------------

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("content-length") or 0)
        return self.rfile.read(length) if length else b""

    def _serve(self) -> None:
        sim = self.server.sim
        self._framing = None  # this answer's Reply.framing, once it has one
        self._burst = bytearray()  # framing "burst": the chunks so far, written with the last one
        try:
            body = self._read_body()
            path = self.path
            if urlsplit(path).path.startswith("/_sim/"):
                self._control(urlsplit(path), body)
                return
            headers = Headers(self.headers.items())
            route_path = urlsplit(path).path.rstrip("/")
            if (self.command == "GET" and route_path.endswith("/responses") and sim.websockets
                    and responses_ws.is_upgrade(headers)):
                sim._log(RequestRecord(self.command, path, headers, body, time.time(), route="websocket",
                                       key=key_of(headers), transport="websocket"))
                self.close_connection = True
                responses_ws.serve(self, headers, "req_" + secrets.token_hex(16))
                return
            route = gemini.claims(route_of(self.command, urlsplit(path).path), headers, parse_qs(urlsplit(path).query))
            record = RequestRecord(self.command, path, headers, body, time.time(), route=route,
                                   key=key_of(headers, parse_qs(urlsplit(path).query)))
            sim._log(record)
            self._answer(record)
        except (_Cut, responses_ws.Cut):
            self.close_connection = True
        except (ConnectionError, TimeoutError, socket.timeout):
            # The client hung up (often on purpose, mid-stream): keep serving others.
            self.close_connection = True
        except Exception:
            # A simulator bug or a bad script: say so on stderr (pytest shows it with the
            # failing test) and drop the connection, since headers may be out already.
            traceback.print_exc()
            self.close_connection = True

    # -- answering -------------------------------------------------------------

    def _answer(self, record: RequestRecord) -> None:
        sim = self.server.sim
        route = record.route
        family = family_of(route, record.headers)
        if family == "anthropic":
            request_id = "req_011C" + random_id("", 20)
            base = {"request-id": request_id, "anthropic-organization-id": str(uuid.uuid5(uuid.NAMESPACE_DNS, "sim"))}
        else:
            request_id = "req_" + secrets.token_hex(16)
            base = {"x-request-id": request_id, "openai-version": "2020-10-01", "openai-processing-ms": "1"}
        if sim.weights_version is not None:
            base["x-weights-version"] = str(sim.weights_version)

        if family == "gemini":
            gemini.serve(self, record, sim, {"x-gemini-service-tier": "standard"})
            return
        if route is None:
            self._error(family, 404, Reply(status=404, error_message=f"Unknown route {record.method} {record.path}"), request_id, base)
            return
        if route in ("model", "models"):
            self._send_body(200, _models_body(sim, family, record), _JSON, Reply(), base)
            return
        if not isinstance(record.json, dict):
            self._error(family, 400, Reply(status=400, error_message="The request body is not valid JSON."), request_id, base)
            return
        if route == "count_tokens":
            turn = Turn(record.json, Reply(text=""), default_model=sim.default_model)
            self._send_body(200, anthropic_messages.count_tokens_body(turn), _JSON, Reply(), base)
            return
        if route == "input_tokens":
            turn = Turn(record.json, Reply(text=""), default_model=sim.default_model)
            body = wire.pretty({"object": "response.input_tokens", "input_tokens": turn.input_tokens})
            self._send_body(200, body, _JSON, Reply(), base)
            return

        if sim.strict and (refusal := strict.check(route, record.json, sim.refuse)) is not None:
            record.refusal = refusal
            self._error(family, refusal.status, refusal.reply(), request_id, base)
            return
        reply = sim._take(record)
        record.reply = reply
        if reply.first_byte_delay:
            time.sleep(reply.first_byte_delay)
        if reply.hang_up:
            raise _Cut
        if reply.raw is not None:
            self._send_raw(reply, family, request_id)
            return
        if reply.status >= 400:
            self._error(family, reply.status, reply, request_id, base)
            return
        module = _MODULES[route]
        request = record.json
        if route == "responses":
            previous = request.get("previous_response_id")
            earlier = sim.stored.get(previous) if previous else []
            if earlier is None:
                self._error(family, 400, Reply(status=400, error_code="previous_response_not_found",
                                               error_param="previous_response_id", should_retry=False,
                                               error_message=f"Previous response with id '{previous}' not found."),
                            request_id, base)
                return
            request = {**request, "input": earlier + responses_ws.input_items(request.get("input"))}
            answer = openai_responses._Answer(Turn(request, reply, default_model=sim.default_model))
            if request.get("store", True) is not False:
                sim.stored[answer.id] = request["input"] + answer.output
            if record.stream:
                self._send_events(reply.status, answer.events, _SSE, reply, base,
                                  lambda i: module.error_event(answer.turn, request_id, i))
            else:
                self._send_body(reply.status, wire.pretty(answer.response(answer.status, final=True)), _JSON,
                                reply, base)
            return
        turn = Turn(request, reply, default_model=sim.default_model)
        if record.stream:
            events = module.stream_events(turn)
            self._send_events(reply.status, events, _SSE, reply, base, lambda i: module.error_event(turn, request_id, i))
        else:
            self._send_body(reply.status, module.json_body(turn), _JSON, reply, base)

    def _error(self, family: str, status: int, reply: Reply, request_id: str, base: dict[str, str]) -> None:
        body = errors.body(family, status, reply, request_id)
        self._send_body(status, body, _JSON, reply, {**base, **errors.headers(family, status, reply)})

    def _send_raw(self, reply: Reply, family: str, request_id: str) -> None:
        raw = reply.raw
        name = ""
        if isinstance(raw, os.PathLike):
            name = os.fspath(raw)
            data = pathlib.Path(raw).read_bytes()
        elif isinstance(raw, str):
            data = raw.encode()
        else:
            data = bytes(raw)
        content_type = reply.content_type or _guess_type(name, data)
        # Verbatim means verbatim: only the reply's own headers, no invented request id
        # that would disagree with the one inside a captured body.
        headers: dict[str, str] = {}
        if reply.encoded:
            self._start(reply.status, _merged({"content-type": content_type, "transfer-encoding": "chunked",
                                               "content-encoding": reply.content_encoding or "identity"},
                                              reply.headers))
            self._framing = None
            for i in range(0, len(data), 1 << 20):
                self._chunk(data[i:i + (1 << 20)])
            self._last_chunk()
            return
        if "text/event-stream" in content_type:
            kind = "anthropic" if family == "anthropic" else "openai"

            def error_event(i: int) -> bytes:
                turn = Turn({}, reply, default_model="raw")
                module = anthropic_messages if kind == "anthropic" else openai_chat
                return module.error_event(turn, request_id, i)

            self._send_events(reply.status, wire.split_events(data), content_type, reply, headers, error_event)
        else:
            self._send_body(reply.status, data, content_type, reply, headers)

    # -- writing ---------------------------------------------------------------

    def _start(self, status: int, headers: dict[str, str]) -> None:
        try:
            phrase = http.HTTPStatus(status).phrase
        except ValueError:
            phrase = {529: "Overloaded"}.get(status, "")
        self.log_request(status)
        self.send_response_only(status, phrase)
        present = {name.lower() for name in headers}
        # A captured exchange brings its own `server` (and maybe `date`): never send two.
        if "server" not in present:
            self.send_header("server", self.version_string())
        if "date" not in present:
            self.send_header("date", self.date_time_string())
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        if not data:  # an empty chunk would end the body
            return
        framing = self._framing
        if framing == "extensions":
            self.wfile.write(b"%x;sim-ext=1;q=\"a b\"\r\n%s\r\n" % (len(data), data))
        elif framing == "split":
            # Every piece in its own write, apart in time, so a client reads them apart: the
            # chunk header cut inside, the data in two, its CRLF in two.
            half = len(data) // 2
            line = b"%X\r\n" % len(data)
            for piece in (line[:1], line[1:], data[:half], data[half:], b"\r", b"\n"):
                if piece:
                    self.wfile.write(piece)
                    time.sleep(0.003)
        elif framing == "close":
            self.wfile.write(data)  # no framing: the body ends with the connection
        elif framing == "burst":
            self._burst += b"%X\r\n%s\r\n" % (len(data), data)
        else:
            self.wfile.write(b"%X\r\n%s\r\n" % (len(data), data))

    def _last_chunk(self) -> None:
        framing = self._framing
        if framing == "close":
            self.close_connection = True
        elif framing == "extensions":
            self.wfile.write(b"0;sim-end=1\r\nx-sim-trailer: done\r\nx-sim-other: 2\r\n\r\n")
        elif framing == "split":
            for piece in (b"0\r", b"\n\r", b"\n"):
                self.wfile.write(piece)
                time.sleep(0.003)
        elif framing == "burst":
            self.wfile.write(bytes(self._burst) + b"0\r\n\r\n")
            self._burst.clear()
        else:
            self.wfile.write(b"0\r\n\r\n")

    def _framed(self, headers: dict[str, str], reply: Reply) -> dict[str, str]:
        """Reply.framing: the chunked headers it says (none for a close-delimited body)."""
        self._framing = reply.framing
        if reply.framing == "close":
            headers.pop("transfer-encoding", None)
            headers["connection"] = "close"
        elif reply.framing == "extensions":
            headers["trailer"] = "x-sim-trailer, x-sim-other"
        return headers

    def _send_body(self, status: int, body: bytes, content_type: str, reply: Reply, base: dict[str, str]) -> None:
        encoder = wire.Encoder(reply.content_encoding)
        data = encoder.whole(body)
        chunked = reply.framing is not None or (reply.chunked if reply.chunked is not None else status < 400)
        headers = {"content-type": content_type, **base}
        if encoder.name:
            headers["content-encoding"] = encoder.name
        if chunked:
            headers["transfer-encoding"] = "chunked"
        else:
            headers["content-length"] = str(len(data))
        self._start(status, _merged(self._framed(headers, reply), reply.headers))
        if reply.cut_after is not None:
            part = data[: reply.cut_after]
            self._chunk(part) if chunked else self.wfile.write(part)
            raise _Cut
        if chunked:
            self._chunk(data)
            self._last_chunk()
        else:
            self.wfile.write(data)

    def _send_events(
        self,
        status: int,
        events: Sequence[bytes],
        content_type: str,
        reply: Reply,
        base: dict[str, str],
        error_event: Callable[[int], bytes],
    ) -> None:
        """One chunk per event, written (and so flushed: wfile is unbuffered) as soon as
        it is due, so a client sees each event at the time the script says."""
        encoder = wire.Encoder(reply.content_encoding)
        headers = {"content-type": content_type, "cache-control": "no-cache", **base, "transfer-encoding": "chunked"}
        if encoder.name:
            headers["content-encoding"] = encoder.name
        self._start(status, _merged(self._framed(headers, reply), reply.headers))
        for index, data in enumerate(events):
            if reply.gap(index):
                time.sleep(reply.gap(index))
            if index == reply.pause_before and reply.resume is not None:
                reply.resume.wait(60)
            if reply.cut_after is not None and index >= reply.cut_after:
                raise _Cut
            if reply.error_after is not None and index >= reply.error_after:
                self._chunk(encoder.chunk(error_event(index)))
                break
            self._chunk(encoder.chunk(data))
        if reply.cut_after is not None:
            raise _Cut  # every event sent, but the body never properly ends
        self._chunk(encoder.finish())
        self._last_chunk()

    # -- the standalone server's control API -----------------------------------

    def _control(self, url: Any, body: bytes) -> None:
        """`POST /_sim/script[?key=K]` (a list of reply objects), `GET /_sim/requests`,
        `POST /_sim/clear`: for harness runs where the simulator is another process."""
        sim = self.server.sim
        status, answer = 200, {"ok": True}
        try:
            if url.path == "/_sim/script":
                data = json.loads(body or b"[]")
                key = parse_qs(url.query).get("key", [None])[0]
                if isinstance(data, dict):
                    key = data.get("key", key)
                    data = data.get("replies", [])
                sim.script(*[Reply.from_dict(d) for d in data], key=key)
                answer = {"ok": True, "pending": sim.pending(key)}
            elif url.path == "/_sim/requests":
                answer = {"requests": [r.to_dict() for r in sim.requests]}
            elif url.path == "/_sim/clear":
                sim.clear()
                if parse_qs(url.query).get("scripts"):
                    sim.clear_scripts()
            else:
                status, answer = 404, {"ok": False, "error": f"no control route {url.path}"}
        except (ValueError, TypeError, FileNotFoundError) as exc:
            status, answer = 400, {"ok": False, "error": str(exc)}
        self._send_body(status, json.dumps(answer).encode(), _JSON, Reply(chunked=False), {})


def _merged(headers: dict[str, str], extra: Any) -> dict[str, str]:
    """`headers` overridden by `extra` regardless of case, so a Reply's
    `Content-Type` replaces ours instead of going out next to it."""
    out = dict(headers)
    for name, value in dict(extra).items():
        for existing in [k for k in out if k.lower() == name.lower()]:
            del out[existing]
        out[name] = str(value)
    return out


def _guess_type(name: str, data: bytes) -> str:
    if name.endswith(".sse") or data.startswith((b"event:", b"data:")):
        return _SSE
    return _JSON


def _models_body(sim: ProviderSimulator, family: str, record: RequestRecord) -> bytes:
    names = list(dict.fromkeys([*sim.models, sim.default_model]))
    wanted = record.route_path.rstrip("/").rsplit("/models/", 1)[-1] if record.route == "model" else None
    if family == "anthropic":
        def one(name: str) -> dict[str, Any]:
            return {"type": "model", "id": name, "display_name": name, "created_at": "2025-09-29T00:00:00Z"}

        if wanted is not None:
            return wire.compact(one(wanted)).encode()
        return wire.compact(
            {"data": [one(n) for n in names], "has_more": False, "first_id": names[0], "last_id": names[-1]}
        ).encode()

    def one(name: str) -> dict[str, Any]:  # type: ignore[no-redef]
        return {"id": name, "object": "model", "created": 1727389042, "owned_by": "system"}

    if wanted is not None:
        return wire.pretty(one(wanted))
    return wire.pretty({"object": "list", "data": [one(n) for n in names]})

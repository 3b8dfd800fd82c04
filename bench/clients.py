"""Upstream HTTP clients side by side: the CPU the proxy's own process spends per streamed
event and per JSON request through each candidate for the gateway's one upstream client, in
one run, rounds interleaved, as ratios to the first candidate (aiohttp, the gateway's client).

    .venv/bin/python bench/clients.py [--rounds 8] [--only sse500,paced,json,pool,handover,ws,tls]

Candidates (each a pool shared by every concurrent exchange, kept alive, TLS verified
against the run's own CA through one ``ssl.SSLContext``):

- ``httpcore2``: ``httpcore2.AsyncConnectionPool`` (http1 only), the httpcore the openai and
  anthropic SDKs install (through httpx2); ``resp.aiter_stream()``.
- ``aiohttp``: ``ClientSession`` on a ``TCPConnector``, ``auto_decompress=False``,
  ``resp.content.iter_any()``, as ``addons/gateway/transport/client.py`` configures it. (The
  hand-written client the gateway used before, which the page's first runs compared with, is
  deleted; ``git log`` has this script's ``relay`` candidate.)
- ``h11``: h11 on asyncio streams with a list of idle connections, the floor a library on h11
  starts from.
- ``aiohttp-1MiB`` (only with ``--candidates``): aiohttp with a 1 MiB read buffer.

Every candidate hands each body piece it yields to the same sink (a count of pieces and
bytes), so what differs is the client alone. The loopback write to mitmproxy that follows
in the product is left out of every candidate alike.

Workloads, against the project's simulator (tests/provider) in its own process, over HTTPS
with a CA made for the run (tests/provider/tls.py), ``strict=False``:

- ``sse500``: 16 streams at once, each a Chat stream of 500 text events (plus the role,
  finish and ``[DONE]`` events), twice per candidate and round: CPU per event.
- ``paced``: 16 streams at once of 200 events 20 ms apart (a provider's 50 tokens/s): CPU per
  event when every event is a read of its own.
- ``json``: 16 workers, each 25 POSTs of a 20 KB JSON body one after another: CPU per
  request and requests per second (the simulator, one Python process on the same two cores,
  bounds the latter: read it as a ratio only).
- ``pool``: connections the simulator accepts (and TLS handshakes it completes) for 100
  requests 16 at once from a fresh pool, then 100 more on the warm one.
- ``handover``: the exchange begun in one task (head and first piece read, as the gateway's
  request hook would), that task over, the rest read to its end by another task (the
  gateway reading on after the harness left); then whether the pool reuses the connection.
- ``ws``: can the candidate be the WebSocket client too: a ``response.create`` frame on the
  simulator's Responses WebSocket (tests/provider/responses_ws.py) answered up to
  ``response.completed`` (aiohttp's own client; httpcore2's upgrade with wsproto framing on
  the stream it hands back; wsproto's own handshake on asyncio streams).
- ``tls``: each candidate refuses the simulator's certificate with a CA bundle that lacks
  the run's CA (certifi's), so the custom bundle is what made the others pass.

CPU is the process's own (the sum of /proc/self/task/*/schedstat, ns on CPU: every thread,
anyio's and the resolver's included), taken around each candidate's share of a round; the
candidates take their turns in a rotated order each round, so each is loaded at the same
moments of a shared machine. Reported per workload: each candidate's median over rounds,
and its ratio to the first candidate's paired round by round (median, min..max over rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import ssl
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

CLIENTS = 16
PATH = "/v1/chat/completions"


# -- the simulator's process --------------------------------------------------------------------

def serve() -> int:
    """The simulator over HTTPS with a CA made here; each stream's length and pace come from
    the request's headers. Prints its URL and CA; answers ``stats`` and ``clear`` on stdin."""
    from provider import ProviderSimulator, Reply, TestCA

    ca = TestCA()

    def default(record: Any) -> Reply:
        events = int(record.headers.get("x-bench-events", "0") or 0)
        if events:
            return Reply(text=["tok "] * events, delay=float(record.headers.get("x-bench-delay", "0") or 0))
        return Reply(text="ok")

    sim = ProviderSimulator("127.0.0.1", 0, strict=False, default=default, tls=ca.server("127.0.0.1"))
    with sim:
        print(json.dumps({"url": sim.base_url, "ca": str(ca.path)}), flush=True)
        for line in sys.stdin:
            if line.strip() == "stats":
                print(json.dumps(sim.connections()), flush=True)
            elif line.strip() == "clear":
                sim.clear()  # the request log would hold every 20 KB body of the run
                print("{}", flush=True)
    ca.cleanup()
    return 0


class Simulator:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT)
        started = json.loads(self.proc.stdout.readline())
        self.url, self.ca = started["url"], started["ca"]
        self.host, self.port = "127.0.0.1", int(self.url.rsplit(":", 1)[1])

    def ask(self, what: str) -> dict[str, int]:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(10)


# -- CPU ------------------------------------------------------------------------------------------

def cpu_ns() -> int:
    """ns on CPU of every thread of this process so far (a thread that ended is lost: none
    ends between two readings here but the resolver's, a few µs)."""
    total = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:
            pass
    return total


class Sink:
    """What every candidate hands each body piece to."""

    __slots__ = ("pieces", "size")

    def __init__(self) -> None:
        self.pieces = 0
        self.size = 0

    def feed(self, data: bytes) -> None:
        self.pieces += 1
        self.size += len(data)


def headers(events: int = 0, delay: float = 0.0) -> list[tuple[str, str]]:
    out = [("authorization", "Bearer sk-bench"), ("content-type", "application/json")]
    if events:
        out += [("x-bench-events", str(events)), ("x-bench-delay", str(delay))]
    return out


def stream_body() -> bytes:
    return json.dumps({"model": "gpt-4o", "stream": True,
                       "messages": [{"role": "user", "content": "count"}]}).encode()


def json_body(i: int) -> bytes:
    return json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": f"{i} " + "x" * 19_800}]}).encode()


# -- the candidates ---------------------------------------------------------------------------

class Candidate:
    name = ""

    def __init__(self, sim: Simulator, tls: ssl.SSLContext) -> None:
        self.sim, self.tls = sim, tls
        self.url = f"https://{sim.host}:{sim.port}{PATH}"

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def stream(self, body: bytes, hdrs: list[tuple[str, str]], sink: Sink) -> int: ...

    async def post(self, body: bytes, hdrs: list[tuple[str, str]]) -> tuple[int, bytes]: ...

    async def begin(self, body: bytes, hdrs: list[tuple[str, str]]) -> tuple[bytes, Any]:
        """Send, read the head and the first body piece; the rest is read by the coroutine
        function returned, from another task (``handover``)."""
        raise NotImplementedError


class Httpcore(Candidate):
    name = "httpcore2"

    async def open(self) -> None:
        import httpcore2

        self.pool = httpcore2.AsyncConnectionPool(ssl_context=self.tls, http1=True, http2=False,
                                                  max_connections=256, max_keepalive_connections=256,
                                                  keepalive_expiry=60.0)

    async def close(self) -> None:
        await self.pool.aclose()

    async def stream(self, body: bytes, hdrs: list[tuple[str, str]], sink: Sink) -> int:
        async with self.pool.stream("POST", self.url, headers=hdrs, content=body) as resp:
            async for data in resp.aiter_stream():
                sink.feed(data)
            return resp.status

    async def post(self, body: bytes, hdrs: list[tuple[str, str]]) -> tuple[int, bytes]:
        resp = await self.pool.request("POST", self.url, headers=hdrs, content=body)
        return resp.status, resp.content

    async def begin(self, body: bytes, hdrs: list[tuple[str, str]]) -> tuple[bytes, Any]:
        import httpcore2

        # request() adds Host and Content-Length; the lower level takes the headers as given
        host = [("host", f"{self.sim.host}:{self.sim.port}"), ("content-length", str(len(body)))]
        resp = await self.pool.handle_async_request(httpcore2.Request("POST", self.url, headers=host + hdrs,
                                                                      content=body))
        pieces = resp.aiter_stream()
        first = await anext(pieces)

        async def rest_of() -> bytes:
            out = b"".join([p async for p in pieces])
            await resp.aclose()
            return out
        return first, rest_of


class Aiohttp(Candidate):
    name = "aiohttp"

    async def open(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self.tls, limit=256, keepalive_timeout=60.0),
            auto_decompress=False, skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None))

    async def close(self) -> None:
        await self.session.close()

    async def stream(self, body: bytes, hdrs: list[tuple[str, str]], sink: Sink) -> int:
        async with self.session.post(self.url, data=body, headers=hdrs) as resp:
            async for data in resp.content.iter_any():
                sink.feed(data)
            return resp.status

    async def post(self, body: bytes, hdrs: list[tuple[str, str]]) -> tuple[int, bytes]:
        async with self.session.post(self.url, data=body, headers=hdrs) as resp:
            return resp.status, await resp.read()

    async def begin(self, body: bytes, hdrs: list[tuple[str, str]]) -> tuple[bytes, Any]:
        resp = await self.session.post(self.url, data=body, headers=hdrs)
        first = await resp.content.readany()

        async def rest_of() -> bytes:
            out = b"".join([p async for p in resp.content.iter_any()])
            resp.release()
            return out
        return first, rest_of


class AiohttpBig(Aiohttp):
    """aiohttp with a 1 MiB read buffer (the hand-written client's StreamReader buffered up to
    1 MiB before it paused, aiohttp's 64 KiB): how much of a gap in the unpaced cell is the buffer."""

    name = "aiohttp-1MiB"

    async def open(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self.tls, limit=256, keepalive_timeout=60.0), read_bufsize=1 << 20,
            auto_decompress=False, skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None))


class H11(Candidate):
    name = "h11"

    async def open(self) -> None:
        import h11

        self.h11 = h11
        self.idle: list[tuple[Any, asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def close(self) -> None:
        for _, _, w in self.idle:
            w.close()

    async def begin(self, body: bytes, hdrs: list[tuple[str, str]]) -> tuple[bytes, Any]:
        pieces: list[bytes] = []
        arrived = asyncio.Event()

        class Tap(Sink):
            def feed(self, data: bytes) -> None:
                pieces.append(bytes(data))
                arrived.set()
        task = asyncio.ensure_future(self._exchange(body, hdrs, Tap()))  # the reading is h11's loop itself
        await arrived.wait()
        first = pieces[0]

        async def rest_of() -> bytes:
            await task
            return b"".join(pieces[1:])
        return first, rest_of

    async def _exchange(self, body: bytes, hdrs: list[tuple[str, str]], sink: Sink | None) -> tuple[int, bytes]:
        h11 = self.h11
        if self.idle:
            conn, reader, writer = self.idle.pop()
        else:
            reader, writer = await asyncio.open_connection(self.sim.host, self.sim.port, ssl=self.tls,
                                                           server_hostname=self.sim.host)
            conn = h11.Connection(h11.CLIENT)
        req = h11.Request(method="POST", target=PATH, headers=[("host", f"{self.sim.host}:{self.sim.port}"), *hdrs,
                                                               ("content-length", str(len(body)))])
        writer.writelines((conn.send(req), conn.send(h11.Data(data=body)), conn.send(h11.EndOfMessage())))
        await writer.drain()
        status, parts = 0, []
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(1 << 16))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                if sink is not None:
                    sink.feed(event.data)
                else:
                    parts.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("closed before the answer's end")
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
            self.idle.append((conn, reader, writer))
        else:
            writer.close()
        return status, b"".join(parts)

    async def stream(self, body: bytes, hdrs: list[tuple[str, str]], sink: Sink) -> int:
        return (await self._exchange(body, hdrs, sink))[0]

    async def post(self, body: bytes, hdrs: list[tuple[str, str]]) -> tuple[int, bytes]:
        return await self._exchange(body, hdrs, None)


CANDIDATES = (Aiohttp, Httpcore, H11)
EXTRA = (AiohttpBig,)


def make(cls: type[Candidate], sim: Simulator, tls: ssl.SSLContext, ca: str) -> Candidate:
    c = cls(sim, tls)
    c.tls_ca = ca
    return c


# -- workloads ------------------------------------------------------------------------------

async def streams(c: Candidate, events: int, delay: float, repeat: int) -> tuple[int, Sink]:
    """CLIENTS streams at once, ``repeat`` times; how many streams, and the sink (each
    candidate's whole body is checked once, by ``stream_shape``)."""
    sink = Sink()
    body, hdrs = stream_body(), headers(events, delay)
    for _ in range(repeat):
        got = await asyncio.gather(*(c.stream(body, hdrs, sink) for _ in range(CLIENTS)))
        if set(got) != {200}:
            raise RuntimeError(f"{c.name}: statuses {sorted(set(got))}")
    return CLIENTS * repeat, sink


async def posts(c: Candidate, per: int) -> int:
    async def worker(k: int) -> None:
        for i in range(per):
            status, data = await c.post(json_body(k * 1000 + i), headers())
            if status != 200 or b'"chat.completion"' not in data:
                raise RuntimeError(f"{c.name}: {status} {data[:200]!r}")
    await asyncio.gather(*(worker(k) for k in range(CLIENTS)))
    return CLIENTS * per


async def stream_shape(c: Candidate, events: int) -> tuple[int, bytes]:
    """One stream read whole through the candidate: its events (blank-line-ended) and body."""
    pieces: list[bytes] = []

    class Keep(Sink):
        def feed(self, data: bytes) -> None:
            pieces.append(bytes(data))

    await c.stream(stream_body(), headers(events), Keep())
    body = b"".join(pieces)
    return body.count(b"\n\n"), body


# -- WebSocket ------------------------------------------------------------------------------

WS_FRAME = json.dumps({"type": "response.create", "model": "gpt-5", "input": [
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]})


def _ws_done(events: list[dict]) -> str:
    kinds = [e.get("type") for e in events]
    return "ok" if kinds and kinds[-1] == "response.completed" else f"FAILED: {kinds[-3:]}"


async def ws_aiohttp(sim: Simulator, tls: ssl.SSLContext) -> str:
    import aiohttp

    got = []
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(f"wss://{sim.host}:{sim.port}/v1/responses", ssl=tls, compress=15,
                                headers={"authorization": "Bearer sk-bench", "x-bench-events": "5"}) as ws:
            await ws.send_str(WS_FRAME)
            async for msg in ws:
                got.append(json.loads(msg.data))
                if got[-1].get("type") in ("response.completed", "error"):
                    break
    return _ws_done(got) + f" ({len(got)} frames, permessage-deflate {'on' if ws.compress else 'off'})"


async def _wsproto_frames(conn: Any, read, write) -> list[dict]:
    from wsproto.events import TextMessage

    got, parts = [], []
    await write(conn.send(TextMessage(data=WS_FRAME)))
    while not got or got[-1].get("type") not in ("response.completed", "error"):
        data = await read()
        if not data:
            break
        conn.receive_data(data)
        for event in conn.events():
            if isinstance(event, TextMessage):
                parts.append(event.data)
                if event.message_finished:
                    got.append(json.loads("".join(parts)))
                    parts = []
    return got


async def ws_httpcore(sim: Simulator, tls: ssl.SSLContext) -> str:
    """httpcore makes the upgrade and hands back the raw stream (its ``network_stream``
    extension, as httpx-ws uses it); wsproto frames on it (no extension negotiated)."""
    import base64
    import secrets

    import httpcore2
    from wsproto.connection import Connection, ConnectionType

    async with httpcore2.AsyncConnectionPool(ssl_context=tls) as pool:
        hdrs = [("upgrade", "websocket"), ("connection", "upgrade"), ("sec-websocket-version", "13"),
                ("sec-websocket-key", base64.b64encode(secrets.token_bytes(16)).decode()),
                ("authorization", "Bearer sk-bench"), ("x-bench-events", "5")]
        async with pool.stream("GET", f"https://{sim.host}:{sim.port}/v1/responses", headers=hdrs) as resp:
            if resp.status != 101:
                return f"FAILED: {resp.status}"
            net = resp.extensions["network_stream"]
            conn = Connection(ConnectionType.CLIENT)

            async def read() -> bytes:
                return await net.read(1 << 16)

            got = await _wsproto_frames(conn, read, net.write)
    return _ws_done(got) + f" ({len(got)} frames, no extension)"


async def ws_wsproto(sim: Simulator, tls: ssl.SSLContext) -> str:
    """wsproto's own handshake (h11 inside) on asyncio streams, permessage-deflate offered."""
    from wsproto import ConnectionType, WSConnection
    from wsproto.events import AcceptConnection, Request
    from wsproto.extensions import PerMessageDeflate

    reader, writer = await asyncio.open_connection(sim.host, sim.port, ssl=tls, server_hostname=sim.host)
    ws = WSConnection(ConnectionType.CLIENT)
    writer.write(ws.send(Request(host=f"{sim.host}:{sim.port}", target="/v1/responses", extensions=[PerMessageDeflate()],
                                 extra_headers=[(b"authorization", b"Bearer sk-bench"), (b"x-bench-events", b"5")])))
    accepted = None
    while accepted is None:
        ws.receive_data(await reader.read(1 << 16))
        accepted = next((e for e in ws.events() if isinstance(e, AcceptConnection)), None)

    async def write(data: bytes) -> None:
        writer.write(data)
        await writer.drain()

    async def read() -> bytes:
        return await reader.read(1 << 16)

    got = await _wsproto_frames(ws, read, write)
    writer.close()
    return _ws_done(got) + f" ({len(got)} frames, permessage-deflate {'on' if accepted.extensions else 'off'})"


# -- the run ------------------------------------------------------------------------------------

def fmt_ratio(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}..{max(xs):.2f})"


async def run(args: argparse.Namespace) -> int:
    sim = Simulator()
    only = set(args.only.split(","))
    trusted = ssl.create_default_context(cafile=sim.ca)
    trusted.set_alpn_protocols(["http/1.1"])
    chosen = [cls for cls in (*CANDIDATES, *EXTRA) if cls.name in args.candidates.split(",")]
    if not chosen:
        raise SystemExit("--candidates: the first is the one the ratios are to, then any of "
                         + ", ".join(cls.name for cls in (*CANDIDATES, *EXTRA)))
    base = chosen[0].name
    cands = [make(cls, sim, trusted, sim.ca) for cls in chosen]
    names = [c.name for c in cands]
    failures: list[str] = []
    out: list[str] = []
    try:
        for c in cands:
            await c.open()
        # Each candidate yields the same body.
        shapes = {}
        for c in cands:
            n, body = await stream_shape(c, 500)
            shapes[c.name] = (n, body)
        bodies = {len(b) for _, b in shapes.values()}
        events500 = shapes[base][0]
        if len({n for n, _ in shapes.values()}) != 1 or len(bodies) != 1:
            failures.append(f"stream shapes differ: {({k: (n, len(b)) for k, (n, b) in shapes.items()})}")
        events200 = (await stream_shape(cands[0], 200))[0]

        workloads = [w for w in ("sse500", "paced", "json") if w in only]
        rows: dict[str, dict[str, list[tuple[float, float, float]]]] = {w: {n: [] for n in names} for w in workloads}
        for rnd in range(args.rounds):
            for w in workloads:
                order = cands[rnd % len(cands):] + cands[:rnd % len(cands)]
                for c in order:
                    t0, c0 = time.perf_counter(), cpu_ns()
                    if w == "sse500":
                        n, sink = await streams(c, 500, 0.0, 2)
                        units, pieces = n * events500, sink.pieces
                    elif w == "paced":
                        n, sink = await streams(c, 200, 0.02, 1)
                        units, pieces = n * events200, sink.pieces
                    else:
                        units = await posts(c, 25)
                        pieces = units
                    cpu, wall = cpu_ns() - c0, time.perf_counter() - t0
                    rows[w][c.name].append((cpu / units, pieces / units, units / wall))
            sim.ask("clear")
            print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)

        units_of = {"sse500": "event", "paced": "event", "json": "request"}
        for w in workloads:
            r = rows[w]
            out.append(f"\n## {w}: CPU per {units_of[w]} ({args.rounds} rounds)\n")
            out.append(f"| client | CPU per {units_of[w]}, µs (median, min..max) | ratio to {base}, paired "
                       f"(median, min..max) | pieces per {units_of[w]} | {units_of[w]}s/s, ratio to {base} |")
            out.append("|---|---|---|---|---|")
            for n in names:
                cpu = [x[0] / 1e3 for x in r[n]]
                ratio = [a[0] / b[0] for a, b in zip(r[n], r[base])]
                rate = [a[2] / b[2] for a, b in zip(r[n], r[base])]
                out.append(f"| {n} | {statistics.median(cpu):.1f} ({min(cpu):.1f}..{max(cpu):.1f}) | "
                           f"{fmt_ratio(ratio)} | {statistics.median(x[1] for x in r[n]):.2f} | {fmt_ratio(rate)} |")

        if "pool" in only:
            out.append("\n## pool: connections the simulator accepted (TLS handshakes) per 100 requests, 16 at once\n")
            out.append("| client | fresh pool | warm pool |")
            out.append("|---|---|---|")
            for cls in chosen:
                c = make(cls, sim, trusted, sim.ca)
                await c.open()
                cells = []
                for _ in range(2):
                    before = sim.ask("stats")
                    sem = asyncio.Semaphore(CLIENTS)

                    async def one(i: int, c: Candidate = c, sem: asyncio.Semaphore = sem) -> None:
                        async with sem:
                            status, _ = await c.post(json_body(i), headers())
                            if status != 200:
                                raise RuntimeError(f"{c.name}: {status}")
                    await asyncio.gather(*(one(i) for i in range(100)))
                    after = sim.ask("stats")
                    cells.append(f"{after['accepted'] - before['accepted']} ({after['handshakes'] - before['handshakes']})")
                await c.close()
                out.append(f"| {c.name} | {cells[0]} | {cells[1]} |")

        if "handover" in only:
            out.append("\n## handover: head and first piece read in one task, which then ends (a harness gone); "
                       "another task reads the rest; then one more request on the pool\n")
            for cls in chosen:
                c = make(cls, sim, trusted, sim.ca)
                await c.open()
                try:
                    await c.post(json_body(0), headers())  # one warm connection
                    start = asyncio.ensure_future(c.begin(stream_body(), headers(500)))
                    first, rest_of = await start  # the task that began it is over
                    rest = await asyncio.ensure_future(rest_of())
                    body = first + rest
                    before = sim.ask("stats")
                    await c.post(json_body(1), headers())
                    after = sim.ask("stats")
                    fresh = after["accepted"] - before["accepted"]
                    ok = body.count(b"\n\n") == events500 and body.endswith(b"data: [DONE]\n\n")
                    verdict = (f"{'whole answer' if ok else 'INCOMPLETE answer'} ({body.count(b'\n\n')} events), "
                               f"{'connection reused' if fresh == 0 else f'{fresh} new connection(s)'} after")
                    if not ok or fresh:
                        failures.append(f"handover {c.name}: {verdict}")
                except Exception as e:  # noqa: BLE001 - reported
                    verdict = f"FAILED: {type(e).__name__}: {e}"
                    failures.append(f"handover {c.name}: {verdict}")
                await c.close()
                out.append(f"- {c.name}: {verdict}")

        if "tls" in only:
            out.append("\n## tls: the simulator's certificate with certifi's bundle alone (must be refused)\n")
            certifi_only = ssl.create_default_context()
            for cls in chosen:
                c = make(cls, sim, certifi_only, "")
                await c.open()
                try:
                    await c.post(json_body(0), headers())
                    verdict = "NOT refused"
                    failures.append(f"{c.name} accepted an untrusted certificate")
                except Exception as e:  # noqa: BLE001 - the refusal is the expected outcome
                    chain = [e, e.__cause__, e.__context__]
                    ok = any(isinstance(x, ssl.SSLCertVerificationError) for x in chain) or "CERTIFICATE_VERIFY_FAILED" in str(e)
                    verdict = f"refused ({type(e).__name__})" if ok else f"failed otherwise: {type(e).__name__}: {e}"
                await c.close()
                out.append(f"- {c.name}: {verdict}")

        if "ws" in only:
            out.append("\n## ws: a response.create frame on the simulator's Responses WebSocket\n")
            for name, check in (("aiohttp (ws_connect)", ws_aiohttp), ("httpcore2 upgrade + wsproto", ws_httpcore),
                                ("asyncio streams + wsproto handshake", ws_wsproto)):
                try:
                    verdict = await check(sim, trusted)
                except Exception as e:  # noqa: BLE001 - reported
                    verdict = f"FAILED: {type(e).__name__}: {e}"
                if verdict.startswith("FAILED"):
                    failures.append(f"ws {name}: {verdict}")
                out.append(f"- {name}: {verdict}")
    finally:
        for c in cands:
            await c.close()
        sim.stop()

    import aiohttp
    import h11
    import httpcore2
    print(f"# bench/clients.py\n\nmachine: {platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
          f"Python {platform.python_version()}; aiohttp {aiohttp.__version__}, httpcore2 {httpcore2.__version__}, "
          f"h11 {h11.__version__}; {CLIENTS} concurrent; simulator over HTTPS in its own process; "
          f"{events500} events per 500-token stream, {events200} per 200-token one")
    print("\n".join(out))
    if failures:
        print("\nFAILURES:\n" + "\n".join(f"- {f}" for f in failures))
        return 1
    return 0


def main() -> int:
    if "--serve" in sys.argv:
        return serve()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--candidates", default=",".join(cls.name for cls in CANDIDATES),
                    help="the first is the one the ratios are to; any of aiohttp, httpcore2, h11, aiohttp-1MiB "
                         "(default: %(default)s)")
    ap.add_argument("--only", default="sse500,paced,json,pool,handover,ws,tls")
    return asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())

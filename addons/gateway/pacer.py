"""Pacer: a replayed stream sent at the pace it was recorded, event by event.

A replay with ``pace: true`` (``addons/gateway/replay.py``) must send each event of a streamed answer
at the time the source trace recorded it (``ModelCall.event_gaps_ms``): the first byte after
the recorded time to first byte, then every event at its offset. mitmproxy cannot stream an
answer an addon makes (a ``flow.response`` set in ``request`` is sent whole, at once), so a
paced HTTP answer comes from this server instead: a plain HTTP/1.1 server on 127.0.0.1 in the
proxy's own event loop, started at the first paced answer, to which Replay points the flow
with a one-use ticket (``book``). To mitmproxy and the answer's pipeline it is then an upstream
streaming its answer: Retry captures the bytes (an SDK retry gets them again, no new turn), the
Relay carries it (an answer the harness stops reading is still read to its end). The turn is on
the record before the first byte (Replay commits it when it books), so the Tee assembles
nothing. Nothing here leaves the machine: the server answers only tickets it issued.

A Codex WebSocket's frames are paced by Replay itself (``send_paced``): each frame is injected
at its time by a task in the same loop.

``schedule`` decides the times. The dialect renders the recorded reply as its own events, which
are not the provider's: a provider streams text token by token, a rendering sends a block's
text in one delta. When the counts are equal each event gets its own recorded time; otherwise
the rendered events are spread over the recorded ones by rank (the first at the first, the
terminal at the last), so the time to first event and the whole duration are as recorded.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import h11
from mitmproxy import ctx, http

from interceptor.trace.model import ModelCall

log = logging.getLogger(__name__)

TICKET = "x-interceptor-pace"
MAX_PACE = 300.0  # seconds: a paced answer never takes longer than this
MAX_HEAD = 1 << 20


def schedule(call: ModelCall, n: int) -> tuple[float, list[float]]:
    """When to send the first byte and each of ``n`` rendered events of ``call``'s answer, in
    seconds after its request: (time to first byte, event times). Without recorded event times
    (a JSON answer, an older trace) every event goes at the call's recorded end."""
    start = call.started_at
    ttfb = (call.first_byte_at - start) if call.first_byte_at and start else 0.0
    ttfb = min(MAX_PACE, max(0.0, ttfb))
    offsets = call.event_offsets
    if not offsets:
        end = (call.ended_at - start) if call.ended_at and start else 0.0
        end = min(MAX_PACE, max(ttfb, end))
        return ttfb, [end] * n
    m = len(offsets)
    if n == m:
        picked = offsets
    elif n == 1:
        picked = [offsets[-1]]
    else:
        picked = [offsets[round(i * (m - 1) / (n - 1))] for i in range(n)]
    return ttfb, [min(MAX_PACE, ttfb + max(0.0, t)) for t in picked]


@dataclass(eq=False)
class Booking:
    status: int
    headers: list[tuple[bytes, bytes]]
    first_byte: float  # loop time of the headers
    events: list[tuple[float, bytes]]  # loop time, bytes


class Pacer:
    """The server; one per Replay addon. See the module docstring."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.port = 0
        self._tickets: dict[str, Booking] = {}

    async def start(self) -> None:
        if self.server is None:
            self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.port = self.server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        self._tickets.clear()

    def book(self, flow: http.HTTPFlow, status: int, headers: dict[str, str], ttfb: float,
             events: Sequence[tuple[float, bytes]]) -> None:
        """Point ``flow`` at this server, which answers it with ``events`` (seconds from now,
        bytes) after the headers at ``ttfb`` seconds. ``start`` must have run."""
        now = asyncio.get_running_loop().time()
        ticket = secrets.token_hex(16)
        self._tickets[ticket] = Booking(status, [(k.encode(), v.encode()) for k, v in headers.items()],
                                        now + ttfb, [(now + t, data) for t, data in events])
        flow.request.headers[TICKET] = ticket
        flow.request.scheme = "http"
        flow.request.data.host = "127.0.0.1"
        flow.request.data.port = self.port

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        try:
            while await self._answer(conn, reader, writer):
                conn.start_next_cycle()  # kept alive: the Relay pools its connections here too
        except (OSError, h11.ProtocolError):
            return  # the harness (or the relay) went away: the turn is on the record already
        except Exception:  # noqa: BLE001 - one answer's bug must not end the proxy's loop
            log.exception("interceptor: paced replay failed")
        finally:
            writer.close()

    async def _answer(self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """One request on the connection; True if it may carry another."""
        request = None
        while True:  # the request, its body read and dropped (the answer is booked already)
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(1 << 16)
                if not data:
                    return False
                conn.receive_data(data)
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.EndOfMessage):
                break
            elif not isinstance(event, h11.Data):
                return False
        ticket = next((v.decode() for k, v in request.headers if k == TICKET.encode()), None) if request else None
        booking = self._tickets.pop(ticket, None) if ticket else None
        if booking is None:  # not a flow of ours: nothing to send
            writer.write(conn.send(h11.Response(status_code=404, headers=[(b"content-length", b"0")]))
                         + conn.send(h11.EndOfMessage()))
            await writer.drain()
            return False
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, booking.first_byte - loop.time()))
        writer.write(conn.send(h11.Response(status_code=booking.status, headers=booking.headers)))
        await writer.drain()
        for at, data in booking.events:
            await asyncio.sleep(max(0.0, at - loop.time()))
            writer.write(conn.send(h11.Data(data=data)))
            await writer.drain()
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()
        return conn.our_state is h11.DONE and conn.their_state is h11.DONE


async def send_paced(flow: http.HTTPFlow, events: Sequence[tuple[float, bytes]]) -> None:
    """A WebSocket answer's frames, each at its time (seconds from now), injected to the client."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    for at, data in events:
        await asyncio.sleep(max(0.0, start + at - loop.time()))
        if flow.websocket is None or flow.websocket.timestamp_end is not None:
            return  # the socket closed: the turn is on the record already
        ctx.master.commands.call("inject.websocket", flow, True, data, True)

"""A streamed answer at a provider's pace, through a real mitmdump: the relay writes each read of
the upstream down its loopback connection to mitmproxy, which reads it as its upstream.

What must hold: the harness gets the answer whole and paced as it came (not gathered up and
sent at its end), over HTTP/1.1 and HTTP/2 (the Rust and Go SDKs; mitmproxy opens a connection
to the relay per flow then), and the trace holds each turn with its events' gaps. A failure of
the relay's own while passing an answer down (not the upstream's) cuts the harness's stream,
ends the exchange as one error call on the record at once, and the next turn is served.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from interceptor.trace import read_trace
from provider import Reply
from waiting import wait_until

FAULTS = Path(__file__).with_name("faults.py")
MESSAGES = [{"role": "user", "content": "count"}]
PIECES = [f"w{k} " for k in range(30)]
CHAT = "https://api.openai.com/v1/chat/completions"


def read_stream(client: httpx.Client, url: str, secret: str, body: dict, http2: bool) -> tuple[str, list[float]]:
    """A streamed answer read to the end of its body (not closed at its last event, as the
    SDKs do, which races the chunked body's end and makes mitmproxy end the flow with an
    error): the text its deltas carry, and the gaps between the reads that brought them."""
    text, times = [], []
    headers = {"authorization": f"Bearer {secret}", "x-api-key": secret, "anthropic-version": "2023-06-01"}
    with client.stream("POST", url, json={**body, "stream": True}, headers=headers) as r:
        assert r.status_code == 200 and r.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
        rest = b""
        for raw in r.iter_raw():
            times.append(time.monotonic())
            *lines, rest = (rest + raw).split(b"\n")
            for line in lines:
                if line.startswith(b"data: {"):
                    event = json.loads(line[6:])
                    if "choices" in event:
                        text += [c["delta"].get("content") or "" for c in event["choices"]]
                    elif event.get("type") == "content_block_delta":
                        text.append(event["delta"].get("text", ""))
    return "".join(text), [b - a for a, b in zip(times, times[1:])]


def recorded(path: str, n: int) -> None:
    """Until the trace holds ``n`` calls (the last answer's hook may run just after the harness
    has read it all)."""
    wait_until(lambda: len(read_trace(path).calls) >= n, 10, f"{n} calls recorded")


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "http2"])
def test_a_paced_stream_reaches_the_harness_whole_and_paced_and_is_recorded(http2, sim, start_proxy):
    proxy = start_proxy()
    session = proxy.create_session(upstream={"base_url": sim.url("/v1")}, model="imposed")
    sim.script(*[Reply(text=PIECES, delay=0.01) for _ in range(4)])
    with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=30, http2=http2) as client:
        for _ in range(2):
            for url, body in ((CHAT, {"model": "m", "messages": MESSAGES}),
                              ("https://api.anthropic.com/v1/messages",
                               {"model": "c", "max_tokens": 64, "messages": MESSAGES})):
                text, gaps = read_stream(client, url, session["model_secret"], body, http2)
                assert text == "".join(PIECES)
                assert len(gaps) >= len(PIECES) - 1 and sorted(gaps)[len(gaps) // 2] > 0.005  # paced, not at the end
    recorded(session["trace_path"], 4)
    status, _ = proxy.api("DELETE", f"sessions/{session['id']}")
    assert status == 200
    trace = read_trace(session["trace_path"])
    assert [c.status for c in trace.calls] == [200] * 4 and all(c.delivered for c in trace.calls)
    assert [trace.nodes[c.node].message.text() for c in trace.calls] == ["".join(PIECES)] * 4
    assert all(len(c.event_gaps_ms or []) >= len(PIECES) for c in trace.calls)


def test_a_failure_passing_the_answer_down_ends_it_as_an_error_on_the_record(sim, start_proxy, tmp_path):
    """A bug in the relay's write down the loopback (tests/faults.py ``passdown_fails``)
    mid-answer: the harness's stream is cut, the exchange is one error call on the record at
    once (not after ``intercept_drain_timeout``, with no one reading the upstream on), and the
    next turn is served."""
    spec = tmp_path / "faults.json"
    spec.write_text(json.dumps({"passdown_fails": 3}))  # the head and two pieces go down
    proxy = start_proxy({"faults_file": str(spec)}, extra_scripts=[FAULTS])
    session = proxy.create_session(upstream={"base_url": sim.url("/v1")})
    sim.script(Reply(text=PIECES, delay=0.01), Reply(text=["after"]))
    body = {"model": "m", "messages": MESSAGES}
    with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=30) as client:
        with pytest.raises(httpx.HTTPError):  # the body cut before its end
            read_stream(client, CHAT, session["model_secret"], body, False)
        recorded(session["trace_path"], 1)
        spec.write_text("{}")
        text, _ = read_stream(client, CHAT, session["model_secret"], {**body, "messages": MESSAGES * 2}, False)
        assert text == "after"
    assert "passing the answer on failed" in proxy.log()
    status, _ = proxy.api("DELETE", f"sessions/{session['id']}")
    assert status == 200
    trace = read_trace(session["trace_path"])
    assert [c.error is not None for c in trace.calls] == [True, False] and trace.num_turns == 1

"""The relay passes an upstream's answer on as it arrives (addons/gateway/transport/relay.py),
whatever its framing: what the upstream client read since the last read as one piece, a
chunked body as one chunk per piece. What must hold whatever the framing:
the harness gets the whole answer, the turn is recorded whole, a kept-alive upstream connection
is reused (a close-delimited one is not), an answer the harness abandons is still read to its
end and recorded, and a malformed body breaks the exchange instead of reaching the harness as a
whole answer. Parsing the answer's head and framing is the client library's (aiohttp).
"""

from __future__ import annotations

import json

import httpx2 as httpx
import pytest

from clients import session_clients
from interceptor.addons.gateway.transport.relay import DOWN_READ
from interceptor.trace import read_trace
from provider import Reply
from waiting import wait_until

MESSAGES = [{"role": "user", "content": "count"}]
FRAMINGS = [None, "extensions", "split", "close"]
PIECES = ["one ", "two ", "three ", "four"]


# -- through a real mitmdump -----------------------------------------------------------------

def turns(proxy, session):
    proxy.api("DELETE", f"sessions/{session['id']}")
    return read_trace(session["trace_path"])


def chat(client: httpx.Client, session: dict, stream: bool) -> str:
    """One chat turn read to the end of its body (an SDK stops reading at ``[DONE]``, which
    with the terminal chunk written apart would make it a client that left), its text."""
    r = client.post("https://api.openai.com/v1/chat/completions",
                    json={"model": "gpt-4.1", "messages": MESSAGES, "stream": stream},
                    headers={"authorization": f"Bearer {session['model_secret']}"})
    assert r.status_code == 200, r.text[:300]
    if not stream:
        return r.json()["choices"][0]["message"]["content"]
    return sse_text(r.text)


def sse_text(body: str) -> str:
    """The text a Chat Completions stream's events carry."""
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    return "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])


@pytest.mark.parametrize("framing", FRAMINGS)
def test_every_framing_reaches_the_harness_whole_and_is_recorded(framing, sim, proxy, new_session):
    """JSON and SSE answers, twice each, in every framing, on one client connection; after the
    first turn, no new upstream connection (the pooled one is reused), except when the answer
    is close-delimited (a connection per turn)."""
    sim.script(*[Reply(text=PIECES, framing=framing) for _ in range(4)])
    session = new_session()
    opened = lambda: sim.connections()["accepted"] - sim.connections()["probes"]  # noqa: E731
    with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=30) as client:
        assert chat(client, session, False) == "".join(PIECES)
        before = opened()  # (and Reach's first look at the upstream)
        assert chat(client, session, True) == "".join(PIECES)
        assert chat(client, session, False) == "".join(PIECES)
        assert chat(client, session, True) == "".join(PIECES)
    assert opened() - before == (3 if framing == "close" else 0)
    trace = turns(proxy, session)
    assert trace.num_turns == 4, trace.calls
    assert all(c.error is None and c.delivered is not False for c in trace.calls), trace.calls
    assert [trace.nodes[c.node].message.text() for c in trace.calls] == ["".join(PIECES)] * 4


@pytest.mark.parametrize("framing", FRAMINGS)
def test_an_abandoned_answer_in_any_framing_is_read_to_its_end_and_recorded(framing, sim, proxy, new_session, harness_env):
    """The client stops after the first event; the rest comes 0.3 s apart: the Drain finishes
    the answer from the body it tracked, and the SDK's retry is answered from the record."""
    sim.script(Reply(text=PIECES, delay=0.3, framing=framing))
    session = new_session()
    harness_env(session["env"])
    oai, _ = session_clients(session)
    stream = oai.chat.completions.create(model="gpt-4.1", messages=MESSAGES, stream=True)
    next(iter(stream))
    stream.close()
    wait_until(lambda: read_trace(session["trace_path"]).calls, 15, "the abandoned answer on the record")
    flag = {"x-stainless-retry-count": "1"}
    with oai.chat.completions.stream(model="gpt-4.1", messages=MESSAGES, extra_headers=flag) as s:
        assert s.get_final_completion().choices[0].message.content == "".join(PIECES)
    assert len(sim.model_requests()) == 1
    trace = turns(proxy, session)
    call = next(c for c in trace.calls if c.node is not None)
    assert trace.num_turns == 1 and call.delivered is False and call.error is None
    assert trace.nodes[call.node].message.text() == "".join(PIECES)


def test_events_that_reach_the_relay_together_go_on_as_one_chunk(sim, proxy, new_session):
    """80 events written at once (``framing="burst"``): the harness reads the same events in a
    few chunks, not 80 (mitmproxy's work per chunk is then per read, ``addons/gateway/transport/relay.py``), and
    the turn is recorded whole. An event that arrives alone still goes at once: the paced
    answer is read as one chunk per event."""
    pieces = [f"w{k} " for k in range(80)]
    sim.script(Reply(text=pieces, framing="burst"), Reply(text=pieces[:6], delay=0.05))
    session = new_session()
    payload = {"model": "gpt-4.1", "messages": MESSAGES, "stream": True}
    got = []
    with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=30) as client:
        for _ in range(2):
            with client.stream("POST", "https://api.openai.com/v1/chat/completions", json=payload,
                               headers={"authorization": f"Bearer {session['model_secret']}"}) as r:
                assert r.status_code == 200
                got.append(list(r.iter_raw()))
    body = b"".join(got[0])
    assert sse_text(body.decode()) == "".join(pieces) and body.endswith(b"data: [DONE]\n\n")
    assert len(got[0]) <= 4, [len(c) for c in got[0]]
    assert len(got[1]) >= 6, [len(c) for c in got[1]]  # paced: nothing waits for company
    trace = turns(proxy, session)
    assert [trace.nodes[c.node].message.text() for c in trace.calls] == ["".join(pieces), "".join(pieces[:6])]


def test_a_malformed_chunk_breaks_the_answer_and_is_never_a_whole_one(sim, proxy, new_session):
    """An upstream whose chunk header is not hex: the harness sees the body cut (as mitmproxy
    would show a broken upstream), the record an error, and nothing is sent again."""
    bad = b'{"x": 1}'
    sim.script(Reply(raw=b"zz\r\n" + bad, content_type="application/json", chunked=False,
                     headers={"transfer-encoding": "chunked"}))
    session = new_session()
    with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=30) as client:
        r = client.post("https://api.openai.com/v1/chat/completions", json={"model": "gpt-4.1", "messages": MESSAGES},
                        headers={"authorization": f"Bearer {session['model_secret']}"})
    assert r.status_code >= 500 and bad not in r.content, (r.status_code, r.content[:200])
    assert len(sim.model_requests()) == 1
    trace = turns(proxy, session)
    assert trace.num_turns == 0 and [c.error is not None for c in trace.calls] == [True]


def test_the_request_leaves_the_relay_without_its_ticket_and_framed_by_its_length(sim, proxy, new_session):
    """The relay writes the upstream request itself: mitmproxy's request as it came, the
    ticket (the relay's own header) never sent, one Host, one Content-Length that is the body's."""
    sim.script(Reply(text="ok"))
    session = new_session()
    with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=30) as client:
        assert chat(client, session, False) == "ok"
    [seen] = sim.model_requests()
    names = [k.lower() for k, _ in seen.headers.items()]
    assert "x-interceptor-relay" not in names
    assert names.count("host") == 1 and names.count("content-length") == 1 and "transfer-encoding" not in names
    assert int(seen.headers["content-length"]) == len(seen.body) and seen.json["messages"] == MESSAGES


def test_a_body_larger_than_the_relays_reads_reaches_the_upstream_byte_for_byte(sim, proxy, new_session):
    """A request body the relay reads from mitmproxy in several reads (3 MB of non-ASCII
    history, past ``DOWN_READ``) and writes after its head without joining them: the upstream
    gets exactly the harness's bytes under one Content-Length, and the next turn on the same
    connections goes through too (the relay's connection to mitmproxy kept in step)."""
    sim.script(Reply(text="ok"), Reply(text="again"))
    session = new_session()
    history = [{"role": "user" if k % 2 == 0 else "assistant", "content": f"{k} ünïcødé → " + "x" * 3000}
               for k in range(1000)]
    bodies = [json.dumps({"model": "gpt-4.1", "messages": history + [{"role": "user", "content": q}]},
                         ensure_ascii=False, indent=1).encode() for q in ("one", "two")]
    assert len(bodies[0]) > 2 * DOWN_READ
    with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=60) as client:
        for body, text in zip(bodies, ("ok", "again")):
            r = client.post("https://api.openai.com/v1/chat/completions", content=body,
                            headers={"authorization": f"Bearer {session['model_secret']}",
                                     "content-type": "application/json"})
            assert r.status_code == 200, r.text[:300]
            assert r.json()["choices"][0]["message"]["content"] == text
    seen = sim.model_requests()
    assert [s.body for s in seen] == bodies
    assert all(int(s.headers["content-length"]) == len(b) for s, b in zip(seen, bodies))
    assert turns(proxy, session).num_turns == 2

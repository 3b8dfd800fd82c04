"""The relay's upstream client (``addons/gateway/transport/relay.py``) sends the harness's
request as the harness sent it and passes the answer on as the upstream sent it.

A client library adds headers of its own (a User-Agent, Accept, Accept-Encoding, a
Content-Type for a bytes body) and decodes a compressed answer unless told not to: the
upstream would see a request the harness never made, and the harness an answer the upstream
never sent (its Content-Encoding kept, its bytes decoded). Both are checked end to end,
through a real mitmdump, against what the simulator received and what the harness read.
"""

from __future__ import annotations

import gzip
import json

import httpx2 as httpx
import pytest

from interceptor.trace import read_trace
from provider import Reply

MESSAGES = [{"role": "user", "content": "count"}]
CHAT = "https://api.openai.com/v1/chat/completions"


def bare(proxy) -> httpx.Client:
    """An HTTP client that sends only the headers a request names (httpx's own defaults
    removed), so every header the upstream sees is one the harness chose."""
    client = httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=30)
    client.headers.clear()
    return client


def test_no_header_the_harness_did_not_send_reaches_the_upstream(sim, proxy, new_session):
    """A request with only Host, Authorization and its body's length: the upstream gets those
    names and no other (no User-Agent, Accept, Accept-Encoding or Content-Type of the client
    library's), in the harness's order (the key, swapped by the proxy, comes last)."""
    sim.script(Reply(text="ok"), Reply(text="ok"))
    session = new_session()
    sent = ["x-first", "authorization", "x-last"]
    with bare(proxy) as client:
        for stream in (False, True):
            body = json.dumps({"model": "gpt-4.1", "messages": MESSAGES, "stream": stream}).encode()
            r = client.post(CHAT, content=body, headers=[("x-first", "1"),
                                                          ("authorization", f"Bearer {session['model_secret']}"),
                                                          ("x-last", "2")])
            assert r.status_code == 200, r.text[:300]
    for seen in sim.model_requests():
        names = [k.lower() for k, _ in seen.headers.items()]
        assert sorted(set(names) - {"host", "content-length"}) == sorted(sent), names
        assert names.index("x-first") < names.index("x-last"), names  # (the key is swapped at the end)
        for name in ("user-agent", "accept", "accept-encoding", "content-type"):
            assert name not in names, names


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_gzip_answer_reaches_the_harness_still_encoded_and_is_recorded(stream, sim, proxy, new_session):
    """The upstream's gzip answer (JSON, and SSE compressed as it goes) reaches the harness as
    the upstream encoded it, under its Content-Encoding, and the turn is recorded decoded."""
    sim.script(Reply(text=["one ", "two"], content_encoding="gzip"))
    session = new_session()
    body = {"model": "gpt-4.1", "messages": MESSAGES, "stream": stream}
    with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=30) as client:
        with client.stream("POST", CHAT, json=body, headers={"authorization": f"Bearer {session['model_secret']}",
                                                            "accept-encoding": "gzip"}) as r:
            assert r.status_code == 200
            assert r.headers["content-encoding"] == "gzip"
            raw = b"".join(r.iter_raw())
    assert raw[:2] == b"\x1f\x8b", raw[:20]
    text = gzip.decompress(raw).decode()
    assert ("one " in text and "two" in text), text[:300]
    proxy.api("DELETE", f"sessions/{session['id']}")
    trace = read_trace(session["trace_path"])
    assert [trace.nodes[c.node].message.text() for c in trace.calls] == ["one two"]


def test_an_answer_not_read_to_its_end_never_reuses_its_connection(sim, start_proxy):
    """A JSON answer past ``intercept_max_answer`` is read no further: its connection is closed
    (a pooled connection with the rest of an answer on it would hand those bytes to the next
    request as its answer), so the next turn opens a new one; a turn read to its end leaves its
    connection to the one after it."""
    proxy = start_proxy({"intercept_max_answer": "64k"})
    session = proxy.create_session(upstream={"base_url": sim.url("/v1")})
    opened = lambda: sim.connections()["accepted"] - sim.connections()["probes"]  # noqa: E731
    sim.script(Reply(text="ok"), Reply(text="x" * 400_000), Reply(text="after"), Reply(text="again"))
    texts = []
    with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=30) as client:
        for k in range(4):
            r = client.post(CHAT, json={"model": "gpt-4.1", "messages": MESSAGES * (k + 1)},
                            headers={"authorization": f"Bearer {session['model_secret']}"})
            texts.append((r.status_code, r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else None))
            if k == 0:
                first = opened()
    assert texts == [(200, "ok"), (502, None), (200, "after"), (200, "again")], texts
    assert opened() == first + 1  # after the cut answer only
    assert [m.json["messages"] for m in sim.model_requests()] == [MESSAGES * (k + 1) for k in range(4)]


def test_no_cookie_is_kept_and_no_redirect_followed(sim, start_proxy):
    """An upstream's Set-Cookie reaches the harness and is not sent back by the proxy on the
    next request (a cookie jar shared by every session would carry one rollout's cookie into
    another's request); a redirect reaches the harness as it came, not followed (the model
    request is sent once, where the session's upstream is)."""
    sim.script(Reply(text="ok", headers={"set-cookie": "sticky=1; Path=/"}),
               Reply(raw=b"", status=307, content_type="application/json",
                     headers={"location": sim.url("/v1/chat/completions")}),
               Reply(text="last"))
    # By name: a cookie jar keeps no cookie from an IP address; a provider is a name.
    by_name = sim.url("/v1").replace("127.0.0.1", "localhost")
    proxy = start_proxy({"intercept_upstream": by_name})
    session = proxy.create_session(upstream={"base_url": by_name})
    got = []
    with bare(proxy) as client:
        for k in range(3):
            r = client.post(CHAT, json={"model": "gpt-4.1", "messages": MESSAGES * (k + 1)},
                            headers={"authorization": f"Bearer {session['model_secret']}"})
            got.append((r.status_code, r.headers.get("set-cookie"), r.headers.get("location")))
            client.cookies.clear()  # the harness keeps none either: any cookie upstream is the proxy's
    assert got[0][:2] == (200, "sticky=1; Path=/") and got[1][0] == 307 and got[1][2] and got[2][0] == 200, got
    seen = sim.model_requests()
    assert len(seen) == 3, [s.json["messages"] for s in seen]  # the 307 not followed
    assert all("cookie" not in {k.lower() for k in s.headers} for s in seen), [sorted(s.headers) for s in seen]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_header_the_client_cannot_send_byte_for_byte_is_refused_and_nothing_leaves(stream, sim, proxy, new_session):
    """A header value that is not UTF-8 text (``caf\\xe9``): the upstream client writes header
    values as UTF-8 and would drop or re-encode the byte, so the upstream would get a request
    the harness never sent. It is refused instead, in the dialect's shape and not to be
    retried (the same request fails the same way), naming the header, never its value; the
    upstream gets nothing. A UTF-8 value goes byte for byte."""
    sim.script(Reply(text="ok"))
    session = new_session()
    body = {"model": "gpt-4.1", "messages": MESSAGES, "stream": stream}
    auth = (b"authorization", f"Bearer {session['model_secret']}".encode())
    with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=30) as client:
        r = client.post(CHAT, json=body, headers=[auth, (b"x-name", b"caf\xe9")])
        assert r.status_code == 502 and r.headers.get("x-should-retry") == "false", (r.status_code, r.text[:300])
        message = r.json()["error"]["message"]
        assert "x-name" in message and "caf" not in message, message
        assert sim.model_requests() == []
        r = client.post(CHAT, json=body, headers=[auth, (b"x-name", "café".encode())])
        assert r.status_code == 200
    [seen] = sim.model_requests()
    assert seen.headers["x-name"].encode("latin-1") == "café".encode()

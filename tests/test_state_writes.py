"""A state write is all or nothing, and the proxy's own API answers every error in its JSON
shape.

Property: a state body of any shape (JSON of any structure, nesting of any depth, numbers
JSON cannot hold, roots that are no object, bytes that are no UTF-8, lone surrogates) sent
as PUT or PATCH is either taken whole (a read gives back exactly it, one version more, one
``state`` record) or refused with ``{"error": {"message", "status"}}`` and the state, its
version and the trace unchanged; a read afterwards always works. And every route under
``/_interceptor/``, with any method and any of those bodies, answers JSON, never
mitmproxy's HTML error page. A real mitmdump.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from clients import KEY_ENV, REAL_KEY, dead_upstream
from interceptor.addons.gateway.sessions.state import merge_patch
from interceptor.trace import read_trace
from mitm import MitmProcess
from provider import ProviderSimulator


def simulated_proxy() -> Iterator[MitmProcess]:
    """A real mitmdump whose default upstream is a strict simulator, for a module's tests."""
    with ProviderSimulator(strict=True) as sim:
        proc = MitmProcess(options={"intercept_upstream": sim.url("/v1"), "intercept_api_key_env": KEY_ENV,
                                    "intercept_upstreams": dead_upstream()}, env={KEY_ENV: REAL_KEY})
        with proc:
            yield proc


@pytest.fixture(scope="module")
def sproxy() -> Iterator[MitmProcess]:
    yield from simulated_proxy()


@pytest.fixture(scope="module")
def state_session(sproxy) -> dict:
    return sproxy.create_session(state={"start": 1})


def request(proxy: MitmProcess, method: str, path: str, body: bytes | None = None,
            headers: dict | None = None) -> tuple[int, str, bytes, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    try:
        conn.request(method, f"/_interceptor/{path}", body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.getheader("content-type", ""), r.read(), dict(r.getheaders())
    finally:
        conn.close()


def _json_error(status: int, kind: str, data: bytes) -> dict:
    assert kind == "application/json", (status, kind, data[:300])
    answer = json.loads(data)
    assert set(answer["error"]) >= {"message", "status"} and answer["error"]["status"] == status, answer
    return answer


def _read(proxy, secret) -> tuple[object, str]:
    status, kind, data, headers = request(proxy, "GET", "state", headers={"Authorization": f"Bearer {secret}"})
    assert status == 200 and kind == "application/json", (status, data[:300])
    return json.loads(data), headers["etag"]


# -- bodies of any shape -----------------------------------------------------------------------

LEAVES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                   st.text(max_size=20))
JSON = st.recursive(LEAVES, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                    max_leaves=20)


@st.composite
def bodies(draw) -> bytes:
    """Bytes a tool server might send as a state write."""
    kind = draw(st.sampled_from(["json", "object", "deep", "number", "surrogate", "not utf-8", "not json"]))
    event(kind)
    if kind == "json":
        return json.dumps(draw(JSON)).encode()
    if kind == "object":
        return json.dumps(draw(st.dictionaries(st.text(max_size=8), JSON, max_size=5))).encode()
    if kind == "deep":
        depth = draw(st.integers(1, 3000))
        leaf = json.dumps(draw(JSON))
        opener, closer = draw(st.sampled_from([('{"k":', "}"), ("[", "]"), ('{"a":[', "]}")]))
        return ("{\"d\":" + opener * depth + leaf + closer * depth + "}").encode()
    if kind == "number":
        number = draw(st.sampled_from(["1e400", "-1e400", "NaN", "Infinity", "-Infinity", "9" * 5000,
                                       "1" + "0" * 400, "1e-400", "0.1e99999"]))
        return ('{"n":' + number + "}").encode()
    if kind == "surrogate":
        return b'{"s":"\\ud800' + draw(st.sampled_from([b"", b"x", b"\\udc00"])) + b'"}'
    if kind == "not utf-8":
        return b'{"s":"' + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf"])) + b'"}'
    return draw(st.sampled_from([b"", b"{", b"{}}", b"nul", b'{"a":1,}', b"\x00"]))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(body=bodies(), method=st.sampled_from(["PUT", "PATCH"]))
def test_a_state_write_of_any_shape_applies_whole_or_changes_nothing(body, method, sproxy, state_session):
    secret = state_session["state_secret"]
    before, etag = _read(sproxy, secret)
    kind = "application/merge-patch+json" if method == "PATCH" else "application/json"
    status, answer_kind, data, _ = request(sproxy, method, "state", body,
                                           {"Authorization": f"Bearer {secret}", "Content-Type": kind})
    after, new_etag = _read(sproxy, secret)  # a read always works afterwards
    event(f"{method} {status}")
    if status == 200:
        sent = json.loads(body)
        assert after == (sent if method == "PUT" else merge_patch(before, sent))
        assert int(new_etag.strip('"')) == int(etag.strip('"')) + 1
        if not isinstance(after, dict) or len(json.dumps(after)) > 200_000:
            _reset(sproxy, secret)
    else:
        assert 400 <= status < 500, (status, data[:300])
        _json_error(status, answer_kind, data)
        assert (after, new_etag) == (before, etag)


def _reset(proxy, secret) -> None:
    status, *_ = request(proxy, "PUT", "state", b'{"start":1}', {"Authorization": f"Bearer {secret}"})
    assert status == 200


def test_the_trace_holds_exactly_the_accepted_writes(sproxy):
    """A refused write leaves no ``state`` record and an accepted one exactly one, whose
    value is what a read returned."""
    session = sproxy.create_session(state={"n": 0})
    secret = session["state_secret"]
    auth = {"Authorization": f"Bearer {secret}"}
    deep = ("{\"a\":" * 900 + "1" + "}" * 900).encode()
    outcomes = [request(sproxy, m, "state", b, auth)[0] for m, b in
                [("PUT", b'{"n":1}'), ("PUT", deep), ("PATCH", deep), ("PUT", b'{"n":NaN}'),
                 ("PUT", b'{"s":"\\ud800"}'), ("PATCH", b'{"n":2}')]]
    assert outcomes[0] == 200 and outcomes[-1] == 200 and all(s == 400 for s in outcomes[1:-1]), outcomes
    assert _read(sproxy, secret) == ({"n": 2}, '"2"')
    sproxy.api("DELETE", f"sessions/{session['id']}")
    trace = read_trace(session["trace_path"])
    assert [(w.version, w.value) for w in trace.state_writes] == [(0, {"n": 0}), (1, {"n": 1}), (2, {"n": 2})]


def test_an_initial_state_too_deep_is_a_bad_config(sproxy):
    deep = {"a": 1}
    for _ in range(900):
        deep = {"a": deep}
    status, kind, data, _ = request(sproxy, "POST", "sessions", json.dumps({"state": deep}).encode(),
                                    {"Authorization": f"Bearer {sproxy.admin_token}"})
    assert status == 400 and "deeper" in _json_error(status, kind, data)["error"]["message"]


# -- every route answers in JSON ---------------------------------------------------------------

DEEP = ("[" * 5000 + "]" * 5000).encode()
BAD = {"deep": DEEP, "deep object": ("{\"a\":" * 900 + "1" + "}" * 900).encode(), "not utf-8": b'{"a":"\xff"}',
       "surrogate": b'{"reason":"\\ud800"}', "nan": b'{"a":NaN}', "big number": b'{"a":' + b"9" * 5000 + b"}",
       "not json": b"{", "none": None}
ROUTES = ["health", "sessions", "sessions/{id}", "sessions/{id}/env", "sessions/{id}/state", "sessions/{id}/x",
          "task", "state", "stop", "tool", "nowhere", "sessions/nosuch/state"]


@pytest.mark.parametrize("route", ROUTES)
def test_every_route_answers_errors_in_json(route, sproxy):
    session = sproxy.create_session()
    path = route.format(id=session["id"])
    tokens = {"admin": sproxy.admin_token, "state": session["state_secret"], "model": session["model_secret"]}
    for method in ("GET", "POST", "PUT", "PATCH", "DELETE", "FOO"):
        for name, body in BAD.items():
            for token in tokens.values():
                if route.startswith("sessions/{id}") and method == "DELETE" and token == tokens["admin"]:
                    continue  # would seal the session the other requests use
                status, kind, data, _ = request(sproxy, method, path, body, {"Authorization": f"Bearer {token}"})
                assert kind == "application/json", (method, path, name, status, data[:300])
                if status >= 400:
                    _json_error(status, kind, data)

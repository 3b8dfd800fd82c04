"""Where a credential can arrive is the dialects' to say, once (``Dialect.secret_places`` and
``credential_headers``): Claim, the tool route, Redact, the recorder and the worker front read
the same list. A dialect added to the registry is covered everywhere without another edit
(tests/test_fifth_api.py shows it for a whole new API); these check the four of today."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest

from interceptor.dialects import CHAT, GEMINI, REGISTRY, credential_headers, secret_of, secret_places
from interceptor.dialects.chat import ChatDialect
from interceptor.trace import read_trace


def test_a_dialect_that_reads_a_key_where_it_does_not_remove_one_is_refused_when_defined():
    with pytest.raises(TypeError, match="x-new-key"):
        class Careless(ChatDialect):  # noqa: F841 - defining it is the test
            secret_places = ("x-new-key", *ChatDialect.secret_places)


def test_every_place_of_every_dialect_is_read_and_removed():
    for dialect in REGISTRY:
        for place in dialect.secret_places:
            name = place.split(":")[0]
            scheme = place.partition(":")[2].strip()
            value = f"{scheme} sk-ic-m-placed" if scheme else "sk-ic-m-placed"
            headers, query = ({}, {name[1:]: value}) if name.startswith("?") else ({name: value}, {})
            assert dialect.secret(headers, query) == "sk-ic-m-placed", (dialect.name, place)
            assert secret_of(headers, query) == "sk-ic-m-placed"
            dialect.put_key(headers, query, None)
            assert headers == {} and query == {}, (dialect.name, place)
    assert "x-goog-api-key" in credential_headers() and "x-goog-api-key" in secret_places()
    # Gemini's own places before the ones every SDK uses, as the genai SDKs send them
    assert GEMINI.secret({"authorization": "Bearer other"}, {"key": "mine"}) == "mine"
    assert CHAT.secret({"authorization": "Basic abc"}, {"key": "x"}) is None


def _tool(mproxy, headers: dict) -> int:
    req = urllib.request.Request(f"{mproxy.url}/_interceptor/tool", data=b"{}", method="POST",
                                 headers={"content-type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_the_tool_route_and_the_recorder_know_every_dialects_credential(proxy):
    """A Gemini harness's tool hook sends its key where its SDK does (``x-goog-api-key``): the
    tool route knows the session by it (the empty call is a 400, not a 401); and a session's
    ``info`` that holds a value under a dialect's credential header never reaches the trace."""
    session = proxy.create_session(info={"note": "kept", "x-goog-api-key": "AIza-leaked-in-info-0123",
                                         "nested": {"X-Goog-Api-Key": "AIza-leaked-deeper-4567"}})
    assert _tool(proxy, {"x-goog-api-key": session["model_secret"]}) == 400
    assert _tool(proxy, {"x-goog-api-key": "sk-ic-m-unknown-unknown"}) == 401
    proxy.api("DELETE", f"sessions/{session['id']}")
    path = Path(session["trace_path"])
    blob = path.read_bytes()
    assert b"AIza-leaked" not in blob
    assert read_trace(path).info == {"note": "kept", "nested": {}}

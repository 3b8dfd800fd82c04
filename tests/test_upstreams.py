"""Upstreams are the operator's: a session picks a declared one, and can never make the proxy
send a key (or any variable of its environment) to a host the operator did not declare."""

from __future__ import annotations

import json

import pytest

from interceptor.addons.gateway.sessions.upstream import KNOWN, UpstreamRef, parse_upstreams, pick
from clients import KEY_ENV, REAL_KEY, session_clients
from provider import ProviderSimulator, Reply


@pytest.fixture
def other() -> ProviderSimulator:
    """A second host: what an attacker would like the key sent to."""
    with ProviderSimulator() as s:
        yield s


@pytest.fixture
def declared(start_proxy, sim, other, tmp_path):
    upstreams = tmp_path / "upstreams.json"
    upstreams.write_text(json.dumps({"second": {"base_url": sim.url("/v2"), "api_key_env": "SECOND_KEY"}}))
    return start_proxy({"intercept_upstreams": str(upstreams)}, env={"SECOND_KEY": "sk-second-key-0123456789"})


@pytest.mark.parametrize("upstream, field", [
    ("nowhere", "upstream.name"),
    ({"base_url": "http://127.0.0.1:9/v1"}, "upstream.base_url"),
    ({"base_url": "OTHER"}, "upstream.base_url"),
    ({"base_url": "OTHER", "api_key_env": KEY_ENV}, "upstream.api_key_env"),  # another upstream's key
    ({"api_key_env": "PATH"}, "upstream.api_key_env"),
    ({"name": "second", "api_key_env": "HOME"}, "upstream.api_key_env"),
    ({"name": "default", "base_url": "OTHER"}, "upstream.base_url"),
])
def test_a_session_cannot_choose_where_a_key_goes(declared, sim, other, upstream, field):
    if isinstance(upstream, dict):
        upstream = {k: (other.url("/v1") if v == "OTHER" else v) for k, v in upstream.items()}
    status, body = declared.api("POST", "sessions", {"upstream": upstream})
    assert status == 400, body
    assert field in body["error"]["message"]
    assert REAL_KEY not in json.dumps(body) and "sk-second" not in json.dumps(body)
    assert len(declared.api("GET", "sessions")[1]["sessions"]) == 1  # the default, nothing made
    assert sim.requests == [] and other.requests == []


def test_a_session_picks_a_declared_upstream_by_name_or_base_url(declared, sim, harness_env):
    sim.script(Reply(text="one"), Reply(text="two"), Reply(text="three"))
    by_name = declared.create_session(upstream="second")
    by_url = declared.create_session(upstream={"base_url": sim.url("/v2") + "/"})
    default = declared.create_session()
    assert by_name["upstream"] == {"name": "second", "base_url": sim.url("/v2"), "api_key_env": "SECOND_KEY",
                                   "dialect": None, "key_set": True}
    for session in (by_name, by_url, default):
        harness_env(session["env"])
        oai, _ = session_clients(session)
        oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    first, second, third = sim.model_requests()
    assert first.path == second.path == "/v2/chat/completions" and third.path == "/v1/chat/completions"
    assert first.headers["authorization"] == second.headers["authorization"] == "Bearer sk-second-key-0123456789"
    assert third.headers["authorization"] == f"Bearer {REAL_KEY}"


def test_an_upstream_of_another_dialect_refuses_rather_than_forwards(start_proxy, sim, harness_env):
    proxy = start_proxy({"intercept_upstreams": json.dumps(
        {"msgs": {"base_url": sim.url("/v1"), "api_key_env": KEY_ENV, "dialect": "anthropic"}})})
    session = proxy.create_session(upstream="msgs")
    harness_env(session["env"])
    oai, _ = session_clients(session)
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert "speaks anthropic" in str(e.value) and "does not translate" in str(e.value)
    assert sim.requests == []


def test_the_declaration_forms():
    assert parse_upstreams('["openai", "anthropic"]')["anthropic"].api_key_env == KNOWN["anthropic"]["api_key_env"]
    assert parse_upstreams('{"openai": {}}')["openai"].base_url == "https://api.openai.com/v1"
    assert parse_upstreams('{"vllm": {"base_url": "http://gpu:8000/v1/"}}')["vllm"].base_url == "http://gpu:8000/v1"
    for bad, says in [('["nope"]', "not a known provider"), ('{"x": {"base_url": "ftp://h"}}', "x.base_url"),
                      ('{"x": {"base_url": "http://h", "api_key_env": "A B"}}', "x.api_key_env"),
                      ('{"x": {"base_url": "http://h", "dialect": "klingon"}}', "x.dialect"), ("[1]", "known providers"), ("4", "JSON object")]:
        with pytest.raises(ValueError, match=says):
            parse_upstreams(bad)
    declared = parse_upstreams('["openai"]')
    assert pick(None, declared) is None  # nothing declared as default: the addressed host, no key
    assert pick(UpstreamRef.model_validate("openai"), declared).name == "openai"

"""Listening beyond loopback, the proxy relays only for its sessions, unless told to be open."""

from __future__ import annotations

import httpx
import pytest

from clients import session_clients
from provider import Reply


def _relay(proxy_url: str, target: str) -> int:
    """A plain proxied request to a host the proxy does not intercept, or a CONNECT."""
    with httpx.Client(proxy=proxy_url, timeout=15, verify=False) as c:
        return c.get(target).status_code


@pytest.fixture
def exposed(start_proxy):
    return start_proxy({"listen_host": "0.0.0.0"})


def test_beyond_loopback_every_connection_needs_a_session_secret(exposed, sim, harness_env):
    assert "every connection must present a session secret" in exposed.log()
    sim.script(Reply(text="relayed for a session"))
    bare = f"http://127.0.0.1:{exposed.port}"
    # No secret: neither a plain proxied request nor a CONNECT goes anywhere.
    assert _relay(bare, sim.url("/anything")) == 407
    with pytest.raises(httpx.ProxyError, match="407"):
        _relay(bare, "https://example.invalid/")
    assert _relay(bare.replace("http://", "http://session:sk-ic-m-wrong@"), sim.url("/x")) == 407
    assert sim.requests == []
    # A session's env carries its secret in the proxy URL, and the harness works.
    session = exposed.create_session(model="exposed")
    assert session["env"]["HTTPS_PROXY"].startswith("http://session:sk-ic-m-")
    harness_env(session["env"])
    oai, _ = session_clients(session)
    r = oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content == "relayed for a session"
    assert _relay(session["env"]["HTTPS_PROXY"], sim.url("/plain")) != 407  # relaying, for a session
    # A sealed session's secret opens nothing any more.
    exposed.api("DELETE", f"sessions/{session['id']}")
    assert _relay(session["env"]["HTTPS_PROXY"], sim.url("/after")) == 407
    assert exposed.api("GET", "health")[0] == 200  # the control API has its own token


def test_intercept_open_proxy_relays_for_anyone_and_says_so(start_proxy, sim):
    proxy = start_proxy({"listen_host": "0.0.0.0", "intercept_open_proxy": "true"})
    assert "OPEN PROXY" in proxy.log()
    assert _relay(f"http://127.0.0.1:{proxy.port}", sim.url("/open")) != 407
    assert [r.path for r in sim.requests] == ["/open"]
    assert "@" not in proxy.create_session()["env"]["HTTPS_PROXY"]


def test_on_loopback_nothing_changes(proxy, sim):
    assert "listening on loopback only" in proxy.log()
    assert _relay(proxy.url, sim.url("/loop")) != 407

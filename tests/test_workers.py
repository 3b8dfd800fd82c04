"""More than one core: HAProxy in front of N real mitmdump workers (scripts/serve.py).

Everything goes through the front, as harnesses and orchestrators use it: the control API
(interceptor.client attached to the front's one address), the real openai and anthropic SDKs
with the front in ``HTTPS_PROXY``, the simulator as the only stand-in. HAProxy is Debian's
package (``make haproxy``); without it these tests fail, unless the machine has no apt-get
at all to install it with (then they skip and say why).
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import anthropic
import httpx
import httpx2  # the anthropic SDK's own HTTP client
import openai
import pytest

from clients import KEY_ENV, REAL_KEY
from interceptor.client import Proxy
from interceptor.client.proxy import call, with_userinfo
from interceptor.scripts.serve import Deployment, haproxy_bin, haproxy_config
from interceptor.trace import read_trace
from provider import ProviderSimulator, Reply
from waiting import wait_until

pytestmark = pytest.mark.proxy


def _haproxy() -> str:
    found = haproxy_bin()
    if found:
        return found
    if shutil.which("apt-get"):
        pytest.fail("haproxy is missing: run `make test-deps` (or `make haproxy`: Debian's package unpacked into .venv)")
    pytest.skip("no haproxy and no apt-get to install it with: install HAProxy to run the multi-worker tests")


def _deployment(tmp: Path, sim: ProviderSimulator, workers: int = 2, **kw) -> Deployment:
    upstreams = '{"sim": {"base_url": "%s", "api_key_env": "%s"}}' % (sim.url("/v1"), KEY_ENV)
    return Deployment(workers, listen_port=0, trace_dir=tmp / "traces", confdir=tmp / "conf",
                      options=[f"intercept_upstreams={upstreams}"], env={KEY_ENV: REAL_KEY},
                      haproxy=_haproxy(), **kw)


@pytest.fixture(scope="module")
def msim():
    with ProviderSimulator(strict=True) as s:
        yield s


@pytest.fixture(scope="module")
def front(msim, tmp_path_factory):
    dep = _deployment(tmp_path_factory.mktemp("workers"), msim).start()
    yield dep
    dep.stop()


def _openai(session) -> openai.OpenAI:
    http = httpx.Client(proxy=session.proxy_url, verify=session.ssl_context())
    return openai.OpenAI(api_key=session.secret, http_client=http, max_retries=0)


def _anthropic(session) -> anthropic.Anthropic:
    http = httpx2.Client(proxy=session.proxy_url, verify=session.ssl_context())
    return anthropic.Anthropic(api_key=session.secret, http_client=http, max_retries=0)


def _chat(session, text: str) -> str:
    return _openai(session).chat.completions.create(
        model="harness-model", messages=[{"role": "user", "content": text}]).choices[0].message.content


def _verify(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "interceptor.scripts.replay_trace", "verify", str(path)],
                          capture_output=True, text=True, timeout=60)


def _connect(port: int, auth: str | None) -> bytes:
    """A raw CONNECT through the front: what it answers before any TLS."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        head = "CONNECT api.openai.com:443 HTTP/1.1\r\nHost: api.openai.com:443\r\n"
        if auth:
            head += f"Proxy-Authorization: {auth}\r\n"
        s.sendall((head + "\r\n").encode())
        data = b""
        while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 40:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
        return data


def test_sessions_land_on_workers_and_keep_their_own_turns(front, msim):
    proxy = Proxy.attach(front.url, front.admin_token)
    a = proxy.session(upstream="sim", model="model-a")
    b = proxy.session(upstream="sim", model="model-b")
    # round robin over healthy workers: two sessions in a row land on the two workers
    assert {a.id.split("-")[0], b.id.split("-")[0]} == {"w1", "w2"}
    assert a.secret.startswith(f"sk-ic-{a.id.split('-')[0]}-")
    assert a.env["HTTPS_PROXY"].endswith(f"@127.0.0.1:{front.port}")  # the front, never a worker's port
    assert a.trace_path.parent == b.trace_path.parent == front.trace_dir  # one folder

    for i in range(2):
        assert _chat(a, f"alpha {i}").endswith(f"alpha {i}")
        reply = _anthropic(b).messages.create(model="claude-x", max_tokens=64,
                                              messages=[{"role": "user", "content": f"beta {i}"}])
        assert reply.content[0].text.endswith(f"beta {i}")
    models = [r.json["model"] for r in msim.model_requests() if r.json]
    assert models.count("model-a") == 2 and models.count("model-b") == 2  # each worker imposed its session's

    # the control API through the front reaches the worker that holds each session
    assert proxy.request("GET", f"sessions/{a.id}")["turns"] == 2
    assert b.update_state({"score": 1}) >= 1 and b.state() == {"score": 1}
    status, task = call(front.url, b.state_secret, "GET", "task")  # the tool servers' route, by state secret
    assert status == 200 and task["session"] == b.id
    # the tool route, by the model secret: b's worker knows it (a 400 for the empty call, not a 401)
    for _ in range(2):  # twice: round robin would have sent one of them to the other worker
        status, answer = call(front.url, b.secret, "POST", "tool", {})
        assert status == 400, answer
    status, listed = call(front.url, front.admin_token, "GET", f"sessions?worker={b.id.split('-')[0]}")
    assert status == 200 and b.id in [s["id"] for s in listed["sessions"]]
    assert a.id not in [s["id"] for s in listed["sessions"]]
    status, answer = call(front.url, front.admin_token, "GET", "sessions")  # which worker's list? say so
    assert status == 400 and "?worker=" in answer["error"]["message"]

    a.close(reward=1.0)
    b.close(reward=0.0)
    for s, own, other in ((a, "alpha", "beta"), (b, "beta", "alpha")):
        trace = read_trace(s.trace_path)
        assert trace.sealed and trace.num_turns == 2
        blob = s.trace_path.read_bytes()
        assert own.encode() in blob and other.encode() not in blob
        assert _verify(s.trace_path).returncode == 0


def test_no_or_unknown_secret_is_refused_at_the_front(front, msim):
    before = len(msim.model_requests())
    # no secret: the front answers itself, before any TLS; nothing reaches a worker or the provider
    answer = _connect(front.port, None)
    assert answer.startswith(b"HTTP/1.1 407") and b"HTTPS_PROXY=http://session:<secret>@" in answer
    # a secret that names no worker: the same
    forged = base64.b64encode(b"session:sk-ic-w9-m-nothing").decode()
    assert _connect(front.port, f"Basic {forged}").startswith(b"HTTP/1.1 407")
    # a well-formed secret of a live worker that no session holds: that worker's own 407
    forged = base64.b64encode(b"session:sk-ic-w1-m-forgedforgedforged").decode()
    answer = _connect(front.port, f"Basic {forged}")
    assert answer.startswith(b"HTTP/1.1 407") and b"session" in answer

    # the real SDK, pointed at the front without the secret in the proxy URL: a clear error
    proxy = Proxy.attach(front.url, front.admin_token)
    s = proxy.session(upstream="sim")
    http = httpx.Client(proxy=front.url, verify=s.ssl_context())
    client = openai.OpenAI(api_key=s.secret, http_client=http, max_retries=0)
    with pytest.raises(openai.APIConnectionError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert "407" in repr(e.value.__cause__)
    assert len(msim.model_requests()) == before  # nothing was forwarded
    # the control API: a wrong admin token is the worker's 401, in the API's shape
    status, answer = call(front.url, "ic-admin-wrong-wrong-wrong", "POST", "sessions", {})
    assert status == 401 and "admin token" in answer["error"]["message"]
    s.close()


def test_kill_9_of_one_worker_loses_only_its_own_turns(msim, tmp_path):
    dep = _deployment(tmp_path, msim).start()
    try:
        proxy = Proxy.attach(dep.url, dep.admin_token)
        a, b = proxy.session(upstream="sim"), proxy.session(upstream="sim")
        victim = next(w for w in dep.workers if a.id.startswith(w.tag + "-"))
        assert not b.id.startswith(victim.tag + "-")
        assert _chat(a, "kept turn").endswith("kept turn")
        assert _chat(b, "other one").endswith("other one")

        # a's next turn streams slowly; the worker holding it dies in the middle
        msim.script(Reply(text=[f"w{i} " for i in range(60)], delay=0.1),
                    key=lambda r: "doomed" in r.body.decode(errors="replace"))
        got, failed = [], []

        def doomed() -> None:
            try:
                stream = _openai(a).chat.completions.create(
                    model="m", stream=True, messages=[{"role": "user", "content": "doomed turn"}])
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        got.append(chunk.choices[0].delta.content)
            except Exception as e:  # noqa: BLE001 - the point: the client sees its connection die
                failed.append(e)

        t = threading.Thread(target=doomed)
        t.start()
        wait_until(lambda: len(got) >= 3, 60, "the slow stream started")
        pid = victim.proc.pid
        os.kill(pid, signal.SIGKILL)
        t.join(60)
        assert failed and len(got) < 60  # its in-flight turn is lost, and the client knows

        # the other worker serves on, while the victim is down or starting again
        for i in range(3):
            assert _chat(b, f"still here {i}").endswith(f"still here {i}")
        b.close()
        trace_b = read_trace(b.trace_path)
        assert trace_b.sealed and trace_b.num_turns == 4

        # the dead worker's session: its trace stands up to the last whole record and verifies
        trace_a = read_trace(a.trace_path)
        assert trace_a.num_turns == 1 and not trace_a.sealed
        assert _verify(a.trace_path).returncode == 0
        # its secret opens nothing any more (the front, or the restarted worker, refuses it)
        with pytest.raises(openai.APIConnectionError):
            _chat(a, "after the kill")

        # the supervisor starts the worker again on its port; new sessions land there too
        wait_until(lambda: victim.proc.pid != pid and victim.proc.poll() is None, 120, "the worker started again")
        assert victim.starts == 2
        tags = set()

        def on_both_workers() -> bool:
            s = proxy.session(upstream="sim")
            tags.add(s.id.split("-")[0])
            assert _chat(s, "fresh").endswith("fresh")
            s.close()
            return len(tags) >= 2
        wait_until(on_both_workers, 120, lambda: f"new sessions on both workers, not only {tags}")
        assert victim.tag in tags
    finally:
        dep.stop()


def test_config_routes_every_worker_and_refuses_the_rest():
    """The front's rules name each worker once per route kind, and refuse an unroutable request
    before any backend (the full behaviour is the end-to-end tests above)."""
    cfg = haproxy_config("127.0.0.1", 8080, {"w1": 9001, "w2": 9002, "w10": 9010})
    for tag in ("w1", "w2", "w10"):
        assert f"path_beg /_interceptor/sessions/{tag}- " in cfg
        assert f"var(txn.secret) -m beg sk-ic-{tag}- " in cfg
    assert "return status 407" in cfg and "!control !routable" in cfg
    assert "http-reuse never" in cfg
    assert cfg.index("return status 407") < cfg.index("use_backend")


@pytest.mark.parametrize("worker,front,why", [
    ("w1", "https://127.0.0.1:8080", "intercept_front"),
    ("w1", "http://127.0.0.1", "intercept_front"),
    ("w1", "http://session:x@127.0.0.1:8080", "intercept_front"),
    ("worker-1", "http://127.0.0.1:8080", "intercept_worker"),
])
def test_worker_options_are_checked(tmp_path, worker, front, why):
    from mitmproxy import exceptions
    from mitmproxy.test import taddons

    from interceptor.addons.gateway.sessions.session import Registry
    from interceptor.addons.mitm.settings import Settings

    registry = Registry()
    settings = Settings(registry)
    with taddons.context(settings) as tctx:
        with pytest.raises(exceptions.OptionsError, match=why):
            tctx.configure(settings, intercept_worker=worker, intercept_front=front,
                           intercept_trace_dir=str(tmp_path))
    registry.store.close()


def test_a_worker_tags_its_ids_files_and_secrets(tmp_path):
    """What the front routes by, made by the registry: ``w2-<id>``, ``w2-<id>.msgpack``,
    ``sk-ic-w2-m-...`` and ``sk-ic-w2-s-...``; without a tag, nothing changes."""
    from interceptor.addons.gateway.sessions.session import Registry, SessionConfig

    tagged, plain = Registry(), Registry()
    tagged.worker = "w2"
    s = tagged.create(SessionConfig(id="rollout-7"), tmp_path, "never")
    assert s.id == "w2-rollout-7" and s.trace_path.name == "w2-rollout-7.msgpack"
    assert s.model_secret.startswith("sk-ic-w2-m-") and s.state_secret.startswith("sk-ic-w2-s-")
    assert tagged.get("w2-rollout-7") is s and tagged.by_model_secret(s.model_secret) is s
    r = tagged.create(SessionConfig(), tmp_path, "never")
    assert r.id.startswith("w2-") and len(r.id) == 3 + 16
    p = plain.create(SessionConfig(id="rollout-7"), tmp_path / "plain", "never")
    assert p.id == "rollout-7" and p.model_secret.startswith("sk-ic-m-")
    for reg in (tagged, plain):
        reg.seal_all("test")
        reg.store.close()

"""The request hooks' caches against the pass they stand for, in process.

A hooked request goes on from its conversation's last pass (``LastPass``), and the hooks' walk
and the commit take what that pass found (``Exchange.walked``). Each stands for a full pass
over the request's messages. Here the whole script's addons (``addons/interception.py``, as
``bench/hooks.py`` drives them: ``taddons``, no sockets) serve the same random sequence of
requests twice, once as they are and once with every one of those caches off, and must send
the upstream the same bytes for every request and leave the same trace.

The sequences mix two conversations turn about, restated histories, forks (a shorter
history going on differently), user messages and tool results that hold SECRET (a hook
redacts both), and restatements written anew (other spacing): what the caches must get
right.
"""

from __future__ import annotations

import base64
import importlib.util
import inspect
import json
import random
import socket
import textwrap
from pathlib import Path

import pytest
from mitmproxy import http
from mitmproxy.test import taddons, tflow

from interceptor.addons.gateway import record
from interceptor.addons.gateway.policy import intercept
from interceptor.addons.gateway.policy.hookload import load_hooks
from interceptor.addons.gateway.sessions.session import SessionConfig
from interceptor.addons.gateway.sessions.upstream import Upstream
from interceptor.trace import read_trace

ROOT = Path(__file__).resolve().parent.parent
KEY_ENV = "DIFFERENTIAL_KEY"
URL = "https://api.openai.com/v1/chat/completions"
REDACT = """
from interceptor.hooks import Request, intercept

@intercept
def redact(request: Request):
    for m in request.messages:
        if m.role in ("user", "tool") and "SECRET" in m.text():
            m.content = m.text().replace("SECRET", "[redacted]")
    return request
"""


def _script():
    spec = importlib.util.spec_from_file_location("interception_differential", ROOT / "addons" / "interception.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sequence(seed: int, n: int = 40) -> list[tuple[list[dict], dict, int]]:
    """``n`` requests: (the messages sent, the JSON style, which reply to give)."""
    rng = random.Random(seed)
    conversations = [[{"role": "system", "content": f"You are agent {c}."}] for c in range(2)]
    out = []
    for k in range(n):
        c = rng.randrange(2)
        history = conversations[c]
        if len(history) > 3 and rng.random() < 0.15:  # a fork: go on from an earlier point
            history[:] = history[:rng.randrange(2, len(history))]
            while history[-1]["role"] != "assistant" and len(history) > 1:
                history.pop()
        last = history[-1]
        if last.get("tool_calls"):
            call = last["tool_calls"][0]["id"]
            history.append({"role": "tool", "tool_call_id": call,
                            "content": f"output {k}{' SECRET' if rng.random() < 0.5 else ''}"})
        else:
            history.append({"role": "user", "content": f"turn {k}{': SECRET ' + str(k) if rng.random() < 0.4 else ''}"})
        style = rng.choice([{}, {"indent": 1}, {"separators": (",", ":")}]) if rng.random() < 0.2 else {}
        reply = k if rng.random() < 0.7 else -k - 1  # negative: a tool call
        out.append(([dict(m) for m in history], style, reply))
        if reply >= 0:
            history.append({"role": "assistant", "content": f"reply {k}"})
        else:
            history.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{k}", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]})
    return out


def _answer(reply: int) -> bytes:
    if reply >= 0:
        message = {"role": "assistant", "content": f"reply {reply}"}
        finish = "stop"
    else:
        message = {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{-reply - 1}", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]}
        finish = "tool_calls"
    return json.dumps({"id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "m",
                       "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                       "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()


def _serve(tmp_path: Path, sequence, monkeypatch) -> dict[str, tuple[list[bytes], list]]:
    """Two sessions on one in-process proxy, ``cached`` as it is and ``full`` with every
    cache off, each sent the whole sequence (request by request, in turn): each one's
    upstream bodies and its trace's branches' messages."""
    (tmp_path / "redact.py").write_text(textwrap.dedent(REDACT))
    script = _script()
    sent: dict[str, list[bytes]] = {"cached": [], "full": []}
    with socket.create_server(("127.0.0.1", 0)) as upstream, taddons.context(*script.addons) as tctx:
        tctx.configure(script.addons[0], intercept_trace_dir=str(tmp_path), confdir=str(tmp_path / "conf"),
                       intercept_drain_timeout=0)
        sessions = {name: script.registry.create(
            SessionConfig(model="imposed"), tmp_path, "never",
            Upstream(base_url=f"http://127.0.0.1:{upstream.getsockname()[1]}/v1", api_key_env=KEY_ENV),
            hooks=load_hooks(str(tmp_path / "redact.py"))) for name in sent}
        full = sessions["full"]
        # Every cache off for ``full``: each of its requests' passes is a whole one.
        full.memory.take_pass = lambda key: None
        held, whole = record._held, intercept.remembered
        monkeypatch.setattr(record, "_held", lambda ex: None if ex.session is full else held(ex))

        def remembered(ex):
            whole(ex)
            if ex.session is full:
                ex.walked = None

        monkeypatch.setattr(intercept, "remembered", remembered)
        loop = tctx.master.event_loop

        async def phase(hook: str, flow: http.HTTPFlow) -> None:
            for addon in script.addons:
                method = getattr(addon, hook, None)
                if method is not None:
                    value = method(flow)
                    if inspect.isawaitable(value):
                        await value

        conns = {name: tflow.tclient_conn() for name in sent}
        for messages, style, reply in sequence:
            body = json.dumps({"model": "gpt-4o", "messages": messages}, **style).encode()
            for name, session in sessions.items():
                secret = session.model_secret
                auth = {"authorization": f"Bearer {secret}", "content-type": "application/json",
                        "proxy-authorization": "Basic " + base64.b64encode(f"session:{secret}".encode()).decode()}
                flow = tflow.tflow(req=http.Request.make("POST", URL, body, auth), client_conn=conns[name])
                loop.run_until_complete(phase("requestheaders", flow))
                loop.run_until_complete(phase("request", flow))
                assert flow.response is None, flow.response.content[:300]
                sent[name].append(flow.request.content)
                flow.response = http.Response.make(200, _answer(reply), {"content-type": "application/json"})
                loop.run_until_complete(phase("responseheaders", flow))
                loop.run_until_complete(phase("response", flow))
        paths = {name: s.recorder.path for name, s in sessions.items()}
        script.registry.seal_all("test")
        script.registry.store.flush(timeout=30)
        script.registry.store.close()
    return {name: (sent[name], [[m.model_dump() for m in b.messages] for b in read_trace(paths[name]).branches])
            for name in sent}


@pytest.mark.parametrize("seed", range(6))
def test_the_caches_send_what_the_full_pass_sends(tmp_path, monkeypatch, seed):
    monkeypatch.setenv(KEY_ENV, "sk-differential-real-key")
    got = _serve(tmp_path, _sequence(seed), monkeypatch)
    (cached, cached_trace), (full, full_trace) = got["cached"], got["full"]
    assert len(cached) == len(full) == 40
    for k, (a, b) in enumerate(zip(cached, full)):
        assert a == b, (k, a[:300], b[:300])
        assert b"SECRET" not in a, k
    assert cached_trace == full_trace

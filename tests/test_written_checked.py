"""What a rollout writes into its trace is checked, whichever route it comes by: a stop
reason over its documented length is a 400 (not cut), and no secret of the proxy (this
session's or another's model or state secret, the admin token, an upstream's key) is taken
into a stop reason, the task state (tool server or admin), or the seal's footer; the 400
names the field and never echoes the secret. A real mitmdump; the trace read back.
"""

from __future__ import annotations

import json

import pytest

from clients import REAL_KEY
from interceptor.trace import read_trace
from test_state_writes import request


def _secrets(proxy, session, other) -> dict[str, str]:
    return {"own model secret": session["model_secret"], "own state secret": session["state_secret"],
            "another session's model secret": other["model_secret"],
            "another session's state secret": other["state_secret"],
            "a worker-shaped secret": "sk-ic-w7-m-" + "A" * 32,
            "admin token": proxy.admin_token, "upstream key": REAL_KEY}


def _refused(status, kind, data, field: str, secret: str | None = None) -> str:
    assert status == 400 and kind == "application/json", (status, data[:300])
    message = json.loads(data)["error"]["message"]
    assert field in message, message
    if secret is not None:
        assert secret not in data.decode(errors="replace")
    return message


@pytest.fixture
def pair(proxy):
    return proxy.create_session(state={"n": 0}), proxy.create_session()


def test_a_stop_reason_over_its_length_is_refused_not_cut(proxy, pair):
    session, _ = pair
    auth = {"Authorization": f"Bearer {session['state_secret']}"}
    status, kind, data, _ = request(proxy, "POST", "stop", json.dumps({"reason": "x" * 201}).encode(), auth)
    assert "201 characters" in _refused(status, kind, data, "reason")
    for reason in ("line\r\nx-injected: 1", "tab\there", "\ud800"):
        status, kind, data, _ = request(proxy, "POST", "stop", json.dumps({"reason": reason}).encode(), auth)
        _refused(status, kind, data, "reason")
    assert proxy.api("GET", f"sessions/{session['id']}")[1].get("stop_condition") is None  # not stopped
    status, _, data, _ = request(proxy, "POST", "stop", json.dumps({"reason": "y" * 200}).encode(), auth)
    assert status == 200 and json.loads(data)["condition"] == "y" * 200


def test_no_secret_of_the_proxy_is_written_by_any_route(proxy, pair):
    session, other = pair
    tool = {"Authorization": f"Bearer {session['state_secret']}"}
    admin = {"Authorization": f"Bearer {proxy.admin_token}"}
    for name, secret in _secrets(proxy, session, other).items():
        writes = [("POST", "stop", {"reason": f"done {secret}"}, tool, "reason"),
                  ("PUT", "state", {"note": secret}, tool, "state"),
                  ("PATCH", "state", {"deep": {"er": [f"x{secret}y"]}}, tool, "state"),
                  ("PUT", f"sessions/{session['id']}/state", {secret: 1}, admin, "state"),
                  ("DELETE", f"sessions/{session['id']}", {"info": {"k": secret}}, admin, "DELETE body"),
                  ("DELETE", f"sessions/{session['id']}", {"stop_condition": secret}, admin, "DELETE body")]
        for method, path, body, auth, field in writes:
            status, kind, data, _ = request(proxy, method, path, json.dumps(body).encode(), auth)
            _refused(status, kind, data, field, secret), (name, method, path)
    summary = proxy.api("GET", f"sessions/{session['id']}")[1]
    assert summary["sealed"] is False and summary.get("stop_condition") is None and summary["state_version"] == 0
    proxy.api("DELETE", f"sessions/{session['id']}")
    raw = open(session["trace_path"], "rb").read()
    for secret in _secrets(proxy, session, other).values():
        assert secret.encode() not in raw
    assert [w.value for w in read_trace(session["trace_path"]).state_writes] == [{"n": 0}]

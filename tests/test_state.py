"""Task and state routes: a tool server reads the task and keeps the rollout's
state through the proxy with the session's state secret; the model secret and the admin
token open nothing there; every accepted write is a ``state`` record and the footer holds
the final version and digest.

Through a real mitmdump; the trace is read back from its file.
"""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request

import openai
import pytest

from interceptor.addons.gateway.sessions.state import merge_patch
from interceptor.trace import read_trace
from interceptor.trace.messages import canonical_json
from clients import session_clients


def call(proxy, method: str, path: str, body=None, *, token: str | None = None, headers: dict | None = None,
         raw: bytes | None = None) -> tuple[int, dict, object]:
    """(status, headers, JSON answer) of one request to the proxy's own API."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(f"{proxy.url}/_interceptor/{path}", data=data, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", (headers or {}).pop("Content-Type", "application/json"))
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=15) as r:
            return r.status, dict(r.headers), json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"null")


PATCH = {"Content-Type": "application/merge-patch+json"}


def test_task_and_state_round_trip_with_etags_and_412(new_session, proxy):
    session = new_session(task={"name": "fix-bug", "repo": "x"}, agent={"name": "claude"}, info={"split": "dev"},
                          state={"score": 0, "notes": {"a": 1}})
    secret = session["state_secret"]
    status, _, task = call(proxy, "GET", "task", token=secret)
    assert status == 200
    assert task == {"session": session["id"], "task": {"name": "fix-bug", "repo": "x"},
                    "agent": {"name": "claude"}, "info": {"split": "dev"}}

    status, headers, state = call(proxy, "GET", "state", token=secret)
    assert (status, headers["etag"], state) == (200, '"0"', {"score": 0, "notes": {"a": 1}})

    status, headers, answer = call(proxy, "PUT", "state", {"score": 1, "notes": {"a": 1, "b": 2}}, token=secret,
                                   headers={"If-Match": '"0"'})
    assert (status, answer, headers["etag"]) == (200, {"ok": True, "version": 1}, '"1"')
    # RFC 7396: null removes a key, objects merge, anything else replaces.
    status, _, answer = call(proxy, "PATCH", "state", {"notes": {"a": None, "c": [1]}, "done": True},
                             token=secret, headers={**PATCH, "If-Match": '"1"'})
    assert (status, answer) == (200, {"ok": True, "version": 2})
    assert call(proxy, "GET", "state", token=secret)[2] == {"score": 1, "notes": {"b": 2, "c": [1]}, "done": True}

    # A write based on a stale read is refused and changes nothing.
    status, headers, answer = call(proxy, "PATCH", "state", {"score": 99}, token=secret,
                                   headers={**PATCH, "If-Match": '"1"'})
    assert status == 412 and answer["version"] == 2 and headers["etag"] == '"2"'
    assert "version 2" in answer["error"]["message"]
    # Without If-Match the last write wins.
    assert call(proxy, "PATCH", "state", {"score": 2}, token=secret, headers=PATCH)[2]["version"] == 3

    # The orchestrator reads and scores the same state with the admin token.
    status, headers, state = call(proxy, "GET", f"sessions/{session['id']}/state", token=proxy.admin_token)
    assert status == 200 and headers["etag"] == '"3"' and state["score"] == 2
    status, _, answer = call(proxy, "PATCH", f"sessions/{session['id']}/state", {"graded": 1},
                             token=proxy.admin_token, headers=PATCH)
    assert (status, answer["version"]) == (200, 4)

    status, summary = proxy.api("DELETE", f"sessions/{session['id']}")
    assert status == 200 and summary["state_version"] == 4
    trace = read_trace(session["trace_path"])
    final = {"score": 2, "notes": {"b": 2, "c": [1]}, "done": True, "graded": 1}
    expected = "sha256:" + hashlib.sha256(canonical_json(final).encode()).hexdigest()
    assert trace.state_version == 4 and trace.state_digest == expected  # from the footer
    writes = trace.state_writes
    assert [(w.version, w.by, w.op) for w in writes] == [
        (0, "config", "init"), (1, "tool", "put"), (2, "tool", "patch"), (3, "tool", "patch"), (4, "admin", "patch")]
    assert writes[-1].value == final and writes[-1].digest == expected
    assert writes[-1].size == len(canonical_json(final).encode())
    raw = open(session["trace_path"], "rb").read()
    assert session["state_secret"].encode() not in raw and session["model_secret"].encode() not in raw
    assert session["state_secret"] not in proxy.log()


def test_only_the_state_secret_opens_the_tool_server_routes(new_session, proxy):
    session = new_session()
    other = new_session()
    for token, needle in ((session["model_secret"], "a model secret cannot"),
                          (proxy.admin_token, "admin token opens /_interceptor/sessions/<id>/state"),
                          (None, "no state secret"), ("sk-ic-s-nothing", "unknown state secret")):
        for method, path, body in (("GET", "task", None), ("GET", "state", None), ("PUT", "state", {"x": 1})):
            status, _, answer = call(proxy, method, path, body, token=token)
            assert status == 401, (token, path, answer)
            message = answer["error"]["message"]
            assert needle in message and "state secret" in message
    # The state secret opens its own session's state only, and not the admin routes.
    assert call(proxy, "PUT", "state", {"mine": 1}, token=session["state_secret"])[0] == 200
    assert call(proxy, "GET", "state", token=other["state_secret"])[2] == {}
    assert call(proxy, "GET", f"sessions/{session['id']}/state", token=session["state_secret"])[0] == 401
    # Nothing refused was written.
    assert read_trace(session["trace_path"]).state_writes[-1].version == 1
    assert proxy.api("GET", f"sessions/{session['id']}")[1]["state_version"] == 1
    # A session nobody wrote to stays at version 0.
    assert proxy.api("GET", f"sessions/{other['id']}")[1]["state_version"] == 0


def test_bad_writes_are_refused_and_change_nothing(start_proxy, sim):
    proxy = start_proxy(options={"intercept_state_max_bytes": "1k"})
    schema = {"type": "object", "properties": {"score": {"type": "number", "minimum": 0},
                                               "steps": {"type": "array", "items": {"type": "string"}}},
              "required": ["score"]}
    session = proxy.create_session(upstream={"base_url": sim.url("/v1")}, state={"score": 0}, state_schema=schema)
    secret = session["state_secret"]
    cases = [
        ("PUT", None, b"{not json", 400, "not JSON"),
        ("PUT", None, b"[1, 2]", 400, "must be a JSON object"),
        ("PATCH", PATCH, b"3", 400, "must be a JSON object"),  # RFC 7396: a non-object patch replaces
        ("PATCH", {"Content-Type": "application/json-patch+json"}, b"[]", 415, "merge-patch"),
        ("PUT", None, json.dumps({"score": 1, "pad": "x" * 2000}).encode(), 413, "intercept_state_max_bytes"),
        ("PATCH", PATCH, json.dumps({"steps": [1]}).encode(), 400, "at $.steps[0]"),
        ("PATCH", PATCH, json.dumps({"score": -1}).encode(), 400, "at $.score"),
        ("PATCH", PATCH, json.dumps({"score": None}).encode(), 400, "'score' is a required property"),
        ("PUT", None, json.dumps({"score": 1, "leak": session["model_secret"]}).encode(), 400, "session secret"),
    ]
    for method, headers, raw, status, needle in cases:
        got, _, answer = call(proxy, method, "state", token=secret, headers=dict(headers or {}), raw=raw)
        assert (got, needle in answer["error"]["message"]) == (status, True), (raw[:40], got, answer)
    status, headers, state = call(proxy, "GET", "state", token=secret)
    assert (headers["etag"], state) == ('"0"', {"score": 0})
    assert call(proxy, "PATCH", "state", {"steps": ["ok"]}, token=secret, headers=PATCH)[2]["version"] == 1

    # A session whose initial state fails its schema, or whose schema is none, is not made.
    for config, needle in (({"state": {"score": "high"}, "state_schema": schema}, "at $.score"),
                           ({"state_schema": {"type": "nonsense"}}, "not a valid JSON Schema")):
        status, answer = proxy.api("POST", "sessions", config)
        assert status == 400 and needle in answer["error"]["message"], answer

    proxy.api("DELETE", f"sessions/{session['id']}")
    status, _, answer = call(proxy, "PATCH", "state", {"score": 5}, token=secret, headers=PATCH)
    assert status == 409 and "sealed" in answer["error"]["message"]
    assert call(proxy, "GET", "state", token=secret)[0] == 409
    assert call(proxy, "PUT", f"sessions/{session['id']}/state", {"score": 5}, token=proxy.admin_token)[0] == 409
    assert read_trace(session["trace_path"]).state_version == 1


def ask(oai) -> None:
    oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "go on"}])


def refused(oai) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        ask(oai)
    return e.value


def test_a_tool_server_stops_the_rollout(new_session, proxy, sim, harness_env):
    session = new_session()
    harness_env(session["env"])
    oai, _ = session_clients(session)
    ask(oai)
    secret = session["state_secret"]
    for token, body, status in ((session["model_secret"], {"reason": "x"}, 401), (None, {}, 401),
                                (secret, {"why": "x"}, 400), (secret, ["x"], 400), (secret, {"reason": 3}, 400)):
        assert call(proxy, "POST", "stop", body, token=token)[0] == status, (token, body)
    assert call(proxy, "GET", "stop", token=secret)[0] == 405
    ask(oai)  # nothing refused stopped it

    status, _, answer = call(proxy, "POST", "stop", {"reason": "gave_up"}, token=secret)
    assert (status, answer) == (200, {"ok": True, "condition": "gave_up", "by": "tool"})
    err = refused(oai)
    assert "rollout stopped: gave_up" in err.message and err.body["type"] == "interceptor_stopped"
    assert err.response.headers["x-interceptor-stop"] == "gave_up"
    assert err.response.headers["x-should-retry"] == "false"
    assert len(sim.model_requests()) == 2  # the refused request never left
    # The first stop is final.
    assert call(proxy, "POST", "stop", {"reason": "later"}, token=secret)[2]["condition"] == "gave_up"
    assert "gave_up" in refused(oai).message
    assert proxy.api("GET", f"sessions/{session['id']}")[1]["stopped_by"] == "tool"

    proxy.api("DELETE", f"sessions/{session['id']}")
    assert call(proxy, "POST", "stop", {"reason": "x"}, token=secret)[0] == 409
    trace = read_trace(session["trace_path"])
    assert (trace.stop_condition, trace.stopped_by, trace.truncated) == ("gave_up", "tool", False)
    assert (trace.stop.condition, trace.stop.by) == ("gave_up", "tool")
    assert [c.status for c in trace.calls] == [200, 200, 400, 400]


STATE_HOOKS = """
from interceptor.hooks import HookContext, stop

@stop(name="solved")
def solved(ctx: HookContext) -> bool:
    seen = ctx.state.get("solved") is True
    ctx.state["solved"] = "changed by a hook"  # a copy: the task state does not change
    return seen
"""


def test_a_between_turn_stop_sees_the_task_state(new_session, proxy, sim, harness_env, tmp_path):
    hooks = tmp_path / "state_hooks.py"
    hooks.write_text(STATE_HOOKS)
    session = new_session(hooks={"module": str(hooks)}, state={"solved": False})
    harness_env(session["env"])
    oai, _ = session_clients(session)
    ask(oai)
    assert call(proxy, "GET", "state", token=session["state_secret"])[2] == {"solved": False}
    call(proxy, "PATCH", "state", {"solved": True}, token=session["state_secret"], headers=PATCH)
    assert "rollout stopped: solved" in refused(oai).message
    assert len(sim.model_requests()) == 1
    assert call(proxy, "GET", "state", token=session["state_secret"])[2] == {"solved": True}


# RFC 7396 Appendix A, every example.
RFC7396 = [
    ({"a": "b"}, {"a": "c"}, {"a": "c"}),
    ({"a": "b"}, {"b": "c"}, {"a": "b", "b": "c"}),
    ({"a": "b"}, {"a": None}, {}),
    ({"a": "b", "b": "c"}, {"a": None}, {"b": "c"}),
    ({"a": ["b"]}, {"a": "c"}, {"a": "c"}),
    ({"a": "c"}, {"a": ["b"]}, {"a": ["b"]}),
    ({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}, {"a": {"b": "d"}}),
    ({"a": [{"b": "c"}]}, {"a": [1]}, {"a": [1]}),
    (["a", "b"], ["c", "d"], ["c", "d"]),
    ({"a": "b"}, ["c"], ["c"]),
    ({"a": "foo"}, None, None),
    ({"a": "foo"}, "bar", "bar"),
    ({"e": None}, {"a": 1}, {"e": None, "a": 1}),
    ([1, 2], {"a": "b", "c": None}, {"a": "b"}),
    ({}, {"a": {"bb": {"ccc": None}}}, {"a": {"bb": {}}}),
]


@pytest.mark.parametrize("target,patch,result", RFC7396)
def test_merge_patch_follows_rfc7396(target, patch, result):
    before = json.dumps(target)
    assert merge_patch(target, patch) == result
    assert json.dumps(target) == before  # the target is not changed in place

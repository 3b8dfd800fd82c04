"""Every Gemini-shaped error the proxy answers carries one of Google's canonical status names.

Google's clients read ``error.status`` as a ``google.rpc.Code`` name and nothing else; a name
of ours there (``interceptor_stopped``, ``hook_error``) is an error they cannot classify. The
canonical names and their HTTP mapping are google/rpc/code.proto's
(https://github.com/googleapis/googleapis/blob/master/google/rpc/code.proto, and
https://cloud.google.com/apis/design/errors#handling_errors), written out here, not read from
the dialect, so a wrong table there cannot agree with itself.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given, strategies as st

from interceptor.dialects import GEMINI
from interceptor.dialects.translate import translation
from provider import Reply
from test_gemini import REQUEST, _post

# google.rpc.Code: every name, and the HTTP status code.proto gives it.
CANONICAL = {
    "OK": 200, "CANCELLED": 499, "UNKNOWN": 500, "INVALID_ARGUMENT": 400, "DEADLINE_EXCEEDED": 504,
    "NOT_FOUND": 404, "ALREADY_EXISTS": 409, "PERMISSION_DENIED": 403, "UNAUTHENTICATED": 401,
    "RESOURCE_EXHAUSTED": 429, "FAILED_PRECONDITION": 400, "ABORTED": 409, "OUT_OF_RANGE": 400,
    "UNIMPLEMENTED": 501, "INTERNAL": 500, "UNAVAILABLE": 503, "DATA_LOSS": 500,
}
# The proxy's own error kinds, as the addons pass them (addons/gateway/policy/stops.py, hold.py, relay.py, tee.py).
OURS = [None, "interceptor_stopped", "hook_error", "hold_unavailable", "answer_too_large", "api_error",
        "invalid_request_error"]


def canonical(error: dict) -> str:
    """The error's status, checked against google.rpc.Code and its HTTP mapping where
    code.proto gives one for the status (a status it does not list takes any name)."""
    name, code = error["status"], error["code"]
    assert name in CANONICAL, error
    if code in CANONICAL.values() and code != 200:
        assert CANONICAL[name] == code or (code, name) in {(502, "UNAVAILABLE")}, error
    return name


@given(status=st.integers(min_value=400, max_value=599), kind=st.sampled_from(OURS))
def test_every_error_body_and_stream_error_names_a_canonical_status(status, kind):
    body = GEMINI.error_body(status, "m", kind)
    canonical(body["error"])
    assert body["error"]["code"] == status
    event = GEMINI.stream_error(status, "m", kind)
    canonical(json.loads(event.data)["error"])
    if kind is not None:  # the proxy's own kind is kept, where Google keeps a reason
        [info] = body["error"]["details"]
        assert info["@type"] == "type.googleapis.com/google.rpc.ErrorInfo" and info["reason"] == kind.upper()


@given(status=st.integers(min_value=400, max_value=599),
       kind=st.sampled_from([None, "rate_limit_error", "invalid_request_error", "RESOURCE_EXHAUSTED"]))
def test_the_simulator_answers_canonical_names_too(status, kind):
    """tests/provider/gemini.py mirrors the API: a scripted error type of another vocabulary
    is not what a Gemini client sees."""
    from provider import gemini as simulated

    error = simulated.error(status, Reply(status=status, error_type=kind))["error"]
    assert error["status"] in CANONICAL
    if kind == "RESOURCE_EXHAUSTED":
        assert error["status"] == kind


@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 413, 429, 500, 502, 503, 504])
def test_a_translated_upstream_error_names_a_canonical_status(status):
    tr = translation("gemini", "chat")
    out = tr.error(status, {"error": {"message": "no", "type": "invalid_request_error", "code": "x"}})
    canonical(out["error"])


def test_the_proxys_gemini_errors_through_mitmdump(start_proxy, sim, harness_env):
    """What a Gemini harness gets from the proxy itself: no secret, a route that is not a
    model's, bad JSON, a body over intercept_max_body, a stopped rollout, an unreachable upstream,
    and the simulator's own 429 passed through."""
    proc = start_proxy({"intercept_max_body": "2k"})
    session = proc.create_session(limits={"max_turns": 1})
    dead = proc.create_session(upstream="dead")
    other = proc.create_session()
    harness_env(session["env"])
    seen = {}
    sim.script(Reply(text="one"), Reply(status=429))
    with httpx.Client(timeout=30, trust_env=True) as http:
        seen["no secret"] = _post(http, "gemini-2.5-flash:generateContent", REQUEST, secret="")
        seen["side route"] = http.post("https://generativelanguage.googleapis.com/v1beta/files", content=b"{}")
        seen["bad json"] = _post(http, "gemini-2.5-flash:generateContent", b"{nope", secret=session["model_secret"])
        big = {**REQUEST, "contents": [{"role": "user", "parts": [{"text": "x" * 4096}]}]}
        seen["too large"] = _post(http, "gemini-2.5-flash:generateContent", big, secret=session["model_secret"])
        seen["unreachable"] = _post(http, "gemini-2.5-flash:generateContent", REQUEST, secret=dead["model_secret"])
        assert _post(http, "gemini-2.5-flash:generateContent", REQUEST, secret=session["model_secret"]).status_code == 200
        seen["stopped"] = _post(http, "gemini-2.5-flash:generateContent", REQUEST, secret=session["model_secret"])
        seen["upstream 429"] = _post(http, "gemini-2.5-flash:generateContent", REQUEST, secret=other["model_secret"])
    statuses = {what: (r.status_code, canonical(r.json()["error"])) for what, r in seen.items()}
    assert statuses == {
        "no secret": (401, "UNAUTHENTICATED"), "side route": (404, "NOT_FOUND"),
        "bad json": (400, "INVALID_ARGUMENT"), "too large": (413, "INVALID_ARGUMENT"),
        "unreachable": (502, "UNAVAILABLE"), "stopped": (400, "INVALID_ARGUMENT"),
        "upstream 429": (429, "RESOURCE_EXHAUSTED"),
    }, {w: r.text for w, r in seen.items()}
    assert seen["stopped"].json()["error"]["details"][0]["reason"] == "INTERCEPTOR_STOPPED"

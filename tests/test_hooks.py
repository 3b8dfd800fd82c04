"""Hooks: the evaluator's stop conditions at the model boundary.

Loading is tested in process (``load_hooks`` on files written here); the stops through a
real mitmdump and the real openai SDK: a between-turn stop and a request stop refuse in the
dialect's shape, a hook that raises answers 500 that no SDK retries and stops the rollout,
``on_hook_error: pass`` lets the request through, a bad hooks module is a 400 naming it at
``POST /_interceptor/sessions`` and a one-line refusal to start for the option.
"""

from __future__ import annotations

import sys
import textwrap

import httpx
import openai
import pytest

from interceptor.addons.gateway.policy.hookload import load_hooks
from interceptor.hooks import HookContext
from interceptor.trace.hooks import HookError
from interceptor.trace import read_trace
from clients import chat_turns, session_clients
from mitm import MitmProcess
from provider import Reply
from test_trace_proxy import mproxy, msim, session  # noqa: F401 (one simulator and proxy for the module)

HEAD = "from interceptor.hooks import HookContext, Request, Response, intercept, stop\n"


def hooks_file(tmp_path, body: str, name: str = "myhooks.py") -> str:
    path = tmp_path / name
    path.write_text(HEAD + textwrap.dedent(body))
    return str(path)


# --- loading ---------------------------------------------------------------------------------

def test_hooks_sorted_by_boundary_and_priority(tmp_path):
    path = hooks_file(tmp_path, """
        @stop(priority=1)
        def b_between(ctx: HookContext) -> bool:
            return False

        @stop(priority=5, name="first")
        def z_between(ctx) -> bool:
            return False

        @stop
        def a_request(request: Request, ctx: HookContext) -> bool:
            return False

        @stop()
        async def on_request(request: Request) -> bool:
            return False

        def not_a_hook(request: Request):
            pass
    """, name="claim.py")  # a name of the proxy's own modules: loaded privately, never clashing
    hooks = load_hooks(path)
    assert [s.name for s in hooks.between_stops] == ["first", "b_between"]
    assert [(s.name, s.is_async) for s in hooks.request_stops] == [("a_request", False), ("on_request", True)]
    assert not hooks.holds_responses
    assert "claim" not in sys.modules or not sys.modules["claim"].__file__.startswith(str(tmp_path))


@pytest.mark.parametrize("body, says", [
    ("def nothing(): pass\n", "no hooks"),
    ("import no_such_module_here\n", "cannot import: ModuleNotFoundError"),
    ("@stop\ndef s(x: int) -> bool: return True\n", "myhooks.py:s: parameter 'x' must be annotated"),
    ("@intercept\ndef i(ctx: HookContext): return None\n", "myhooks.py:i: an intercept hook needs"),
    ("@stop\ndef s(request: Request, response: Response) -> bool: return True\n", "myhooks.py:s: takes both"),
    ("@stop\ndef s(*args) -> bool: return True\n", "myhooks.py:s: parameter 'args'"),
    ("@stop(name='x')\ndef a(ctx) -> bool: return True\n@stop(name='x')\ndef b(ctx) -> bool: return True\n",
     "two stops named x"),
])
def test_bad_hooks_modules_name_module_function_and_reason(tmp_path, body, says):
    with pytest.raises(HookError, match="^hooks: ") as e:
        load_hooks(hooks_file(tmp_path, body))
    assert says in str(e.value)


def test_a_dotted_module_name_is_imported(tmp_path, monkeypatch):
    hooks_file(tmp_path, "@stop\ndef s(ctx) -> bool: return False\n", name="dotted_hooks_mod.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert [s.name for s in load_hooks("dotted_hooks_mod").between_stops] == ["s"]


def test_an_edited_file_is_loaded_again_and_a_broken_edit_leaves_the_last_good_one(tmp_path):
    """The same path, edited: a new load gets the new code and digest, the old HookSet keeps
    its own functions; an unchanged file is not executed again; an edit that does not import
    is the usual HookError, and the fix loads."""
    import hashlib
    from pathlib import Path

    def version(n: int, extra: str = "") -> str:
        return hooks_file(tmp_path, f"@stop\ndef s(ctx) -> bool:\n    return {n}\n{extra}")

    path = version(1)
    first = load_hooks(path)
    assert first.sha256 == hashlib.sha256(Path(path).read_bytes()).hexdigest()
    assert load_hooks(path).between_stops[0].fn is first.between_stops[0].fn  # not executed again
    version(2, "# longer\n")
    second = load_hooks(path)
    assert second.sha256 == hashlib.sha256(Path(path).read_bytes()).hexdigest() != first.sha256
    assert (first.between_stops[0].fn(None), second.between_stops[0].fn(None)) == (1, 2)
    version(3, "import no_such_module_here\n")
    with pytest.raises(HookError, match="cannot import"):
        load_hooks(path)
    assert second.between_stops[0].fn(None) == 2
    version(4)
    assert load_hooks(path).between_stops[0].fn(None) == 4
    # Compiled as its own module: not under the loader's ``from __future__ import annotations``.
    hooks_file(tmp_path, "@stop\ndef s(ctx: HookContext) -> bool:\n    return True\n# five\n")
    assert load_hooks(path).between_stops[0].fn.__annotations__["ctx"] is HookContext


# --- through the proxy -------------------------------------------------------------------------

def test_a_between_turn_stop_ends_the_rollout_and_metrics_reach_the_footer(session, msim, mproxy, tmp_path):
    path = hooks_file(tmp_path, """
        @stop(name="enough")
        def enough(ctx: HookContext) -> bool:
            ctx.record_metric("turns_seen", ctx.num_turns)
            return ctx.num_turns >= ctx.config["turns"]
    """)
    s = session(hooks={"module": path, "config": {"turns": 2}})
    oai, _ = session_clients(s)
    msim.script(Reply(text="one"), Reply(text="two"), Reply(text="three"))
    oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "a"}])
    oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "b"}])
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "c"}])
    assert "rollout stopped: enough" in e.value.message and e.value.response.headers["x-interceptor-stop"] == "enough"
    assert len(msim.model_requests()) == 2
    status, summary = mproxy.api("DELETE", f"sessions/{s['id']}", {"metrics": {"grader": 1}})
    assert status == 200 and summary["stopped_by"] == "hook"
    trace = read_trace(s["trace_path"])
    assert (trace.stop_condition, trace.stopped_by, trace.truncated) == ("enough", "hook", False)
    assert trace.metrics == {"turns_seen": 2, "grader": 1}


def test_a_session_made_after_an_edit_runs_the_new_hooks_and_each_trace_names_its_file(session, msim, mproxy, tmp_path):
    """An evaluator edits hooks.py while the proxy runs: sessions made afterwards run the new
    code, a session made before keeps its own, and each trace's header has the sha256 of the
    file its session ran."""
    import hashlib
    from pathlib import Path

    def version(n: int) -> str:
        return hooks_file(tmp_path, f"@stop\ndef count(ctx: HookContext) -> bool:\n"
                                    f"    ctx.record_metric('version', {n})\n    return False\n" + "#" * n)

    path = version(1)
    digests = [hashlib.sha256(Path(path).read_bytes()).hexdigest()]
    old = session(hooks={"module": path})
    version(2)
    digests.append(hashlib.sha256(Path(path).read_bytes()).hexdigest())
    new = session(hooks={"module": path})
    msim.script(Reply(text="one"), Reply(text="two"))
    for s in (old, new):
        session_clients(s)[0].chat.completions.create(model="x", messages=[{"role": "user", "content": "a"}])
        assert mproxy.api("DELETE", f"sessions/{s['id']}")[0] == 200
    traces = [read_trace(s["trace_path"]) for s in (old, new)]
    assert [t.metrics for t in traces] == [{"version": 1}, {"version": 2}]
    assert [t.config["hooks"]["sha256"] for t in traces] == digests


def test_a_request_stop_sees_the_request_the_upstream_would_get(session, msim, mproxy, tmp_path):
    path = hooks_file(tmp_path, """
        @stop(name="forbidden_command")
        def forbidden(request: Request, ctx: HookContext) -> bool:
            assert request.model == "session-model"  # after the session's overrides
            return "rm -rf" in str(request.messages[-1].content)
    """)
    s = session(model="session-model", hooks={"module": path})
    oai, _ = session_clients(s)
    msim.script(Reply(text="fine"))
    oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "ls"}])
    with pytest.raises(openai.BadRequestError, match="rollout stopped: forbidden_command"):
        oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "rm -rf /"}])
    assert len(msim.model_requests()) == 1
    mproxy.api("DELETE", f"sessions/{s['id']}")
    trace = read_trace(s["trace_path"])
    assert trace.stop.by == "hook" and trace.stop.call == trace.calls[-1].id
    assert trace.branches[-1].messages[-1].content == "rm -rf /"  # the refused prompt is on the trace


@pytest.mark.parametrize("handed, seen", [
    ("request: Request", ["17", "17 15 11", "17 15 11 15 11"]),  # a request stop: the request
    ("ctx: HookContext", ["", "17 15", "17 15 11 15"]),  # a between-turn stop: ctx.messages
])
def test_a_stop_that_changes_the_messages_it_is_handed_changes_nothing_else(session, msim, mproxy, tmp_path,
                                                                          handed, seen):
    """A stop that trims the messages it is handed in place (for its own reading) changes
    neither what the upstream gets nor the trace, and sees each message whole again next
    turn: it is handed copies (kept between turns only while it leaves them unchanged).
    Before, both were the graph's own messages, and the trace kept the trimmed text."""
    log = tmp_path / "seen.log"
    messages = "request.messages" if handed.startswith("request") else "ctx.messages"
    path = hooks_file(tmp_path, f"""
        @stop
        def trims({handed}) -> bool:
            with open({str(log)!r}, "a") as f:
                f.write(" ".join(str(len(m.text())) for m in {messages}) + "\\n")
            for m in {messages}:
                m.content = m.text()[:3]
            return False
    """)
    s = session(hooks={"module": path})
    oai, _ = session_clients(s)
    msim.script(*[Reply(text=f"a long answer {k}") for k in range(3)])
    chat_turns(oai, "a long task to do", 3, "and go on {k}")
    assert [r.json["messages"][0]["content"] for r in msim.model_requests()] == ["a long task to do"] * 3
    assert log.read_text().splitlines() == seen  # whole every time
    trace = read_trace(s["trace_path"]) if mproxy.api("DELETE", f"sessions/{s['id']}")[0] == 200 else None
    assert [len(m.text()) for m in trace.branches[0].messages] == [17, 15, 11, 15, 11, 15]


def test_a_hook_that_raises_answers_500_never_retried_and_stops(session, msim, mproxy, tmp_path):
    path = hooks_file(tmp_path, """
        @stop
        def broken(ctx: HookContext) -> bool:
            raise RuntimeError("grader is down")
    """)
    s = session(hooks={"module": path})
    oai = openai.OpenAI(api_key=s["model_secret"], max_retries=2, timeout=30)  # retries a 500 unless told not to
    msim.script(Reply(text="never"))
    with pytest.raises(openai.InternalServerError) as e:
        oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "a"}])
    assert e.value.status_code == 500 and e.value.response.headers["x-should-retry"] == "false"
    assert "hook broken: raised RuntimeError: grader is down" in e.value.message
    assert e.value.body["type"] == "hook_error"
    assert msim.model_requests() == []  # nothing forwarded, nothing retried
    with pytest.raises(openai.BadRequestError, match="rollout stopped: hook_error"):
        oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "b"}])
    status, summary = mproxy.api("DELETE", f"sessions/{s['id']}")
    trace = read_trace(s["trace_path"])
    assert (trace.stop_condition, trace.stopped_by) == ("hook_error", "hook")
    assert [c.error.type for c in trace.calls] == ["hook_error", "interceptor_stopped"]
    assert [c.status for c in trace.calls] == [500, 400]


def test_on_hook_error_pass_lets_the_request_through(session, msim, mproxy, tmp_path):
    path = hooks_file(tmp_path, """
        @stop
        def broken(ctx: HookContext) -> bool:
            raise RuntimeError("grader is down")
    """)
    s = session(hooks={"module": path}, on_hook_error="pass")
    oai, _ = session_clients(s)
    msim.script(Reply(text="served"))
    r = oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "a"}])
    assert r.choices[0].message.content == "served"
    mproxy.api("DELETE", f"sessions/{s['id']}")
    assert read_trace(s["trace_path"]).stop_condition == "deleted"


def test_bad_hooks_are_a_400_at_creation(mproxy, tmp_path):
    path = hooks_file(tmp_path, "@stop\ndef s(x: int) -> bool: return True\n")
    status, answer = mproxy.api("POST", "sessions", {"hooks": {"module": path}})
    assert status == 400, answer
    assert f"hooks: {path}:s: parameter 'x' must be annotated" in answer["error"]["message"]
    status, answer = mproxy.api("POST", "sessions", {"hooks": {"module": str(tmp_path / "missing.py")}})
    assert status == 400 and "cannot import" in answer["error"]["message"]


def test_the_option_is_the_default_and_null_means_none(tmp_path, sim):
    bad = hooks_file(tmp_path, "def nothing(): pass\n", name="empty.py")
    proc = MitmProcess(options={"intercept_hooks": bad, "intercept_upstream": sim.url("/v1")})
    proc.start(expect_failure=True)
    try:
        assert proc.wait(30) != 0
        lines = [line for line in proc.log().splitlines() if "hooks:" in line]
        assert lines and f"intercept_hooks: hooks: {bad}: no hooks" in lines[0] and "Traceback" not in proc.log()
    finally:
        proc.cleanup()
    good = hooks_file(tmp_path, "@stop(name='always')\ndef s(ctx) -> bool: return True\n", name="always.py")
    with MitmProcess(options={"intercept_hooks": good, "intercept_upstream": sim.url("/v1")}) as proc:
        with_default = proc.create_session()
        without = proc.create_session(hooks=None)
        for s, refused in ((with_default, True), (without, False)):
            client = openai.OpenAI(api_key=s["model_secret"], max_retries=0, timeout=30, http_client=httpx.Client(
                proxy=s["env"]["HTTPS_PROXY"], verify=s["env"]["SSL_CERT_FILE"]))
            sim.script(Reply(text="ok"))
            ask = lambda: client.chat.completions.create(model="x", messages=[{"role": "user", "content": "a"}])  # noqa: E731
            if refused:
                with pytest.raises(openai.BadRequestError, match="rollout stopped: always"):
                    ask()
            else:
                assert ask().choices[0].message.content == "ok"


def test_stops_run_for_the_frames_of_a_websocket(session, msim, mproxy, tmp_path):
    """Over Codex's Responses WebSocket a between-turn stop refuses the next frame with an
    error frame, as it refuses a POST; nothing more reaches the upstream."""
    from wsclient import WSClient

    path = hooks_file(tmp_path, "@stop(name='one_turn')\ndef s(ctx) -> bool: return ctx.num_turns >= 1\n")
    s = session(hooks={"module": path})
    msim.script(Reply(text="first"), Reply(text="never"))
    create = {"type": "response.create", "model": "gpt-4o", "stream": True}
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    with WSClient("wss://api.openai.com/v1/responses", headers={"Authorization": f"Bearer {s['model_secret']}"},
                  proxy=mproxy.url, cafile=str(mproxy.ca_bundle)) as ws:
        ws.send_json({**create, "input": [user]})
        first = ws.until("response.completed")[-1]["response"]
        ws.send_json({**create, "previous_response_id": first["id"], "input": [user]})
        [error] = ws.until("error")
    assert error["status"] == 400 and error["error"]["message"] == "rollout stopped: one_turn"
    assert len([r for r in msim.model_requests() if r.transport == "websocket"]) == 1
    mproxy.api("DELETE", f"sessions/{s['id']}")
    trace = read_trace(s["trace_path"])
    assert (trace.stop_condition, trace.stopped_by, trace.num_turns) == ("one_turn", "hook", 1)

"""interceptor.client, the evaluator's API, against real mitmdump processes: one it starts,
one it attaches to; the Python API page's 16-rollout example run as a user runs it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from interceptor.client import AsyncProxy, BadRequest, Conflict, Proxy, Unauthorized
from interceptor.client.proxy import call
from interceptor.trace import iter_records
from conftest import KEY_ENV, REAL_KEY
from mitm import ROOT, MitmProcess
from provider import Reply, ToolCall

EXAMPLE = ROOT / "examples" / "rollouts.py"


def _proxy(sim, **kw) -> Proxy:
    return Proxy(upstreams={"sim": {"base_url": sim.url("/v1"), "api_key_env": KEY_ENV}},
                 env={KEY_ENV: REAL_KEY}, **kw)


def _chat(session, text: str = "hi") -> str:
    http = httpx.Client(proxy=session.proxy_url, verify=session.ssl_context())
    client = openai.OpenAI(api_key=session.secret, http_client=http, max_retries=0)
    return client.chat.completions.create(model="harness-model", messages=[{"role": "user", "content": text}]) \
        .choices[0].message.content


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def test_a_started_proxy_runs_a_session_and_seals_it_with_the_reward(sim, tmp_path):
    with _proxy(sim, trace_dir=tmp_path / "traces") as proxy:
        session = proxy.session(model="imposed-model", sampling={"temperature": 0.3}, upstream="sim",
                                task={"name": "t1"}, agent={"name": "unit"}, id="rollout-1")
        assert session.id == "rollout-1"
        assert session.trace_path == tmp_path / "traces" / "rollout-1.msgpack"
        assert session.env["OPENAI_API_KEY"] == session.secret and session.secret.startswith("sk-ic-m-")
        assert session.env["HTTPS_PROXY"].startswith("http://session:") and proxy.url.split("//")[1] in session.env["HTTPS_PROXY"]
        assert Path(session.env["SSL_CERT_FILE"]).is_file()
        assert session.secret not in repr(session)

        assert _chat(session).startswith("You said: hi")
        assert session.summary()["turns"] == 1 and session.summary()["sealed"] is False
        result = session.close(reward=0.75, metrics={"tests": 3}, stop_condition="done")
        assert result["sealed"] is True and result["reward"] == 0.75 and result["metrics"] == {"tests": 3}
        assert result["stop_condition"] == "done" and result["turns"] == 1
        assert session.close(reward=0.0) == result  # closing twice changes nothing

        trace = session.trace()
        assert trace.sealed and trace.reward == 0.75 and trace.metrics == {"tests": 3}
        assert trace.stop_condition == "done" and trace.task == {"name": "t1"} and trace.agent == {"name": "unit"}
        footer = [r for _, r in iter_records(session.trace_path) if r["kind"] == "footer"]
        assert len(footer) == 1 and footer[0]["reward"] == 0.75

    (req,) = sim.model_requests()
    assert req.json["model"] == "imposed-model" and req.json["temperature"] == 0.3
    assert req.headers["authorization"] == f"Bearer {REAL_KEY}"
    assert not _alive(proxy.pid)


def test_attach_to_a_running_proxy_by_url_and_token(sim, proxy):
    running = proxy  # a mitmdump started by the tests' own helper, its upstream declared by options
    client = Proxy.attach(running.url, running.admin_token)
    with client.session(model="attached-model") as session:
        assert _chat(session, "attached").startswith("You said: attached")
    assert session.closed and session.result["stop_condition"] == "deleted"
    assert session.trace().sealed and session.trace().num_turns == 1
    assert running.api("GET", f"sessions/{session.id}")[1]["sealed"] is True

    # the token from the proxy's confdir; a wrong token raises with the server's message
    assert Proxy.attach(running.url, confdir=running.confdir).sessions()
    with pytest.raises(Unauthorized) as err:
        Proxy.attach(running.url, "not-the-token-0123456789").session()
    status, body = call(running.url, "not-the-token-0123456789", "POST", "sessions", {})
    assert err.value.status == status == 401 and err.value.message == body["error"]["message"]

    client.stop()  # an attached proxy is not ours to stop
    assert running.proc.poll() is None and client.health()["ok"]
    assert sim.model_requests()[0].json["model"] == "attached-model"


def test_the_evaluator_reads_and_scores_the_task_state(proxy):
    client = Proxy.attach(proxy.url, proxy.admin_token)
    with client.session(state={"answer": None}, state_schema={"type": "object"}) as session:
        assert session.state() == {"answer": None}
        assert session.update_state({"answer": "42", "score": 1}) == 1
        assert session.state() == {"answer": "42", "score": 1}
        with pytest.raises(BadRequest, match="must be a JSON object"):
            session.proxy.request("PUT", f"sessions/{session.id}/state", [1])
    assert session.trace().state_version == 1


def test_a_refused_config_raises_with_the_servers_message(proxy):
    client = Proxy.attach(proxy.url, proxy.admin_token)
    before = len(client.sessions())

    # caught client-side by the proxy's own model, with the message the proxy gives
    with pytest.raises(BadRequest) as err:
        client.session(sampling={"temprature": 0.7})
    status, body = proxy.api("POST", "sessions", {"sampling": {"temprature": 0.7}})
    assert status == 400 and err.value.message == body["error"]["message"]
    assert "sampling.temprature" in err.value.message

    # passed through and refused by the proxy (a field this proxy's model does not know yet)
    with pytest.raises(BadRequest) as err:
        client.session(hooks={"module": "no.such.module"})
    assert "hooks" in err.value.message and err.value.body == {"error": {"message": err.value.message, "status": 400}}

    client.session(id="twice").close()
    with pytest.raises(Conflict) as err:
        client.session(id="twice")
    assert err.value.message == "session 'twice' exists already"

    with pytest.raises(BadRequest, match="upstream.name: no upstream 'nowhere' is declared"):
        client.session(upstream="nowhere")
    assert len(client.sessions()) == before + 1  # only "twice"


def test_a_refused_seal_raises_before_anything_is_sealed(proxy):
    session = Proxy.attach(proxy.url, proxy.admin_token).session(id="s")
    with pytest.raises(BadRequest) as err:
        session.close(reward=float("nan"))
    status, body = proxy.api("DELETE", "sessions/s", {"reward": float("nan")})  # what the proxy says
    assert status == 400 and err.value.message == body["error"]["message"] and "reward" in err.value.message
    assert not session.closed and session.summary()["sealed"] is False
    result = session.close(rewards={"tests": {"score": 1.0, "weight": 0.5}}, info={"grader": "unit"})
    assert result["reward"] == 0.5 and session.trace().info["grader"] == "unit"


def test_leaving_the_context_with_an_exception_stops_the_proxy(sim, tmp_path):
    with pytest.raises(RuntimeError, match="evaluator bug"):
        with _proxy(sim, trace_dir=tmp_path) as proxy:
            pid, workdir = proxy.pid, proxy.workdir
            session = proxy.session(upstream="sim", id="open")
            _chat(session)
            raise RuntimeError("evaluator bug")
    assert not _alive(pid) and _children(pid) == []
    assert not workdir.exists()  # its confdir held the CA's private key
    trace = session.trace()  # SIGTERM sealed the open session on the way out
    assert trace.sealed and trace.stop_condition == "proxy_shutdown" and trace.num_turns == 1


def test_async_proxy_stops_on_an_exception_too(tmp_path):
    seen = {}

    async def main():
        async with AsyncProxy(trace_dir=tmp_path) as proxy:
            seen["pid"] = proxy.pid
            async with await proxy.session(id="a") as session:
                seen["summary"] = await session.summary()
                raise KeyError("rollout failed")

    with pytest.raises(KeyError):
        asyncio.run(main())
    assert seen["summary"]["id"] == "a" and not _alive(seen["pid"])
    records = [r for _, r in iter_records(tmp_path / "a.msgpack")]
    assert records[-1]["kind"] == "footer" and records[-1]["stop_condition"] == "error"


def _tool_model(record) -> Reply:
    """The simulator as the example's model: it calls `add` with the question's numbers, then
    states the tool's result, except that it gets every sum divisible by 3 wrong by one."""
    last = record.json["messages"][-1]
    if last["role"] == "user":
        a, b = (int(x) for x in re.findall(r"\d+", last["content"])[:2])
        return Reply(tool_calls=[ToolCall(name="add", arguments={"a": a, "b": b})])
    total = int(last["content"])
    return Reply(text=f"The sum is {total + 1 if total % 3 == 0 else total}.")


def test_the_readme_example_runs_16_rollouts_each_sealed_with_its_reward(sim, tmp_path):
    sim.default = _tool_model
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, str(EXAMPLE), sim.url("/v1"), KEY_ENV, str(out)],
                            env={**os.environ, KEY_ENV: REAL_KEY}, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    # The Python API's proxy makes no default session: nothing records beside the rollouts.
    traces = sorted(out.glob("*.msgpack"))
    assert len(traces) == 16
    from interceptor.trace import read_trace
    rewards = []
    for path in traces:
        trace = read_trace(path)
        a, b = trace.task["a"], trace.task["b"]
        footer = [r for _, r in iter_records(path) if r["kind"] == "footer"]
        assert len(footer) == 1 and footer[0]["reward"] == (0.0 if (a + b) % 3 == 0 else 1.0), (a, b)
        assert trace.reward == footer[0]["reward"] and trace.metrics == {"turns": 4}
        assert len(trace.branches) == 1 and trace.num_turns == 2 and not trace.errors
        assert [m.role for m in trace.branches[0].messages] == ["user", "assistant", "tool", "assistant"]
        rewards.append(trace.reward)
    assert 0 < sum(rewards) < 16  # both outcomes happened, so the reward really is computed
    assert f"16 rollouts, mean reward {sum(rewards) / 16:.2f}" in result.stdout
    requests = sim.model_requests()
    assert len(requests) == 32 and all(r.json["model"] == "sim-model" for r in requests)
    exported = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(exported) == 16 and all(row["messages"][1]["tool_calls"][0]["function"]["name"] == "add"
                                       for row in exported)


def test_the_python_api_page_shows_the_example_file():
    readme = (ROOT / "docs" / "python-api.md").read_text()
    assert EXAMPLE.read_text().strip() in readme
    assert len(EXAMPLE.read_text().splitlines()) < 40

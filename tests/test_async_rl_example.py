"""examples/async_rl.py against the simulator playing vLLM: rollouts through one upstream
while a stand-in trainer pauses it, bumps its version and resumes, twice; the finished
branches carry the version of every sampled token, and no turn was sampled twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from interceptor.trace import read_trace
from clients import KEY_ENV, REAL_KEY
from mitm import ROOT
from provider import Reply
from test_trace_proxy import render

EXAMPLE = ROOT / "examples" / "async_rl.py"


def _vllm(record) -> Reply:
    """vLLM's answer: a reply, the prompt's token ids from the toy chat template (so each
    turn's prompt ids extend the last turn's prompt and reply, and the branch has token ids)."""
    turn = sum(m["role"] == "assistant" for m in record.json["messages"])
    return Reply(text=f"Step {turn} done.", prompt_token_ids=render(record.json["messages"]))


def test_the_async_rl_example_stamps_every_sampled_token_with_the_version_that_sampled_it(sim, tmp_path):
    sim.strict = False  # return_token_ids is vLLM's
    sim.default = _vllm
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, str(EXAMPLE), sim.url("/v1"), KEY_ENV, str(out)],
                            env={**os.environ, KEY_ENV: REAL_KEY}, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    traces = [read_trace(p) for p in sorted(out.glob("*.msgpack"))]
    assert len(traces) == 8
    assert len(sim.model_requests()) == 8 * 6  # every turn sampled once, across both swaps
    counted: dict = {}
    for trace in traces:
        [branch] = trace.branches
        assert trace.num_turns == 6 and not trace.errors
        assert branch.token_ids is not None and len(branch.policy_versions) == len(branch.token_ids)
        sampled = [v for v, m in zip(branch.policy_versions, branch.sampled_mask) if m]
        assert None not in sampled and all(v is None for v, m in zip(branch.policy_versions, branch.sampled_mask) if not m)
        assert sampled == sorted(sampled)  # a rollout's later turns never ran on older weights
        assert [c.policy_version for c in trace.calls] == [v for v in branch.message_versions if v is not None]
        assert [v.version for v in trace.versions] == sorted(v.version for v in trace.versions)
        for v in sampled:
            counted[v] = counted.get(v, 0) + 1
    assert set(counted) == {1, 2, 3}  # the trainer's two swaps fell while rollouts ran
    assert f"sampled tokens per policy version: {dict(sorted(counted.items()))}" in result.stdout
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(len(r["policy_versions"]) == len(r["token_ids"]) for r in rows)


def test_proxy_paused_resumes_however_the_block_ends_and_declares_the_version_only_when_it_ends_well(sim):
    import threading

    import httpx
    import openai
    import pytest

    from interceptor.client import Proxy
    from waiting import wait_until

    with Proxy(upstreams={"vllm": {"base_url": sim.url("/v1"), "api_key_env": KEY_ENV}},
               env={KEY_ENV: REAL_KEY}) as proxy:
        assert proxy.set_version("vllm", "ckpt-1")["version"] == "ckpt-1"
        session = proxy.session(upstream="vllm")
        client = openai.OpenAI(api_key=session.secret, max_retries=0, http_client=httpx.Client(
            proxy=session.proxy_url, verify=session.ssl_context()))
        got: list = []
        with pytest.raises(RuntimeError, match="the swap failed"):
            with proxy.paused("vllm", version="ckpt-2") as drain:
                assert drain["drained"] and drain["paused"]
                asking = threading.Thread(target=lambda: got.append(client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}]).choices[0].message.content))
                asking.start()
                wait_until(lambda: proxy.upstream("vllm")["held"] == 1, 60, "the request held")
                raise RuntimeError("the swap failed")
        asking.join(30)
        assert got and proxy.upstream("vllm")["version"] == "ckpt-1" and not proxy.upstream("vllm")["paused"]
        with proxy.paused("vllm", version="ckpt-2"):
            pass
        assert proxy.upstream("vllm")["version"] == "ckpt-2"
        session.close()
        trace = session.trace()
    assert [c.policy_version for c in trace.calls] == ["ckpt-1"] and trace.calls[0].held_ms > 0
    assert [v.version for v in trace.versions] == ["ckpt-1", "ckpt-2"]


def test_the_async_rl_page_shows_the_example_file():
    page = (ROOT / "docs" / "async-rl.md").read_text()
    assert EXAMPLE.read_text().strip() in page

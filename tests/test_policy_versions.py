"""Policy versions: the orchestrator declares an upstream's weights version, every call is
stamped with it (and with the one the upstream says answered), each sampled token carries the
version that sampled it, in the trace and in every export; a session's min_version refuses an
older one as an error, never a turn. Through a real mitmdump, the OpenAI SDK, the simulator
playing vLLM."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from interceptor.trace import read_trace
from interceptor.trace.export import read_parquet
from clients import KEY_ENV, REAL_KEY
from mitm import ROOT
from provider import Reply
from test_trace_proxy import FakeVLLM

REPLAY = [sys.executable, str(ROOT / "scripts" / "replay_trace.py")]


@pytest.fixture
def vllm(start_proxy, sim, harness_env):
    """A proxy whose upstream ``vllm`` (the simulator) reports its weights version in
    ``x-weights-version``; ``open(**config)`` makes a session on it, its env applied."""
    sim.strict = False  # return_token_ids is vLLM's
    upstreams = json.dumps({"vllm": {"base_url": sim.url("/v1"), "api_key_env": KEY_ENV,
                                     "version_header": "x-weights-version"}})
    proxy = start_proxy({"intercept_upstreams": upstreams})

    def open_session(**config):
        s = proxy.create_session(upstream="vllm", model="policy", **config)
        harness_env(s["env"])
        return s

    return proxy, open_session


def declare(proxy, version) -> dict:
    status, body = proxy.api("PUT", "upstreams/vllm/version", {"version": version})
    assert status == 200, body
    return body


def sealed(proxy, s):
    assert proxy.api("DELETE", f"sessions/{s['id']}")[0] == 200
    return read_trace(s["trace_path"])


def chat(oai, messages, stream):
    if stream:
        parts = oai.chat.completions.create(model="x", messages=messages, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    return oai.chat.completions.create(model="x", messages=messages).choices[0].message.content


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_version_change_mid_rollout_stamps_each_turn_and_its_tokens(vllm, sim, tmp_path, stream):
    proxy, open_session = vllm
    declare(proxy, 1)
    sim.weights_version = 1
    s = open_session(collect_tokens=True)
    fake = FakeVLLM([Reply(text="first answer"), Reply(text="second answer"), Reply(text="third answer here")])
    sim.default = fake
    oai = openai.OpenAI(api_key=s["model_secret"], max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "start"}]
    for k in range(3):
        if k == 2:  # the trainer swapped the weights between two turns of the rollout
            assert declare(proxy, "2")["version"] == 2  # a name of digits is the number
            sim.weights_version = 2
        messages += [{"role": "assistant", "content": chat(oai, messages, stream)},
                     {"role": "user", "content": f"go on {k}"}]
    trace = sealed(proxy, s)

    assert [(v.upstream, v.version) for v in trace.versions] == [("vllm", 1), ("vllm", 2)]
    assert [(c.policy_version, c.answered_version, c.version_mismatch) for c in trace.calls] == [
        (1, 1, False), (1, 1, False), (2, 2, False)]
    [branch] = trace.branches
    # Each sampled message and each of its tokens carries the version of the call that sampled it.
    sampled = [i for i, n in enumerate(branch.nodes) if trace.nodes[n].sampled]
    assert [branch.message_versions[i] for i in sampled] == [1, 1, 2]
    assert all(v is None for i, v in enumerate(branch.message_versions) if i not in sampled)
    assert len(branch.policy_versions) == len(branch.token_ids)
    for mask, version in zip(branch.sampled_mask, branch.policy_versions):
        assert (version is not None) == mask
    start = 0
    for node, version in zip(branch.nodes, branch.message_versions):
        n = len(trace.nodes[node].token_ids)
        assert branch.policy_versions[start:start + n] == [version] * n
        start += n

    # Every export keeps them.
    rows = {}
    for fmt in ("jsonl", "parquet", "messages"):
        out = tmp_path / f"out.{fmt}"
        done = subprocess.run([*REPLAY, "export", s["trace_path"], "--format", fmt, "--out", str(out)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        rows[fmt] = read_parquet(str(out)) if fmt == "parquet" else [json.loads(x) for x in out.read_text().splitlines()]
    for fmt in ("jsonl", "parquet"):
        [row] = rows[fmt]
        assert row["policy_versions"] == branch.policy_versions
        assert row["message_versions"] == branch.message_versions
    [row] = rows["messages"]
    assert row["message_versions"] == branch.message_versions
    assert [m["role"] for m in row["messages"]] == [m.role for m in branch.messages]

    # So do the interchange formats: each agent step of the ATIF trajectory, each call's span.
    for fmt in ("atif", "otel"):
        out = tmp_path / f"out.{fmt}.jsonl"
        done = subprocess.run([*REPLAY, "export", s["trace_path"], "--format", fmt, "--out", str(out)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        rows[fmt] = json.loads(out.read_text())
    agent = [step for step in rows["atif"]["steps"] if step["source"] == "agent"]
    assert [step["extra"]["policy_version"] for step in agent] == [1, 1, 2]
    spans = [span for scope in rows["otel"]["resourceSpans"][0]["scopeSpans"] for span in scope["spans"]
             if span.get("parentSpanId")]
    versions = [{a["key"]: a["value"] for a in span["attributes"]}.get("llm_interceptor.policy_version")
                for span in sorted(spans, key=lambda span: int(span["startTimeUnixNano"]))]
    assert versions == [{"intValue": "1"}, {"intValue": "1"}, {"intValue": "2"}]


def test_an_upstream_that_answers_with_other_weights_than_declared_is_marked(vllm, sim):
    proxy, open_session = vllm
    declare(proxy, "ckpt-8")
    sim.weights_version = "ckpt-7"  # the swap has not reached this replica yet
    s = open_session()
    oai = openai.OpenAI(api_key=s["model_secret"], max_retries=0, timeout=30)
    chat(oai, [{"role": "user", "content": "hi"}], stream=True)
    sim.weights_version = "ckpt-8"
    chat(oai, [{"role": "user", "content": "hi again"}], stream=False)
    trace = sealed(proxy, s)
    assert [(c.policy_version, c.answered_version, c.version_mismatch) for c in trace.calls] == [
        ("ckpt-8", "ckpt-7", True), ("ckpt-8", "ckpt-8", False)]
    # The tokens carry the weights that sampled them: the ones the upstream said answered.
    assert [trace.nodes[c.node].policy_version for c in trace.calls] == ["ckpt-7", "ckpt-8"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_minimum_version_refuses_an_older_one_as_an_error_not_a_turn(vllm, sim, stream):
    proxy, open_session = vllm
    declare(proxy, 3)
    s = open_session(min_version=4)
    oai = openai.OpenAI(api_key=s["model_secret"], max_retries=0, timeout=30)
    # Declared older than the session accepts: refused before anything is sent.
    with pytest.raises(openai.APIStatusError) as refused:
        chat(oai, [{"role": "user", "content": "hi"}], stream)
    assert refused.value.status_code == 409 and "min_version" in refused.value.message
    assert sim.model_requests() == []
    # Declared new enough, but the upstream says an older one answered: an error, not a turn.
    declare(proxy, 4)
    sim.weights_version = 3
    with pytest.raises(openai.APIStatusError) as stale:
        chat(oai, [{"role": "user", "content": "hi"}], stream)
    assert stale.value.status_code == 409 and "version 3" in stale.value.message
    assert len(sim.model_requests()) == 1
    sim.weights_version = 4
    assert chat(oai, [{"role": "user", "content": "hi"}], stream)
    trace = sealed(proxy, s)
    assert [(c.error.type if c.error else None, c.node is not None) for c in trace.calls] == [
        ("stale_version", False), ("stale_version", False), (None, True)]
    assert trace.num_turns == 1 and trace.calls[1].answered_version == 3


def test_the_upstream_routes_answer_each_mistake_with_its_reason(vllm):
    proxy, _ = vllm
    status, listed = proxy.api("GET", "upstreams")
    assert status == 200 and [u["name"] for u in listed["upstreams"]] == ["vllm", "default"]
    assert listed["upstreams"][0]["version_header"] == "x-weights-version" and REAL_KEY not in json.dumps(listed)
    assert proxy.api("GET", "upstreams", token="wrong")[0] == 401
    assert proxy.api("PUT", "upstreams/vllm/version", {"version": 2}, token=None)[0] == 401
    status, body = proxy.api("PUT", "upstreams/nope/version", {"version": 2})
    assert status == 404 and "vllm" in body["error"]["message"]
    for bad in ({}, {"version": ""}, {"version": -1}, {"version": 1, "extra": 2}):
        status, body = proxy.api("PUT", "upstreams/vllm/version", bad)
        assert status == 400 and "version" in body["error"]["message"], bad
    assert proxy.api("POST", "upstreams/vllm/version", {"version": 2})[0] == 405
    assert proxy.api("GET", "upstreams/vllm/pause")[0] == 405
    assert proxy.api("POST", "upstreams/vllm/pause", {"timeout": -1})[0] == 400
    assert proxy.api("POST", "upstreams/vllm/bogus")[0] == 404
    status, resumed = proxy.api("POST", "upstreams/vllm/resume")  # not paused: nothing to do
    assert status == 200 and resumed["released"] == 0 and proxy.api("GET", "upstreams/vllm")[1]["version"] is None

"""The per-trace export formats other tools read: ATIF (checked with the ``atif`` package's
published models) and OTLP JSON GenAI spans (parsed with ``opentelemetry-proto``), every field
we fill compared with a trace we know: the recorder's traces of tests/test_export.py (token ids,
a compaction's second branch, a tool call) and one an Anthropic SDK wrote through a real
mitmdump. Reached as a user reaches them: ``replay_trace.py export --format atif|otel``, its
``--follow`` of a folder, and ``Session.export``."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import anthropic
import atif
import msgpack
import httpx2
import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from interceptor.client import Proxy
from interceptor.trace import Message, ModelCall, Request, Response, read_trace
from mitm import ROOT
from provider import Reply, ToolCall
from test_export import _export, _traces
from test_trace import SYSTEM, TOOLS, Rollout
from test_trace_tokens import send
from waiting import wait_until


def _steps_by_node(traj: dict) -> dict[int, dict]:
    return {s["extra"]["node"]: s for s in traj["steps"]}


def _all(doc: dict) -> list[dict]:
    return [doc] + [t for sub in doc.get("subagent_trajectories") or [] for t in _all(sub)]


def test_atif_is_a_trajectory_per_branch_the_compaction_linked_to_the_main_one(tmp_path):
    paths = _traces(tmp_path)
    docs = _export(tmp_path, paths, "atif")
    assert [d["session_id"] for d in docs] == ["tok", "tool", "open"]
    for doc in docs:
        atif.Trajectory.model_validate(doc)  # the published models accept every document
        assert doc["schema_version"] == "ATIF-v1.8"
    tok = read_trace(paths[0])
    main, = [b for b in tok.branches if b.index == 1]  # the compaction holds the last reply
    root = docs[0]
    assert root["trajectory_id"] == "tok/branch-1" and root["extra"]["branch"] == 1
    assert root["extra"]["reward"] == 1.0 and root["extra"]["metrics"] == {"passed": 2}
    assert root["extra"]["stop_condition"] == "done" and root["extra"]["sealed"] is True
    (sub,) = root["subagent_trajectories"]
    assert sub["trajectory_id"] == "tok/branch-0" and sub["extra"]["parent_branch"] == 1
    # the parent names the child on the step they part at: the shared system prompt
    ref = root["steps"][0]["observation"]["results"][0]["subagent_trajectory_ref"][0]
    assert ref == {"trajectory_id": "tok/branch-0", "session_id": "tok"}
    assert sub["steps"][0]["is_copied_context"] is True and "is_copied_context" not in sub["steps"][1]
    assert [s["source"] for s in sub["steps"]] == ["system", "user", "agent", "user", "agent"]
    assert [s["message"] for s in sub["steps"]] == [SYSTEM.content, "hi", "hello", "more", "sure"]
    assert sub["steps"][2]["reasoning_content"] == "think"
    assert [s["message"] for s in root["steps"]] == [SYSTEM.content, "compacted", "ok"]

    # every agent step's token arrays are the branch's, cut at its reply
    for traj, branch in ((root, main), (sub, tok.branches[0])):
        for step in (s for s in traj["steps"] if s["source"] == "agent"):
            node = step["extra"]["node"]
            call = next(c for c in tok.calls if c.node == node)
            m = step["metrics"]
            start = sum(len(tok.nodes[i].token_ids) for i in branch.nodes[:branch.nodes.index(node)])
            assert m["prompt_token_ids"] == branch.token_ids[:start]
            assert m["completion_token_ids"] == tok.nodes[node].token_ids == \
                branch.token_ids[start:start + len(m["completion_token_ids"])]
            assert m["logprobs"] == tok.nodes[node].logprobs and len(m["logprobs"]) == len(m["completion_token_ids"])
            assert (m["prompt_tokens"], m["completion_tokens"]) == (call.usage.input_tokens, call.usage.output_tokens)
            assert step["extra"]["call"] == call.id and step["llm_call_count"] == 1 and step["model_name"] == "m"
    assert root["final_metrics"]["total_completion_tokens"] == tok.calls[-1].usage.output_tokens
    assert sub["final_metrics"]["total_prompt_tokens"] == sum(c.usage.input_tokens for c in tok.calls[:2])

    tool = docs[1]
    call_step = tool["steps"][2]
    assert call_step["tool_calls"] == [{"tool_call_id": "c1", "function_name": "bash", "arguments": {"cmd": "ls"}}]
    assert call_step["observation"]["results"] == [{"source_call_id": "c1", "content": "a.txt", "extra": {"node": 3}}]
    assert tool["steps"][3]["message"] == "one file" and tool["extra"]["task"] == {"id": 3}
    assert tool["agent"]["tool_definitions"][0]["function"]["name"] == "bash"
    assert "sealed" in docs[2]["extra"] and docs[2]["extra"]["sealed"] is False


def _at(r: Rollout, prompt: list[Message], reply: Message, at: float) -> None:
    """A turn whose call ends at ``at`` (its nodes' timestamp): when each agent ran."""
    call = ModelCall(id=f"call-{at:g}", dialect="chat", endpoint="/v1/chat/completions", model="m",
                     started_at=at - 1, ended_at=at, status=200)
    r.recorder.commit_turn(Request(messages=prompt, tools=TOOLS),
                           Response(message=reply, finish_reason="tool_calls" if reply.tool_calls else "stop"), call)


def test_atif_links_a_sub_agent_to_the_step_whose_call_started_it(tmp_path):
    # the main agent asks for a task; a sub-agent with a system prompt of its own (it shares
    # nothing with the main conversation) runs it; its answer comes back as the tool result
    r = Rollout(tmp_path / "sub.msgpack")
    main = [SYSTEM, Message(role="user", content="fix it")]
    task = Message(role="assistant", tool_calls=[{"id": "t1", "name": "Task", "arguments": '{"do": "look"}'}])
    _at(r, main, task, 10.0)
    sub = [Message(role="system", content="You are a sub-agent."), Message(role="user", content="look")]
    _at(r, sub, Message(role="assistant", content="found it"), 20.0)
    main += [task, Message(role="tool", tool_call_id="t1", content="found it")]
    _at(r, main, Message(role="assistant", content="fixed"), 30.0)
    r.store.flush(timeout=10)
    (doc,) = _export(tmp_path, [str(r.path)], "atif")
    atif.Trajectory.model_validate(doc)
    assert [s["message"] for s in doc["steps"]] == [SYSTEM.content, "fix it", "", "fixed"]
    (child,) = doc["subagent_trajectories"]
    assert [s["message"] for s in child["steps"]] == ["You are a sub-agent.", "look", "found it"]
    assert not any(s.get("is_copied_context") for s in child["steps"])
    assert child["extra"]["shared_messages"] == 0 and child["extra"]["parent_branch"] == doc["extra"]["branch"]
    results = doc["steps"][2]["observation"]["results"]  # the Task call's step: its result, then the link
    assert results[0] == {"source_call_id": "t1", "content": "found it", "extra": {"node": 6}}
    assert results[1]["subagent_trajectory_ref"] == [{"trajectory_id": child["trajectory_id"], "session_id": "sub"}]


def test_atif_filters_and_a_freeform_call_keeps_its_raw_input(tmp_path):
    paths = _traces(tmp_path)
    assert [d["session_id"] for d in _export(tmp_path, paths, "atif", "--min-reward", "0.5")] == ["tok"]
    r = Rollout(tmp_path / "free.msgpack")
    ask = [SYSTEM, Message(role="user", content="patch it")]
    patch = Message(role="assistant", tool_calls=[{"id": "p1", "name": "apply_patch", "type": "custom",
                                                   "arguments": "*** Begin Patch"}])
    r.send(ask, patch)
    r.store.flush(timeout=10)
    (doc,) = _export(tmp_path, [str(r.path)], "atif")
    (call,) = doc["steps"][2]["tool_calls"]
    assert call["arguments"] == {} and call["extra"] == {"arguments": "*** Begin Patch", "type": "custom"}


def _parse(line: str) -> ExportTraceServiceRequest:
    """An OTLP JSON line as the collector reads it. OTLP JSON writes ids in hex, protobuf's
    own JSON mapping reads base64: the ids are turned over first, nothing else."""
    data = json.loads(line)
    for rs in data["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    return json_format.ParseDict(data, ExportTraceServiceRequest())


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


def _spans(request: ExportTraceServiceRequest) -> list[tuple[object, dict]]:
    (rs,) = request.resource_spans
    (ss,) = rs.scope_spans
    return [(s, {a.key: _value(a.value) for a in s.attributes}) for s in ss.spans]


def _otel(tmp_path, paths, *extra) -> list[ExportTraceServiceRequest]:
    out = tmp_path / "spans.jsonl"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "replay_trace.py"), "export", *paths,
                           "--format", "otel", "--out", str(out), *extra], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return [_parse(line) for line in out.read_text().splitlines()]


def test_otel_spans_a_session_span_and_one_per_call_with_the_genai_attributes(tmp_path):
    paths = _traces(tmp_path)
    requests = _otel(tmp_path, paths)
    assert len(requests) == 3
    tok = read_trace(paths[0])
    spans = _spans(requests[0])
    assert len(spans) == 1 + len(tok.calls)
    (session, sattrs), calls = spans[0], spans[1:]
    assert len(session.trace_id) == 16 and len(session.span_id) == 8 and not session.parent_span_id
    assert session.name == "invoke_agent" and session.kind == 1
    assert sattrs["gen_ai.operation.name"] == "invoke_agent" and sattrs["gen_ai.conversation.id"] == "tok"
    assert sattrs["llm_interceptor.reward"] == 1.0 and sattrs["llm_interceptor.stop_condition"] == "done"
    assert sattrs["gen_ai.usage.output_tokens"] == tok.usage.output_tokens
    for (span, attrs), call in zip(calls, tok.calls):
        assert span.trace_id == session.trace_id and span.parent_span_id == session.span_id
        assert span.kind == 3 and span.name == "chat m"
        assert span.start_time_unix_nano == int(call.started_at * 1e9)
        assert span.end_time_unix_nano == int(call.ended_at * 1e9)
        assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == "m"
        assert attrs["gen_ai.usage.input_tokens"] == call.usage.input_tokens
        assert attrs["gen_ai.usage.output_tokens"] == call.usage.output_tokens
        assert attrs["gen_ai.response.finish_reasons"] == ["stop"]
        assert attrs["llm_interceptor.call.id"] == call.id
        assert not any(k.startswith("gen_ai.input") or k.startswith("gen_ai.output") for k in attrs)  # opt-in
    tool_calls = _spans(requests[1])[1:]
    assert tool_calls[0][1]["gen_ai.response.finish_reasons"] == ["tool_call"]

    with_content = _spans(_otel(tmp_path, [paths[1]], "--capture-content")[0])
    first, second = with_content[1][1], with_content[2][1]
    assert json.loads(first["gen_ai.input.messages"]) == [
        {"role": "system", "parts": [{"type": "text", "content": SYSTEM.content}]},
        {"role": "user", "parts": [{"type": "text", "content": "list files"}]}]
    assert json.loads(first["gen_ai.output.messages"]) == [{"role": "assistant", "finish_reason": "tool_call", "parts": [
        {"type": "tool_call", "id": "c1", "name": "bash", "arguments": {"cmd": "ls"}}]}]
    assert json.loads(second["gen_ai.input.messages"])[-1] == {
        "role": "tool", "parts": [{"type": "tool_call_response", "id": "c1", "response": "a.txt"}]}
    assert json.loads(first["gen_ai.tool.definitions"])[0]["name"] == "bash"

    # the same session gives the same ids on every export (a re-export replaces, not adds)
    again = _spans(_otel(tmp_path, [paths[0]])[0])
    assert [s.span_id for s, _ in again] == [s.span_id for s, _ in spans]


def test_otel_marks_a_failed_call_as_an_error_span(tmp_path):
    path = tmp_path / "e.msgpack"
    path.write_bytes(b"".join(msgpack.packb(r) for r in [
        {"kind": "header", "schema_version": 1, "id": "e"},
        {"kind": "turn", "nodes": [{"i": 0, "message": {"role": "user", "content": "q"}}],
         "call": {"id": "c1", "dialect": "responses", "model": "gpt-5", "status": 429, "started_at": 5.0,
                  "ended_at": 5.25, "error": {"type": "rate_limit_error", "message": "slow down", "status": 429}}},
    ]))
    (_, _), (span, attrs) = _spans(_otel(tmp_path, [str(path)])[0])
    assert span.status.code == 2 and span.status.message == "slow down"
    assert attrs["error.type"] == "rate_limit_error" and attrs["http.response.status_code"] == 429
    assert attrs["gen_ai.provider.name"] == "openai" and span.name == "chat gpt-5"
    assert span.end_time_unix_nano - span.start_time_unix_nano == 250_000_000


def test_what_cannot_be_exported_is_refused(tmp_path):
    paths = _traces(tmp_path)
    script = [sys.executable, str(ROOT / "scripts" / "replay_trace.py"), "export"]
    for args, why in (([*paths, "--format", "otel", "--sampled-only"], "span per call"),
                      (["--follow", str(tmp_path), "--format", "parquet"], "readable only once closed"),
                      ([*paths, "--format", "jsonl", "--capture-content"], "otel format's"),
                      ([*paths, "--follow", str(tmp_path), "--format", "atif"], "one of the two")):
        done = subprocess.run([*script, *args, "--out", str(tmp_path / "x")], capture_output=True, text=True)
        assert done.returncode == 2 and why in done.stderr, (args, done.stderr)


def _anthropic(session) -> anthropic.Anthropic:
    http = httpx2.Client(proxy=session.proxy_url, verify=session.ssl_context())
    return anthropic.Anthropic(api_key=session.secret, http_client=http, max_retries=0)


def test_an_sdk_session_exported_from_the_python_api(proxy, sim, tmp_path):
    """Anthropic Messages through a real mitmdump: thinking, a tool call and its result, cache
    reads; both formats from ``Session.export``, every field checked against the trace."""
    sim.script(Reply(reasoning="Paris, so the weather tool.", text="Checking.",
                     tool_calls=[ToolCall("get_weather", {"location": "Paris"}, id="toolu_1")],
                     input_tokens=40, output_tokens=12, cached_tokens=30),
               Reply(text="Rainy.", input_tokens=60, output_tokens=3))
    client = Proxy.attach(proxy.url, proxy.admin_token)
    tools = [{"name": "get_weather", "description": "the weather", "input_schema": {
        "type": "object", "properties": {"location": {"type": "string"}}}}]
    with client.session(agent={"name": "unit-agent", "version": "2"}, task={"id": "t"}) as session:
        ant = _anthropic(session)
        ask = [{"role": "user", "content": "Weather in Paris?"}]
        first = ant.messages.create(model="claude-sonnet-4-5", max_tokens=2000, system="Be brief.", messages=ask,
                                    tools=tools, thinking={"type": "enabled", "budget_tokens": 1024})
        ask += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "rainy"}]}]
        ant.messages.create(model="claude-sonnet-4-5", max_tokens=2000, system="Be brief.", messages=ask,
                            tools=tools, thinking={"type": "enabled", "budget_tokens": 1024})
        session.close(reward=0.5)
    trace = session.trace()
    assert len(trace.calls) == 2 and len(trace.branches) == 1

    assert session.export(tmp_path / "t.json", "atif") == 1
    doc = json.loads((tmp_path / "t.json").read_text())
    atif.Trajectory.model_validate(doc)
    assert doc["agent"]["name"] == "unit-agent" and doc["agent"]["version"] == "2"
    assert doc["agent"]["model_name"] == trace.calls[-1].model
    assert [s["source"] for s in doc["steps"]] == ["system", "user", "agent", "agent"]
    agent = doc["steps"][2]
    assert agent["message"] == "Checking." and agent["reasoning_content"] == "Paris, so the weather tool."
    assert agent["tool_calls"] == [{"tool_call_id": "toolu_1", "function_name": "get_weather",
                                    "arguments": {"location": "Paris"}}]
    assert agent["observation"]["results"][0]["source_call_id"] == "toolu_1"
    assert agent["observation"]["results"][0]["content"] == "rainy"
    usage = trace.calls[0].usage
    assert agent["metrics"]["prompt_tokens"] == usage.input_tokens == 70  # Anthropic 40 + 30 read from cache
    assert agent["metrics"]["cached_tokens"] == usage.cached_input_tokens == 30
    assert agent["metrics"]["completion_tokens"] == 12 and "prompt_token_ids" not in agent["metrics"]
    assert agent["extra"]["finish_reason"] == "tool_calls" and agent["extra"]["call"] == trace.calls[0].id
    assert doc["steps"][3]["message"] == "Rainy." and doc["extra"]["reward"] == 0.5
    assert doc["agent"]["tool_definitions"][0]["function"]["name"] == "get_weather"

    with open(tmp_path / "spans.jsonl", "w") as f:
        assert session.export(f, "otel", capture_content=True) == 3
    spans = _spans(_parse((tmp_path / "spans.jsonl").read_text()))
    (session_span, sattrs), (span, attrs), _ = spans
    assert session_span.name == "invoke_agent unit-agent" and sattrs["gen_ai.agent.name"] == "unit-agent"
    assert attrs["gen_ai.provider.name"] == "anthropic" and attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == "claude-sonnet-4-5" and attrs["gen_ai.response.model"] == trace.calls[0].model
    assert attrs["gen_ai.request.max_tokens"] == 2000 and attrs["gen_ai.response.id"] == trace.calls[0].response_id
    assert attrs["gen_ai.usage.input_tokens"] == 70 and attrs["gen_ai.usage.cache_read.input_tokens"] == 30
    assert attrs["gen_ai.usage.output_tokens"] == 12 and attrs["gen_ai.response.finish_reasons"] == ["tool_call"]
    assert json.loads(attrs["gen_ai.system_instructions"]) == [{"type": "text", "content": "Be brief."}]
    assert json.loads(attrs["gen_ai.input.messages"]) == [
        {"role": "user", "parts": [{"type": "text", "content": "Weather in Paris?"}]}]
    assert json.loads(attrs["gen_ai.output.messages"]) == [{"role": "assistant", "finish_reason": "tool_call", "parts": [
        {"type": "reasoning", "content": "Paris, so the weather tool."}, {"type": "text", "content": "Checking."},
        {"type": "tool_call", "id": "toolu_1", "name": "get_weather", "arguments": {"location": "Paris"}}]}]
    with pytest.raises(ValueError, match="not a per-trace format"):
        session.export(tmp_path / "x", "jsonl")


def test_follow_exports_each_trace_as_it_is_sealed(tmp_path):
    folder = tmp_path / "traces"
    folder.mkdir()
    out = tmp_path / "follow.jsonl"
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "replay_trace.py"), "export",
                             "--follow", str(folder), "--state", str(tmp_path / "state.json"),
                             "--format", "atif", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def lines(n: int) -> list[dict]:
            def landed() -> str | None:
                text = out.read_text() if out.exists() else ""
                if text.count("\n") >= n:
                    return text
                assert proc.poll() is None, proc.stderr.read()
                return None
            text = wait_until(landed, 30, lambda: f"{n} lines in {out.read_text() if out.exists() else ''!r}")
            return [json.loads(line) for line in text.splitlines()]

        a = Rollout(folder / "a.msgpack")
        a.send([SYSTEM, Message(role="user", content="q")], Message(role="assistant", content="a1"))
        a.store.flush(timeout=10)
        b = Rollout(folder / "b.msgpack")
        send(b, [SYSTEM, Message(role="user", content="hi")], Message(role="assistant", content="b1"))
        b.recorder.seal("done", reward=1.0)
        b.store.flush(timeout=10)
        (first,) = lines(1)  # the sealed one only: a trace is exported when its footer lands
        assert first["session_id"] == "b" and first["steps"][-1]["message"] == "b1"
        a.recorder.seal("done", reward=0.0)
        a.store.flush(timeout=10)
        assert [d["session_id"] for d in lines(2)] == ["b", "a"]
        for doc in lines(2):
            atif.Trajectory.model_validate(doc)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert sorted(json.loads((tmp_path / "state.json").read_text())["sealed"]) == ["a.msgpack", "b.msgpack"]

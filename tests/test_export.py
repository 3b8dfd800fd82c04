"""`replay_trace.py export --format jsonl|parquet|messages` and its filters, as a user runs it;
the messages export of real Claude Code and Codex traces rendered through a Hugging Face chat
template (a tokenizer built here, nothing downloaded)."""

from __future__ import annotations

import json
import uuid

import msgpack
import pyarrow.parquet as pq
import pytest

from interceptor.trace import Message
from interceptor.trace.export import read_parquet
from harness import TOOL_OUTPUT, FINAL, check_ran, node_harness, run_harness, trace_of
from harness import hproxy, hsim, sim  # noqa: F401 (this module's fixtures)
from test_trace import SYSTEM, Rollout
from test_trace_replay import run
from test_trace_tokens import send


def _traces(tmp_path):
    """Two sealed traces: one with token ids, two branches (a compaction) and a reward; one
    without token ids, a tool call and result, and a lower reward; plus an unsealed one."""
    r = Rollout(tmp_path / "tok.msgpack")
    history = [SYSTEM, Message(role="user", content="hi")]
    reply = Message(role="assistant", content="hello", reasoning=[{"text": "think"}])
    send(r, history, reply)
    send(r, history + [reply, Message(role="user", content="more")], Message(role="assistant", content="sure"))
    send(r, [SYSTEM, Message(role="user", content="compacted")], Message(role="assistant", content="ok"))
    r.recorder.seal("done", reward=1.0, metrics={"passed": 2})
    t = Rollout(tmp_path / "tool.msgpack", task={"id": 3})
    ask = [SYSTEM, Message(role="user", content="list files")]
    call = Message(role="assistant", tool_calls=[{"id": "c1", "name": "bash", "arguments": '{"cmd": "ls"}'}])
    t.send(ask, call)
    t.send(ask + [call, Message(role="tool", tool_call_id="c1", content="a.txt")],
           Message(role="assistant", content="one file"))
    t.recorder.seal("done", reward=0.25)
    u = Rollout(tmp_path / "open.msgpack")
    u.send([SYSTEM, Message(role="user", content="q")], Message(role="assistant", content="a"))
    for x in (r, t, u):
        x.store.flush(timeout=10)
    return [str(x.path) for x in (r, t, u)]


def _export(tmp_path, paths, fmt, *extra) -> list[dict]:
    out = tmp_path / f"out.{fmt}"
    done = run("export", *paths, "--format", fmt, "--out", str(out), *extra)
    assert done.returncode == 0, done.stderr
    if fmt == "parquet":
        return read_parquet(str(out))
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_parquet_reads_back_equal_to_the_jsonl_with_list_columns(tmp_path):
    paths = _traces(tmp_path)
    jsonl = _export(tmp_path, paths, "jsonl")
    assert [(r["trace_id"], r["branch"]) for r in jsonl] == [("tok", 0), ("tok", 1), ("tool", 0), ("open", 0)]
    assert _export(tmp_path, paths, "parquet") == jsonl

    table = pq.read_table(tmp_path / "out.parquet")
    types = {f.name: str(f.type) for f in table.schema}
    assert types["token_ids"] == "list<element: int64>" and types["sampled_mask"] == "list<element: bool>"
    assert types["logprobs"] == types["advantages"] == "list<element: double>"
    assert types["reward"] == "double" and types["branch"] == "int64" and types["messages"] == "string"
    first = table.slice(0, 1).to_pylist()[0]
    assert first["token_ids"] == jsonl[0]["token_ids"] and len(first["token_ids"]) > 0
    assert first["sampled_mask"].count(True) > 0 and table.column("token_ids")[2].as_py() is None
    # one file's schema is every file's: the one without token ids alone has the same
    assert pq.read_table(tmp_path / "out.parquet").schema == \
        pq.read_table(_export_path(tmp_path, [paths[1]])).schema


def _export_path(tmp_path, paths):
    out = tmp_path / "single.parquet"
    assert run("export", *paths, "--format", "parquet", "--out", str(out)).returncode == 0
    return out


def test_filters_apply_to_every_format(tmp_path):
    paths = _traces(tmp_path)
    for fmt in ("jsonl", "parquet", "messages"):
        rows = _export(tmp_path, paths, fmt, "--min-reward", "0.5")
        assert [(r["trace_id"], r["branch"]) for r in rows] == [("tok", 0), ("tok", 1)], fmt
    assert [r["trace_id"] for r in _export(tmp_path, paths, "jsonl", "--min-reward", "0")] == ["tok", "tok", "tool"]
    assert len(_export(tmp_path, paths, "jsonl", "--sampled-only")) == 4


def test_sampled_only_drops_a_branch_the_model_never_answered(tmp_path):
    # a turn that added a prompt and no reply (a compaction refused before it was sent): its
    # branch holds nothing the model produced
    path = tmp_path / "p.msgpack"
    path.write_bytes(b"".join(msgpack.packb(r) for r in [
        {"kind": "header", "schema_version": 1, "id": "p"},
        {"kind": "turn", "nodes": [{"i": 0, "message": {"role": "user", "content": "q"}},
                                   {"i": 1, "parent": 0, "sampled": True,
                                    "message": {"role": "assistant", "content": "a"}}],
         "call": {"id": "c1", "node": 1}},
        {"kind": "turn", "nodes": [{"i": 2, "message": {"role": "user", "content": "summary"}}],
         "call": {"id": "c2", "status": 400}},
        {"kind": "footer", "stop_condition": "done", "reward": 1.0},
    ]))
    assert [r["branch"] for r in _export(tmp_path, [str(path)], "jsonl")] == [0, 1]
    assert [r["branch"] for r in _export(tmp_path, [str(path)], "jsonl", "--sampled-only")] == [0]


def test_messages_are_openai_chat_with_tool_calls_paired_and_reasoning(tmp_path):
    paths = _traces(tmp_path)
    rows = _export(tmp_path, paths, "messages")
    tok, _, tool, _ = rows
    assert tok["messages"][1:3] == [{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "hello", "reasoning_content": "think"}]
    assert tok["reward"] == 1.0 and tok["metrics"] == {"passed": 2}
    assert tool["messages"][2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]}
    assert tool["messages"][3] == {"role": "tool", "content": "a.txt", "tool_call_id": "c1", "name": "bash"}
    assert tool["task"] == {"id": 3}
    _render(tool)


# -- a Hugging Face chat template -------------------------------------------------------------

# Qwen-style ChatML with tools, tool calls, tool results and reasoning. It refuses (raises) a
# tool result that answers no pending call and a call left without its result, so rendering is
# also the pairing check.
TEMPLATE = """
{%- set ns = namespace(pending=[]) -%}
{%- if tools %}<|im_start|>system
# Tools
{% for tool in tools %}{{ tool.function.name }}: {{ tool.function.parameters | tojson }}
{% endfor %}<|im_end|>
{% endif -%}
{%- for message in messages -%}
  {%- set content = message.content if message.content is string else
        message.content | map(attribute='text') | select | join('') -%}
  {%- if message.role == 'tool' -%}
    {%- if message.tool_call_id not in ns.pending -%}
      {{ raise_exception('tool result ' ~ message.tool_call_id ~ ' answers no pending call') }}
    {%- endif -%}
    {%- set ns.pending = ns.pending | reject('equalto', message.tool_call_id) | list -%}
<|im_start|>user
<tool_response name="{{ message.name }}">{{ content }}</tool_response><|im_end|>
  {%- elif message.role == 'assistant' -%}
    {%- if ns.pending -%}{{ raise_exception('calls without results: ' ~ ns.pending | join(',')) }}{%- endif -%}
<|im_start|>assistant
{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>
{% endif %}{{ content }}
    {%- for call in message.tool_calls or [] -%}
      {%- set ns.pending = ns.pending + [call.id] %}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}}</tool_call>
    {%- endfor -%}<|im_end|>
  {%- else -%}
<|im_start|>{{ message.role }}
{{ content }}<|im_end|>
  {%- endif %}
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<|im_start|>", "<|im_end|>", "user", "assistant", "system", "[UNK]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", chat_template=TEMPLATE)


def _render(row: dict) -> str:
    tokenizer = _tokenizer()
    text = tokenizer.apply_chat_template(row["messages"], tools=row["tools"] or None, tokenize=False)
    ids = tokenizer.apply_chat_template(row["messages"], tools=row["tools"] or None, tokenize=True)
    assert ids and text.count("<|im_start|>") >= len(row["messages"])
    return text


def test_the_template_refuses_an_unpaired_tool_result():
    row = {"messages": [{"role": "user", "content": "q"},
                        {"role": "tool", "tool_call_id": "nope", "content": "x", "name": "bash"}], "tools": []}
    with pytest.raises(Exception, match="answers no pending call"):
        _render(row)


def _harness_row(proxy, sim, tmp_path, command, session, task, name):
    task(sim)
    sid = f"{name}-{uuid.uuid4().hex[:8]}"
    check_ran(run_harness(proxy, sim, command, sid=sid, cwd=tmp_path / "work", session=session))
    trace = trace_of(proxy, sid)
    rows = _export(tmp_path, [str(proxy.trace_dir / f"{sid}.msgpack")], "messages")
    assert len(rows) == len(trace.branches) == 1
    return rows[0]


def _check_paired(row: dict, tool: str) -> None:
    messages = row["messages"]
    calls = {c["id"]: c["function"]["name"] for m in messages if m["role"] == "assistant"
             for c in m.get("tool_calls", [])}
    results = [m for m in messages if m["role"] == "tool"]
    assert tool in calls.values() and results
    assert sorted(calls) == sorted(m["tool_call_id"] for m in results)
    assert all(m["name"] == calls[m["tool_call_id"]] for m in results)
    assert any(TOOL_OUTPUT in m["content"] for m in results)
    assert FINAL in messages[-1]["content"]
    assert tool in [t["function"]["name"] for t in row["tools"]]


def test_claude_code_trace_renders_through_a_chat_template(hproxy, sim, tmp_path):
    from test_harness_claude import SESSION, _script_task
    claude = [node_harness("claude"), "-p", "Run `echo hello-from-tool` and then tell me the answer.",
              "--allowedTools", "Bash"]
    row = _harness_row(hproxy, sim, tmp_path, claude, SESSION, _script_task, "claude")
    _check_paired(row, "Bash")
    assert any(m.get("reasoning_content") == "It printed." for m in row["messages"])
    text = _render(row)
    assert TOOL_OUTPUT in text and "<think>It printed.</think>" in text and FINAL in text


def test_codex_trace_renders_through_a_chat_template(hproxy, sim, tmp_path):
    from test_harness_codex import SESSION, _codex, _script_task
    row = _harness_row(hproxy, sim, tmp_path, _codex(), SESSION, _script_task, "codex")
    _check_paired(row, "exec")
    call = next(c for m in row["messages"] for c in m.get("tool_calls", []))
    assert call["type"] == "function" and "exec_command" in call["function"]["arguments"]  # freeform input, raw
    text = _render(row)
    assert TOOL_OUTPUT in text and FINAL in text

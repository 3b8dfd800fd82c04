"""scripts/replay_trace.py as a user runs it: a subprocess on real trace files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgpack

from interceptor.trace import Message, Usage
from test_trace import SYSTEM, Rollout, tool_turns
from test_trace_store import recorded
from test_trace_tokens import send

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "replay_trace.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=60)


def test_show_prints_each_branch_once_and_a_line_per_call(tmp_path):
    r = recorded(tmp_path, turns=3)
    r2 = Rollout(tmp_path / "fork.msgpack")
    for prompt, reply in tool_turns(2):
        r2.send(prompt, reply, usage=Usage(input_tokens=9, output_tokens=2))
    r2.send([SYSTEM, Message(role="user", content="compacted")],
            Message(role="assistant", content="onwards"))
    r2.store.flush(timeout=10)

    out = run("show", str(r.path))
    assert out.returncode == 0, out.stderr
    assert "sealed (done)" in out.stdout and "== branch 0" in out.stdout
    assert out.stdout.count("\ncall ") == 4
    assert "error upstream: refused" in out.stdout
    assert "-> bash(" in out.stdout

    out = run("show", str(r2.path))
    assert "first 1 shared with branch 0" in out.stdout
    assert "(estimated)" in out.stdout
    assert out.stdout.count("You are a careful agent.") == 1


def test_show_json_summary(tmp_path):
    r = recorded(tmp_path, turns=2)
    out = run("show", "--json", str(r.path))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["id"] == "r" and data["sealed"] is True and data["stop_condition"] == "done"
    assert data["turns"] == 2 and data["output_tokens"] == 10
    first = data["calls"][0]
    assert first["model"] == "m" and first["status"] == 200
    assert first["finish_reason"] == "tool_calls"
    assert first["usage"]["input_tokens"] == 50
    assert first["sampling"] == {} and first["error"] is None
    assert data["calls"][-1]["error"]["message"] == "refused"


def test_verify_passes_good_files_and_names_the_first_problem(tmp_path):
    good = recorded(tmp_path, turns=2)
    torn = tmp_path / "torn.msgpack"
    torn.write_bytes(good.path.read_bytes()[:-3])
    out = run("verify", str(good.path), str(torn))
    assert out.returncode == 0, out.stderr
    assert "torn last record" in out.stderr

    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(b"".join(msgpack.packb(r) for r in [
        {"kind": "header", "schema_version": 1, "id": "b"},
        {"kind": "turn", "nodes": [{"i": 0, "message": {"role": "user", "content": "q"}}],
         "call": {"id": "c", "node": 0}},
    ]))
    out = run("verify", str(good.path), str(bad))
    assert out.returncode == 1
    assert "bad.msgpack: call c: node 0 is not a sampled reply" in out.stderr

    newer = tmp_path / "newer.msgpack"
    newer.write_bytes(msgpack.packb({"kind": "header", "schema_version": 99, "id": "n"}))
    out = run("verify", str(newer))
    assert out.returncode == 1 and "schema version 99" in out.stderr


def test_export_writes_one_sample_per_branch(tmp_path):
    r = Rollout(tmp_path / "x.msgpack")
    history = [SYSTEM, Message(role="user", content="hi")]
    reply = Message(role="assistant", content="hello")
    send(r, history, reply)
    send(r, history + [reply, Message(role="user", content="more")],
         Message(role="assistant", content="sure"))
    send(r, [SYSTEM, Message(role="user", content="other")], Message(role="assistant", content="b"))
    r.recorder.seal("done", reward=1.0)
    r.store.flush(timeout=10)
    other = recorded(tmp_path, turns=1)
    out_file = tmp_path / "samples.jsonl"
    out = run("export", str(r.path), str(other.path), "--out", str(out_file))
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [(s["trace_id"], s["branch"]) for s in lines] == [("x", 0), ("x", 1), ("r", 0)]
    first = lines[0]
    assert [m["role"] for m in first["messages"]] == ["system", "user", "assistant", "user",
                                                       "assistant"]
    assert len(first["token_ids"]) == len(first["sampled_mask"]) == len(first["logprobs"])
    assert first["reward"] == 1.0
    assert lines[2]["token_ids"] is None  # no token ids from that upstream


def test_export_carries_the_trainers_fields_when_present_and_verify_checks_them(tmp_path):
    """``reference_logprobs`` and ``loss_weights`` are reserved per node: a trainer's file
    with them exports them aligned with the branch's tokens (0.0 and the sampled mask on the
    nodes without), and ``verify`` refuses them misaligned."""
    def write(path, weights):
        path.write_bytes(b"".join(msgpack.packb(r) for r in [
            {"kind": "header", "schema_version": 2, "id": path.stem},
            {"kind": "turn", "nodes": [
                {"i": 0, "message": {"role": "user", "content": "q"}, "token_ids": [1, 2]},
                {"i": 1, "parent": 0, "message": {"role": "assistant", "content": "a"}, "sampled": True,
                 "token_ids": [3, 4], "logprobs": [-0.5, -0.25], "reference_logprobs": [-0.4, -0.3],
                 "loss_weights": weights}],
             "call": {"id": "c", "node": 1}},
        ]))

    trainer = tmp_path / "trainer.msgpack"
    write(trainer, [0.5, 1.0])
    out_file = tmp_path / "s.jsonl"
    out = run("export", str(trainer), "--out", str(out_file))
    assert out.returncode == 0, out.stderr
    (sample,) = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert sample["reference_logprobs"] == [0.0, 0.0, -0.4, -0.3]
    assert sample["loss_weights"] == [0.0, 0.0, 0.5, 1.0]  # the prompt node: its mask
    plain = recorded(tmp_path, turns=1)
    out = run("export", str(plain.path), "--out", "-")
    assert "reference_logprobs" not in json.loads(out.stdout.splitlines()[0])  # absent, not null

    misaligned = tmp_path / "misaligned.msgpack"
    write(misaligned, [1.0])
    out = run("verify", str(misaligned))
    assert out.returncode == 1 and "loss_weights has 1 entries for 2 token ids" in out.stderr

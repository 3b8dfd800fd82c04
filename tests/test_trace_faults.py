"""The record under faults: a full disk, a turn that cannot be recorded, text UTF-8 cannot
carry. The invariants: the file is never corrupt in the middle, a failed commit
never poisons the next turn, and graph and file agree after every exchange."""

from __future__ import annotations

import errno
import os
import warnings

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from interceptor.scripts.replay_trace import main as replay_main
from interceptor.trace import HoleWarning, Message, Store, TornRecordWarning, iter_records, read_trace
from interceptor.trace import store as store_module
from interceptor.trace.escape import ESCAPE, escape, escape_text, unescape
from interceptor.trace.verify import problems
from test_trace import Rollout, tool_turns


class Disk:
    """An injected disk that fills up: while ``full``, every write gets half its bytes onto
    the file and then fails with ENOSPC, as a real full disk does mid-record."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.full = False
        self.failures = 0
        real = store_module._write_all

        def write_all(fd: int, data: bytes) -> None:
            if self.full:
                self.failures += 1
                os.write(fd, data[: len(data) // 2])
                raise OSError(errno.ENOSPC, "No space left on device")
            real(fd, data)

        monkeypatch.setattr(store_module, "_write_all", write_all)


def read_clean(path):
    """The trace and the reader's warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace = read_trace(path)
    return trace, [w for w in caught if issubclass(w.category, TornRecordWarning)]


def same(memory, disk) -> None:
    """Graph and file agree: the same nodes, the same calls, in the same order."""
    assert [n.model_dump() for n in disk.nodes] == [n.model_dump() for n in memory.nodes]
    assert [(c.id, c.node, c.error.type if c.error else None) for c in disk.calls] == \
           [(c.id, c.node, c.error.type if c.error else None) for c in memory.calls]


def test_a_full_disk_mid_session_loses_nothing_once_space_returns(tmp_path, monkeypatch):
    disk = Disk(monkeypatch)
    monkeypatch.setattr(store_module, "RETRY_INTERVAL", 0.05)
    r = Rollout(tmp_path / "full.msgpack")
    turns = tool_turns(20)
    for k, (prompt, reply) in enumerate(turns):
        disk.full = 8 <= k < 14
        r.send(prompt, reply)
        r.store.flush(timeout=10)
        if disk.full:
            health = r.recorder.write_health()
            assert not health.ok and health.held >= 1 and "No space left" in health.error
            assert r.recorder.summary()["store"]["held"] == health.held
            # rolled back: the file holds complete records only, the last one turn k-1's
            assert os.path.getsize(r.path) == sum(len(store_module.pack(rec)) for _, rec in iter_records(r.path))
    r.recorder.seal("done")
    r.store.flush(timeout=10)
    assert disk.failures >= 6
    trace, torn = read_clean(r.path)
    assert torn == []
    assert trace.num_turns == 20 and trace.sealed and problems(trace) == []
    same(r.recorder.trace, trace)
    health = r.recorder.write_health()
    assert health.ok and health.late >= 6 and health.lost == 0
    assert replay_main(["verify", str(r.path)]) == 0


def test_a_disk_that_stays_full_degrades_the_session_and_says_how_many_were_lost(tmp_path, monkeypatch):
    disk = Disk(monkeypatch)
    monkeypatch.setattr(store_module, "MAX_HELD_BYTES", 2000)
    r = Rollout(tmp_path / "degraded.msgpack")
    for k, (prompt, reply) in enumerate(tool_turns(20)):
        disk.full = k >= 10
        r.send(prompt, reply)
        r.store.flush(timeout=10)
    disk.full = False  # too late: the file was given up on
    r.recorder.seal("done")
    r.store.flush(timeout=10)
    health = r.recorder.write_health()
    assert health.degraded and health.lost == 11  # turns 10..19 and the footer
    summary = r.recorder.summary()
    assert summary["store"]["degraded"] and summary["store"]["lost"] == 11
    trace, torn = read_clean(r.path)
    assert torn == [] and trace.num_turns == 10 and problems(trace) == []
    assert replay_main(["verify", str(r.path)]) == 0  # what is there is sound; the summary says the rest


def raw_records(path) -> list[bytes]:
    """Each record's bytes as written (its checksum with it)."""
    data = path.read_bytes()
    ends = [offset for offset, _ in iter_records(path)][1:] + [len(data)]
    return [data[a:b] for a, b in zip([0] + ends[:-1], ends)]


def test_verify_fails_on_a_hole_in_the_middle_and_passes_a_torn_tail(tmp_path, capsys):
    r = Rollout(tmp_path / "src.msgpack")
    for prompt, reply in tool_turns(6):
        r.send(prompt, reply)
    r.recorder.seal()
    r.store.flush(timeout=10)
    records = raw_records(r.path)
    hole = tmp_path / "hole.msgpack"
    # what the old writer left after ENOSPC: half a record, then the records written later
    hole.write_bytes(b"".join(records[:3]) + records[3][: len(records[3]) // 2] + b"".join(records[4:]))
    with pytest.warns(HoleWarning, match="hole in the middle"):
        read_trace(hole)
    assert replay_main(["verify", str(hole)]) == 1
    assert "hole in the middle" in capsys.readouterr().err
    torn = tmp_path / "torn.msgpack"
    torn.write_bytes(b"".join(records[:-1]) + records[-1][:5])
    _, caught = read_clean(torn)
    assert len(caught) == 1 and not issubclass(caught[0].category, HoleWarning)
    assert replay_main(["verify", str(torn)]) == 0


def test_a_hole_before_records_of_any_kind_is_a_hole(tmp_path):
    """Records after the undecodable one may be of any kind (here a stop and a metric, as a
    stopped rollout writes them): still a hole, never mistaken for a torn tail."""
    r = Rollout(tmp_path / "src.msgpack")
    for prompt, reply in tool_turns(2):
        r.send(prompt, reply)
    r.store.flush(timeout=10)
    records = raw_records(r.path)
    after = [msgpack.packb({"kind": "metric", "name": "m", "value": 1}),
             msgpack.packb({"kind": "stop", "stop": {"condition": "gave_up", "by": "tool"}})]
    hole = tmp_path / "hole.msgpack"
    hole.write_bytes(b"".join(records[:-1]) + records[-1][: len(records[-1]) // 2] + b"".join(after))
    at = sum(len(rec) for rec in records[:-1])
    # (undecodable there, or read on into the records after it and ending without its
    # checksum: a hole either way, at the half record)
    with pytest.warns(HoleWarning, match=f"byte {at}"):
        read_trace(hole)


def test_a_turn_that_cannot_be_recorded_is_an_error_call_and_the_next_turn_records(tmp_path, monkeypatch):
    r = Rollout(tmp_path / "atomic.msgpack")
    turns = tool_turns(4)
    r.send(*turns[0])
    real = store_module.pack

    def pack(record, prev=0):
        if record.get("kind") == "turn" and len(record["nodes"]) and "poison" in str(record["nodes"]):
            trace = r.recorder.trace  # the counts kept between reads, read with the turn in
            seen.append((trace.num_turns, trace.num_output_tokens, trace.num_input_tokens, len(trace.messages)))
            raise ValueError("cannot pack this")
        return real(record, prev)

    seen = []

    monkeypatch.setattr(store_module, "pack", pack)
    prompt, reply = turns[1]
    bad = r.send(prompt, reply.model_copy(update={"content": "poison"}))
    assert bad.node is None and bad.error.type == "record_error" and "cannot pack" in bad.error.message
    assert len(r.recorder.trace.nodes) == 3  # the failed turn left nothing in the graph
    trace = r.recorder.trace  # ... nor in the counts kept while it was in
    assert seen[0][0] == 2 and trace.num_turns == 1
    assert trace.num_output_tokens == sum(c.usage.output_tokens for c in trace.calls if c.usage)
    assert trace.num_input_tokens == trace._count_input_tokens()[0]
    assert len(trace.messages) == 3
    for prompt, reply in turns[1:]:
        r.send(prompt, reply)
    r.recorder.seal()
    trace = r.read()
    assert trace.num_turns == 4 and problems(trace) == []
    same(r.recorder.trace, trace)
    assert len(trace.branches) == 1  # the next turns continued the one conversation


def test_a_lone_surrogate_is_recorded_with_a_reversible_escape_and_later_turns_record(tmp_path):
    r = Rollout(tmp_path / "surrogate.msgpack")
    turns = tool_turns(3)
    odd = Message(role="user", content="half a pair: \ud800 and a low one \udfff")
    for prompt, reply in turns:
        call = r.send(prompt[:2] + [odd] + prompt[2:], reply)
        assert call.node is not None and call.error is None
    r.recorder.seal()
    trace = r.read()
    assert trace.num_turns == 3 and problems(trace) == [] and len(trace.branches) == 1
    stored = trace.nodes[2].message.content
    assert isinstance(stored, str) and stored.encode()  # valid UTF-8, a str in msgpack
    assert unescape(stored) == odd.content
    with open(r.path, "rb") as f:  # strict readers (raw=False) decode the file
        list(msgpack.Unpacker(f, raw=False))


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(codec=None, categories=None)) | st.lists(
    st.sampled_from(["a", "\ud800", "\udbff", "\udc00", "\udfff", ESCAPE, "\U0010f000", "\U0010f7ff", "é"]),
).map("".join))
def test_the_escape_is_reversible_and_valid_utf8(text):
    escaped = escape_text(text)
    escaped.encode("utf-8")  # never raises
    assert unescape(escaped) == text
    assert unescape(escape({"k": [text]})["k"][0]) == text


def test_an_integer_beyond_64_bits_is_recorded_and_read_back_exactly(tmp_path):
    """JSON has no integer limit and a harness may send one; msgpack stops at 64 bits. The
    record keeps it as an extension type (not a string a reader would take for text)."""
    from interceptor.trace.records import ext_hook
    from interceptor.trace.store import pack

    big = {"seed": 10**30, "neg": -(2**70), "small": 7, "flag": True}
    unpacked = msgpack.unpackb(pack(big), raw=False, ext_hook=ext_hook)
    assert unpacked.pop("xxh3") >= 0 and unpacked == big

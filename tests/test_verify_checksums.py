"""``verify`` finds a changed byte, not only a broken structure: every record of a version-3
file ends in an XXH3-64 checksum that chains it to the record before it (docs/record-format.md).

The chain is recomputed here from the record format page's words alone (not with the package's code), so
the documented format and the writer cannot drift apart; every byte of a header, a turn with
nodes, an error call and a footer is changed in turn and ``verify`` must fail at that record's
offset; a record removed or two swapped fail too; a version-2 file still reads, and ``verify``
says it carries no checksums.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import msgpack
import pytest
import xxhash

from interceptor.scripts.replay_trace import main as replay_main
from interceptor.trace import ModelCall, ResponseError, Usage, iter_records, read_trace
from interceptor.trace.records import HoleWarning
from interceptor.trace.verify import problems
from test_trace import Rollout, tool_turns

DATA = Path(__file__).resolve().parent / "data"
REPLAY = Path(__file__).resolve().parent.parent / "scripts" / "replay_trace.py"
TRAILER = b"\xa4xxh3\xcf"  # docs/record-format.md: fixstr "xxh3", then a uint64 in its 9-byte form


def spans(blob: bytes) -> list[tuple[int, int, dict]]:
    """(start, end, record) of every record, by msgpack framing alone."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=0, strict_map_key=False)
    unpacker.feed(blob)
    out, start = [], 0
    for record in unpacker:
        end = unpacker.tell()
        out.append((start, end, record))
        start = end
    return out


def trace_file(tmp_path: Path) -> Path:
    r = Rollout(tmp_path / "c.msgpack", agent={"name": "test"}, task={"id": 7})
    for prompt, reply in tool_turns(2):
        r.send(prompt, reply, usage=Usage(input_tokens=50, output_tokens=5))
    r.recorder.record_call(ModelCall(id="boom", status=502, error=ResponseError(type="upstream", message="refused")))
    r.recorder.seal("done")
    r.store.flush(timeout=10)
    return r.path


def verify(path: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = replay_main(["verify", str(path)])
    return code, capsys.readouterr().err


def test_every_record_ends_in_the_documented_checksum_chain(tmp_path):
    blob = trace_file(tmp_path).read_bytes()
    prev = 0
    records = spans(blob)
    assert [r["kind"] for _, _, r in records][0] == "header" and records[-1][2]["kind"] == "footer"
    for start, end, record in records:
        raw = blob[start:end]
        assert raw[-14:-8] == TRAILER, f"record at byte {start} does not end in its checksum"
        assert list(record)[-1] == "xxh3" and record["xxh3"] == int.from_bytes(raw[-8:], "big")
        prev = xxhash.xxh3_64_intdigest(raw[:-8], seed=prev)
        assert record["xxh3"] == prev, f"record at byte {start}: the chain does not hold"
    # the reader hands out the records without their framing
    assert all("xxh3" not in rec for _, rec in iter_records(tmp_path / "c.msgpack"))


def _classes(blob: bytes) -> dict[str, tuple[int, int]]:
    found: dict[str, tuple[int, int]] = {}
    for start, end, rec in spans(blob):
        name = {"header": "header", "footer": "footer", "call": "call"}.get(rec["kind"])
        if rec["kind"] == "turn" and rec.get("nodes"):
            name = "node"
        if name and name not in found:
            found[name] = (start, end)
    assert set(found) == {"header", "node", "call", "footer"}
    return found


@pytest.mark.parametrize("cls", ["header", "node", "call", "footer"])
def test_a_changed_byte_anywhere_in_a_record_fails_verify_at_that_record(tmp_path, capsys, cls):
    """Every position of the record, two ways: one bit (a disk's or a copy's error) and every
    bit (an edit). Structural bytes included: a changed length or type byte must not pass as
    a torn tail, nor a shifted record as a sound one."""
    path = trace_file(tmp_path)
    blob = path.read_bytes()
    assert verify(path, capsys)[0] == 0
    start, end = _classes(blob)[cls]
    changed = tmp_path / "changed.msgpack"
    for at in range(start, end):
        for mask in (0x01, 0xFF):
            data = bytearray(blob)
            data[at] ^= mask
            changed.write_bytes(bytes(data))
            code, err = verify(changed, capsys)
            assert code == 1 and f"byte {start}" in err, (cls, at - start, hex(mask), err)


def test_the_real_command_names_the_record_and_its_offset(tmp_path):
    path = trace_file(tmp_path)
    blob = path.read_bytes()
    start, end = _classes(blob)["node"]
    data = bytearray(blob)
    at = blob.index(b"thinking 0", start, end)  # an edited turn: the model's text
    data[at] = ord("T")
    path.write_bytes(bytes(data))
    out = subprocess.run([sys.executable, str(REPLAY), "verify", str(path)], capture_output=True, text=True)
    assert out.returncode == 1
    assert f"byte {start}" in out.stderr and "checksum" in out.stderr, out.stderr
    # the reader keeps what stands before it and says where it stopped
    with pytest.warns(HoleWarning, match=f"byte {start}"):
        trace = read_trace(path)
    assert trace.num_turns == 0 and trace.nodes == []  # it stopped at the edited turn


@pytest.mark.parametrize("how", ["removed", "swapped", "duplicated"])
def test_a_removed_swapped_or_repeated_record_breaks_the_chain(tmp_path, capsys, how):
    """Each record alone is intact: only the chain can tell (a dropped ``call`` or ``stop``
    record changes no node index, so the structure checks never would)."""
    path = trace_file(tmp_path)
    blob = path.read_bytes()
    records = spans(blob)
    k = next(i for i, (_, _, r) in enumerate(records) if r["kind"] == "call")
    parts = [blob[s:e] for s, e, _ in records]
    if how == "removed":
        del parts[k]
    elif how == "swapped":
        parts[k - 1], parts[k] = parts[k], parts[k - 1]
    else:
        parts.insert(k, parts[k])
    path.write_bytes(b"".join(parts))
    first_bad = {"removed": records[k][0], "swapped": records[k - 1][0], "duplicated": records[k][1]}[how]
    code, err = verify(path, capsys)
    assert code == 1 and f"byte {first_bad}" in err, err


@pytest.mark.parametrize("name", ["trace-v1.msgpack", "trace-v2.msgpack", "trace-v2-last.msgpack"])
def test_older_files_carry_no_checksums_still_read_and_verify_says_so(name, capsys):
    trace = read_trace(DATA / name)
    assert trace.sealed and trace.num_turns == 3 and problems(trace) == []
    capsys.readouterr()
    assert replay_main(["verify", str(DATA / name)]) == 0
    out = capsys.readouterr()
    assert "no checksums" in out.out + out.err, out


def test_a_torn_tail_is_still_a_warning_and_the_records_before_it_stand(tmp_path, capsys):
    """A crash mid-write leaves a prefix of a record: not a change, and verify passes what
    stands (the writer's torn-record rollback and the reader's rule are unchanged)."""
    path = trace_file(tmp_path)
    blob = path.read_bytes()
    start, end = _classes(blob)["footer"]
    for cut in (start + 1, (start + end) // 2, end - 5, end - 1):
        path.write_bytes(blob[:cut])
        code, err = verify(path, capsys)
        assert code == 0 and f"torn last record at byte {start}" in err, (cut, err)


def test_the_readmes_chain_check_passes_a_written_file_and_fails_a_changed_one(tmp_path):
    from test_record_format import readme_block

    check = readme_block("And the checksum chain of a version 3 file")
    data = trace_file(tmp_path).read_bytes()
    exec(check, {"data": data})
    changed = bytearray(data)
    changed[len(data) // 2] ^= 0x01
    with pytest.raises(AssertionError, match="record at byte"):
        exec(check, {"data": bytes(changed)})

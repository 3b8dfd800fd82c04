"""The msgpack record stream: round trip, crash recovery, versions, size, the writer thread."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from interceptor.trace import (
    SCHEMA_VERSION,
    HoleWarning,
    SCHEMA_VERSION,
    Message,
    ModelCall,
    Recorder,
    ResponseError,
    Store,
    TornRecordWarning,
    TraceFormatError,
    TraceVersionError,
    Usage,
    iter_records,
    read_trace,
)
from interceptor.trace import store as store_module
from interceptor.trace.store import TraceExistsError
from interceptor.trace.verify import problems
from test_trace import Rollout, tool_turns
from waiting import wait_until

REPLAY = Path(__file__).resolve().parent.parent / "scripts" / "replay_trace.py"


def recorded(tmp_path, turns=5, name="r.msgpack"):
    r = Rollout(tmp_path / name, agent={"name": "test"}, task={"id": 7},
                config={"model": "m", "model_secret": "sk-nope", "upstream": {"api_key": "x"}})
    for prompt, reply in tool_turns(turns):
        r.send(prompt, reply, usage=Usage(input_tokens=50, output_tokens=5))
    r.recorder.record_call(ModelCall(id="boom", status=502,
                                     error=ResponseError(type="upstream", message="refused")))
    r.recorder.record_rewrite({"direction": "response", "what": "web_search", "call": "x"})
    r.recorder.record_rewrite({"what": "tool_result", "node": 3})
    r.recorder.seal("done")
    r.store.flush(timeout=10)
    return r


def test_round_trip_equals_the_in_memory_trace(tmp_path):
    r = recorded(tmp_path)
    back = read_trace(r.path)
    assert back == r.recorder.trace
    assert back.sealed and back.stop_condition == "done"
    assert back.config == {"model": "m", "upstream": {}}  # secrets never reach the file
    assert b"sk-nope" not in r.path.read_bytes()
    assert len(back.request_rewrites) == 1 and len(back.response_rewrites) == 1
    assert back.tools and back.tools[0].name == "bash"
    kinds = [rec["kind"] for _, rec in iter_records(r.path)]
    assert kinds == ["header"] + ["turn"] * 5 + ["call", "rewrite", "rewrite", "footer"]
    footer = next(rec for _, rec in iter_records(r.path) if rec["kind"] == "footer")
    assert footer["turns"] == 5 and footer["errors"] == 1
    assert r.recorder.summary() == {
        "id": "r", "turns": 5, "input_tokens": back.num_input_tokens, "output_tokens": 25,
        "calls": 6, "errors": 1, "stop_condition": "done", "sealed": True,
        "trace_path": str(r.path), "stopped_by": None, "truncated": False,
        "last_call": {"status": 502, "finish_reason": None, "error": "upstream"}}


def test_turn_records_carry_only_new_nodes(tmp_path):
    r = recorded(tmp_path, turns=4)
    turns = [rec for _, rec in iter_records(r.path) if rec["kind"] == "turn"]
    assert [len(t["nodes"]) for t in turns] == [3, 2, 2, 2]  # sys+user+reply, then tool+reply
    assert "tools" in turns[0] and all("tools" not in t for t in turns[1:])


def test_seal_is_idempotent_and_later_calls_still_land(tmp_path):
    r = recorded(tmp_path, turns=1)
    r.recorder.seal("again")
    r.recorder.record_call(ModelCall(id="late", replay_of="boom"))
    r.store.flush(timeout=10)
    back = read_trace(r.path)
    assert back.stop_condition == "done"
    assert back.calls[-1].id == "late"
    kinds = [rec["kind"] for _, rec in iter_records(r.path)]
    assert kinds.count("footer") == 1 and kinds[-1] == "replay"


@pytest.fixture(scope="module")
def sample_file(tmp_path_factory):
    r = recorded(tmp_path_factory.mktemp("torn"), turns=6)
    r.store.close()  # a module's fixture: no test's teardown stops its writer
    data = r.path.read_bytes()
    ends = [0]
    for offset, _ in iter_records(r.path):
        ends.append(offset)
    ends = ends[2:] + [len(data)]  # byte offset where each record ends
    return data, ends, r.recorder.trace


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_torn_file_keeps_every_complete_record(tmp_path_factory, sample_file, data):
    blob, ends, full = sample_file
    cut = data.draw(st.integers(0, len(blob)))
    path = tmp_path_factory.mktemp("cut") / "t.msgpack"
    path.write_bytes(blob[:cut])
    complete = [e for e in ends if e <= cut]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if not complete:
            with pytest.raises(TraceFormatError):
                read_trace(path)
            return
        trace = read_trace(path)
    torn = [w for w in caught if issubclass(w.category, TornRecordWarning)]
    if cut in ends:
        assert torn == []
    else:
        assert len(torn) == 1 and f"byte {complete[-1]}" in str(torn[0].message)
    # records fold in order: header, then one per call/rewrite/footer
    assert trace.calls == full.calls[:len(trace.calls)]
    assert trace.nodes == full.nodes[:len(trace.nodes)]
    assert problems(trace) == []


def test_a_garbled_record_in_the_middle_is_reported_with_its_offset_and_fails_verify(tmp_path):
    """Damage is not a crash: the reader keeps what precedes it, says where it is, and
    ``verify`` refuses the file (everything after the damage is lost to a trainer)."""
    r = recorded(tmp_path, turns=5)
    offsets = [offset for offset, _ in iter_records(r.path)]
    data = bytearray(r.path.read_bytes())
    data[offsets[3]] = 0xC1  # the one byte msgpack never uses: turn 3's record is garbage
    r.path.write_bytes(bytes(data))
    with pytest.warns(HoleWarning, match=f"undecodable record at byte {offsets[3]} of {len(data)}.*hole in the middle"):
        trace = read_trace(r.path)
    assert trace.num_turns == 2 and trace.calls == r.recorder.trace.calls[:2]
    verify = subprocess.run([sys.executable, str(REPLAY), "verify", str(r.path)], capture_output=True, text=True)
    assert verify.returncode == 1 and f"byte {offsets[3]}" in verify.stderr


def write_records(path, *records):
    path.write_bytes(b"".join(msgpack.packb(r, use_bin_type=True) for r in records))


def test_newer_schema_is_refused_with_a_clear_message(tmp_path):
    path = tmp_path / "new.msgpack"
    write_records(path, {"kind": "header", "schema_version": SCHEMA_VERSION + 1, "id": "x"})
    with pytest.raises(TraceVersionError, match=f"schema version {SCHEMA_VERSION + 1}.*Upgrade llm-interceptor"):
        read_trace(path)


def test_reads_a_version_1_file_written_by_hand(tmp_path):
    """The format as docs/record-format.md documents it, written without our writer."""
    path = tmp_path / "v1.msgpack"
    write_records(
        path,
        {"kind": "header", "schema_version": 1, "id": "h", "started_at": 1.0},
        {"kind": "turn", "nodes": [
            {"i": 0, "message": {"role": "user", "content": "hi"}, "token_ids": [1, 2]},
            {"i": 1, "parent": 0, "message": {"role": "assistant", "content": "yo"},
             "sampled": True, "token_ids": [3], "logprobs": [-0.1]}],
         "call": {"id": "c1", "node": 1, "usage": {"input_tokens": 2, "output_tokens": 1}}},
        {"kind": "some_future_kind", "x": 1},
        {"kind": "footer", "stop_condition": "done"},
    )
    trace = read_trace(path)
    (b,) = trace.branches
    assert b.token_ids == [1, 2, 3] and b.sampled_mask == [False, False, True]
    assert b.logprobs == [0.0, 0.0, -0.1]
    assert trace.num_turns == 1 and trace.sealed


def test_broken_files_say_what_is_wrong(tmp_path):
    path = tmp_path / "b.msgpack"
    write_records(path, {"kind": "turn", "nodes": [], "call": {"id": "c"}})
    with pytest.raises(TraceFormatError, match="before the header"):
        read_trace(path)
    write_records(path, {"kind": "header", "schema_version": 1, "id": "x"},
                  {"kind": "turn", "nodes": [{"i": 5, "message": {"role": "user"}}],
                   "call": {"id": "c"}})
    with pytest.raises(TraceFormatError, match="out of sequence"):
        read_trace(path)


def test_a_reused_path_is_refused_and_the_old_trace_stays_as_it_was(tmp_path):
    """(tests/test_trace_never_overwritten.py has the proxy's side of it.)"""
    first = recorded(tmp_path, turns=1)
    before = first.path.read_bytes()
    store = Store()
    with pytest.raises(TraceExistsError, match="exists already"):
        Recorder(first.path, {"id": "r"}, store=store)
    store.flush(timeout=10)
    assert first.path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["r.msgpack"]


@pytest.mark.parametrize("policy,expected", [("never", 0), ("seal", 1), ("turn", 4)])
def test_fsync_policy(tmp_path, monkeypatch, policy, expected):
    synced = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd))
    r = Rollout(tmp_path / "f.msgpack", fsync=policy)
    r.store.flush(timeout=10)  # the header on its own batch
    for prompt, reply in tool_turns(2):
        r.send(prompt, reply)
        r.store.flush(timeout=10)
    r.recorder.seal()
    r.store.flush(timeout=10)
    assert len(synced) == expected


def _watch_fsyncs(monkeypatch, fail_first: int = 0) -> list[tuple[float, int]]:
    """Each fsync's time and the size of the file it covered; the first ``fail_first`` raise
    EIO (a disk that could not take what was written)."""
    seen: list[tuple[float, int]] = []
    real = os.fsync

    def fsync(fd):
        if len(seen) < fail_first:
            seen.append((time.monotonic(), -1))
            raise OSError(5, "Input/output error")
        real(fd)
        seen.append((time.monotonic(), os.fstat(fd).st_size))

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def test_turn_fsyncs_are_grouped_and_none_waits_longer_than_the_interval(tmp_path, monkeypatch):
    """40 turns in quick succession ask for 41 fsyncs (the header's too); the writer does one
    per interval per file, and the last one, without any flush, covers the whole file within
    the interval of the last write (plus the writer's own wake-up)."""
    seen = _watch_fsyncs(monkeypatch)
    store = Store(fsync_interval=0.2)
    r = Rollout(tmp_path / "g.msgpack", store=store)
    t0 = time.monotonic()
    for prompt, reply in tool_turns(40):
        r.send(prompt, reply)
        time.sleep(0.005)
    written = time.monotonic()
    wait_until(lambda: seen and seen[-1][1] == r.path.stat().st_size, 5, lambda: f"an fsync of the whole file in {seen}")
    # Well under the writer's idle wake-up (RETRY_INTERVAL, 1 s), which alone would also get
    # there; the margin is for a loaded machine.
    assert seen[-1][0] - written < 0.2 + 0.5
    assert 1 <= len(seen) <= (written - t0) / 0.2 + 2, seen  # ~0.3 s of writing: a few, not 41
    sealed_whole(r, store, turns=40)


def test_an_interval_of_0_fsyncs_after_each_write(tmp_path, monkeypatch):
    seen = _watch_fsyncs(monkeypatch)
    store = Store(fsync_interval=0)
    r = Rollout(tmp_path / "z.msgpack", store=store)
    wait_until(lambda: seen, 5, "the header's fsync")  # the header alone
    for prompt, reply in tool_turns(3):
        before = len(seen)
        r.send(prompt, reply)
        wait_until(lambda: len(seen) > before, 5, "this turn's fsync")
        assert len(seen) == before + 1 and seen[-1][1] == r.path.stat().st_size  # this turn's, at once
    assert len(seen) == 4  # the header and each turn, each on its own write
    sealed_whole(r, store, turns=3)


def test_the_footer_is_fsynced_at_once_whatever_the_interval(tmp_path, monkeypatch):
    """A DELETE's orchestrator reads the sealed file next: its fsync does not wait out the
    window (and takes the turns still pending with it)."""
    seen = _watch_fsyncs(monkeypatch)
    store = Store(fsync_interval=30)
    r = Rollout(tmp_path / "f.msgpack", store=store)
    for prompt, reply in tool_turns(3):
        r.send(prompt, reply)
    r.recorder.seal("done")
    wait_until(lambda: seen, 5, "the footer's fsync")
    assert len(seen) == 1 and seen[0][1] == r.path.stat().st_size
    assert read_trace(r.path).num_turns == 3
    store.close()


def test_a_failed_fsync_writes_everything_since_the_last_one_again(tmp_path, monkeypatch):
    """EIO from fsync means the disk may not hold what was written since the last good one:
    the file goes back to that offset, those records are held and written again in order, and
    the trace ends whole, as after a failed write."""
    monkeypatch.setattr(store_module, "RETRY_INTERVAL", 0.05)
    seen = _watch_fsyncs(monkeypatch, fail_first=1)
    # A window no test waits out: the one fsync is the flush's, over the header and two turns
    # whatever the writer's batches were (a short window raced the first, slow, commits).
    store = Store(fsync_interval=30)
    r = Rollout(tmp_path / "e.msgpack", store=store)
    for prompt, reply in tool_turns(2):
        r.send(prompt, reply)
    store.flush(timeout=10)
    assert [size for _, size in seen] == [-1]
    health = store.health(r.path)
    assert health.held == 3 and "Input/output error" in health.error
    for prompt, reply in tool_turns(4)[2:]:
        r.send(prompt, reply)
    wait_until(lambda: store.health(r.path).ok, 5, "the file healthy again (the writer retries on its own)")
    assert store.health(r.path).late == 3  # the header and both turns
    assert "Input/output error" in store.errors[r.path]
    sealed_whole(r, store, turns=4)
    kinds = [record["kind"] for _, record in iter_records(r.path)]
    assert kinds.count("header") == 1 and kinds.count("turn") == 4  # written again, not twice


def test_a_failing_file_does_not_stop_other_sessions(tmp_path):
    store = Store()
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    bad = Recorder(blocker / "x.msgpack", {"id": "x"}, store=store)
    good = Rollout(tmp_path / "g.msgpack", store=store)
    for prompt, reply in tool_turns(2):
        good.send(prompt, reply)
    good.recorder.seal()
    store.flush(timeout=10)
    assert "store_error" in bad.summary()
    assert read_trace(good.path).num_turns == 2
    store.close()


def sealed_whole(r: Rollout, store: Store, turns: int) -> None:
    """Seal, drain and close: the file holds every turn and verifies."""
    r.recorder.seal()
    store.flush(timeout=10)
    trace = read_trace(r.path)
    assert trace.num_turns == turns and problems(trace) == []
    store.close()


def test_a_bug_in_a_write_holds_the_records_and_the_writer_carries_on(tmp_path, monkeypatch):
    """Not only the disk's OSError: any error while writing a file (a bug, a hook) holds that
    file's records and retries, as a full disk does. It once ended the writer thread, and then
    every flush (a DELETE's) waited for a writer that was gone, and health said ok."""
    monkeypatch.setattr(store_module, "RETRY_INTERVAL", 0.05)
    write_all, failing = store_module._write_all, [True]

    def buggy(fd, data):
        if failing[0]:
            raise ValueError("a bug in the writer")
        write_all(fd, data)

    monkeypatch.setattr(store_module, "_write_all", buggy)
    store = Store()
    r = Rollout(tmp_path / "b.msgpack", store=store)
    r.send(*tool_turns(1)[0])
    store.flush(timeout=10)  # answers: the barrier is set whatever the write did
    health = store.health(r.path)
    assert health.held >= 1 and "ValueError: a bug in the writer" in health.error
    assert store.stopped is None
    failing[0] = False
    wait_until(lambda: store.health(r.path).ok, 10, "the file healthy again (the writer retries on its own)")
    assert store.health(r.path).late >= 1
    sealed_whole(r, store, turns=1)


def test_a_writer_that_died_fails_flush_at_once_and_the_next_append_restarts_it(tmp_path, monkeypatch):
    """Whatever ends the thread (here an error outside any file's write), a flush says so at
    once instead of waiting out its timeout, ``stopped`` names the error for health, and the
    next record starts a new writer."""
    store = Store()
    r = Rollout(tmp_path / "d.msgpack", store=store)
    store.flush(timeout=10)
    batch = store._write_batch

    def dies(items):
        raise SystemExit("the writer is gone")

    monkeypatch.setattr(store, "_write_batch", dies)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="stopped before it drained: SystemExit: the writer is gone"):
        store.flush(timeout=30)  # its barrier is what the writer dies on
    assert time.monotonic() - t0 < 5
    assert "the writer is gone" in store.stopped
    store._start = lambda: None  # the loop's wait too, before anything restarts the writer
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="stopped before it drained"):
        asyncio.run(store.drained(30))
    assert time.monotonic() - t0 < 5
    del store._start
    monkeypatch.setattr(store, "_write_batch", batch)
    r.send(*tool_turns(1)[0])
    asyncio.run(store.drained(10))
    assert store.stopped is None
    sealed_whole(r, store, turns=1)


def test_a_write_that_takes_too_long_is_reported_as_stalled(tmp_path, monkeypatch):
    """A disk that sits on one fsync holds every session's records behind it: ``trouble``
    says which file and for how long while it lasts (health answers 503 with it), and
    nothing once the write is through."""
    monkeypatch.setattr(store_module, "STALL_SECONDS", 0.2)
    release = threading.Event()
    write_all = store_module._write_all

    def slow(fd, data):
        release.wait(10)
        write_all(fd, data)

    monkeypatch.setattr(store_module, "_write_all", slow)
    store = Store()
    r = Rollout(tmp_path / "s.msgpack", store=store)
    assert store.trouble is None
    assert f"writing {r.path} for" in wait_until(lambda: store.trouble, 5, "the stalled write reported")
    release.set()
    store.flush(timeout=10)
    assert store.trouble is None
    store.close()


def _writer_held(monkeypatch, store: Store) -> threading.Event:
    """Make ``store``'s writer thread wait, before its next batch, until the event is set."""
    release = threading.Event()
    batch = store._write_batch

    def held(items):
        release.wait(5)
        return batch(items)

    monkeypatch.setattr(store, "_write_batch", held)
    return release


def test_records_of_an_open_healthy_file_are_written_where_they_are_made(tmp_path, monkeypatch):
    """Handing each record to the writer thread costs CPU on every request, so once the
    thread has opened the file the producer writes each turn itself: with the thread held,
    every turn is on the file when ``append`` returns; the footer still goes through the
    thread (it is fsynced at once), and with ``write_on_loop`` off every record waits for the
    thread again."""
    store = Store()
    r = Rollout(tmp_path / "i.msgpack", store=store)
    store.flush(timeout=10)  # the header: the thread opens the file
    release = _writer_held(monkeypatch, store)
    for k, (prompt, reply) in enumerate(tool_turns(3)):
        before = r.path.stat().st_size
        r.send(prompt, reply)
        assert r.path.stat().st_size > before, k
    assert read_trace(r.path).num_turns == 3
    size = r.path.stat().st_size
    r.recorder.seal("done")
    time.sleep(0.1)
    assert r.path.stat().st_size == size  # the footer waits for the held thread
    release.set()
    sealed_whole(r, store, turns=3)

    off = Store(write_on_loop=False)
    r = Rollout(tmp_path / "t.msgpack", store=off)
    off.flush(timeout=10)
    release = _writer_held(monkeypatch, off)
    size = r.path.stat().st_size
    r.send(*tool_turns(1)[0])
    time.sleep(0.1)
    assert r.path.stat().st_size == size  # the turn waits for the held thread
    release.set()
    sealed_whole(r, off, turns=1)


def _producer_writes(monkeypatch, path: Path, instead) -> tuple[Store, Rollout]:
    """A store whose writes on this thread (the producer's) go through ``instead(fd, data,
    write_all)``, and a rollout on it whose header the writer thread has written."""
    write_all = store_module._write_all
    main = threading.current_thread()

    def patched(fd, data):
        if threading.current_thread() is main:
            return instead(fd, data, write_all)
        return write_all(fd, data)

    monkeypatch.setattr(store_module, "_write_all", patched)
    store = Store()
    r = Rollout(path, store=store)
    store.flush(timeout=10)
    return store, r


def test_a_slow_write_hands_every_later_record_to_the_thread(tmp_path, monkeypatch, caplog):
    """A write that takes longer than ``SLOW_WRITE_SECONDS`` (dirty-page throttling, a network
    filesystem) must not happen on the event loop again: the store turns ``write_on_loop``
    off, says so once, and the trace is whole, in order."""
    monkeypatch.setattr(store_module, "SLOW_WRITE_SECONDS", 0.02)

    def slow(fd, data, write_all):
        time.sleep(0.05)
        write_all(fd, data)

    store, r = _producer_writes(monkeypatch, tmp_path / "s.msgpack", slow)
    turns = tool_turns(4)
    r.send(*turns[0])  # written here, slowly
    assert store.write_on_loop is False
    release = _writer_held(monkeypatch, store)
    size = r.path.stat().st_size
    for prompt, reply in turns[1:]:
        r.send(prompt, reply)
    time.sleep(0.1)
    assert r.path.stat().st_size == size  # the thread's now, and it is held
    release.set()
    sealed_whole(r, store, turns=4)
    assert sum(store_module.FELL_BACK in m for m in caplog.messages) == 1


def test_a_write_that_fails_part_way_where_it_was_made_is_cut_back_and_written_again(tmp_path, monkeypatch):
    """The producer's write puts half a record down and fails (a full disk): the thread cuts
    the file back to its last complete record, writes that record again and every later one
    in order; no half record stays in the middle, and later turns are the producer's again."""
    failures = []

    def half_once(fd, data, write_all):
        if failures:
            return write_all(fd, data)
        failures.append(len(data))
        os.write(fd, data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    store, r = _producer_writes(monkeypatch, tmp_path / "h.msgpack", half_once)
    turns = tool_turns(5)
    r.send(*turns[0])
    r.send(*turns[1])  # fails half-way; queued
    assert failures
    store.flush(timeout=10)
    release = _writer_held(monkeypatch, store)
    size = r.path.stat().st_size
    for prompt, reply in turns[2:]:
        r.send(prompt, reply)
    assert r.path.stat().st_size > size  # written where made again
    release.set()
    sealed_whole(r, store, turns=5)
    kinds = [record["kind"] for _, record in iter_records(r.path)]
    assert kinds.count("turn") == 5


def test_fsyncs_that_fail_while_the_producer_writes_lose_and_repeat_nothing(tmp_path, monkeypatch):
    """The thread fsyncs a file the producer goes on writing; every other fsync fails (EIO),
    so the file goes back to its last good fsync again and again, with records the producer
    wrote during the failed fsync among those held. 200 turns later the trace holds each turn
    once, in order, and verifies."""
    monkeypatch.setattr(store_module, "RETRY_INTERVAL", 0.01)
    real = os.fsync
    calls = [0]

    def flaky(fd):
        calls[0] += 1
        time.sleep(0.002)  # long enough for the producer to write meanwhile
        if calls[0] % 2:
            raise OSError(5, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", flaky)
    store = Store(fsync_interval=0.003)
    r = Rollout(tmp_path / "f.msgpack", store=store)
    store.flush(timeout=10)
    for prompt, reply in tool_turns(200):
        r.send(prompt, reply)
    store.flush(timeout=20)
    calls[0] = 0
    monkeypatch.setattr(os, "fsync", real)
    assert store.health(r.path).late > 0  # some records were held and written again
    sealed_whole(r, store, turns=200)
    kinds = [record["kind"] for _, record in iter_records(r.path)]
    assert kinds.count("turn") == 200 and kinds.count("header") == 1


def test_close_drains_and_a_later_append_restarts(tmp_path):
    store = Store()
    r = Rollout(tmp_path / "c.msgpack", store=store)
    store.close()
    assert read_trace(r.path).id == "c"
    r.send(*tool_turns(1)[0])
    store.flush(timeout=10)
    assert read_trace(r.path).num_turns == 1


def test_300_turns_of_a_2mb_conversation_stay_near_2mb(tmp_path):
    """Each turn restates everything: a raw request log would be ~300 MB."""
    r = Rollout(tmp_path / "big.msgpack", fsync="never")
    chunk = "x" * 3400
    history = [Message(role="system", content="s"), Message(role="user", content="go")]
    sizes = []
    for k in range(300):
        reply = Message(role="assistant", content=f"{k} {chunk}")
        r.send(history, reply, usage=Usage(input_tokens=1, output_tokens=1))
        history = history + [reply, Message(role="user", content=f"{k} {chunk}")]
        if k % 50 == 49:
            r.store.flush(timeout=30)
            sizes.append(r.path.stat().st_size)
    final_request = sum(len(m.text()) for m in history)
    assert final_request > 2_000_000
    size = r.path.stat().st_size
    assert size < 1.5 * final_request, (size, final_request)
    steps = [b - a for a, b in zip(sizes, sizes[1:])]
    assert max(steps) < 1.2 * min(steps)  # linear growth: flat cost per turn
    assert read_trace(r.path).num_turns == 300


def test_many_sessions_share_a_bounded_number_of_open_files(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "MAX_OPEN_FILES", 3)
    store = Store()
    rollouts = [Rollout(tmp_path / f"s{k}.msgpack", store=store) for k in range(8)]
    for prompt, reply in tool_turns(3):
        for r in rollouts:
            r.send(prompt, reply)
    store.flush(timeout=10)
    assert len(store._files) <= 3
    assert all(read_trace(r.path).num_turns == 3 for r in rollouts)
    store.close()


KILLED_WRITER = r"""
import sys, pathlib
sys.path.insert(0, sys.argv[2])
from test_trace import Rollout, tool_turns
r = Rollout(pathlib.Path(sys.argv[1]), fsync="never")
for k, (prompt, reply) in enumerate(tool_turns(1000)):
    r.send(prompt, reply)
    if k < 5:
        r.store.flush(timeout=10)
        print(k, flush=True)
"""


def test_kill_9_loses_at_most_what_was_in_flight(tmp_path):
    """The writer flushes to the OS after each batch, so a SIGKILL (no atexit, no fsync)
    keeps every flushed turn; the kill usually lands mid-write of the burst after them."""
    path = tmp_path / "k.msgpack"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path),
                             str(Path(__file__).parent)], stdout=subprocess.PIPE, text=True)
    for _ in range(5):
        proc.stdout.readline()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace = read_trace(path)
    assert trace.num_turns >= 5
    assert len([w for w in caught if issubclass(w.category, TornRecordWarning)]) <= 1
    assert problems(trace) == []


def test_forgetting_a_file_drops_its_account_and_the_writer_still_writes_what_it_holds(tmp_path, monkeypatch):
    """``Store.forget`` (a session dropped from memory): the file's account goes, also while
    the writer still holds records of it for a disk that failed; once the disk takes them,
    they are written whole."""
    monkeypatch.setattr(store_module, "RETRY_INTERVAL", 0.05)
    store = Store()
    blocker = tmp_path / "not-yet-a-dir"
    blocker.write_text("")
    held = Recorder(blocker / "x.msgpack", {"id": "x"}, store=store)
    good = Rollout(tmp_path / "g.msgpack", store=store)
    good.recorder.seal()
    store.flush(timeout=10)
    assert not store.health(held.path).ok
    for path in (held.path, good.path):
        store.forget(path)
        assert path not in store._health and path not in store.errors
    blocker.unlink()
    blocker.mkdir()
    held.seal("done")
    store.flush(timeout=10)
    assert read_trace(held.path).stop_condition == "done"
    store.close()

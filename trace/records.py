"""The on-disk record format (schema version 4) and the fold that turns records into a Trace.

A trace file is a plain concatenation of msgpack maps, each with a ``kind`` first and, since
version 3, an ``xxh3`` last: a checksum that chains the record to the one before it (below), so a
changed byte is found, not only a broken structure. The kinds:

- ``header``  first record: schema_version, producer, producer_version, id, started_at,
              agent, task, info, config (secrets removed)
- ``turn``    nodes (the new nodes only, each with its index ``i``), call (the ModelCall,
              whose ``tool_set`` names the tools it advertised), tools (a tool set advertised
              for the first time: it becomes ``tool_sets[len(tool_sets)]``)
- ``call``    call: an exchange that committed no node (an error, a refusal)
- ``prompt``  nodes, call: a request answered without the model (a stopped rollout's
              refusal): its new messages as prompt nodes, the call without a ``node``
- ``replay``  call: a flagged retry answered from the record (``replay_of`` set)
- ``stop``    stop: why the rollout ends (condition, by, call, at); the first one counts
- ``metric``  name, value: measured by a hook during the rollout (folded into metrics)
- ``rewrite`` rewrite: what a boundary hook changed (``direction`` request or response)
- ``state``   state: one accepted write of the task state (version, by, op, size, digest,
              the value when small); the session's initial state is version 0
- ``tool``    tool: one call of the tool route (phase, tool call id, action, hooks, digest,
              the reported content when small, what was delivered)
- ``egress``  egress: a connection the network policy refused (host, port, count so far)
- ``version`` version: the weights version of the session's upstream, declared by the
              orchestrator (upstream, version, at); calls after it carry it (version 4)
- ``undelivered`` call (an id): that call's answer did not reach the harness whole; written
              when the harness went away after the call was recorded (its ``delivered``
              becomes false)
- ``footer``  stop_condition, stopped_by, truncated, ended_at, totals, timing, the task
              state's final state_version and state_digest, and what the evaluator sent at
              the seal (reward, rewards, metrics, info); written when the session is sealed

Models are dumped with defaults left out, so a reader fills in the defaults of the schema
version named in the header. Nodes omit ``mask`` when it is just ``sampled`` repeated.
This module is the one place that knows the format; README "Trace file format" mirrors it.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Iterator

import msgpack
import xxhash
from pydantic import ValidationError

from interceptor.trace.messages import Tool
from interceptor.trace.model import (
    MIN_SCHEMA_VERSION,
    SCHEMA_VERSION,
    Header,
    MessageNode,
    ModelCall,
    Rewrite,
    Reward,
    EgressRefusal,
    ToolDecision,
    StateWrite,
    StopRecord,
    Timing,
    Trace,
    VersionChange,
)
from interceptor.trace.shared import shared


# An integer beyond msgpack's 64 bits is written as this extension type holding its decimal
# digits (trace/store.py) and read back as the same int: lossless, documented in the README.
BIG_INT_EXT = 1


def ext_hook(code: int, data: bytes) -> Any:
    if code == BIG_INT_EXT:
        return int(data)
    return msgpack.ExtType(code, data)


class TraceFormatError(ValueError):
    """The file is not a trace this reader can fold (no header, broken graph links)."""


class TraceVersionError(TraceFormatError):
    """The file was written by a newer schema than this reader knows."""


class TornRecordWarning(UserWarning):
    """The file ends in an incomplete record (a crash mid-write); it was skipped."""


# --- encoding ------------------------------------------------------------------------------

def node_record(index: int, node: MessageNode) -> dict[str, Any]:
    data = node.model_dump(exclude_defaults=True)
    if node.mask is not None and node.token_ids is not None \
            and node.mask == [node.sampled] * len(node.token_ids):
        data.pop("mask", None)
    data["i"] = index
    return data


def call_record(call: ModelCall) -> dict[str, Any]:
    return call.model_dump(exclude_defaults=True)


# --- decoding ------------------------------------------------------------------------------

class HoleWarning(TornRecordWarning):
    """An undecodable record with readable records after it: not a torn tail but a hole in
    the middle of the file (a write failure that was not rolled back). ``verify`` fails on it."""


# Every record kind, in the module docstring's order (a hole is told from a torn tail by any of them).
RECORD_KINDS = ("header", "turn", "call", "prompt", "replay", "metric", "stop", "rewrite", "state", "egress", "version",
                "tool", "undelivered", "footer")
KINDS = frozenset(RECORD_KINDS)
_KIND_KEY = b"\xa4kind"  # every record is a map whose first key is "kind"


class ChecksumWarning(HoleWarning):
    """A record whose bytes changed after the writer wrote them: its checksum does not hold
    (the record, or the chain: one removed, repeated or moved), it carries none in a file
    whose records all do, or it cannot be read where a crash could not have cut it. ``verify``
    fails on it; the reader keeps what precedes it, as for a hole."""


# --- the checksum chain (schema version 3) ---------------------------------------------------
# Every record's last entry is "xxh3", a uint64 always in its nine-byte form, so a record ends
# in TRAILER and the checksum's eight bytes, big-endian. The checksum is XXH3-64 of the record's
# bytes but those eight, seeded with the checksum of the record before it (0 for the header):
# each record is chained to all before it, so a changed byte, or a record removed, repeated or
# moved, fails at that record (a change goes unseen one time in 2^64). XXH3-64 rather than
# CRC-32: several times faster than zlib's, on every record the producer writes, and its
# seed is the chain (libraries: C xxhash.h XXH3_64bits_withSeed, Go zeebo/xxh3, Rust
# xxhash-rust, Java zero-allocation-hashing). It guards against accidents (a disk, a copy, an
# edit by hand), not against someone who recomputes the chain: it is not signed.
CHECKSUM_KEY = "xxh3"
TRAILER = b"\xa4xxh3\xcf"  # fixstr "xxh3", then the uint64 marker
DIGEST_BYTES = 8
TRAILER_BYTES = len(TRAILER) + DIGEST_BYTES
PLACEHOLDER = 0xFFFFFFFFFFFFFFFF  # what the writer packs first: always nine bytes, then overwritten
CHECKSUMS_SINCE = 3  # the schema version from which every record carries one
# The largest record the writer writes (trace/store.py refuses a bigger one: its commit fails):
# the readers take any record up to twice this in one piece (msgpack's Unpacker, with
# max_buffer_size=0, holds up to 2**31 - 1 bytes), so whatever the writer wrote, they read.
MAX_RECORD_BYTES = 1 << 30
READ_CHUNK = 1 << 20  # what a reader reads at a time: memory is one record plus this


def chain(raw: bytes | memoryview, prev: int) -> int:
    """The checksum a record of bytes ``raw`` (its trailer included) carries after a record
    whose checksum was ``prev``."""
    return xxhash.xxh3_64_intdigest(memoryview(raw)[:-DIGEST_BYTES], seed=prev)


def seal_record(data: bytes, prev: int) -> bytes:
    """A record packed with ``PLACEHOLDER`` as its last value, with its checksum in place."""
    if data[-TRAILER_BYTES:-DIGEST_BYTES] != TRAILER:
        raise ValueError(f"a trace record must end in its {CHECKSUM_KEY!r} entry (a record of "
                         f"its own with that key?)")
    return data[:-DIGEST_BYTES] + chain(data, prev).to_bytes(DIGEST_BYTES, "big")


def _near_trailer(tail: bytes) -> bool:
    """An incomplete last record that ends as a whole record does (its trailer, one byte off
    at most) was cut by a change to a length or type byte, not by a crash: a crash leaves the
    beginning of a record, which ends in its trailer only where the trailer's bytes happen to
    appear inside a value exactly where the write stopped."""
    end = tail[-TRAILER_BYTES:-DIGEST_BYTES]
    return len(tail) >= TRAILER_BYTES and sum(a != b for a, b in zip(end, TRAILER)) <= 1


class BadRecord(Exception):
    """The record at ``offset`` is not one the writer wrote (``RecordReader.read``)."""

    def __init__(self, offset: int, why: str, undecodable: bool = False) -> None:
        super().__init__(why)
        self.offset, self.why, self.undecodable = offset, why, undecodable


class RecordReader:
    """One trace file's records, read in order as the file grows, each checked against the
    chain (``checked``: from the header on, when the file carries checksums). ``offset`` is the
    end of the last complete record read; a later ``read`` goes on from there. Memory is one
    record and ``READ_CHUNK``, whatever the file's size."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.offset = 0
        self.prev = 0
        self.checked: bool | None = None  # None: the header was not read yet
        self.records = 0

    def read(self) -> Iterator[tuple[int, Any]]:
        """Yield ``(offset, record)`` for each complete record after ``offset`` (its checksum
        entry taken out); raise ``BadRecord`` at one that is not as written. Stops at the end
        of the last complete record: what follows is a record being written, or torn."""
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=0, strict_map_key=False, ext_hook=ext_hook)
        buf = bytearray()  # the bytes fed and not yet a whole record: buf[0] is at ``offset``
        base = self.offset  # where ``unpacker.tell()`` counts from
        with open(self.path, "rb") as f:
            f.seek(base)
            while True:
                start = self.offset
                try:
                    value = unpacker.unpack()
                except msgpack.OutOfData:
                    chunk = f.read(READ_CHUNK)
                    if not chunk:
                        return
                    unpacker.feed(chunk)
                    buf += chunk
                    continue
                except (ValueError, msgpack.UnpackException, TypeError) as e:
                    raise BadRecord(start, str(e), undecodable=True) from None
                size = base + unpacker.tell() - start
                with memoryview(buf) as view:
                    self._check(start, view[:size], value)
                del buf[:size]
                self.offset = start + size
                self.records += 1
                yield start, value

    def _check(self, start: int, raw: memoryview, value: Any) -> None:
        sealed = raw[-TRAILER_BYTES:-DIGEST_BYTES] == TRAILER and isinstance(value, dict) and CHECKSUM_KEY in value
        if self.checked is None:
            version = value.get("schema_version") if isinstance(value, dict) else None
            # (a newer version than this reader's may frame its records otherwise: the fold
            # refuses it by its version, not here)
            self.checked = sealed or (isinstance(version, int) and CHECKSUMS_SINCE <= version <= SCHEMA_VERSION)
        if not self.checked:
            # A header without a checksum is trusted only once the record after it reads as one
            # of its version (``iter_records`` holds it back till then): a changed byte can turn
            # a version-3 header into one that seems older, or end it early.
            if sealed:
                raise BadRecord(0, f"the header at byte 0 carries no checksum, yet the record at byte "
                                   f"{start} does, as every record after a version-3 header")
            if self.records == 1 and not (isinstance(value, dict) and "kind" in value):
                raise BadRecord(0, f"the header at byte 0 is followed by bytes that are no record "
                                   f"(at byte {start}): a length or count in the header was changed")
            return
        if not sealed:
            raise BadRecord(start, f"the record at byte {start} carries no checksum, as every record of "
                                   f"this file must")
        digest = chain(raw, self.prev)
        stored = value.pop(CHECKSUM_KEY)
        if stored != digest:
            raise BadRecord(start, f"the record at byte {start} fails its checksum (it carries "
                                   f"{stored:016x}, its bytes and the records before it make {digest:016x})")
        self.prev = digest


def _report(path: Path, bad: BadRecord, size: int) -> None:
    """Warn about a record that is not as written, once, with its offset: a hole in the middle
    (``HoleWarning``) if a complete record follows an undecodable one, else a changed record."""
    offset = bad.offset
    cls, text = ChecksumWarning, f"{bad.why}: changed after it was written"
    if bad.undecodable:
        with open(path, "rb") as f:
            f.seek(offset)
            after = _next_record(f.read(), 0)
        if after is not None:
            cls, text = HoleWarning, (f"undecodable record at byte {offset} of {size} ({bad.why}), yet a "
                                      f"complete record follows at byte {offset + after}: the file has a "
                                      f"hole in the middle")
        else:
            text = (f"undecodable last record at byte {offset} of {size} ({bad.why}): a crash leaves the "
                    f"beginning of a record, never bytes msgpack cannot read, so it was changed")
    warnings.warn(cls(f"{path}: {text}; everything from byte {offset} on was skipped"), stacklevel=4)


def _next_record(data: bytes, start: int) -> int | None:
    """The offset of the first complete record in ``data`` after ``start``, if any."""
    at = data.find(_KIND_KEY, start + 1)
    while at != -1:
        for begin in (at - 1, at - 3):  # a fixmap or a map16 header before the first key
            if begin > start and (0x80 <= data[begin] <= 0x8F or data[begin] == 0xDE):
                try:
                    rec = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=0, ext_hook=ext_hook)
                    rec.feed(data[begin:])
                    value = rec.unpack()
                except Exception:  # noqa: BLE001 - not a record start
                    continue
                if isinstance(value, dict) and value.get("kind") in KINDS:
                    return begin
        at = data.find(_KIND_KEY, at + 1)
    return None


def iter_records(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(byte offset, record)``, each record's checksum checked (and taken out) where
    the file carries them. A torn tail (a crash mid-write) is warned about once with its
    offset (``TornRecordWarning``) and ends the iteration, so every complete record before it
    stands; a record that was changed after it was written (``ChecksumWarning``) or a hole in
    the middle (``HoleWarning``) ends it the same way, and ``verify`` fails on either."""
    path = Path(path)
    reader = RecordReader(path)
    size = path.stat().st_size
    try:
        held = None  # a header without a checksum waits for the record after it (``_check``)
        for item in reader.read():
            if held is not None:
                yield held
                held = None
            if reader.records == 1 and not reader.checked:
                held = item
                continue
            yield item
        if held is not None:
            yield held
    except BadRecord as bad:
        _report(path, bad, size)
        return
    offset = reader.offset
    if offset < size:
        with open(path, "rb") as f:
            f.seek(max(offset, size - TRAILER_BYTES))
            end = f.read()
        if reader.checked and _near_trailer(end):
            _report(path, BadRecord(offset, f"the record at byte {offset} is incomplete, yet it ends as a "
                                            f"whole record does (in its checksum): a length or type byte "
                                            f"was changed, not a write cut by a crash"), size)
        else:
            warnings.warn(TornRecordWarning(
                f"{path}: torn last record at byte {offset} of {size} (incomplete; {size - offset} "
                f"bytes, a crash mid-write?); skipped, everything before it stands"), stacklevel=2)


def node_from_record(data: dict[str, Any]) -> tuple[int, MessageNode]:
    """A ``turn`` record's node entry: its index and the node (``mask`` filled back in)."""
    data = dict(data)
    index = data.pop("i")
    node = MessageNode.model_validate(data)
    shared(node.token_ids)  # a trainer holds many traces' ids at once: one object per value
    if node.mask is None and node.token_ids is not None:
        node.mask = [node.sampled] * len(node.token_ids)
    return index, node


def _upgrade(record: dict[str, Any], version: int) -> dict[str, Any]:
    """Bring a record of an older supported schema version to the current shape. Version 2
    only added record kinds and footer fields, and version 3 the checksum (taken out by the
    reader), and version 4 only fields and a record kind, so a version 1 record is already in
    shape."""
    return record


def _v1_tool_set(trace: Trace, tools: list[Tool]) -> int | None:
    """Version 1 kept no per-call tool set, but wrote a turn's tools whenever they changed,
    so the set each turn advertised is the last one written before it."""
    index = trace.tool_set_index(tools)
    if index is None and tools:
        index = len(trace.tool_sets)
        trace.tool_sets.append(tools)
    return index


def fold(records: Iterator[tuple[int, dict[str, Any]]], source: str = "trace") -> Trace:
    """Fold records into a Trace. Unknown kinds are skipped (forward compatible additions
    within a version); a record before the header, a newer schema or a node out of
    sequence is an error."""
    trace: Trace | None = None
    version = SCHEMA_VERSION
    v1_tools: list[Tool] = []  # version 1 wrote a turn's tools when they differed from the last
    for offset, rec in records:
        if not isinstance(rec, dict) or "kind" not in rec:
            raise TraceFormatError(f"{source}: byte {offset}: not a trace record")
        kind = rec["kind"]
        if kind == "header":
            if trace is not None:
                raise TraceFormatError(
                    f"{source}: byte {offset}: a second header; one file holds one trace")
            version = rec.get("schema_version", 0)
            if not isinstance(version, int) or version > SCHEMA_VERSION:
                raise TraceVersionError(
                    f"{source} was written with trace schema version {version}; this "
                    f"llm-interceptor reads versions {MIN_SCHEMA_VERSION}..{SCHEMA_VERSION}. "
                    f"Upgrade llm-interceptor to read it.")
            if version < MIN_SCHEMA_VERSION:
                raise TraceVersionError(
                    f"{source} uses trace schema version {version}, older than the oldest "
                    f"this reader supports ({MIN_SCHEMA_VERSION}); read it with an older "
                    f"llm-interceptor and re-export.")
            try:
                header = Header.model_validate({k: v for k, v in rec.items() if k != "kind"})
            except ValidationError as e:
                raise TraceFormatError(f"{source}: byte {offset}: not a header this reader knows: "
                                       f"{e.errors()[0]['loc']}: {e.errors()[0]['msg']}") from e
            trace = Trace(**header.model_dump())
            continue
        if trace is None:
            raise TraceFormatError(f"{source}: byte {offset}: {kind!r} record before the header")
        rec = _upgrade(rec, version)
        if kind in ("turn", "prompt"):
            for data in rec.get("nodes", []):
                index, node = node_from_record(data)
                if index != len(trace.nodes):
                    raise TraceFormatError(
                        f"{source}: byte {offset}: node {index} out of sequence "
                        f"(expected {len(trace.nodes)})")
                trace.nodes.append(node)
            call = ModelCall.model_validate(rec["call"])
            if "tools" in rec:
                tools = [Tool.model_validate(t) for t in rec["tools"]]
                if version >= 2:
                    trace.tool_sets.append(tools)
                else:
                    v1_tools = tools
            if version < 2:
                call.tool_set = _v1_tool_set(trace, v1_tools)
            trace.calls.append(call)
        elif kind in ("call", "replay"):
            trace.calls.append(ModelCall.model_validate(rec["call"]))
        elif kind == "undelivered":
            for call in reversed(trace.calls):
                if call.id == rec.get("call"):
                    call.delivered = False
                    break
        elif kind == "metric":
            if isinstance(rec.get("name"), str):
                trace.metrics[rec["name"]] = rec.get("value")
        elif kind == "stop":
            if trace.stop is None:
                trace.stop = StopRecord.model_validate(rec["stop"])
        elif kind == "rewrite":
            rewrite = Rewrite.model_validate(rec.get("rewrite") or {})
            if rewrite.direction == "response":
                trace.response_rewrites.append(rewrite)
            else:
                trace.request_rewrites.append(rewrite)
        elif kind == "state":
            write = StateWrite.model_validate(rec["state"])
            trace.state_writes.append(write)
            trace.state_version, trace.state_digest = write.version, write.digest
        elif kind == "tool":
            trace.tool_decisions.append(ToolDecision.model_validate(rec["tool"]))
        elif kind == "egress":
            refusal = EgressRefusal.model_validate(rec["egress"])
            trace.egress_refusals.append(refusal)
            trace.egress[refusal.host] = refusal.count
        elif kind == "version":
            trace.versions.append(VersionChange.model_validate(rec["version"]))
        elif kind == "footer":
            trace.sealed = True
            if "state_version" in rec:
                trace.state_version = rec["state_version"]
                trace.state_digest = rec.get("state_digest")
            trace.stop_condition = rec.get("stop_condition")
            trace.ended_at = rec.get("ended_at")
            if rec.get("reward") is not None:
                trace.reward = rec["reward"]
            if rec.get("metrics"):
                trace.metrics = rec["metrics"]
            trace.rewards = {k: Reward.model_validate(v) for k, v in (rec.get("rewards") or {}).items()}
            trace.truncated = bool(rec.get("truncated", False))
            trace.stopped_by = rec.get("stopped_by")
            if rec.get("timing") is not None:
                trace.timing = Timing.model_validate(rec["timing"])
            if rec.get("info"):
                trace.info.update(rec["info"])
        # other kinds: written by a newer minor producer; skipped on purpose
    if trace is None:
        raise TraceFormatError(f"{source}: no complete header record; not a trace file "
                               f"(or it was cut before its first record was written)")
    return trace


def record_schema() -> dict[str, Any]:
    """The JSON schema of every typed part of the records, by name: the format as the code
    defines it. tests/data/schema-v<N>.json keeps it as of each schema version, and a test
    fails when it changes under the same version (a reader of that version would misread it)."""
    parts = {"header": Header, "node": MessageNode, "call": ModelCall, "tool": Tool,
             "rewrite": Rewrite, "stop": StopRecord, "reward": Reward, "timing": Timing, "state": StateWrite,
             "egress": EgressRefusal, "tool_decision": ToolDecision, "version": VersionChange}
    return {"kinds": list(RECORD_KINDS),
            **{name: model.model_json_schema() for name, model in parts.items()}}


def read_trace(path: str | Path) -> Trace:
    """The Trace stored at ``path``. A torn last record is warned about (``TornRecordWarning``
    with its byte offset) and skipped; a newer schema raises ``TraceVersionError``."""
    return fold(iter_records(path), source=str(path))

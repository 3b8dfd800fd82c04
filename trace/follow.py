"""Follow a folder of traces while the proxy writes them: ``read_trace``'s companion for an
asynchronous trainer that consumes rollouts as they are sealed.

    for item in follow_traces("traces/", state="trainer.state.json"):
        train_on(item.branches, reward=item.trace.reward)

Each trace is yielded once, when its footer lands (``Sealed``: the whole folded ``Trace``);
with ``turns=True`` each turn is also yielded as it lands (``TurnLanded``: the call and the
nodes it added), so a trainer can start on a rollout before its end. Traces sealed between
two looks at the folder come in the order of their footers' ``ended_at``.

The reader never re-reads what it has read: per file it keeps the offset of the last complete
record and reads only what was appended since (a record still being written is left for the
next look; the writer appends whole records, so this is never a torn file, only a young one),
a chunk at a time, each record checked against the file's checksum chain as ``read_trace``
checks it.

Resuming: with ``state``, a small JSON file (written atomically: a temporary file renamed
over it) names every trace already handed out and, for ``turns``, the offset of the last turn
handed out per file. It is written *before* an item is yielded, so a reader killed anywhere
and restarted yields nothing twice (at most once: a consumer that must not lose the item it
was processing when killed keeps its own note of ``item.path``).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


from interceptor.trace.model import Branch, MessageNode, ModelCall, Trace
from interceptor.trace.records import BadRecord, HoleWarning, RecordReader, node_from_record, read_trace

STATE_VERSION = 1


@dataclass
class Sealed:
    """A sealed trace: everything its file holds, folded."""

    path: Path
    trace: Trace
    ended_at: float = 0.0

    @property
    def branches(self) -> list[Branch]:
        return self.trace.branches


@dataclass
class TurnLanded:
    """One turn as it landed: its call and the nodes it added (``index`` is the first one's
    position in the trace's ``nodes``)."""

    path: Path
    trace_id: str
    call: ModelCall
    index: int
    nodes: list[MessageNode]
    end: int = 0  # the byte offset just after its record


@dataclass
class _File:
    reader: RecordReader | None = None  # where it is in the file, and its checksum chain
    size: int = -1  # the size at the last look, to skip unchanged files cheaply
    trace_id: str = ""
    turn_offset: int = 0  # turns before this offset were handed out (turn mode)
    footer: dict | None = None
    broken: bool = False  # an undecodable record: never sealed as far as a reader can tell
    turns: list[tuple[int, dict]] = field(default_factory=list)  # (end offset, record) not yet handed out


class Follower:
    """One folder, its state file, and what was read of each trace. ``poll()`` looks once
    and returns what is new; iterating polls forever (or until ``idle_timeout`` seconds pass
    with nothing new)."""

    def __init__(self, folder: str | os.PathLike, state: str | os.PathLike | None = None, *,
                 turns: bool = False, pattern: str = "*.msgpack") -> None:
        self.folder = Path(folder)
        self.state_path = Path(state) if state is not None else None
        self.turns = turns
        self.pattern = pattern
        self.sealed: dict[str, float] = {}  # file name -> ended_at, handed out
        self.turn_offsets: dict[str, int] = {}
        self._files: dict[str, _File] = {}
        self._load_state()

    def _load_state(self) -> None:
        if self.state_path is None or not self.state_path.exists():
            return
        data = json.loads(self.state_path.read_text())
        if data.get("version") != STATE_VERSION:
            raise ValueError(f"{self.state_path}: follow state version {data.get('version')!r}, "
                             f"this reader writes {STATE_VERSION}")
        self.sealed = dict(data.get("sealed", {}))
        self.turn_offsets = dict(data.get("turn_offsets", {}))

    def _save_state(self) -> None:
        if self.state_path is None:
            return
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        tmp.write_text(json.dumps({"version": STATE_VERSION, "folder": str(self.folder),
                                   "sealed": self.sealed, "turn_offsets": self.turn_offsets}))
        os.replace(tmp, self.state_path)

    def poll(self) -> list[Sealed | TurnLanded]:
        """One look at the folder: what is new, all of it marked handed out (state saved)."""
        items = self._scan()
        for item in items:
            self._mark(item)
        if items:
            self._save_state()
        return items

    def _scan(self) -> list[Sealed | TurnLanded]:
        out: list[Sealed | TurnLanded] = []
        newly_sealed: list[tuple[float, str, Path]] = []
        for path in sorted(self.folder.glob(self.pattern)):
            name = path.name
            if name in self.sealed:
                continue
            f = self._files.setdefault(name, _File(turn_offset=self.turn_offsets.get(name, 0)))
            self._read_new(path, f)
            if self.turns:
                out.extend(_turn(path, f.trace_id, end, rec) for end, rec in f.turns)
                f.turns.clear()
            if f.footer is not None:
                newly_sealed.append((float(f.footer.get("ended_at") or 0.0), name, path))
        for ended_at, name, path in sorted(newly_sealed):
            out.append(Sealed(path, read_trace(path), ended_at))
        return out

    def _mark(self, item: Sealed | TurnLanded) -> None:
        name = item.path.name
        if isinstance(item, Sealed):
            self.sealed[name] = item.ended_at
            self.turn_offsets.pop(name, None)
            self._files.pop(name, None)
        else:
            self.turn_offsets[name] = item.end

    def _read_new(self, path: Path, f: _File) -> None:
        try:
            size = path.stat().st_size
        except FileNotFoundError:  # removed between the listing and now
            return
        if size == f.size or f.broken:
            return
        f.size = size
        reader = f.reader
        if reader is None:
            reader = f.reader = RecordReader(path)
        try:
            for offset, rec in reader.read():
                end = reader.offset
                if isinstance(rec, dict):
                    kind = rec.get("kind")
                    if kind == "header":
                        f.trace_id = str(rec.get("id", path.stem))
                    elif kind == "turn" and self.turns and end > f.turn_offset:
                        f.turns.append((end, rec))
                    elif kind == "footer":
                        f.footer = rec
                        return
        except BadRecord as bad:
            # Not a record being written but a broken or changed one: read_trace stops there
            # too, so this trace can never be handed out whole. Say so once and leave the file.
            what = f"undecodable record at byte {bad.offset} ({bad.why})" if bad.undecodable else bad.why
            warnings.warn(HoleWarning(f"{path}: {what}; not following this trace"), stacklevel=2)
            f.broken = True
        except FileNotFoundError:
            return

    def __iter__(self) -> Iterator[Sealed | TurnLanded]:
        return self.follow()

    def follow(self, poll_interval: float = 0.2, idle_timeout: float | None = None) -> Iterator[Sealed | TurnLanded]:
        idle_since = time.monotonic()
        while True:
            items = self._scan()
            for item in items:
                self._mark(item)
                self._save_state()  # before the yield: a kill after it cannot repeat the item
                yield item
            if items:
                idle_since = time.monotonic()
                continue
            if idle_timeout is not None and time.monotonic() - idle_since >= idle_timeout:
                return
            time.sleep(poll_interval)


def _turn(path: Path, trace_id: str, end: int, rec: dict) -> TurnLanded:
    pairs = [node_from_record(data) for data in rec.get("nodes", [])]
    return TurnLanded(path, trace_id, ModelCall.model_validate(rec["call"]), pairs[0][0] if pairs else -1,
                      [node for _, node in pairs], end)


def follow_traces(folder: str | os.PathLike, state: str | os.PathLike | None = None, *, turns: bool = False,
                  poll_interval: float = 0.2, idle_timeout: float | None = None) -> Iterator[Sealed | TurnLanded]:
    """Yield each trace in ``folder`` once it is sealed (and each turn as it lands, with
    ``turns``), resuming from ``state``; see the module docstring."""
    return Follower(folder, state, turns=turns).follow(poll_interval, idle_timeout)

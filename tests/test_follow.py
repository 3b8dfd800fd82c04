"""follow_traces: a reader following the trace folder of a real proxy while sessions are
sealed one by one; killed and restarted, it resumes from its state file."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading

import pytest

from interceptor.client import Proxy
from interceptor.trace import Follower, Sealed, TurnLanded
from conftest import KEY_ENV, REAL_KEY
from test_client import _chat
from waiting import wait_until

READER = """
import sys
from interceptor.trace import Sealed, follow_traces
idle = float(sys.argv[3]) if len(sys.argv) > 3 else None
for item in follow_traces(sys.argv[1], state=sys.argv[2], poll_interval=0.05, idle_timeout=idle):
    if isinstance(item, Sealed):
        print(item.trace.id, item.trace.reward, len(item.branches), flush=True)
"""


class Reader:
    """The follower as its own process, its lines read by a thread."""

    def __init__(self, folder, state, idle: float | None = None) -> None:
        args = [sys.executable, "-c", READER, str(folder), str(state)] + ([str(idle)] if idle else [])
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(x.strip()) for x in self.proc.stdout], daemon=True).start()

    def next(self, timeout: float = 20) -> str:
        return self.lines.get(timeout=timeout)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


def _proxy(sim, tmp_path) -> Proxy:
    return Proxy(upstreams={"sim": {"base_url": sim.url("/v1"), "api_key_env": KEY_ENV}},
                 env={KEY_ENV: REAL_KEY}, trace_dir=tmp_path / "traces")


@pytest.fixture
def readers():
    started: list[Reader] = []
    yield started
    for r in started:
        if r.proc.poll() is None:
            r.kill()


def test_each_sealed_trace_once_in_seal_order_across_a_kill(sim, tmp_path, readers):
    order = [5, 2, 7, 0, 3, 6, 1, 4]  # not the names' order: the reader must follow the seals
    state = tmp_path / "state.json"
    with _proxy(sim, tmp_path) as proxy:
        sessions = {k: proxy.session(upstream="sim", id=f"s{k}") for k in range(8)}
        for s in sessions.values():
            _chat(s)
        got = []
        reader = Reader(proxy.trace_dir, state)
        readers.append(reader)
        for k in order[:3]:  # sealed one by one while it follows
            sessions[k].close(reward=k / 10)
            got.append(reader.next())
        reader.kill()
        for k in order[3:5]:  # sealed while it is down
            sessions[k].close(reward=k / 10)
        reader = Reader(proxy.trace_dir, state)
        readers.append(reader)
        got += [reader.next(), reader.next()]
        for k in order[5:]:
            sessions[k].close(reward=k / 10)
            got.append(reader.next())
        reader.kill()
        assert reader.lines.empty()
        again = Reader(proxy.trace_dir, state, idle=1.5)  # a third start: nothing left to yield
        readers.append(again)
        assert again.proc.wait(30) == 0 and again.lines.empty()
    assert got == [f"s{k} {k / 10} 1" for k in order]


def _landed(follower: Follower, timeout: float = 10) -> list:
    """The next non-empty look: the proxy answers a turn before its writer thread has put the
    record on disk, so it may land a moment after the harness has its answer."""
    return wait_until(follower.poll, timeout, "a turn landed")


def test_turns_as_they_land_then_the_seal(sim, tmp_path):
    with _proxy(sim, tmp_path) as proxy:
        follower = Follower(proxy.trace_dir, tmp_path / "state.json", turns=True, pattern="r*.msgpack")
        session = proxy.session(upstream="sim", id="r1")
        assert follower.poll() == []  # only the header so far
        _chat(session, "first")
        (turn,) = _landed(follower)
        assert isinstance(turn, TurnLanded) and turn.trace_id == "r1" and turn.index == 0
        assert [n.message.role for n in turn.nodes] == ["user", "assistant"] and turn.call.node == 1
        _chat(session, "second")
        (turn,) = _landed(follower)
        assert turn.nodes[0].message.content == "second" and turn.index == 2
        assert follower.poll() == []
        session.close(reward=1.0)
        (sealed,) = follower.poll()
        assert isinstance(sealed, Sealed) and sealed.trace.reward == 1.0 and len(sealed.branches) == 2
        assert follower.poll() == []
        # a new reader on the same state has nothing left; one without state sees the seal
        assert Follower(proxy.trace_dir, tmp_path / "state.json", turns=True, pattern="r*.msgpack").poll() == []
        fresh = Follower(proxy.trace_dir, pattern="r*.msgpack").poll()
        assert [type(x) for x in fresh] == [Sealed]


def test_a_broken_trace_is_warned_about_and_the_others_still_follow(tmp_path):
    import msgpack
    import pytest as _pytest
    from interceptor.trace import HoleWarning

    (tmp_path / "bad.msgpack").write_bytes(msgpack.packb({"kind": "header", "schema_version": 1, "id": "bad"})
                                           + b"\xc1" + msgpack.packb({"kind": "footer"}))
    (tmp_path / "good.msgpack").write_bytes(msgpack.packb({"kind": "header", "schema_version": 1, "id": "good"})
                                            + msgpack.packb({"kind": "footer", "ended_at": 1.0}))
    follower = Follower(tmp_path)
    with _pytest.warns(HoleWarning, match="bad.msgpack: undecodable record at byte"):
        items = follower.poll()
    assert [i.trace.id for i in items] == ["good"] and follower.poll() == []

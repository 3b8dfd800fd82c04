"""A sealed trace's graph is let go (a long night of rollouts keeps summaries, not messages);
an exchange still in flight at the seal is recorded all the same, as a call without nodes."""

from __future__ import annotations

import gc

from interceptor.addons.gateway.exchange import Walked
from interceptor.addons.gateway.sessions.session import Registry, SessionConfig
from interceptor.addons.gateway.sessions.upstream import Upstream
from interceptor.trace import ModelCall, Recorder, Store, read_trace
from interceptor.trace.messages import Message, Request, Response


def test_release_keeps_the_summary_and_records_late_exchanges(tmp_path):
    store = Store()
    rec = Recorder(tmp_path / "s.msgpack", {"id": "s"}, store=store)
    request = Request(messages=[Message(role="user", content="hi")])
    reply = Response(message=Message(role="assistant", content="hello"))
    rec.commit_turn(request, reply, ModelCall(id="c1"))
    rec.release()  # not sealed yet: nothing happens
    assert len(rec.trace.nodes) == 2
    rec.seal("deleted")
    before = rec.summary()
    rec.release()
    assert rec.trace.nodes == [] and rec.sealed
    assert {k: v for k, v in rec.summary().items() if k != "released"} == before
    late = rec.commit_turn(request, reply, ModelCall(id="c2"))
    assert late.node is None and late.error.type == "after_seal"
    store.flush()
    trace = read_trace(tmp_path / "s.msgpack")
    assert trace.num_turns == 1 and [c.id for c in trace.calls] == ["c1", "c2"]
    assert trace.calls[1].error.type == "after_seal"


def test_a_released_session_keeps_few_objects_for_the_collector_and_remakes_what_a_late_exchange_asks(tmp_path, monkeypatch):
    """Up to ``intercept_keep_sealed`` released sessions stay in memory, and a full collection
    walks every container they hold: 1,000 of them at ~55 objects each made a 57 ms pause of
    every stream (docs/benchmarks.md). A released session keeps its config, summary and
    path, not empty replacements of what it let go of (38 tracked objects in process before,
    18 now); its summary, listing state and ``state_version`` read nothing back, and what a
    late exchange asks for is made again."""
    monkeypatch.setenv("RELEASE_TEST_KEY", "sk-x")
    registry = Registry()
    session = registry.create(SessionConfig(model="m"), tmp_path, "never", Upstream(api_key_env="RELEASE_TEST_KEY"))
    walked = Walked(messages=[], on=0, last=None, nodes=0, generation=0)  # a pass over the empty graph
    assert walked.current(session.recorder)
    session.seal()
    session.release()
    registry.retire(session)
    summary = session.summary()
    assert summary["sealed"] and summary["released"] and summary["state_version"] == 0 and session.sealed
    rec = session.recorder
    assert "_trace" not in vars(rec) and "memory" not in vars(session)  # nothing was made again

    shared = {id(x) for x in (session.upstream, registry, registry.store)}
    seen, stack = set(), [session]
    while stack:
        o = stack.pop()
        if id(o) in seen or id(o) in shared or not gc.is_tracked(o) or isinstance(o, (type, type(gc))):
            continue
        seen.add(id(o))
        stack.extend(gc.get_referents(o))
    assert len(seen) <= 24, f"a released session holds {len(seen)} tracked objects"

    assert not session.memory and session.handed.by_hook == {}  # made again, empty
    assert not walked.current(rec) and len(rec.prefixes) == 0  # what was found before the release is stale
    assert rec.trace.nodes == [] and rec.trace.sealed and rec.child(None, Message(role="user", content="x")) is None
    rec.record_metric("late", 1)
    registry.store.flush(timeout=10)
    assert read_trace(rec.path).metrics == {"late": 1}
    registry.store.close()

"""A sealed trace's graph is let go (a long night of rollouts keeps summaries, not messages);
an exchange still in flight at the seal is recorded all the same, as a call without nodes."""

from __future__ import annotations

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

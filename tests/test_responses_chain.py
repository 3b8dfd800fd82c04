"""Responses over HTTP chained on `previous_response_id` with `store: true`: each
request sends only its new input, the provider holds the rest; the trace still has every
turn's whole prompt on one branch. An id this proxy never recorded starts a new root and the
call names it."""

from __future__ import annotations

import httpx2 as httpx

from clients import session_clients
from interceptor.trace import read_trace
from provider import Reply


def test_chained_responses_over_http_are_one_branch(new_session, sim, proxy, harness_env):
    session = new_session()
    harness_env(session["env"])
    oai, _ = session_clients(session)
    sim.script(Reply(text="one"), Reply(text="two"), Reply(text="three"))
    first = oai.responses.create(model="gpt-5", instructions="Be brief.", input="first", store=True)
    second = oai.responses.create(model="gpt-5", instructions="Be brief.", input="second", store=True,
                                  previous_response_id=first.id)
    third = oai.responses.create(model="gpt-5", instructions="Be brief.", input="third", store=True,
                                 previous_response_id=second.id, stream=False)
    assert third.output_text == "three"
    # The harness sent only its new input; the provider resolved the rest.
    assert [r.json["input"] for r in sim.model_requests()] == ["first", "second", "third"]
    proxy.api("DELETE", f"sessions/{session['id']}")
    trace = read_trace(session["trace_path"])
    assert len(trace.branches) == 1 and trace.num_turns == 3
    messages = trace.branches[0].messages
    assert [(m.role, m.text()) for m in messages] == [
        ("system", "Be brief."), ("user", "first"), ("assistant", "one"), ("user", "second"),
        ("assistant", "two"), ("user", "third"), ("assistant", "three")]
    assert [c.previous_response_id for c in trace.calls] == [None, first.id, second.id]
    assert not any(c.previous_response_unknown for c in trace.calls)
    # Each call's prompt is the whole conversation before it: its reply's ancestors.
    def prompt_length(node: int) -> int:
        length, parent = 0, trace.nodes[node].parent
        while parent is not None:
            length, parent = length + 1, trace.nodes[parent].parent
        return length

    assert [prompt_length(c.node) for c in trace.calls] == [2, 4, 6]


def test_an_unknown_previous_response_is_a_new_root_named_on_the_call(new_session, sim, proxy, harness_env):
    # An answer the provider stored before this session (made without the proxy).
    sim.script(Reply(text="elsewhere"), Reply(text="continued"))
    earlier = httpx.post(sim.url("/v1/responses"), json={"model": "gpt-5", "input": "before", "store": True},
                         headers={"authorization": "Bearer k"}).json()
    session = new_session()
    harness_env(session["env"])
    oai, _ = session_clients(session)
    answer = oai.responses.create(model="gpt-5", input="after", previous_response_id=earlier["id"], store=True)
    assert answer.output_text == "continued"
    proxy.api("DELETE", f"sessions/{session['id']}")
    trace = read_trace(session["trace_path"])
    [call] = trace.calls
    assert call.previous_response_id == earlier["id"] and call.previous_response_unknown
    assert [(m.role, m.text()) for m in trace.branches[0].messages] == [("user", "after"), ("assistant", "continued")]

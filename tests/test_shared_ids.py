"""Token ids a live trace keeps are one int object per value in the process (trace/shared.py).

What must hold: the values (and every record written of them) never change; every id a
collect_tokens session keeps (the nodes', and the list the next prompt extends) is the
table's object, JSON and streamed, so a session's ids cost a list's pointer each; so is every
id of a trace read back; and an id the table must not hold (negative, past ``CAP``) leaves
its list as it was. (The ids are a validated ``list[int]`` where they are shared.)
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from mitmproxy import http

from interceptor.trace import read_trace
from interceptor.trace import shared as shared_module
from interceptor.trace.shared import CAP, shared

from test_addons import CHAT_URL, World, flow_for, world  # noqa: F401 (the fixture)
from test_prompt_ids import _answer, _words

ROLES = {"system": 50_001, "user": 50_002, "assistant": 50_003}


def _template(messages: list[dict]) -> list[int]:
    """test_prompt_ids' template (the prefix property), its role ids below ``CAP``."""
    out: list[int] = []
    for m in messages:
        out += [ROLES[m["role"]], *_words(m["content"])]
    return out + [ROLES["assistant"]]


def _is_shared(ids) -> bool:
    table = shared_module._TABLE
    return all(0 <= x < len(table) and x is table[x] for x in ids)


def _parsed(ids: list) -> list:
    """The ids as a JSON parser makes them: an int object of its own each (past 256)."""
    return json.loads(json.dumps(ids))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.integers(-5, 300_000), st.integers(-2**40, 2**40)), max_size=30), st.integers(0, 35))
def test_the_values_never_change_and_only_plain_ids_in_range_are_shared(ids, start):
    ids = _parsed(ids)
    before = list(ids)
    out = shared(ids, start)
    assert ids == before
    assert out == before[start:]
    plain = all(0 <= x < CAP for x in before[start:])
    if plain:
        assert _is_shared(ids[start:]) and _is_shared(out)
    else:
        assert all(a is b for a, b in zip(ids, before))  # left as it was


def test_two_parses_of_the_same_ids_end_as_the_same_objects():
    one, two = _parsed([151_643, 198, 100_000, 262_143]), _parsed([262_143, 100_000])
    assert one[0] is not _parsed([151_643])[0]
    shared(one), shared(two)
    assert one[3] is two[0] and one[2] is two[1]
    assert shared(None) is None and shared([]) == []
    past = _parsed([CAP, 5_000])
    assert shared(past) == past and past[1] is not shared([5_000])[0]  # past CAP: the list as it was


def test_a_collect_tokens_session_keeps_one_object_per_id(world: World):
    """Six turns, JSON and streamed: every id on the nodes and in the list the next prompt
    extends is the table's; the trace read back is too, and equal to what was sent."""
    session = world.session(collect_tokens=True)
    headers = {"authorization": f"Bearer {session.model_secret}"}
    messages = [{"role": "system", "content": "be brief"}]
    for k in range(6):
        messages.append({"role": "user", "content": f"question number {k} please"})
        flow = world.send(flow_for("POST", CHAT_URL, {"model": "gpt-4o", "messages": messages,
                                                      "stream": k % 2 == 1}, headers))
        body, events = _answer(_template(messages), f"answer {k} is here", True)
        if k % 2:
            world.answer(flow, chunks=events, ctype="text/event-stream")
        else:
            world.answer(flow, body=body)
        assert isinstance(flow.response, http.Response) and flow.response.status_code == 200
        messages.append({"role": "assistant", "content": f"answer {k} is here"})
    trace = session.recorder.trace
    kept = [n.token_ids for n in trace.nodes if n.token_ids]
    assert len(kept) == 12 and all(_is_shared(ids) for ids in kept)
    prior = session.last_prompts[0].ids
    assert prior is not None and len(prior) == len(_template(messages[:-1])) and _is_shared(prior)
    (branch,) = trace.branches
    assert branch.token_ids == _template(messages[:-1]) + _words("answer 5 is here")
    world.registry.store.flush(timeout=10)
    back = read_trace(session.trace_path)
    assert [n.token_ids for n in back.nodes] == [n.token_ids for n in trace.nodes]
    assert all(_is_shared(n.token_ids) for n in back.nodes if n.token_ids)

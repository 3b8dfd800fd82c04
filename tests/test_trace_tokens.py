"""Token ids from an upstream that returns them (vLLM, SGLang): alignment on every branch.

A toy chat template stands in for the model's: each message renders as
``[role] text [END, NL]`` and the prompt ends with the generation scaffold ``[ASSISTANT]``;
the completion is ``reasoning text [END]`` (no NL: the template adds it when the reply is
restated). That is the shape that makes naive per-turn token storage go wrong, and a
template that drops past reasoning forces retokenisation branches.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st

from interceptor.trace import Message, Reasoning, Usage
from interceptor.trace.verify import problems
from test_trace import SYSTEM, Rollout

ROLE = {"system": 1, "user": 2, "assistant": 3, "tool": 4}
END, NL = 9, 10


def text_ids(text: str) -> list[int]:
    return [100 + ord(c) for c in text]


def render(messages: list[Message], strip_reasoning: bool = False) -> list[int]:
    out: list[int] = []
    for m in messages:
        out.append(ROLE[m.role])
        if not strip_reasoning:
            for r in m.reasoning:
                out += text_ids(r.text)
        out += text_ids(m.text()) + [END, NL]
    return out + [ROLE["assistant"]]


def completion(reply: Message) -> list[int]:
    return [t for r in reply.reasoning for t in text_ids(r.text)] + text_ids(reply.text()) + [END]


def send(r: Rollout, prompt, reply, *, strip_reasoning=False):
    prompt_ids = render(prompt, strip_reasoning)
    ids = completion(reply)
    call = r.send(prompt, reply, usage=Usage(input_tokens=len(prompt_ids), output_tokens=len(ids)),
                  prompt_token_ids=prompt_ids, token_ids=ids,
                  logprobs=[-0.5] * len(ids))
    return call, prompt_ids + ids


def assert_aligned(trace, expected: dict[int, list[int]]):
    """Every branch's tokens are exactly the last call's prompt + completion on it."""
    assert problems(trace) == []
    for b in trace.branches:
        assert b.token_ids == expected[b.leaf], f"branch {b.index}"
        assert len(b.sampled_mask) == len(b.logprobs) == len(b.advantages) == len(b.token_ids)
        for tok, m, lp in zip(b.token_ids, b.sampled_mask, b.logprobs):
            assert lp == (-0.5 if m else 0.0)


def test_tokens_split_onto_new_nodes_and_align(tmp_path):
    r = Rollout(tmp_path / "t.msgpack")
    history = [SYSTEM, Message(role="user", content="hi")]
    expected = {}
    for k in range(4):
        reply = Message(role="assistant", content=f"answer {k}")
        call, full = send(r, history, reply)
        expected[call.node] = full
        history += [reply, Message(role="user", content=f"next {k}")]
    trace = r.recorder.trace
    assert len(trace.branches) == 1
    assert_aligned(trace, expected)
    sampled = [n for n in trace.nodes if n.sampled]
    assert all(n.mask == [True] * len(n.token_ids) for n in sampled)
    # the generation scaffold rides on the last prompt node of its turn
    assert trace.nodes[1].token_ids[-1] == ROLE["assistant"]
    assert r.read() == trace


def test_retokenised_history_branches_instead_of_inheriting_stale_tokens(tmp_path):
    r = Rollout(tmp_path / "r.msgpack")
    history = [SYSTEM, Message(role="user", content="hi")]
    reply = Message(role="assistant", content="ok", reasoning=[Reasoning(text="hmm")])
    call1, full1 = send(r, history, reply)
    history += [reply, Message(role="user", content="again")]
    # the template drops past reasoning: the stored completion is not what the model sees now
    call2, full2 = send(r, history, Message(role="assistant", content="done"),
                        strip_reasoning=True)
    trace = r.recorder.trace
    assert len(trace.branches) == 2
    a, b = trace.branches
    assert a.nodes[:2] == b.nodes[:2]  # system and user still shared
    assert call1.node in a.nodes and call1.node not in b.nodes
    assert_aligned(trace, {call1.node: full1, call2.node: full2})


def test_whole_prompt_matched_but_new_scaffold_tokens(tmp_path):
    """A prompt that ends at a stored reply (continue from it) re-creates that node so the
    scaffold tokens after it have a home."""
    r = Rollout(tmp_path / "s.msgpack")
    history = [SYSTEM, Message(role="user", content="hi")]
    reply = Message(role="assistant", content="part one")
    call1, full1 = send(r, history, reply)
    call2, full2 = send(r, history + [reply], Message(role="assistant", content="part two"))
    assert_aligned(r.recorder.trace, {call1.node: full1, call2.node: full2})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 10), st.booleans(), st.booleans()), min_size=1, max_size=12))
def test_alignment_holds_for_any_mix_of_continuations_and_forks(tmp_path_factory, plan):
    """Each step continues or forks a random earlier conversation, sometimes with a template
    that strips reasoning; every branch must still align with its last call."""
    r = Rollout(tmp_path_factory.mktemp("h") / "h.msgpack")
    conversations: list[list[Message]] = [[SYSTEM, Message(role="user", content="start")]]
    expected = {}
    for step, (pick, strip, reason) in enumerate(plan):
        base = conversations[pick % len(conversations)]
        cut = 2 + (pick % max(1, len(base) - 1))  # sometimes a shorter prefix: an edit
        prompt = base[:cut] if cut < len(base) and base[cut - 1].role == "user" else base
        reply = Message(role="assistant", content=f"r{step}",
                        reasoning=[Reasoning(text=f"why{step}")] if reason else [])
        call, full = send(r, prompt, reply, strip_reasoning=strip)
        expected[call.node] = full
        conversations.append(prompt + [reply, Message(role="user", content=f"u{step}")])
    trace = r.recorder.trace
    leaves = set(trace.leaves())
    assert_aligned(trace, {k: v for k, v in expected.items() if k in leaves})
    assert r.read() == trace


def test_input_tokens_not_double_counted_across_retokenisation(tmp_path):
    r = Rollout(tmp_path / "n.msgpack")
    history = [SYSTEM, Message(role="user", content="hi")]
    inputs = []
    for k in range(3):
        reply = Message(role="assistant", content=f"a{k}", reasoning=[Reasoning(text="think")])
        call, _ = send(r, history, reply, strip_reasoning=k > 0)
        inputs.append((call.usage.input_tokens, call.usage.output_tokens))
        history += [reply, Message(role="user", content=f"u{k}")]
    trace = r.recorder.trace
    assert len(trace.branches) == 3  # each past reply was re-rendered without reasoning
    expected = inputs[0][0] + sum(max(0, i - (pi + po))
                                  for (i, _), (pi, po) in zip(inputs[1:], inputs))
    assert trace.num_input_tokens == expected


def test_reply_restated_without_reasoning_and_rendered_without_it_is_counted_once(tmp_path):
    """The harness dropped the reasoning and the template rendered none: the tokens differ
    from the sampled node's, so the turn branches, and the copy still stands for its call."""
    r = Rollout(tmp_path / "d.msgpack")
    history = [SYSTEM, Message(role="user", content="hi")]
    reply = Message(role="assistant", content="a0", reasoning=[Reasoning(text="think")])
    call1, full1 = send(r, history, reply)
    history += [reply.model_copy(update={"reasoning": []}), Message(role="user", content="u0")]
    call2, full2 = send(r, history, Message(role="assistant", content="a1"))
    trace = r.recorder.trace
    assert len(trace.branches) == 2
    assert_aligned(trace, {call1.node: full1, call2.node: full2})
    first_total = call1.usage.input_tokens + call1.usage.output_tokens
    assert trace.num_input_tokens == call1.usage.input_tokens + call2.usage.input_tokens - first_total

"""Provider feedback, through a real mitmdump with the real SDKs against the strict
simulator configured to refuse a parameter for a model no table knows: a session imposing it
gets one error call, one success and a ``provider_rejected`` override, the second attempt
carries the real key where the dialect puts it (Redact has blanked the flow's by then), and
the next request for that model is sent right the first time. A 400 about what the harness
sent itself passes through untouched.

The proxy is shared by the module and remembers refusals for its lifetime, so each test
names a model of its own.
"""

from __future__ import annotations

import itertools

import anthropic
import openai
import pytest

from clients import REAL_KEY, session_clients
from provider.reply import Reply
from interceptor.dialects.common import PROVIDER_REJECTED
from test_dialects_proxy import assert_no_credentials, make_session, mproxy, msim, sealed, sim  # noqa: F401

_models = itertools.count()


def unknown_model() -> str:
    return f"mystery-model-{next(_models)}"


def ask(session: dict, api: str, stream: bool, text: str, **extra) -> str:
    oai, claude = session_clients(session)
    if api == "chat":
        messages = [{"role": "user", "content": text}]
        if stream:
            chunks = oai.chat.completions.create(model="gpt-4o", messages=messages, stream=True, **extra)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return oai.chat.completions.create(model="gpt-4o", messages=messages, **extra).choices[0].message.content
    if api == "responses":
        if stream:
            with oai.responses.stream(model="gpt-4o", input=text, **extra) as s:
                return s.get_final_response().output_text
        return oai.responses.create(model="gpt-4o", input=text, **extra).output_text
    messages = [{"role": "user", "content": text}]
    if stream:
        with claude.messages.stream(model="claude-x", max_tokens=100, messages=messages, **extra) as s:
            return s.get_final_text()
    return claude.messages.create(model="claude-x", max_tokens=100, messages=messages, **extra).content[0].text


def real_key_of(record, api: str) -> str | None:
    if api == "messages":
        return record.headers.get("x-api-key")
    return (record.headers.get("authorization") or "").removeprefix("Bearer ")


@pytest.mark.parametrize("api,stream", [(api, stream) for api in ("chat", "responses", "messages")
                                        for stream in (False, True)])
def test_a_refused_parameter_the_proxy_set_is_undone_sent_once_more_and_remembered(
        make_session, sim, mproxy, api, stream):
    model = unknown_model()
    sim.refuse = {model: {"temperature"}}
    session = make_session(model=model, sampling={"temperature": 0.5})

    assert "first" in ask(session, api, stream, "first")
    assert "second" in ask(session, api, stream, "second")

    requests = sim.model_requests()
    # first: refused (temperature), then once more without it; second: right the first time.
    assert [("temperature" in r.json, r.refusal is not None) for r in requests] == \
           [(True, True), (False, False), (False, False)]
    # The second attempt carried the real key where the dialect sends it, nothing else.
    assert [real_key_of(r, api) for r in requests] == [REAL_KEY] * 3
    assert all(r.json.get("model") == model for r in requests)
    trace = sealed(mproxy, session)
    assert [c.status for c in trace.calls] == [400, 200, 200]
    assert trace.calls[0].error is not None and trace.calls[0].node is None
    assert "temperature" in trace.calls[0].error.message
    assert trace.num_turns == 2
    # The refused attempt's record shows what it was sent with; the exchange's, what undid it.
    assert [o.key for o in trace.calls[0].overrides if o.reason == PROVIDER_REJECTED] == []
    assert trace.calls[0].sampling.temperature == 0.5
    for call in trace.calls[1:]:
        rejected = [(o.key, o.old, o.new) for o in call.overrides if o.reason == PROVIDER_REJECTED]
        assert rejected == [("temperature", 0.5, None)]
        assert call.sampling.temperature is None
    assert_no_credentials(mproxy, session)


def test_the_harness_value_is_restored_when_the_proxy_changed_it(make_session, sim, mproxy):
    """The proxy replaced the harness's max_tokens and the provider refused the new value (in
    Anthropic's words for a model's output limit): the harness's comes back (dropping a
    required key would be another 400), and stays back for the next request."""
    model = unknown_model()
    sim.script(Reply(status=400, error_type="invalid_request_error", should_retry=False,
                     error_message=f"max_tokens: 4000 > 1000, which is the maximum allowed number of output "
                                   f"tokens for {model}"),
               key=lambda r: (r.json or {}).get("max_tokens") == 4000)
    session = make_session(model=model, sampling={"max_tokens": 4000})
    _, claude = session_clients(session)
    for max_tokens in (100, 200):
        reply = claude.messages.create(model="claude-x", max_tokens=max_tokens,
                                       messages=[{"role": "user", "content": "hi"}])
        assert reply.content[0].text.endswith("hi")
    assert [r.json["max_tokens"] for r in sim.model_requests()] == [4000, 100, 200]
    trace = sealed(mproxy, session)
    assert [c.status for c in trace.calls] == [400, 200, 200]
    assert [(o.key, o.old, o.new) for o in trace.calls[1].overrides if o.reason == PROVIDER_REJECTED] == \
           [("max_tokens", 4000, 100)]
    assert [(o.key, o.old, o.new) for o in trace.calls[2].overrides if o.reason == PROVIDER_REJECTED] == \
           [("max_tokens", 4000, 200)]


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_a_refusal_of_what_the_harness_sent_passes_through(make_session, sim, mproxy, api):
    model = unknown_model()
    sim.refuse = {model: {"temperature"}}
    session = make_session(model=model)
    with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as caught:
        ask(session, api, False, "x", **({"temperature": 0.3} if api == "chat" else
                                         {"extra_body": {"temperature": 0.3}}))
    assert "temperature" in str(caught.value)
    assert len(sim.model_requests()) == 1  # not sent again
    trace = sealed(mproxy, session)
    assert [c.status for c in trace.calls] == [400]
    assert not any(o.reason == PROVIDER_REJECTED for o in trace.calls[0].overrides)


def test_a_second_refusal_reaches_the_harness(make_session, sim, mproxy):
    """Once: when the second attempt is refused too (here: for the harness's own top_p), that
    answer is the harness's, and nothing is sent a third time."""
    model = unknown_model()
    sim.refuse = {model: {"temperature", "top_p"}}
    session = make_session(model=model, sampling={"temperature": 0.5})
    oai, _ = session_clients(session)
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}], top_p=0.5)
    assert caught.value.body["param"] == "top_p"
    assert [sorted(k for k in ("temperature", "top_p") if k in r.json) for r in sim.model_requests()] == \
           [["temperature", "top_p"], ["top_p"]]
    trace = sealed(mproxy, session)
    assert [c.status for c in trace.calls] == [400, 400]


REDACT = """
from interceptor.hooks import Request, intercept

@intercept
def redact(request: Request):
    for m in request.messages:
        if m.role == "user" and "SECRET" in m.text():
            m.content = m.text().replace("SECRET", "[redacted]")
    return request
"""


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_the_second_attempt_carries_what_a_request_hook_rewrote(make_session, sim, mproxy, tmp_path, api):
    """A request hook rewrote the request (a redaction, then the same one restated, spliced
    in from memory) and the provider refused a parameter the proxy set: the attempt sent
    once more without it still carries the rewrite, so the model never reads the original."""
    model = unknown_model()
    sim.refuse = {model: {"temperature"}}
    (tmp_path / "redact.py").write_text(REDACT)
    session = make_session(model=model, sampling={"temperature": 0.5}, hooks={"module": str(tmp_path / "redact.py")})
    oai, claude = session_clients(session)
    messages = [{"role": "user", "content": "the key is SECRET"}]
    for follow_up in ("go on", None):
        if api == "chat":
            reply = oai.chat.completions.create(model="gpt-4o", messages=messages).choices[0].message.content
        else:
            reply = claude.messages.create(model="claude-x", max_tokens=100, messages=messages).content[0].text
        if follow_up:
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": follow_up}]
    requests = sim.model_requests()
    # first: refused (temperature), then once more without it; second: right the first time.
    assert [("temperature" in r.json, r.refusal is not None) for r in requests] == \
           [(True, True), (False, False), (False, False)]
    for r in requests:
        assert "SECRET" not in r.body.decode() and "[redacted]" in r.body.decode()
    trace = sealed(mproxy, session)
    assert [c.status for c in trace.calls] == [400, 200, 200]
    assert "SECRET" not in str([n.message.model_dump() for n in trace.nodes])

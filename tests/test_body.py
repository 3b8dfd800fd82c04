"""dialects.body: parsing equals json.loads, and a spliced rewrite equals a full re-serialisation
while every untouched key keeps the harness's own bytes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interceptor.dialects.body import Body, parse_body

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4), max_leaves=12)
objects = st.dictionaries(st.text(max_size=8), values, max_size=8)


def dump(obj, style: int) -> str:
    if style == 0:
        return json.dumps(obj)
    if style == 1:
        return json.dumps(obj, indent=2, ensure_ascii=False)
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


@settings(max_examples=300, deadline=None)
@given(obj=objects, style=st.integers(0, 2), edits=st.dictionaries(st.text(max_size=8), st.one_of(st.just("DROP"), values), max_size=4))
def test_splice_equals_reserialising_and_keeps_untouched_bytes(obj, style, edits):
    text = dump(obj, style)
    body = parse_body(text.encode())
    assert body.data == json.loads(text)
    expected = dict(body.data)
    for k, v in edits.items():
        if v == "DROP":
            body.data.pop(k, None)
            expected.pop(k, None)
        else:
            body.data[k] = v
            expected[k] = v
    out = body.encode(set(edits))
    assert json.loads(out) == expected
    # Copied from the harness's bytes (the fast path) exactly as from its decoded text.
    assert out == Body(body.data, body.text, body.spans).encode(set(edits))
    for k in obj:
        if k not in edits:
            start, end = body.spans[k]
            assert text[start:end].encode() in out


@pytest.mark.parametrize("raw", [b"", b"{", b'{"a":1,}', b'{"a" 1}', b"{'a':1}", b'{"a":1} x', b"[1,", b'{"a":tru}'])
def test_malformed_bodies_raise_like_json_loads(raw):
    with pytest.raises(ValueError):
        json.loads(raw)
    with pytest.raises(ValueError):
        parse_body(raw)


def test_duplicate_keys_last_wins_and_non_objects_pass_through():
    assert parse_body(b'{"a": 1, "a": 2}').data == {"a": 2}
    assert parse_body(b"[1, 2]").data == [1, 2]
    assert parse_body(json.dumps({"x": "é"}).encode("utf-16")).data == {"x": "é"}


def test_unchanged_history_is_copied_as_written():
    raw = b'{"model": "gpt-4o",  "messages": [ {"role":"user", "content":"caf\\u00e9"} ], "temperature": 1}'
    body = parse_body(raw)
    body.data["temperature"] = 0.2
    body.data["model"] = "m"
    out = body.encode({"temperature", "model"})
    assert b'"messages": [ {"role":"user", "content":"caf\\u00e9"} ]' in out
    assert json.loads(out) == {"model": "m", "messages": [{"role": "user", "content": "café"}], "temperature": 0.2}


def test_a_non_ascii_history_is_spliced_at_the_right_bytes():
    """The spans are indices into the text; the copy is made from the bytes, where a
    non-ASCII character before, inside or after the history takes two to four bytes."""
    raw = json.dumps({"system": "naïve ☃", "messages": [{"role": "user", "content": "𝄞 " * 50}],
                      "model": "gpt-4o", "tools": ["é"]}, ensure_ascii=False).encode()
    body = parse_body(raw, "messages")
    body.data["model"] = "m—2"
    out = body.encode({"model"})
    assert out == raw.replace('"model": "gpt-4o"'.encode(), '"model":"m—2"'.encode())


@settings(max_examples=300, deadline=None)
@given(items=st.lists(st.fixed_dictionaries({"content": values}, optional={"role": st.text(max_size=4), "x": values}),
                      min_size=1, max_size=8),
       style=st.integers(0, 2), data=st.data())
def test_a_message_list_splice_reads_only_what_it_edits_and_equals_a_scan(items, style, data):
    """Edits into the message list, with its elements' ends known (``Listed``), give the
    same text as the splice that scans every element; every untouched element's bytes stay."""
    from interceptor.dialects.body import Edit
    text = dump({"model": "m", "messages": items, "z": 1}, style)
    n = len(items)
    edits = []
    for k in data.draw(st.lists(st.integers(0, n - 1), unique=True, max_size=3)):
        content = items[k]["content"]
        kind = data.draw(st.sampled_from(["element", "content", "run"] if isinstance(content, list) and content
                                         else ["element", "content"]))
        if kind == "element":  # a block written anew with its flag (Dialect.content_edits)
            edits.append(Edit(("messages", k), {"content": data.draw(values), "is_error": True}))
        elif kind == "content":
            edits.append(Edit(("messages", k, "content"), data.draw(values)))
        else:  # a run of content blocks (Anthropic's text blocks between tool results)
            lo = data.draw(st.integers(0, len(content) - 1))
            hi = data.draw(st.integers(lo + 1, len(content)))
            edits.append(Edit(("messages", k, "content"), data.draw(st.lists(values, min_size=1, max_size=3)), (lo, hi)))
    listed = parse_body(text.encode(), "messages")
    scanned = parse_body(text.encode())
    assert listed.listed is not None and len(listed.listed.ends) == n
    for body in (listed, scanned):
        for edit in sorted(edits, key=lambda e: (*e.path, *(e.run or ())), reverse=True):
            edit.apply(body.data)
    out = listed.encode(set(), edits)
    assert out == scanned.encode(set(), edits)
    assert json.loads(out) == listed.data
    # The elements as parsed (shared with the session's remembered lists) were not changed.
    assert listed.listed.items == json.loads(text)["messages"]

"""``header`` and ``drop`` (dialects/base.py) read and remove mitmproxy's header fields in one
pass instead of its per-lookup walk: they must answer exactly as ``Headers.get``
and ``Headers.pop`` do, whatever the names' case, repeated fields and non-UTF-8 bytes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from mitmproxy import http

from interceptor.dialects.base import drop, header

NAMES = ["authorization", "x-api-key", "content-type", "x-stainless-retry-count", "proxy-authorization", "connection"]
name = st.sampled_from(NAMES + ["x-api-keys", "api-key", "accept"]).flatmap(
    lambda n: st.sampled_from([n, n.upper(), n.title(), n.capitalize()]))
value = st.binary(max_size=12) | st.sampled_from([b"Bearer sk-1", b"caf\xc3\xa9", b"\xff\xfe", b""])
fields = st.lists(st.tuples(name.map(str.encode), value), max_size=10)


@settings(max_examples=400, deadline=None)
@given(fields=fields, asked=st.sampled_from(NAMES + ["missing"]), default=st.sampled_from([None, "", "0"]))
def test_header_reads_as_mitmproxy_reads(fields, asked, default):
    headers = http.Headers(fields)
    assert header(headers, asked, default) == headers.get(asked, default)
    assert header({asked: "plain"}, asked, default) == "plain"  # a plain mapping is asked its get


@settings(max_examples=400, deadline=None)
@given(fields=fields, names=st.lists(st.sampled_from(NAMES + ["missing"]), max_size=4))
def test_drop_removes_as_mitmproxy_pops(fields, names):
    mine, theirs = http.Headers(fields), http.Headers(fields)
    drop(mine, names)
    for n in names:
        theirs.pop(n, None)
    assert mine.fields == theirs.fields
    plain = {"authorization": "x", "accept": "y"}
    drop(plain, names)
    assert ("authorization" in plain) == ("authorization" not in names) and plain["accept"] == "y"

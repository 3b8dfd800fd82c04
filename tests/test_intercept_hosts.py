"""intercept_hosts adds to the dialects' own hosts; replacing them is asked for by name.

One ``--set intercept_hosts=X`` used to replace the whole built-in list, so an operator adding
a gateway host silently stopped claiming api.openai.com (and the Gemini host). Each test starts
a real mitmdump; what is claimed is read from the start banner and from the proxy's own answer
(an unclaimed host would be passed through, never answered 401 in a provider's shape).
"""

from __future__ import annotations

import re
import ssl

import httpx
import pytest

from interceptor.dialects import default_hosts

GEMINI = "generativelanguage.googleapis.com"
EXTRA = "llm.example.org"


def claimed(proc) -> list[str]:
    """The hosts the start banner names."""
    [line] = re.findall(r"interceptor: claiming model traffic to: (.*)", proc.log())
    return [h.strip() for h in line.split("(")[0].split(",")]


def answer(proc, url: str, body: dict) -> httpx.Response:
    """A model request without any session secret, through the proxy."""
    with httpx.Client(proxy=proc.url, verify=ssl.create_default_context(cafile=str(proc.ca_bundle)),
                      timeout=30) as c:
        return c.post(url, json=body)


def test_one_added_host_keeps_every_dialects_own(start_proxy):
    proc = start_proxy({"intercept_hosts": EXTRA})
    assert set(claimed(proc)) == {*default_hosts(), EXTRA}
    assert GEMINI in default_hosts()
    # Both claimed: the proxy answers for them itself, each in its dialect's shape.
    r = answer(proc, f"https://{GEMINI}/v1beta/models/gemini-2.5-flash:generateContent", {"contents": []})
    assert r.status_code == 401 and r.json()["error"]["status"] == "UNAUTHENTICATED", r.text
    r = answer(proc, f"https://{EXTRA}/v1/chat/completions", {"model": "m", "messages": []})
    assert r.status_code == 401 and "session secret" in r.json()["error"]["message"], r.text


def test_replacing_the_list_is_explicit(start_proxy):
    proc = start_proxy({"intercept_default_hosts": "false", "intercept_hosts": [EXTRA, "api.openai.com"]})
    assert claimed(proc) == ["api.openai.com", EXTRA]
    assert "intercept_default_hosts=false" in proc.log()
    r = answer(proc, f"https://{EXTRA}/v1/chat/completions", {"model": "m", "messages": []})
    assert r.status_code == 401, r.text


def test_nothing_to_claim_is_refused_at_start(start_proxy):
    from mitm import MitmProcess

    proc = MitmProcess(options={"intercept_default_hosts": "false"})
    try:
        proc.start(expect_failure=True)
        assert proc.wait() == 1
        assert "intercept_default_hosts=false needs intercept_hosts" in proc.log()
    finally:
        proc.cleanup()


@pytest.mark.parametrize("bad", ["https://x.org", "a b"])
def test_a_bad_host_is_refused_at_start(bad):
    from mitm import MitmProcess

    proc = MitmProcess(options={"intercept_hosts": bad})
    try:
        proc.start(expect_failure=True)
        assert proc.wait() == 1 and "intercept_hosts: not a host name" in proc.log()
    finally:
        proc.cleanup()

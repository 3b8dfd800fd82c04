"""Claude Code under a network policy: its WebSearch tool makes a request of its
own whose only tool is Anthropic's hosted web search; with ``provider_tools: strip`` the
proxy answers that request itself (search unavailable), the model's next turn gets that as
the tool's result, and only the two real turns reach the provider."""

from __future__ import annotations

import json
import uuid

from harness import FINAL, check_ran, node_harness, run_harness, trace_of
from harness import hproxy, hsim, sim  # noqa: F401 (this module's fixtures)
from interceptor.addons.gateway.policy.network import SEARCH_UNAVAILABLE
from provider import Reply, ToolCall


def test_claude_codes_websearch_is_answered_locally_under_strip(hproxy, sim, tmp_path):
    claude = [node_harness("claude"), "-p", "When was Python 3.14 released? Search the web.",
              "--allowedTools", "WebSearch"]
    sim.script(
        Reply(reasoning="Search.", tool_calls=[ToolCall(name="WebSearch", arguments={"query": "python 3.14 release"})]),
        Reply(reasoning="No search here.", text=["The answer is ", FINAL]),
    )
    sid = f"claude-websearch-{uuid.uuid4().hex[:8]}"
    result = run_harness(hproxy, sim, claude, sid=sid, cwd=tmp_path / "work",
                         session={"network": {"provider_tools": "strip"}})
    check_ran(result)
    requests = [r.json for r in sim.model_requests()]
    assert len(requests) == 2  # the search request never left the proxy
    assert all("web_search" not in json.dumps(r.get("tools")) for r in requests)
    results = [b for m in requests[1]["messages"] if m["role"] == "user" and isinstance(m["content"], list)
               for b in m["content"] if b.get("type") == "tool_result"]
    assert results and SEARCH_UNAVAILABLE in json.dumps(results[-1]), results
    trace = trace_of(hproxy, sid)
    local = [c for c in trace.calls if c.node is None]
    assert len(local) == 1 and local[0].status == 200
    assert [(o.key, o.reason) for o in local[0].overrides] == [("tools.web_search", "network_policy"),
                                                               ("tool_choice", "network_policy")]
    assert trace.num_turns == 2

"""The HTML viewer (``replay_trace.py html``) in a real headless Chromium.

Traces recorded for real: Claude Code through the proxy, an SDK conversation compacted into a
second branch, a collect_tokens session on the simulator playing vLLM (token ids, logprobs and
the proxy's own response rewrites), and, because no request hook exists yet to make one, a
request rewrite with its original and delivered text written by the Recorder in the shape the
hooks will write. Each page is opened from ``file://``; the DevTools network log must hold
nothing but the page itself, and a screenshot of each view is written to
``test-artifacts/viewer/``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from interceptor.scripts import viewer
from interceptor.trace import Message, ModelCall, Reasoning, Recorder, Request, Response, Store, ToolCall, Usage, read_trace
from browser import Browser, chromium_bin
from clients import session_clients
from harness import FINAL, PROMPT, TOOL_OUTPUT, check_ran, node_harness, run_harness, trace_of
from harness import hproxy, hsim, sim  # noqa: F401 (this module's fixtures)
from mitm import ROOT
from provider import Reply
from provider import ToolCall as SimToolCall
from test_trace_proxy import FakeVLLM, chat_loop, sealed_trace, step_reply

ARTIFACTS = ROOT / "test-artifacts" / "viewer"
REPLAY = [sys.executable, str(ROOT / "scripts" / "replay_trace.py")]


@pytest.fixture(scope="module")
def browser():
    chromium_bin()  # skips, saying why, where there is none
    with Browser() as b:
        yield b


@pytest.fixture
def session(hproxy, sim, harness_env):
    def create(**config):
        config.setdefault("upstream", {"base_url": sim.url("/v1")})
        s = hproxy.create_session(**config)
        harness_env(s["env"])
        return s

    yield create
    sim.default = None


def html_of(*traces: Path, out: Path) -> Path:
    """The page as a user makes it: the replay_trace.py subcommand."""
    result = subprocess.run([*REPLAY, "html", *map(str, traces), "-o", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return out


def open_view(browser: Browser, page: Path) -> None:
    browser.open(page.as_uri())
    assert browser.requests() == [page.as_uri()], "the page asked for something besides itself"
    assert browser.console_errors() == []


def check_branches_and_calls(browser: Browser, trace, name: str) -> None:
    """Every branch in the tree, each branch's every message in order when selected (the
    sampled ones marked), every call in the calls table; a screenshot of each view."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    items = browser.eval("[...document.querySelectorAll('#branches .branch')].map(e => +e.dataset.branch)")
    assert items == list(range(len(trace.branches)))
    for b in trace.branches:
        browser.click(f'#branches [data-branch="{b.index}"]')
        browser.click('[data-tab="conversation"]')
        browser.wait(f"document.body.dataset.rendered === 'conversation:{b.index}'")
        assert browser.eval("[...document.querySelectorAll('#view .card[data-node]')].map(e => +e.dataset.node)") == b.nodes
        sampled = [i for i in b.nodes if trace.nodes[i].sampled]
        assert browser.eval("[...document.querySelectorAll('#view .card.sampled')].map(e => +e.dataset.node)") == sampled
        # each sampled reply's call is one click away
        for i in sampled:
            call = next(c for c in trace.calls if c.node == i)
            assert browser.eval(f"document.querySelector('#node-{i} a[data-call]').dataset.call") == call.id
        browser.screenshot(ARTIFACTS / f"{name}-branch{b.index}.png")
    browser.click('[data-tab="calls"]')
    assert browser.eval("[...document.querySelectorAll('#calls tbody tr')].map(e => e.dataset.call)") == \
        [c.id for c in trace.calls]
    browser.screenshot(ARTIFACTS / f"{name}-calls.png")
    # sortable: by status descending, then back
    browser.click("#calls th:nth-child(5)")
    browser.click("#calls th:nth-child(5)")
    statuses = browser.eval("[...document.querySelectorAll('#calls tbody tr td:nth-child(5)')].map(e => e.textContent)")
    assert statuses == sorted(statuses, reverse=True)


def test_claude_code_trace(browser, hproxy, sim, tmp_path):
    sim.script(
        Reply(reasoning="The user wants a command run.",
              tool_calls=[SimToolCall(name="Bash", arguments={"command": f"echo {TOOL_OUTPUT}", "description": "Print"})]),
        Reply(reasoning="It printed.", text=["The answer is ", FINAL]),
    )
    sid = f"viewer-claude-{uuid.uuid4().hex[:8]}"
    claude = [node_harness("claude"), "-p", PROMPT, "--allowedTools", "Bash"]
    check_ran(run_harness(hproxy, sim, claude, sid=sid, cwd=tmp_path / "work",
                          session={"model": "claude-session-model"}))
    trace = trace_of(hproxy, sid)
    page = html_of(hproxy.trace_dir / f"{sid}.msgpack", out=tmp_path / "claude.html")
    open_view(browser, page)
    assert f"trace {sid}" in browser.eval("document.querySelector('header h1').textContent")
    check_branches_and_calls(browser, trace, "claude-code")
    browser.click('[data-tab="conversation"]')
    browser.wait(f"document.body.dataset.rendered === 'conversation:{len(trace.branches) - 1}'")
    text = browser.eval("document.querySelector('#view').textContent")
    # tool-call arguments pretty-printed, reasoning behind its toggle, the tool's result
    assert f'"command": "echo {TOOL_OUTPUT}"' in text
    assert browser.eval("[...document.querySelectorAll('details.reason')].map(d => d.textContent)")[-1].endswith("It printed.")
    assert TOOL_OUTPUT in browser.eval("[...document.querySelectorAll('.card.tool')].map(e => e.textContent).join()")
    assert FINAL in text
    # the call's record one click away: its model is the session's
    last = trace.calls[-1]
    browser.click(f'#node-{last.node} a[data-call="{last.id}"]')
    assert '"model": "claude-session-model"' in browser.eval(f"document.querySelector('#node-{last.node} .calldetail').textContent")
    browser.screenshot(ARTIFACTS / "claude-code-call.png")
    # no secret on the page: the session secret never reached the trace, nor the real key
    html = page.read_text()
    assert "sk-ic-" not in html and "sk-real-provider-key" not in html


def test_compaction_trace_shows_two_branches_and_their_fork(browser, session, hproxy, sim, tmp_path):
    s = session()
    sim.script(*[step_reply(k, 6) for k in range(7)])
    oai, _ = session_clients(s)
    history, _ = chat_loop(oai, 4, stream=True)
    chat_loop(oai, 3, stream=True, messages=[history[0], {"role": "user", "content": "Summary so far: ran steps 0-3. Go on."}])
    trace = sealed_trace(hproxy, s)
    assert len(trace.branches) == 2
    page = html_of(Path(s["trace_path"]), out=tmp_path / "compaction.html")
    open_view(browser, page)
    check_branches_and_calls(browser, trace, "compaction")
    tree = browser.eval("[...document.querySelectorAll('#branches .branch')].map(e => e.textContent)")
    assert "4 turns" in tree[0] and "root" in tree[0]
    assert "3 turns" in tree[1] and "forks from branch 0 after message 1 (system)" in tree[1]


def test_token_ids_and_the_proxys_response_rewrites(browser, session, hproxy, sim, tmp_path):
    sim.strict = False  # a vLLM upstream (return_token_ids): OpenAI's rules are not its rules
    s = session(collect_tokens=True)
    replies = [step_reply(0, 3), step_reply(1, 3).replace(reasoning="Think about step 1."),
               step_reply(2, 3), step_reply(3, 3)]
    sim.default = FakeVLLM(replies)
    oai, _ = session_clients(s)
    chat_loop(oai, 4, stream=True)
    trace = sealed_trace(hproxy, s)
    assert all(b.token_ids for b in trace.branches) and len(trace.response_rewrites) == 4
    page = html_of(Path(s["trace_path"]), out=tmp_path / "tokens.html")
    open_view(browser, page)
    check_branches_and_calls(browser, trace, "tokens")
    for b in trace.branches:
        browser.click(f'#branches [data-branch="{b.index}"]')
        browser.click('[data-tab="tokens"]')
        browser.wait(f"document.body.dataset.rendered === 'tokens:{b.index}'")
        cells = browser.eval("[...document.querySelectorAll('#tokens .tok')].map(e => "
                             "[+e.textContent, e.classList.contains('s'), e.title, getComputedStyle(e).backgroundColor])")
        assert [c[0] for c in cells] == b.token_ids
        assert [c[1] for c in cells] == b.sampled_mask
        grey = {c[3] for c in cells if not c[1]}
        assert len(grey) == 1  # mask false: one grey
        for (tok, sampled, title, colour), lp in zip(cells, b.logprobs):
            assert f"token {tok} " in title  # the id on hover
            if sampled:
                assert f"logprob {lp:.4f}" in title and colour not in grey
        browser.screenshot(ARTIFACTS / f"tokens-branch{b.index}-tokens.png")
    # Collect's rewrites shown at the reply they touched, and listed
    browser.click('[data-tab="conversation"]')
    browser.wait(f"document.body.dataset.rendered === 'conversation:{len(trace.branches) - 1}'")
    for c in trace.calls:
        if c.node in trace.branches[-1].nodes:
            box = browser.eval(f"document.querySelector('#node-{c.node} .rewrite').textContent")
            assert "collect_tokens" in box and "prompt_token_ids" in box
    browser.click('[data-tab="rewrites"]')
    assert browser.eval("document.querySelectorAll('#view .rewrite').length") == 4


def _rewrite_trace(path: Path) -> tuple[str, str]:
    """A request hook's rewrite of a tool result as the hooks record it (the
    record's own fields: direction, by, call, original, delivered), written by the real
    Recorder; the delivered text is what the graph holds."""
    original = "PASSED 3 tests. (hint leaked: the expected answer is 42)"
    delivered = "PASSED 3 tests."
    store = Store()
    rec = Recorder(path, {"id": "rewritten", "agent": {"name": "sdk"}, "task": {"id": "t-1"}}, store=store)
    system, user = Message(role="system", content="Be careful."), Message(role="user", content="run the tests")
    ask = Message(role="assistant", reasoning=[Reasoning(text="Run them.")],
                  tool_calls=[ToolCall(id="call_1", name="bash", arguments='{"cmd":"pytest"}')])
    result = Message(role="tool", tool_call_id="call_1", content=delivered)
    for k, (prompt, reply) in enumerate([([system, user], ask),
                                         ([system, user, ask, result], Message(role="assistant", content="Done."))]):
        call = ModelCall(id=f"call-{k}", dialect="chat", status=200, started_at=1.0, ended_at=2.0)
        if k == 1:
            rec.record_rewrite({"direction": "request", "by": "hide_answer", "call": call.id,
                                "message": "tool call_1", "original": original, "delivered": delivered})
        rec.commit_turn(Request(messages=prompt), Response(message=reply, finish_reason="stop",
                                                           usage=Usage(input_tokens=5, output_tokens=2)), call)
    rec.seal("done", reward=0.5, stopped_by="control", metrics={"tests_passed": 3})
    store.flush(10)
    store.close()
    return original, delivered


def test_a_rewrite_shows_its_original_beside_what_was_delivered(browser, tmp_path):
    trace_path = tmp_path / "rewritten.msgpack"
    original, delivered = _rewrite_trace(trace_path)
    page = html_of(trace_path, out=tmp_path / "rewrite.html")
    open_view(browser, page)
    check_branches_and_calls(browser, read_trace(trace_path), "rewrite")
    header = browser.eval("document.querySelector('#summary').textContent")
    assert "done (by control)" in header and "reward0.5" in header
    assert '"tests_passed": 3' in browser.eval("document.querySelector('.metas').textContent")
    browser.click('[data-tab="conversation"]')
    browser.wait("document.body.dataset.rendered === 'conversation:0'")
    box = "document.querySelector('.rewrite[data-rewrite=\"call-1\"]')"
    assert browser.eval(f"{box}.querySelector('.original').textContent") == "original" + original
    assert browser.eval(f"{box}.querySelector('.delivered').textContent") == "delivered" + delivered
    assert "hide_answer" in browser.eval(f"{box}.textContent")
    browser.eval(f"{box}.scrollIntoView()")
    browser.screenshot(ARTIFACTS / "rewrite-conversation.png")


def test_several_traces_make_an_index_linking_to_each_view(browser, tmp_path):
    paths = []
    for k in range(3):
        paths.append(tmp_path / f"t{k}.msgpack")
        _rewrite_trace(paths[-1])
    index = html_of(*paths, out=tmp_path / "out" / "index.html")
    open_view(browser, index)
    rows = browser.eval("[...document.querySelectorAll('#index tbody tr')].map(e => "
                        "[e.querySelector('a').getAttribute('href'), e.textContent])")
    assert len(rows) == 3
    assert all("done" in text and "0.5" in text for _, text in rows)
    browser.screenshot(ARTIFACTS / "index.png")
    views = sorted(p.name for p in (tmp_path / "out").iterdir() if p.name != "index.html")
    assert sorted(href for href, _ in rows) == views
    browser.click("#index tbody tr a")
    browser.wait("document.body.dataset.ready && !!document.querySelector('header a')")
    assert browser.eval("document.querySelector('header a').getAttribute('href')") == "index.html"
    assert browser.requests()[-1].endswith(rows[0][0])


def test_the_network_check_sees_a_request_a_page_would_make(browser, tmp_path):
    """The check above can fail: a page that loads a remote image shows it in the log (the
    viewer's CSP then blocks it, which shows as a console error)."""
    path = tmp_path / "t.msgpack"
    _rewrite_trace(path)
    page = html_of(path, out=tmp_path / "leaky.html")
    page.write_text(page.read_text().replace("<body>", '<body><img src="http://127.0.0.1:9/pixel.png">', 1))
    browser.open(page.as_uri())
    assert "http://127.0.0.1:9/pixel.png" in browser.requests()
    assert any("Content Security Policy" in e for e in browser.console_errors())


def test_page_size_and_embedded_data(tmp_path):
    """Each node once in the embedded data, whatever the branches restate; no ``</script>``
    from a message can end the data block."""
    path = tmp_path / "t.msgpack"
    _rewrite_trace(path)
    data = viewer.page_data(path)
    trace = read_trace(path)
    assert len(data["nodes"]) == len(trace.nodes) and [c["id"] for c in data["calls"]] == [c.id for c in trace.calls]
    html = viewer.render({**data, "notes": ["</script><script>alert(1)</script>"]}, title="x")
    assert html.count("</script>") == 2  # the data block's and the page script's own
    embedded = html.split('<script id="data" type="application/json">', 1)[1].split("</script>", 1)[0]
    assert json.loads(embedded)["trace"]["notes"] == ["</script><script>alert(1)</script>"]

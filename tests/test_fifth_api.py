"""Adding an API is one dialect module and one registry line.

The product is copied to a temporary folder; ``tests/fifth/dialect.py`` (an API made up for
this test: its own host, route, key header, body, stream and error shapes) goes in as
``dialects/fifth.py``, and ``dialects/__init__.py`` gains its import and its line in
``REGISTRY``; the test checks that this is the whole difference between the copy and the
product. A real ``mitmdump`` runs from the copy (its own ``interceptor`` package on
``PYTHONPATH``) against an upstream of this test's own that speaks the fifth API, and a client
goes through ``HTTPS_PROXY`` with the session's secret, as a harness would.
"""

from __future__ import annotations

import difflib
import json
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from mitm import MitmProcess
from interceptor.trace import read_trace

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("addons", "client", "dialects", "hooks", "scripts", "trace")
DIALECT = Path(__file__).resolve().parent / "fifth" / "dialect.py"
IMPORT = "from interceptor.dialects.fifth import FIFTH\n"
ENTRY = "    FIFTH,\n"
REAL_KEY = "fifth-real-key-0123456789abcdef"
HOST = "api.fifth.test"


WATCH = """
import json
from interceptor.hooks import HookContext, Request, intercept

@intercept
def watch(request: Request, ctx: HookContext):
    with open(SEEN, "a") as f:
        f.write(json.dumps({"model": request.model, "temperature": request.sampling.temperature,
                            "last": request.messages[-1].text()}) + "\\n")
"""


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for folder in FOLDERS for p in (root / folder).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def add_fifth(into: Path) -> Path:
    """The product copied into ``into/tree`` with the fifth dialect added; returns the folder
    that, on ``PYTHONPATH``, makes ``interceptor`` that copy (as setup.cfg's package_dir maps it)."""
    tree = into / "tree"
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, tree / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(DIALECT, tree / "dialects" / "fifth.py")
    init = tree / "dialects" / "__init__.py"
    lines = init.read_text().splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if line.startswith("from interceptor.dialects."))
    start = next(i for i, line in enumerate(lines) if line.startswith("REGISTRY"))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith(")"))
    lines[end:end] = [ENTRY]
    lines[first:first] = [IMPORT]
    init.write_text("".join(lines))
    pkg = into / "pkg" / "interceptor"
    pkg.mkdir(parents=True)
    for folder in FOLDERS:
        (pkg / folder).symlink_to(tree / folder)
    return into / "pkg"


def diff_of_copy(tree: Path) -> tuple[set[str], list[str]]:
    """The files the copy adds, and the lines it adds or removes in the files both have."""
    ours, theirs = _files(ROOT), _files(tree)
    changed = []
    for name in sorted(ours.keys() & theirs.keys()):
        if ours[name] != theirs[name]:
            a, b = ours[name].decode().splitlines(keepends=True), theirs[name].decode().splitlines(keepends=True)
            changed += [f"{name}: {d}" for d in difflib.ndiff(a, b) if d[:1] in "+-"]
    assert not ours.keys() - theirs.keys()
    return theirs.keys() - ours.keys(), changed


class Upstream(ThreadingHTTPServer):
    """The fifth API's own server: ``POST /v2/answer`` answers JSON or a stream, and keeps each
    request it was sent (path, headers, body) for the test to read."""

    daemon_threads = True

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, str], dict]] = []
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v2"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.server.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
        said = [t["says"] for t in body["turns"] if t["who"] == "user"][-1]
        reply = f"{body['engine']} heard {said}"
        # token ids for training: a character's code point is its token
        tokens = {"tokens": {"prompt": [ord(c) for t in body["turns"] for c in t["says"]],
                             "sampled": [ord(c) for c in reply]}} if body.get("want_tokens") else {}
        if self.headers.get("x-fifth-key") != REAL_KEY:
            self._send(401, "application/json", json.dumps({"fault": {"code": 401, "reason": "bad key"}}).encode())
        elif body.get("stream"):
            events = [("piece", {"says": f"{body['engine']} heard "}), ("piece", {"says": said}),
                      ("done", {"why": "stop", "spent": {"in": 7, "out": 3}, **tokens})]
            self._send(200, "text/event-stream",
                       b"".join(f"event: {e}\ndata: {json.dumps(d)}\n\n".encode() for e, d in events))
        else:
            self._send(200, "application/json", json.dumps(
                {"answer_id": "a-1", "engine": body["engine"], "says": reply,
                 "why": "stop", "spent": {"in": 7, "out": 3}, **tokens}).encode())

    def _send(self, status: int, kind: str, data: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fifth(tmp_path):
    pkg = add_fifth(tmp_path)
    upstream = Upstream()
    proc = MitmProcess(workdir=tmp_path / "run", options={
        "intercept_upstream": upstream.url, "intercept_api_key_env": "FIFTH_REAL_KEY", "flow_detail": 3},
        env={"FIFTH_REAL_KEY": REAL_KEY, "PYTHONPATH": str(pkg)})
    proc.script_path = tmp_path / "tree" / "addons" / "interception.py"
    try:
        yield proc.start(), upstream, tmp_path / "tree"
    finally:
        proc.cleanup()
        upstream.shutdown()


def _client(session: dict) -> httpx.Client:
    env = session["env"]
    return httpx.Client(proxy=env["HTTPS_PROXY"], verify=env["SSL_CERT_FILE"], timeout=30)


def test_the_copy_differs_by_the_module_and_its_registry_line(tmp_path):
    add_fifth(tmp_path)
    added, changed = diff_of_copy(tmp_path / "tree")
    assert added == {"dialects/fifth.py"}
    assert changed == [f"dialects/__init__.py: + {IMPORT}", f"dialects/__init__.py: + {ENTRY}"]


def test_a_fifth_api_is_claimed_imposed_keyed_routed_and_recorded(fifth):
    proxy, upstream, tree = fifth
    seen = tree.parent / "hooks-saw.jsonl"
    hook = tree.parent / "watch.py"
    hook.write_text(WATCH.replace("SEEN", repr(str(seen))))
    session = proxy.create_session(model="fifth-large", sampling={"temperature": 0.25},
                                   info={"x-fifth-key": "fifth-leaked-in-info-0123"}, hooks={"module": str(hook)})
    assert session["env"]["FIFTH_API_KEY"] == session["model_secret"]  # the dialect's key variable
    turns = [{"who": "system", "says": "be brief"}, {"who": "user", "says": "hello"}]
    with _client(session) as client:
        plain = client.post(f"https://{HOST}/v2/answer", headers={"x-fifth-key": session["model_secret"]},
                            json={"engine": "fifth-small", "turns": turns, "heat": 1.0})
        assert plain.status_code == 200, plain.text
        assert plain.json()["says"] == "fifth-large heard hello"
        streamed = client.post(f"https://{HOST}/v2/answer", headers={"x-fifth-key": session["model_secret"]},
                               json={"engine": "fifth-small", "stream": True, "heat": 1.0,
                                     "turns": [*turns, {"who": "model", "says": plain.json()["says"]},
                                               {"who": "user", "says": "again"}]})
        assert streamed.status_code == 200 and "event: done" in streamed.text
    # routed to the session's upstream, the session's model and sampling imposed, the real key swapped in
    assert [path for path, _, _ in upstream.seen] == ["/v2/answer", "/v2/answer"]
    for _, headers, body in upstream.seen:
        assert headers["x-fifth-key"] == REAL_KEY
        assert body["engine"] == "fifth-large" and body["heat"] == 0.25
        assert session["model_secret"] not in json.dumps(headers)

    status, _ = proxy.api("DELETE", f"sessions/{session['id']}")
    assert status == 200
    trace = read_trace(session["trace_path"])
    assert trace.num_turns == 2
    assert [c.dialect for c in trace.calls] == ["fifth", "fifth"]
    assert [c.model for c in trace.calls] == ["fifth-large", "fifth-large"]
    assert trace.calls[0].requested_model == "fifth-small"
    assert {o.key for o in trace.calls[0].overrides} >= {"engine", "heat"}
    assert [c.sampling.temperature for c in trace.calls] == [0.25, 0.25]  # read back by the dialect
    # a request hook sees what the upstream is asked: the session's model and sampling
    saw = [json.loads(line) for line in seen.read_text().splitlines()]
    assert saw == [{"model": "fifth-large", "temperature": 0.25, "last": "hello"},
                   {"model": "fifth-large", "temperature": 0.25, "last": "again"}]
    texts = [m.text() for m in trace.branches[-1].messages]
    assert texts == ["be brief", "hello", "fifth-large heard hello", "again", "fifth-large heard again"]
    blob = Path(session["trace_path"]).read_bytes()
    assert b"fifth-leaked-in-info" not in blob and REAL_KEY.encode() not in blob


def test_a_bad_secret_gets_the_fifth_apis_error_and_nothing_leaves(fifth):
    proxy, upstream, tree = fifth
    session = proxy.create_session()
    wrong = "not-a-session-key-7f3a9c"
    with _client(session) as client:
        refused = client.post(f"https://{HOST}/v2/answer", headers={"x-fifth-key": wrong},
                              json={"engine": "e", "turns": [{"who": "user", "says": "hi"}]})
        lost = client.post(f"https://{HOST}/v2/elsewhere", headers={"x-fifth-key": session["model_secret"]},
                           json={})
        status = client.get(f"https://{HOST}/v2/status", headers={"x-fifth-key": session["model_secret"]})
    assert status.status_code == 200 and status.json() == {"status": "answered by the proxy"}
    assert refused.status_code == 401 and set(refused.json()) == {"fault"}
    assert refused.json()["fault"]["code"] == 401
    assert lost.status_code == 404 and set(lost.json()) == {"fault"}  # the host's own shape
    assert upstream.seen == []
    # the tool route knows the session by the fifth API's key header, as its harness sends it
    req = httpx.post(f"{proxy.url}/_interceptor/tool", json={}, headers={"x-fifth-key": session["model_secret"]})
    assert req.status_code == 400, req.text  # the empty call, not a 401
    proxy.stop()
    log = proxy.log()
    assert "x-fifth-key" in log.lower()  # flow_detail shows the header...
    assert wrong not in log and session["model_secret"] not in log  # ...redacted


def test_the_worker_front_and_the_upstream_declarations_know_the_fifth_api(tmp_path):
    """The worker front (scripts/serve.py) reads a control route's secret where the fifth API
    sends its key; an operator declares its provider's upstream by name alone."""
    pkg = add_fifth(tmp_path)
    out = subprocess.run([sys.executable, "-c", "from interceptor.scripts.serve import haproxy_config; "
                          "from interceptor.addons.gateway.sessions.upstream import parse_upstreams; "
                          "print(haproxy_config('127.0.0.1', 8080, {'w1': 9001})); "
                          "print(parse_upstreams('[\"fifth\"]')['fifth'].public())"],
                         env={"PYTHONPATH": str(pkg)}, capture_output=True, text=True, check=True).stdout
    assert "set-var(txn.bearer) req.hdr(x-fifth-key)" in out
    assert "'base_url': 'https://api.fifth.test/v2', 'api_key_env': 'FIFTH_API_KEY'" in out


def test_a_fifth_apis_token_fields_are_asked_recorded_and_kept_from_the_harness(fifth):
    """The fifth dialect's own token fields (``FifthTokens``): a ``collect_tokens`` session asks
    for them, the trace holds them, the harness's answers (JSON and stream) do not."""
    proxy, upstream, tree = fifth
    session = proxy.create_session(collect_tokens=True)
    turns = [{"who": "user", "says": "hello"}]
    with _client(session) as client:
        plain = client.post(f"https://{HOST}/v2/answer", headers={"x-fifth-key": session["model_secret"]},
                            json={"engine": "e", "turns": turns})
        streamed = client.post(f"https://{HOST}/v2/answer", headers={"x-fifth-key": session["model_secret"]},
                               json={"engine": "e", "stream": True,
                                     "turns": [*turns, {"who": "model", "says": plain.json()["says"]},
                                               {"who": "user", "says": "again"}]})
    assert plain.status_code == streamed.status_code == 200
    assert "tokens" not in plain.json() and plain.json()["says"] == "e heard hello"
    assert '"tokens"' not in streamed.text and "event: done" in streamed.text
    assert [body.get("want_tokens") for _, _, body in upstream.seen] == [True, True]
    proxy.api("DELETE", f"sessions/{session['id']}")
    trace = read_trace(session["trace_path"])
    assert trace.num_turns == 2
    text = "hello" + "e heard hello" + "again" + "e heard again"
    assert trace.branches[-1].token_ids == [ord(c) for c in text]
    removed = [r for r in trace.response_rewrites if r.by == "collect_tokens"]
    assert [(r.body, r.removed) for r in removed] == [("json", ["tokens"]), ("sse", ["tokens"])]

"""A trace is never overwritten, moved or appended to by a later trace: the file of a new trace
is created exclusively, and a session whose file exists already is refused, whichever way it
is made (the control API: 409 in its JSON shape; a sessions file: the proxy does not start,
naming the file); the default session takes a new name instead. Checked on the bytes
(sha256 before and after), through a real mitmdump restarted on the same trace folder.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from clients import KEY_ENV, REAL_KEY
from interceptor.trace import Recorder, Store, read_trace
from interceptor.trace.store import TraceExistsError
from mitm import MitmProcess


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def siblings(path: Path) -> list[str]:
    """The files beside ``path`` but the default sessions' (each start of a proxy makes one)."""
    return sorted(p.name for p in path.parent.iterdir() if not p.name.startswith("default-"))


def test_a_recorder_on_an_existing_file_is_refused_and_the_file_is_untouched(tmp_path):
    store = Store()
    path = tmp_path / "r.msgpack"
    first = Recorder(path, {"id": "r"}, store=store)
    first.seal("done")
    store.flush(timeout=10)
    before = digest(path)
    with pytest.raises(TraceExistsError, match=f"{path}.*exists"):
        Recorder(path, {"id": "r"}, store=store)
    store.flush(timeout=10)
    assert digest(path) == before and siblings(path) == ["r.msgpack"]
    assert read_trace(path).sealed
    # an empty file is somebody's too (a trace whose header is still queued, another tool's)
    empty = tmp_path / "e.msgpack"
    empty.touch()
    with pytest.raises(TraceExistsError):
        Recorder(empty, {"id": "e"}, store=store)
    store.flush(timeout=10)
    assert empty.read_bytes() == b""


def _start(workdir: Path, sim, **options) -> MitmProcess:
    opts = {"intercept_upstream": sim.url("/v1"), "intercept_api_key_env": KEY_ENV, **options}
    return MitmProcess(options=opts, env={KEY_ENV: REAL_KEY}, workdir=workdir)


def test_a_restart_on_the_same_trace_folder_refuses_a_sealed_sessions_id(sim, tmp_path):
    first = _start(tmp_path, sim).start()
    try:
        s = first.create_session(id="night-1", upstream={"base_url": sim.url("/v1")})
        status, summary = first.api("DELETE", "sessions/night-1")
        assert status == 200 and summary["sealed"]
    finally:
        first.cleanup()
    path = Path(s["trace_path"])
    assert read_trace(path).sealed
    before, names = digest(path), siblings(path)

    again = _start(tmp_path, sim).start()
    try:
        status, body = again.api("POST", "sessions", {"id": "night-1", "upstream": {"base_url": sim.url("/v1")}})
        assert status == 409, (status, body)
        assert isinstance(body, dict) and str(path) in json.dumps(body) and "exists" in json.dumps(body), body
        # nothing of the refused session is left behind: not in the registry, not on disk
        assert again.api("GET", "sessions/night-1")[0] == 404
        assert digest(path) == before and siblings(path) == names
        # another id still works, in the same folder
        assert again.create_session(id="night-2", upstream={"base_url": sim.url("/v1")})["trace_path"] \
            == str(path.with_name("night-2.msgpack"))
    finally:
        again.cleanup()
    assert digest(path) == before and read_trace(path).sealed


def test_a_sessions_file_naming_an_existing_trace_stops_the_proxy_naming_the_file(sim, tmp_path):
    """An evaluator restarting a night's run with the same sessions file and trace folder:
    the proxy refuses to start and names the file, rather than filling ``<id>.msgpack`` with a
    new trace the evaluator's tools would take for the old one (or hiding the new one under
    another name they do not know)."""
    sessions = tmp_path / "sessions.json"
    sessions.write_text(json.dumps([{"id": "a", "upstream": {"base_url": sim.url("/v1")}},
                                    {"id": "b", "upstream": {"base_url": sim.url("/v1")}}]))
    _start(tmp_path, sim, intercept_sessions=str(sessions)).start().cleanup()
    traces = tmp_path / "traces"
    sealed = {p.name: digest(p) for p in traces.iterdir()}
    assert set(sealed) >= {"a.msgpack", "b.msgpack"} and read_trace(traces / "b.msgpack").sealed
    (traces / "a.msgpack").rename(tmp_path / "a-moved.msgpack")  # only b's file is in the way
    del sealed["a.msgpack"]

    again = _start(tmp_path, sim, intercept_sessions=str(sessions))
    again.start(timeout=30, expect_failure=True)
    try:
        assert again.wait(30) == 1
        out = again.log()
    finally:
        again.cleanup()
    lines = [line for line in out.splitlines() if "interceptor: cannot start" in line]
    assert len(lines) == 1 and str(traces / "b.msgpack") in lines[0] and "intercept_sessions" in lines[0], out
    # b's trace is as it was, and a's was not created either: all or nothing
    assert {p.name: digest(p) for p in traces.iterdir() if p.name != "a.msgpack"} == sealed
    assert not (traces / "a.msgpack").exists()


def test_the_default_session_takes_a_new_file_at_each_start(sim, tmp_path):
    names = []
    for _ in range(2):
        _start(tmp_path, sim).start().cleanup()
        names.append(sorted(x.name for x in (tmp_path / "traces").iterdir()))
    assert len(names[0]) == 1 and len(names[1]) == 2 and names[0][0] in names[1]


@pytest.mark.parametrize("which", ["the source itself", "another trace", "an empty file"])
def test_resend_never_overwrites_a_trace_it_did_not_write(tmp_path, which):
    """``resend --out`` resumes an earlier resend of the same source (its file set aside,
    taken over, then removed); any other file there is refused before anything is sent."""
    import shutil

    from interceptor.addons.gateway.sessions.upstream import Upstream
    from interceptor.scripts.resend import ResendError, resend
    from interceptor.trace.messages import Sampling

    data = Path(__file__).resolve().parent / "data"
    source = tmp_path / "source.msgpack"
    shutil.copyfile(data / "trace-v3.msgpack", source)
    out = {"the source itself": source, "another trace": tmp_path / "other.msgpack",
           "an empty file": tmp_path / "empty.msgpack"}[which]
    if which == "another trace":
        shutil.copyfile(data / "trace-v2-last.msgpack", out)
    elif which == "an empty file":
        out.touch()
    before, names = digest(out), siblings(out)
    up = Upstream(name="nowhere", base_url="http://127.0.0.1:9/v1", api_key_env="PATH")
    with pytest.raises(ResendError, match="never overwritten"):
        resend(str(source), out, up, model="m", sampling=Sampling(), branch=None, concurrency=1,
               collect_tokens=False)
    assert digest(out) == before and siblings(out) == names

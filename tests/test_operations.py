"""A proxy that runs rollouts all night: memory that stays flat, a listing that pages, sealed
sessions that stay answerable, and a default trace that is never renamed."""

from __future__ import annotations

import httpx

from provider import Reply

PAGE = 100


def _rss_kb(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _rollouts(proxy, client: httpx.Client, n: int, offset: int) -> list[str]:
    ids = []
    for i in range(offset, offset + n):
        s = proxy.create_session(id=f"r{i:05d}", model="m")
        r = client.post("https://api.anthropic.com/v1/messages", headers={"x-api-key": s["model_secret"]},
                        json={"model": "x", "max_tokens": 8, "messages": [{"role": "user", "content": f"task {i}"}]})
        assert r.status_code == 200, r.text
        status, summary = proxy.api("DELETE", f"sessions/{s['id']}")
        assert status == 200 and summary["released"] is True and summary["turns"] == 1
        ids.append(s["id"])
    return ids


def test_two_thousand_rollouts_keep_memory_flat_and_the_listing_pages(start_proxy, sim):
    sim.script(*[Reply(text="ok")] * 2300)
    proxy = start_proxy({"intercept_keep_sealed": 500})
    with httpx.Client(proxy=proxy.url, verify=str(proxy.ca_bundle), timeout=30) as client:
        _rollouts(proxy, client, 200, 0)  # warm-up: imports, caches, the tokenizer, pools
        start = _rss_kb(proxy.proc.pid)
        ids = _rollouts(proxy, client, 2000, 200)
        end = _rss_kb(proxy.proc.pid)
    assert end <= start * 1.10, f"RSS grew from {start} kB to {end} kB over 2,000 rollouts"

    # The listing pages: the 500 sealed ones still in memory, in creation order.
    seen, after = [], None
    while True:
        query = f"sessions?state=sealed&limit={PAGE}" + (f"&after={after}" if after else "")
        status, page = proxy.api("GET", query)
        assert status == 200 and len(page["sessions"]) <= PAGE
        seen += [s["id"] for s in page["sessions"]]
        after = page["next_after"]
        if after is None:
            break
    assert seen == ids[-500:]
    status, live = proxy.api("GET", "sessions?state=live")
    assert [s["id"] for s in live["sessions"]] == ["default"] and live["next_after"] is None
    assert proxy.api("GET", "sessions?limit=0")[0] == 400 and proxy.api("GET", "sessions?state=open")[0] == 400

    # A session dropped from memory: its summary comes from its trace; nothing hands out its secrets.
    status, old = proxy.api("GET", f"sessions/{ids[0]}")
    assert status == 200 and old["dropped"] and old["turns"] == 1 and old["sealed"]
    assert proxy.api("GET", f"sessions/{ids[0]}/env")[0] == 410
    assert proxy.api("GET", f"sessions/{ids[-1]}/env")[0] == 410  # sealed, still in memory
    status, again = proxy.api("DELETE", f"sessions/{ids[-1]}")
    assert status == 200 and again["released"] is True


def test_each_start_records_the_default_session_to_a_file_of_its_own(start_proxy, tmp_path):
    traces = tmp_path / "traces"
    names = []
    for _ in range(2):
        proxy = start_proxy({"intercept_trace_dir": str(traces)})
        [line] = [line for line in proxy.log().splitlines() if "default session 'default' records to" in line]
        names.append(line.rsplit(" ", 1)[1])
        proxy.stop()
    files = sorted(p.name for p in traces.iterdir())
    assert len(files) == 2 and all(f.startswith("default-") for f in files), files
    assert [n.rsplit("/", 1)[1] for n in names] == files or sorted(n.rsplit("/", 1)[1] for n in names) == files


def test_a_closed_pipe_ends_replay_trace_quietly():
    """``replay_trace.py show trace | head``: the reader went away; no traceback."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, str(root / "scripts" / "replay_trace.py"), "show",
                             str(root / "tests" / "data" / "trace-v1.msgpack")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before it writes a byte: its first write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(30) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err

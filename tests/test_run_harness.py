"""scripts/run_harness.py with a stand-in harness (a Python one-liner): the environment it
hands over, the exit status it passes back, the proxy it starts and stops, the summary.
The real harnesses run through it in tests/test_harness_*.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from interceptor.trace import read_trace
from clients import KEY_ENV, REAL_KEY
from harness import RUN_HARNESS, node_harness
from provider import Reply
from waiting import wait_until

# Prints what a harness would see, then asks the model through the OpenAI SDK (its default
# base URL: only HTTPS_PROXY and the CA bundle lead it to the proxy).
DUMP_AND_ASK = """
import json, os, sys, openai
keys = ["HOME", "CODEX_HOME", "HTTPS_PROXY", "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "CODEX_API_KEY",
        "SSL_CERT_FILE", "NODE_EXTRA_CA_CERTS", "CODEX_CA_CERTIFICATE", "OPENAI_BASE_URL",
        "ANTHROPIC_AUTH_TOKEN", "%s", "MSWEA_CONFIGURED"]
json.dump({k: os.environ.get(k) for k in keys}, open(sys.argv[1], "w"))
reply = openai.OpenAI(max_retries=0).chat.completions.create(model="gpt-x", messages=[{"role": "user", "content": "hi"}])
print(reply.choices[0].message.content)
sys.exit(int(sys.argv[2]))
""" % KEY_ENV


def _run(args: list[str], command: list[str], env: dict | None = None, timeout: float = 90):
    return subprocess.run([sys.executable, str(RUN_HARNESS), *args, "--", *command], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=timeout, env=env)


def test_it_starts_a_proxy_hands_over_the_session_and_passes_the_exit_status_back(sim, tmp_path, monkeypatch):
    sim.script(Reply(text="hello through the proxy"))
    monkeypatch.setenv(KEY_ENV, REAL_KEY)
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")  # would bypass the proxy
    monkeypatch.setenv("ANTHROPIC_AUTH_TOKEN", "a-real-looking-token")
    dump = tmp_path / "env.json"
    result = _run(["--upstream", sim.url("/v1"), "--api-key-env", KEY_ENV, "--model", "imposed",
                   "--trace-dir", str(tmp_path / "traces"), "--id", "stand-in",
                   "--summary-json", str(tmp_path / "summary.json")],
                  [sys.executable, "-c", DUMP_AND_ASK, str(dump), "3"])
    assert result.returncode == 3, result.stderr
    assert "hello through the proxy" in result.stdout
    seen = json.loads(dump.read_text())
    secret = seen["OPENAI_API_KEY"]
    assert secret.startswith("sk-ic-m-") and seen["ANTHROPIC_API_KEY"] == seen["CODEX_API_KEY"] == secret
    assert seen["HTTPS_PROXY"].startswith("http://session:") and secret in seen["HTTPS_PROXY"]
    assert seen[KEY_ENV] is None and seen["OPENAI_BASE_URL"] is None and seen["ANTHROPIC_AUTH_TOKEN"] is None
    assert seen["HOME"].startswith("/tmp") and seen["CODEX_HOME"] == seen["HOME"] + "/.codex"
    assert seen["SSL_CERT_FILE"] == seen["NODE_EXTRA_CA_CERTS"] == seen["CODEX_CA_CERTIFICATE"]
    assert seen["MSWEA_CONFIGURED"] == "true"

    assert "run_harness: python" in result.stderr and "exited with 3" in result.stderr
    assert "turns 1  calls 1  errors 0" in result.stderr and "(sealed)" in result.stderr
    assert secret not in result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["sealed"] and summary["exit_status"] == 3 and summary["tls_rejections"] == 0
    assert [p.name for p in (tmp_path / "traces").iterdir()] == ["stand-in.msgpack"]  # the run's only
    trace = read_trace(tmp_path / "traces" / "stand-in.msgpack")
    assert trace.calls[0].model == "imposed" and trace.sealed
    assert sim.requests[0].headers["authorization"] == f"Bearer {REAL_KEY}"


def test_it_uses_a_running_proxy_and_leaves_it_running(proxy, sim, tmp_path):
    sim.script(Reply(text="from the running proxy"))
    home = tmp_path / "myhome"
    result = _run(["--proxy", proxy.url, f"--admin-token={proxy.admin_token}", "--upstream", sim.url("/v1"),
                   "--home", str(home), "--no-proxy-auth"],
                  [sys.executable, "-c", DUMP_AND_ASK, str(tmp_path / "env.json"), "0"])
    assert result.returncode == 0, result.stderr
    seen = json.loads((tmp_path / "env.json").read_text())
    assert seen["HOME"] == str(home) and "@" not in seen["HTTPS_PROXY"]
    assert proxy.proc.poll() is None
    sessions = proxy.api("GET", "sessions")[1]["sessions"]
    ours = [s for s in sessions if s["id"] != "default"]
    assert len(ours) == 1 and ours[0]["sealed"] and ours[0]["turns"] == 1


def test_it_says_what_is_wrong_instead_of_running(tmp_path):
    result = _run(["--proxy", "http://127.0.0.1:9", "--admin-token", "x" * 20], ["true"])
    assert result.returncode == 2 and "no proxy answers" in result.stderr
    result = _run(["--sampling", "{not json"], ["true"])
    assert result.returncode == 2 and "--sampling is not JSON" in result.stderr
    result = _run(["--sampling", '{"temprature": 1}', "--trace-dir", str(tmp_path)], ["true"])
    assert result.returncode == 2 and "temprature" in result.stderr


def test_it_names_a_harness_that_rejects_the_ca(tmp_path, sim, monkeypatch):
    """Claude Code without any CA variable retries the failed handshake (2.1.197 forever, until
    --timeout stops it; 2.1.332 gives up with status 1 after its retries): either way the warning
    printed while it retries and the summary say why nothing happened."""
    claude = node_harness("claude")
    monkeypatch.setenv(KEY_ENV, REAL_KEY)
    result = _run(["--upstream", sim.url("/v1"), "--api-key-env", KEY_ENV, "--timeout", "30",
                   "--trace-dir", str(tmp_path), "--summary-json", str(tmp_path / "summary.json")],
                  ["env", "-u", "NODE_EXTRA_CA_CERTS", "-u", "SSL_CERT_FILE", "-u", "REQUESTS_CA_BUNDLE",
                   claude, "-p", "hello"])
    assert result.returncode in (1, 124), result.stderr
    assert "rejected the proxy's TLS certificate" in result.stderr  # said while it was hanging
    assert "does not trust the CA" in result.stderr and "NODE_EXTRA_CA_CERTS" in result.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["tls_rejections"] >= 1
    assert sim.requests == []


@pytest.mark.parametrize("code", [0, 1, 7])
def test_the_harness_status_is_the_exit_status(tmp_path, code):
    result = _run(["--trace-dir", str(tmp_path)], [sys.executable, "-c", f"import sys; sys.exit({code})"])
    assert result.returncode == code, result.stderr


def _in_group(pgid: int, argv: list[str]) -> bool:
    """Whether a process of group ``pgid`` runs ``argv`` (read from /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            group = int(stat.read_text().rpartition(")")[2].split()[2])  # after the name: state, ppid, pgrp
            if group == pgid and (stat.parent / "cmdline").read_bytes().split(b"\0")[:-1] == [a.encode() for a in argv]:
                return True
        except (OSError, ValueError, IndexError):  # a process that ended meanwhile
            continue
    return False


def test_an_interrupt_still_seals_and_prints_the_summary(tmp_path):
    """^C at the terminal reaches the whole foreground group: run_harness and the harness. The
    proxy it started is in a session of its own, so it is still there to seal and summarise."""
    import os
    import signal

    proc = subprocess.Popen([sys.executable, str(RUN_HARNESS), "--trace-dir", str(tmp_path), "--summary-json",
                             str(tmp_path / "summary.json"), "--", "sleep", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            # as a terminal's foreground job has it, even if this suite runs as a
                            # background job of a non-interactive shell (`pytest &` ignores SIGINT,
                            # and that is inherited: the ^C would then reach nothing)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wait_until(lambda: list(tmp_path.glob("*.msgpack")), 60, "the session's trace")  # the harness is starting
    wait_until(lambda: _in_group(proc.pid, ["sleep", "60"]), 30, "the harness (sleep 60) in the foreground group")
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert "(interrupted)" in err and "(sealed)" in err, err
    assert "does not answer" not in err and "Traceback" not in err, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["sealed"] and summary["interrupted"]
# Three turns a second apart: a terminal sees the progress line move.
THREE_TURNS = """
import time, openai
client = openai.OpenAI(max_retries=0)
for k in range(3):
    client.chat.completions.create(model="gpt-x", messages=[{"role": "user", "content": f"q{k}"}])
    time.sleep(1.2)
print("done")
"""


def test_progress_on_a_terminal_and_nothing_extra_when_piped(sim, tmp_path, monkeypatch):
    import os
    import pty
    import select

    sim.script(*[Reply(text=f"a{k}") for k in range(6)])
    monkeypatch.setenv(KEY_ENV, REAL_KEY)
    args = ["--upstream", sim.url("/v1"), "--api-key-env", KEY_ENV, "--trace-dir", str(tmp_path / "traces")]
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, str(RUN_HARNESS), *args, "--id", "tty", "--", sys.executable, "-c", THREE_TURNS],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    seen = b""
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        if not ready:
            break
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        seen += chunk
    proc.wait(60)
    os.close(master)
    text = seen.decode(errors="replace")
    assert proc.returncode == 0, text
    lines = [part.removeprefix("\x1b[K") for part in text.split("\r")]
    progress = [line for line in lines if re.match(r"run_harness: \d+s · \d+ turns? · ", line)]
    assert any(" · 1 turn · 1 call · tokens " in line for line in progress), text
    assert any(" · 3 turns · 3 calls · " in line and line.endswith("· last call 200 stop") for line in progress), text
    assert "turns 3  calls 3" in text  # the summary after it, as always
    piped = _run(args + ["--id", "piped"], [sys.executable, "-c", THREE_TURNS])
    assert piped.returncode == 0, piped.stderr
    assert "\r" not in piped.stderr and "last call" not in piped.stderr

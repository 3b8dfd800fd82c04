"""``run_harness.py --isolate`` and ``interceptor.client.isolate``: the harness's only way out
is the proxy. A program that ignores ``HTTPS_PROXY`` gets a connection error at once; one
that honours it works through the proxy, under the session's egress policy; nothing of the
rollout outlives it, also when the runner is killed; where the kernel cannot make the
namespace, nothing runs. Claude Code's isolated rollout is in tests/test_isolate_claude.py."""

from __future__ import annotations

import asyncio
import json
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from interceptor.client import AsyncProxy, isolate
from interceptor.trace import read_trace
from clients import KEY_ENV
from harness import RUN_HARNESS
from provider import Reply
from test_run_as_user import ATTACKER, other_user  # noqa: F401 (its fixture)



@pytest.fixture
def host_doors():
    """A TCP listener and a UDP socket on this machine's own non-loopback IPv4 address, as the
    isolated harness's arguments (address, TCP port, UDP port): what it must not reach. Which
    address is found by connecting a UDP socket towards a documentation address (RFC 5737),
    which sends nothing."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
            host = probe.getsockname()[0]
        except OSError:
            host = ""
    if not host or host.startswith("127."):
        pytest.skip("this machine has no non-loopback IPv4 address to probe the wall with")
    with socket.create_server((host, 0)) as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.bind((host, 0))
        yield [host, str(tcp.getsockname()[1]), str(udp.getsockname()[1])]


@pytest.fixture
def namespaces() -> None:
    """Skips only where the kernel (or a container's seccomp) forbids this user to make user
    namespaces, with its reason; any other failure of the check fails the test."""
    try:
        isolate.check()
    except isolate.IsolationUnavailable as e:
        if "cannot make a user namespace" not in str(e):
            raise
        pytest.skip(f"user namespaces are forbidden here: {e}")


pytestmark = [pytest.mark.skipif(sys.platform != "linux", reason="network namespaces are Linux's"),
              pytest.mark.usefixtures("namespaces")]

# A harness that ignores the proxy variables for its own connections, then asks the model
# through the OpenAI SDK (default base URL: only HTTPS_PROXY and the CA bundle lead it on).
# "host" is a TCP and a UDP door the test opened on this machine's own non-loopback address
# (``host_doors``): unreachable from the namespace, and if the wall broke, nothing would leave
# the machine either (a datagram stands in for a DNS query).
IGNORES_THE_PROXY = r"""
import errno, json, socket, sys, openai
out, sim_port, host, tcp_port, udp_port = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
seen = {}
for name, address in (("simulator", ("127.0.0.1", sim_port)), ("host", (host, tcp_port))):
    try:
        socket.create_connection(address, timeout=30).close()
        seen[name] = "connected"
    except OSError as e:  # a timeout would be "timed out": a hang, not a refusal
        seen[name] = errno.errorcode.get(e.errno) or str(e)
try:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.sendto(b"probe", (host, udp_port))
    seen["datagram"] = "sent"
except OSError as e:
    seen["datagram"] = errno.errorcode.get(e.errno) or str(e)
reply = openai.OpenAI(max_retries=0).chat.completions.create(
    model="gpt-x", messages=[{"role": "user", "content": "hi"}])
seen["answer"] = reply.choices[0].message.content
json.dump(seen, open(out, "w"))
"""

# A tool the harness runs: tunnels through the proxy in and out of the allow list (with the
# session's credentials from HTTPS_PROXY, and without: a tool that drops them), a plain
# request out of it, and a connection around the proxy.
TOOL = r"""
import base64, errno, http.client, json, os, socket, sys
from urllib.parse import unquote, urlsplit
out, sim_port = sys.argv[1], int(sys.argv[2])
proxy = urlsplit(os.environ["HTTPS_PROXY"])
auth = base64.b64encode(f"{unquote(proxy.username)}:{unquote(proxy.password)}".encode()).decode()

def tunnel(host, port, credentials=True):
    conn = http.client.HTTPConnection(proxy.hostname, proxy.port, timeout=30)
    conn.set_tunnel(host, port, headers={"Proxy-Authorization": f"Basic {auth}"} if credentials else {})
    try:
        conn.request("GET", "/tool-probe", headers={"Host": f"{host}:{port}"})
        return f"answered {conn.getresponse().status}"
    except OSError as e:
        return str(e)
    finally:
        conn.close()

def plain(url):
    conn = http.client.HTTPConnection(proxy.hostname, proxy.port, timeout=30)
    try:
        conn.request("GET", url)
        return f"answered {conn.getresponse().status}"
    finally:
        conn.close()

def after_own_api():
    # Pipelined on one connection: the proxy's own API first (which binds no session), then a
    # request out of the allow list without credentials: the proxy ends the connection after
    # its own answer, or refuses what follows; never forwards it.
    with socket.create_connection((proxy.hostname, proxy.port), timeout=30) as s:
        s.sendall(f"GET /_interceptor/health HTTP/1.1\r\nHost: {proxy.hostname}:{proxy.port}\r\n\r\n".encode()
                  + b"GET http://outside.invalid/tool-probe HTTP/1.1\r\nHost: outside.invalid\r\n\r\n")
        answers = b""
        while chunk := s.recv(65536):
            answers += chunk
    return [line.decode() for line in answers.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]

seen = {"inside": tunnel("127.0.0.1", sim_port), "outside": tunnel("outside.invalid", 80),
        "after_own_api": after_own_api(),
        "outside_without_credentials": tunnel("outside.invalid", 80, credentials=False),
        "plain_without_credentials": plain("http://outside.invalid/tool-probe")}
try:
    socket.create_connection(("127.0.0.1", sim_port), timeout=30).close()
    seen["around"] = "connected"
except OSError as e:
    seen["around"] = errno.errorcode.get(e.errno) or str(e)
json.dump(seen, open(out, "w"))
"""
RUNS_A_TOOL = f"import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', {TOOL!r}, *sys.argv[1:]]))"

# A harness that leaves a daemon behind (its own session, so no process group ties it), says
# so on stdout, then waits (for a SIGKILL of the runner) or exits.
LINGERS = r"""
import signal, subprocess, sys
token, mode = sys.argv[1], sys.argv[2]
subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()", token], start_new_session=True,
                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("ready", flush=True)
if mode == "wait":
    signal.pause()  # until a signal ends it (the runner's SIGKILL ends the namespace)
"""


def _run_harness(proxy, args: list[str], command: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RUN_HARNESS), "--proxy", proxy.url,
                           f"--admin-token={proxy.admin_token}", *args, "--", *command],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120, **kw)


def _with_token(token: str) -> list[int]:
    """PIDs of the live processes whose command line holds ``token``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if token.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue  # gone meanwhile
    return found


def _kill_left(token: str) -> list[int]:
    """SIGKILL what a failed run left (processes this test started); their PIDs."""
    left = _with_token(token)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def _in_netns(inode: int) -> list[int]:
    """PIDs of the processes in the network namespace ``inode``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.stat(entry / "ns" / "net").st_ino == inode:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_a_harness_that_ignores_the_proxy_cannot_connect_and_its_sdk_works_through_it(proxy, sim, tmp_path, host_doors):
    sim.script(Reply(text="answered inside the wall"))
    out = tmp_path / "seen.json"
    result = _run_harness(proxy, ["--isolate", "--upstream", sim.url("/v1"), "--id", "walled", "--model", "imposed"],
                          [sys.executable, "-c", IGNORES_THE_PROXY, str(out), str(sim.port), *host_doors])
    assert result.returncode == 0, result.stderr
    seen = json.loads(out.read_text())
    # Refused at once, never a connection and never a hang: the loopback has nothing but the
    # proxy's door, and there is no route anywhere else (no DNS either).
    assert seen["simulator"] == "ECONNREFUSED", seen
    assert seen["host"] == "ENETUNREACH", seen
    assert seen["datagram"] == "ENETUNREACH", seen  # no DNS, nor any other datagram
    assert seen["answer"] == "answered inside the wall"
    trace = read_trace(proxy.trace_dir / "walled.msgpack")
    assert [c.model for c in trace.calls] == ["imposed"] and trace.sealed
    assert len(sim.requests) == 1  # the SDK's call, and nothing around the proxy


def test_the_python_api_runs_a_rollout_isolated(proxy, sim, tmp_path, host_doors):
    """``AsyncSession.isolated`` (on ``Session.isolated``): the evaluator's own subprocess."""
    sim.script(Reply(text="answered to the evaluator"))
    out = tmp_path / "seen.json"

    async def rollout() -> dict:
        client = await AsyncProxy.attach(proxy.url, proxy.admin_token)
        async with await client.session(upstream={"base_url": sim.url("/v1")}, id="api-walled") as session:
            argv = await session.isolated([sys.executable, "-c", IGNORES_THE_PROXY, str(out), str(sim.port), *host_doors])
            harness = await asyncio.create_subprocess_exec(*argv, env={**os.environ, **session.env},
                                                          stdin=subprocess.DEVNULL)
            assert await harness.wait() == 0
            return await session.close(reward=1.0)

    summary = asyncio.run(rollout())
    seen = json.loads(out.read_text())
    assert (seen["simulator"], seen["host"], seen["datagram"]) == ("ECONNREFUSED", "ENETUNREACH", "ENETUNREACH"), seen
    assert seen["answer"] == "answered to the evaluator"
    assert summary["calls"] == 1 and summary["sealed"]
    assert read_trace(proxy.trace_dir / "api-walled.msgpack").calls[0].error is None


def test_the_egress_allow_list_holds_for_a_tool_the_harness_runs(proxy, sim, tmp_path):
    out = tmp_path / "tool.json"
    session = {"network": {"allow": ["127.0.0.1"], "egress": True}}
    result = _run_harness(proxy, ["--isolate", "--upstream", sim.url("/v1"), "--id", "tool-egress",
                                  "--session", json.dumps(session)],
                          [sys.executable, "-c", RUNS_A_TOOL, str(out), str(sim.port)])
    assert result.returncode == 0, result.stderr
    seen = json.loads(out.read_text())
    assert seen["inside"].startswith("answered "), seen  # through the proxy to an allowed host
    assert "403" in seen["outside"], seen  # the proxy refused the tunnel
    # The forwarder gave the credentials to the connections that had none: refused all the
    # same (an unbound connection would have been forwarded: a 502 for this host).
    assert "403" in seen["outside_without_credentials"], seen
    assert seen["plain_without_credentials"] == "answered 403", seen
    assert seen["after_own_api"] in (["HTTP/1.1 200 OK"], ["HTTP/1.1 200 OK", "HTTP/1.1 403 Forbidden"]), seen
    assert seen["around"] == "ECONNREFUSED", seen  # and around the proxy there is no way
    trace = read_trace(proxy.trace_dir / "tool-egress.msgpack")
    assert trace.egress == {"outside.invalid": 3}


def test_nothing_of_the_rollout_remains_when_the_harness_exits(proxy, sim, tmp_path):
    token = f"linger-{uuid.uuid4().hex}"
    result = _run_harness(proxy, ["--isolate", "--upstream", sim.url("/v1")],
                          [sys.executable, "-c", LINGERS, token, "exit"])
    # run_harness has returned: its daemon, the forwarder and the connector are gone with it.
    assert _kill_left(token) == []
    assert result.returncode == 0 and result.stdout == "ready\n", result.stderr


def test_nothing_of_the_rollout_remains_when_the_runner_is_killed(proxy, sim, tmp_path):
    token = f"linger-{uuid.uuid4().hex}"
    runner = subprocess.Popen([sys.executable, str(RUN_HARNESS), "--proxy", proxy.url,
                               f"--admin-token={proxy.admin_token}", "--isolate", "--upstream", sim.url("/v1"),
                               "--", sys.executable, "-c", LINGERS, token, "wait"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    pidfds: list[int] = []
    try:
        readable, _, _ = select.select([runner.stdout], [], [], 60)
        assert readable and runner.stdout.readline() == b"ready\n", runner.stderr.read1().decode()
        pids = _with_token(token)  # the harness, its daemon, the forwarder, PID 1, the connector
        ours = os.stat("/proc/self/ns/net").st_ino
        netns = {os.stat(f"/proc/{pid}/ns/net").st_ino for pid in pids} - {ours}
        assert len(pids) >= 4 and len(netns) == 1, (pids, netns)
        pidfds = [os.pidfd_open(pid) for pid in pids]
        runner.send_signal(signal.SIGKILL)
        runner.wait()
        pending = set(pidfds)
        while pending:  # each pidfd turns readable when its process has exited
            readable, _, _ = select.select(list(pending), [], [], 60)
            assert readable, f"still running after the runner was killed: {_with_token(token)}"
            pending -= set(readable)
        assert _with_token(token) == []
        assert _in_netns(netns.pop()) == []  # the namespace went with its last process
    finally:
        for fd in pidfds:
            os.close(fd)
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        _kill_left(token)
        runner.stdout.close()
        runner.stderr.close()


# Says which signal reached it, once, and exits with 128 + its number.
TRAPS = r"""
import signal, sys
def caught(signum, _frame):
    open(sys.argv[1], "a").write(signal.Signals(signum).name + "\n")
    sys.exit(128 + signum)
signal.signal(signal.SIGINT, caught)
signal.signal(signal.SIGTERM, caught)
print("ready", flush=True)
signal.pause()
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_terminal_interrupt_and_a_sigterm_reach_the_harness_inside_once(proxy, sim, tmp_path, sig):
    """^C goes to the runner's process group (the harness is in it; the namespace's own
    processes ignore it); SIGTERM to the runner is passed on through the namespace's PID 1."""
    out = tmp_path / "caught.txt"
    runner = subprocess.Popen([sys.executable, str(RUN_HARNESS), "--proxy", proxy.url,
                               f"--admin-token={proxy.admin_token}", "--isolate", "--upstream", sim.url("/v1"),
                               "--", sys.executable, "-c", TRAPS, str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                              start_new_session=True)  # its own process group, as a terminal's job
    try:
        readable, _, _ = select.select([runner.stdout], [], [], 60)
        assert readable and runner.stdout.readline() == b"ready\n", runner.stderr.read1().decode()
        if sig == signal.SIGINT:
            os.killpg(runner.pid, sig)  # what the terminal does on ^C
        else:
            runner.send_signal(sig)
        assert runner.wait(60) == 128 + sig
        assert out.read_text() == f"{sig.name}\n"
        assert "(sealed)" in runner.stderr.read().decode()
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        runner.stdout.close()
        runner.stderr.close()


def test_it_refuses_to_start_where_the_kernel_cannot_make_the_namespace(proxy, sim, tmp_path):
    """A user namespace of the test's own whose limit of nested user namespaces is 0 stands
    for a kernel that forbids them (the limit is per user namespace: nothing else is touched)."""
    if not shutil.which("unshare"):
        pytest.skip("util-linux's unshare is not installed: no way to make a kernel that refuses here")
    marker = tmp_path / "ran"
    before = {s["id"] for s in proxy.api("GET", "sessions")[1]["sessions"]}
    result = subprocess.run(
        ["unshare", "--user", "--map-root-user", "sh", "-c", 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"',
         "sh", sys.executable, str(RUN_HARNESS), "--proxy", proxy.url, f"--admin-token={proxy.admin_token}",
         "--isolate", "--upstream", sim.url("/v1"), "--", sys.executable, "-c",
         f"open({str(marker)!r}, 'w').write('ran unisolated')"],
        capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "run_harness: --isolate: cannot make a user namespace" in result.stderr
    assert "user.max_user_namespaces=0" in result.stderr and "Nothing was run." in result.stderr
    assert not marker.exists()
    assert {s["id"] for s in proxy.api("GET", "sessions")[1]["sessions"]} == before  # no session either


# The plain user's harness (the system's Python: the project's venv lives under /root): a
# connection around the proxy, then test_run_as_user's harness, whose model call goes through it.
AROUND = r"""
import errno, socket, sys
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[2])), timeout=30).close()
    seen = "connected"
except OSError as e:
    seen = errno.errorcode.get(e.errno) or str(e)
open(sys.argv[1], "w").write(seen)
"""


def test_a_plain_user_gets_the_same_wall_through_unprivileged_user_namespaces(new_session, proxy, sim):
    """The isolating program as ``nobody`` (standard library only, so the system's Python runs
    it): the unprivileged path, where the user namespace maps that user alone."""
    system_python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or not shutil.which("setpriv") or not system_python:
        pytest.skip("needs root, setpriv and a system python3 to become `nobody` for the test (CI has them)")
    sim.script(Reply(text="answered to nobody"))
    session = new_session(id="as-nobody")
    shared = Path(tempfile.mkdtemp(prefix="ic-isolate-user-"))  # pytest's tmp_path is root's alone
    try:
        shared.chmod(0o777)
        program = shared / "isolate.py"
        shutil.copyfile(isolate.PROGRAM, program)
        ca = shared / "ca.pem"
        shutil.copyfile(session["env"]["SSL_CERT_FILE"], ca)
        for path in (program, ca):
            path.chmod(0o644)
        as_nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", system_python, "-I"]
        check = subprocess.run([*as_nobody, str(program), "--check"], capture_output=True, text=True, timeout=60)
        if check.returncode == isolate.REFUSED and "cannot make a user namespace" in check.stderr:
            pytest.skip(f"this kernel forbids unprivileged user namespaces: {check.stderr.strip()}")
        assert check.returncode == 0, check.stderr
        env = {**session["env"], "PATH": "/usr/bin:/bin", "SSL_CERT_FILE": str(ca)}
        out, around = shared / "seen.json", shared / "around.txt"
        harness = (f"{system_python} -c {shlex.quote(AROUND)} {around} {sim.port} && "
                   f"exec {system_python} -c {shlex.quote(ATTACKER)} {proxy.confdir / 'interceptor-admin-token'} "
                   f"{proxy.proc.pid} {KEY_ENV} {out}")
        result = subprocess.run([*as_nobody, str(program), "--proxy", proxy.url.removeprefix("http://"),
                                 "--parent", str(os.getpid()), "--", "sh", "-c", harness],
                                env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
        assert result.returncode == 0, result.stderr
        assert around.read_text() == "ECONNREFUSED"
        seen = json.loads(out.read_text())
        assert seen["uid"] != 0 and seen["uid"] == int(subprocess.check_output(["id", "-u", "nobody"]))
        assert seen["answer"] == "answered to nobody"
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_run_as_another_user_isolated(other_user, proxy, sim):
    """``--isolate --user``: root makes the namespaces, the harness runs inside as that user."""
    sim.script(Reply(text="done as another user, isolated"))
    for folder in (proxy.workdir, proxy.confdir):
        folder.chmod(0o755)
    shared = Path(tempfile.mkdtemp(prefix="ic-isolate-user-"))
    try:
        shared.chmod(0o777)
        out, around = shared / "seen.json", shared / "around.txt"
        system_python = shutil.which("python3", path="/usr/bin:/bin")
        harness = (f"{system_python} -c {shlex.quote(AROUND)} {around} {sim.port} && "
                   f"exec {system_python} -c {shlex.quote(ATTACKER)} {proxy.confdir / 'interceptor-admin-token'} "
                   f"{proxy.proc.pid} {KEY_ENV} {out}")
        result = _run_harness(proxy, ["--isolate", "--user", other_user.pw_name, "--upstream", sim.url("/v1")],
                              ["sh", "-c", harness])
        assert result.returncode == 0, result.stderr
        assert around.read_text() == "ECONNREFUSED"
        seen = json.loads(out.read_text())
        assert seen["uid"] == other_user.pw_uid and seen["answer"] == "done as another user, isolated"
        assert seen["token"].startswith("refused: PermissionError"), seen["token"][:20]
        assert seen["environ"].startswith("refused"), seen["environ"][:20]
    finally:
        shutil.rmtree(shared, ignore_errors=True)

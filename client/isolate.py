"""A harness whose only way out is the proxy: a network namespace of its own.

    argv = isolate.command(["claude", "-p", "..."], proxy_url)  # after isolate.check()
    subprocess.run(argv, env={**os.environ, **session.env})

``HTTPS_PROXY`` is a request, not a wall: a program that ignores it would reach the network
directly. Run through ``command``, the harness and everything it starts live in new user,
network and PID namespaces where the network is the loopback alone. The only thing
listening there is a forwarder on ``127.0.0.1:<the proxy's port>``, so the session's
``HTTPS_PROXY`` still works (a proxy on another address is rewritten to that one in the
proxy variables) and the proxy applies the session's egress policy to everything that
leaves. Any other connection fails at once: ``ECONNREFUSED`` on the loopback,
``ENETUNREACH`` everywhere else; no DNS is needed, the proxy is reached by address.

How the wall has one door, without root, ``ip`` or veth: this file, run as a program, forks
a *connector* that stays in the caller's namespace, then enters the new namespaces. For each
connection a program makes to the forwarder, the connector connects to the proxy and hands
the connected socket over a socketpair (``SCM_RIGHTS``); a socket keeps the namespace it was
made in, so the forwarder relays between the two with large reads (one copy, no file on
disk, nothing to clean up). Each connection's first request gets the session's credentials
(from the proxy URL in ``HTTPS_PROXY``) in place of any it had, so the proxy applies the
session's egress policy to every connection from the namespace, also one whose program
dropped them. The user namespace maps the caller's own uid to itself (as root:
every uid to itself), so the harness is the same user inside as outside, without capabilities
outside its namespaces.

Nothing outlives the harness: the first process of the PID namespace waits for it and exits
with its status, and when that process exits the kernel kills everything left in the
namespace (daemons and double forks included), and the namespaces go with their last process.
The namespace's processes die with the program that made them (``PR_SET_PDEATHSIG``), and
that program, with the process that started it (its pidfd), so a ``SIGKILL`` of the runner
leaves nothing behind either.

It never runs anything unisolated: when the namespaces cannot be made (not root and the
kernel forbids unprivileged user namespaces, or a sandbox's seccomp forbids them), it runs
nothing, says why on stderr and exits with ``REFUSED``; ``check()`` asks the same question
first and raises ``IsolationUnavailable`` with the reason.

Standard library only: the program starts with ``python -I`` and imports nothing of ours.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import ctypes
import fcntl
import functools
import os
import re
import signal
import socket
import struct
import subprocess
import sys
from collections import deque
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

PROGRAM = Path(__file__).resolve()
REFUSED = 125  # the exit status when nothing ran: the namespaces could not be made
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
CHUNK = 256 * 1024  # one read of a relayed stream: the per-chunk Python cost stays small
HEAD_LIMIT = 64 * 1024  # a first request head longer than this is refused
HEAD_END = re.compile(rb"\r?\n\r?\n")
# Signals the runner sends that go on to the harness. SIGINT does not: a terminal's ^C
# reaches the harness itself (it is in the runner's process group).
FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
PR_SET_PDEATHSIG = 1  # prctl(2)
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000  # unshare(2)
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1  # netdevice(7)
KNOBS = ("/proc/sys/kernel/unprivileged_userns_clone", "/proc/sys/user/max_user_namespaces",
         "/proc/sys/kernel/apparmor_restrict_unprivileged_userns")


class IsolationUnavailable(RuntimeError):
    """This process cannot make the namespaces; the message says why. Nothing was run."""


# -- the caller's side --------------------------------------------------------------------------


def _argv(*args: str) -> list[str]:
    return [sys.executable, "-I", str(PROGRAM), *args]


@functools.cache  # a success only: a refusal raises, and is asked again next time
def check() -> None:
    """Make the namespaces once in a throw-away process; raise ``IsolationUnavailable`` with
    the kernel's reason when they cannot be made (before a proxy, a session or a harness)."""
    try:
        result = subprocess.run(_argv("--check"), capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise IsolationUnavailable(f"the isolation check did not run: {e}") from e
    if result.returncode != 0:
        reason = result.stderr.strip().removeprefix("isolate: ")
        raise IsolationUnavailable(reason or f"the isolation check exited with {result.returncode}")


def command(cmd: list[str], proxy_url: str, *, user: tuple[int, int] | None = None) -> list[str]:
    """The argv that runs ``cmd`` isolated, its only way out the proxy at ``proxy_url``
    (``http://host:port``). ``user``: (uid, gid) the harness runs as (the caller must be root).
    Start it from this process (everything in it dies with this process) with the harness's
    environment; its exit status is the harness's (``REFUSED`` if nothing could run)."""
    u = urlsplit(proxy_url)
    if not u.hostname or not u.port:
        raise ValueError(f"the proxy URL needs a host and a port: {proxy_url!r}")
    extra = ["--user", f"{user[0]}:{user[1]}"] if user else []
    return _argv("--proxy", f"{u.hostname}:{u.port}", "--parent", str(os.getpid()), *extra, "--", *cmd)


# -- the program: entering the namespaces -------------------------------------------------------


def _libc(name: str, *args: int) -> None:
    """A libc call by ctypes (the program runs on any Python 3.9+: ``os.unshare`` is 3.12's)."""
    if getattr(ctypes.CDLL(None, use_errno=True), name)(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def _die_with_parent() -> None:
    """SIGKILL when the parent goes. Only for children of this program's one thread (the
    signal follows the thread that forked, which here is the only one)."""
    _libc("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _knobs() -> str:
    seen = []
    for path in KNOBS:
        try:
            seen.append(f"{path.removeprefix('/proc/sys/').replace('/', '.')}={Path(path).read_text().strip()}")
        except OSError:
            continue
    return ", ".join(seen) or "no user-namespace sysctl found"


def _enter(chan: socket.socket) -> None:
    """New user, network and PID namespaces for this process's children; the loopback up.
    Raises ``IsolationUnavailable``; before it returns, nothing else has run."""
    uid, gid = os.geteuid(), os.getegid()
    try:
        _libc("unshare", CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID)
    except OSError as e:
        who = "root" if uid == 0 else f"uid {uid}, not root"
        raise IsolationUnavailable(
            f"cannot make a user namespace ({e.strerror}) as {who}: the kernel or a sandbox forbids it "
            f"({_knobs()}); allow unprivileged user namespaces, or run as root where they are allowed. "
            "Nothing was run.") from None
    # The caller's ids, unchanged. Root maps every id to itself, which only a process left in
    # the caller's user namespace may write (the connector); anyone else maps its own id
    # alone, which it writes itself after denying setgroups (user_namespaces(7)).
    try:
        if uid == 0:
            chan.send(b"m")
            answer = chan.recv(256)
            if answer[:1] != b"\x01":
                raise OSError(answer[1:].decode(errors="replace") or "the connector is gone")
        else:
            Path("/proc/self/setgroups").write_text("deny")
            Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
            Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")
    except OSError as e:
        raise IsolationUnavailable(f"made a user namespace but cannot map its ids ({e.strerror or e}). "
                                   "Nothing was run.") from None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            ifreq = fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, struct.pack("16sH22x", b"lo", 0))
            flags = struct.unpack("16sH22x", ifreq)[1]
            fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))
    except OSError as e:
        raise IsolationUnavailable(
            f"made the namespaces but cannot bring their loopback up ({e.strerror}); a security module may "
            f"restrict user namespaces ({_knobs()}). Nothing was run.") from None


def _connector(chan: socket.socket, address: tuple[str, int] | None, parent: int) -> None:
    """In the caller's namespaces: for each ``c`` on ``chan``, a connection to the proxy,
    handed over (or a refusal byte, which the forwarder answers by closing the harness's
    connection); for ``m``, root's identity id maps written for the namespace's maker."""
    _die_with_parent()
    if os.getppid() != parent:
        os._exit(0)
    while True:
        try:
            request = chan.recv(16)
        except OSError:
            request = b""
        if not request:
            os._exit(0)  # the forwarder is gone
        try:
            if request == b"m":
                try:
                    for name in ("uid_map", "gid_map"):
                        Path(f"/proc/{parent}/{name}").write_text("0 0 4294967295")
                except OSError as e:
                    chan.send(b"\x00" + str(e.strerror).encode())
                else:
                    chan.send(b"\x01")
                continue
            try:
                conn = socket.create_connection(address, timeout=30)
            except (OSError, TypeError):
                chan.send(b"\x00")
                continue
            with conn:
                socket.send_fds(chan, [b"\x01"], [conn.fileno()])
        except OSError:
            os._exit(0)  # the forwarder went while this was connecting


def _init(cmd: list[str], env: dict[str, str], user: tuple[int, int] | None) -> None:
    """PID 1 of the new PID namespace: start the harness, pass the forwarded signals on, reap
    whatever is orphaned, and exit with the harness's status; the kernel then kills the rest."""
    _die_with_parent()
    pid = os.fork()
    if pid == 0:
        # What Python changed at its start (SIGPIPE, SIGXFSZ ignored) and this program since.
        for sig in (*FORWARDED, signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        try:
            if user is not None:
                os.setgroups([])
                os.setgid(user[1])
                os.setuid(user[0])
            os.execvpe(cmd[0], cmd, env)
        except OSError as e:
            print(f"isolate: cannot run {cmd[0]!r}: {e.strerror}", file=sys.stderr, flush=True)
        os._exit(127)
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: os.kill(pid, signum))
    while True:
        try:
            reaped, status = os.wait()
        except ChildProcessError:
            os._exit(REFUSED)
        if reaped == pid:
            code = os.waitstatus_to_exitcode(status)
            os._exit(128 - code if code < 0 else code)


def _env(address: tuple[str, int]) -> tuple[dict[str, str], bytes | None]:
    """This environment, its proxy variables that name the proxy pointed at the forwarder; and
    the ``Proxy-Authorization`` header line their credentials make (the session's secret)."""
    env, auth = dict(os.environ), None
    for name in PROXY_VARIABLES:
        value = env.get(name)
        if not value:
            continue
        u = urlsplit(value)
        if u.port != address[1] or not u.hostname:
            continue
        if u.password and auth is None:
            token = base64.b64encode(f"{unquote(u.username or '')}:{unquote(u.password)}".encode())
            auth = b"Proxy-Authorization: Basic " + token
        if u.hostname != "127.0.0.1":
            userinfo = u.netloc.rpartition("@")[0]
            netloc = f"{userinfo}@" if userinfo else ""
            env[name] = urlunsplit((u.scheme, f"{netloc}127.0.0.1:{u.port}", u.path, u.query, u.fragment))
    return env, auth


async def _head(loop: asyncio.AbstractEventLoop, client: socket.socket) -> tuple[bytes, bytes] | None:
    """The first request's head (request line and headers, its blank line excluded) and what
    came after it; None for anything that is no HTTP/1 request head within ``HEAD_LIMIT``."""
    buf = bytearray()
    while len(buf) < HEAD_LIMIT:
        chunk = await loop.sock_recv(client, HEAD_LIMIT)
        if not chunk:
            return None
        buf += chunk
        if not buf[:1].isalpha():  # a method comes first; TLS or garbage never reaches the proxy
            return None
        end = HEAD_END.search(buf)
        if end:
            return bytes(buf[:end.start()]), bytes(buf[end.end():])
    return None


def _authorized(head: bytes, auth: bytes) -> bytes:
    """``head`` with the session's credentials as its only ``Proxy-Authorization``."""
    lines = [line.rstrip(b"\r") for line in head.split(b"\n")]
    kept = [line for line in lines[1:] if not line.lower().startswith(b"proxy-authorization:")]
    return b"\r\n".join([lines[0], auth, *kept]) + b"\r\n\r\n"


# -- the program: the forwarder -----------------------------------------------------------------


async def _pump(loop: asyncio.AbstractEventLoop, src: socket.socket, dst: socket.socket) -> None:
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    while n := await loop.sock_recv_into(src, buf):
        await loop.sock_sendall(dst, view[:n])
    dst.shutdown(socket.SHUT_WR)  # the other direction may still be talking


async def _forward(listener: socket.socket, chan: socket.socket, init: int, parent: int, auth: bytes | None) -> int:
    """Relay every connection to the proxy until the harness's PID 1 exits; its status. Kill
    that PID 1 (and so the namespace) when the runner or the connector goes.

    With ``auth``, each connection's first request carries the session's credentials, in
    place of any it had: the proxy then holds every connection from here to the session's
    network policy (egress binds a connection to the session that showed its secret), also
    one whose program dropped the credentials of ``HTTPS_PROXY`` or never read them."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()
    waiting: deque[asyncio.Future[int | None]] = deque()
    tasks: set[asyncio.Task] = set()

    def kill() -> None:
        try:
            os.kill(init, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def replied() -> None:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(chan, 16, 1)
        except BlockingIOError:
            return
        except OSError:
            msg, fds = b"", []
        if not msg:  # the connector is gone: nothing can leave any more, so nothing runs
            loop.remove_reader(chan)
            kill()
            return
        future = waiting.popleft()
        if future.done():
            for fd in fds:
                os.close(fd)
        else:
            future.set_result(fds[0] if fds else None)

    def exited() -> None:
        loop.remove_reader(init_fd)
        _pid, status = os.waitpid(init, 0)
        code = os.waitstatus_to_exitcode(status)
        if not done.done():
            done.set_result(128 - code if code < 0 else code)

    async def relay(client: socket.socket) -> None:
        with client:
            first = b""
            if auth is not None:
                head = await _head(loop, client)
                if head is None:
                    return
                first = _authorized(head[0], auth) + head[1]
            future = loop.create_future()
            waiting.append(future)
            await loop.sock_sendall(chan, b"c")
            fd = await future
            if fd is None:
                return  # the proxy did not answer: the harness sees its connection closed
            with socket.socket(fileno=fd) as upstream:
                upstream.setblocking(False)
                await loop.sock_sendall(upstream, first)
                pumps = {asyncio.ensure_future(_pump(loop, client, upstream)),
                         asyncio.ensure_future(_pump(loop, upstream, client))}
                finished, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                for task in finished:
                    task.exception()  # a reset either way ends both directions

    async def accept() -> None:
        while True:
            client, _addr = await loop.sock_accept(listener)
            task = asyncio.ensure_future(relay(client))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    chan.setblocking(False)
    listener.setblocking(False)
    loop.add_reader(chan, replied)
    init_fd = os.pidfd_open(init)
    loop.add_reader(init_fd, exited)
    try:
        runner_fd = os.pidfd_open(parent)
    except ProcessLookupError:
        runner_fd = None
    if runner_fd is None or os.getppid() != parent:
        kill()  # the runner is already gone
    else:
        loop.add_reader(runner_fd, kill)
    for sig in FORWARDED:
        loop.add_signal_handler(sig, os.kill, init, sig)
    acceptor = asyncio.ensure_future(accept())
    try:
        return await done
    finally:
        acceptor.cancel()
        for task in list(tasks):
            task.cancel()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="isolate", usage="%(prog)s --proxy HOST:PORT --parent PID -- CMD...")
    parser.add_argument("--check", action="store_true", help="make the namespaces and exit 0, or say why not")
    parser.add_argument("--proxy", help="the proxy's address, HOST:PORT")
    parser.add_argument("--parent", type=int, help="the runner's PID: everything dies with it")
    parser.add_argument("--user", help="UID:GID the harness runs as (root only)")
    parser.add_argument("command", nargs="*")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's ^C is the harness's alone
    if not args.check and (not args.proxy or not args.parent or not args.command):
        parser.error("give --proxy, --parent and the command after --")
    address = None
    if args.proxy:
        host, _, port = args.proxy.rpartition(":")
        address = (host.strip("[]"), int(port))
    user = tuple(int(part) for part in args.user.split(":")) if args.user else None
    chan, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    me = os.getpid()
    connector = os.fork()  # before the namespaces: it stays where the proxy is
    if connector == 0:
        try:
            chan.close()
            _connector(theirs, address, me)
        finally:
            os._exit(0)  # a child never goes on with the parent's code
    theirs.close()
    try:
        try:
            _enter(chan)
            if args.check:
                return 0
            listener = socket.create_server(("127.0.0.1", address[1]), backlog=128)
        except (IsolationUnavailable, OSError) as e:
            print(f"isolate: {e}", file=sys.stderr, flush=True)
            return REFUSED
        env, auth = _env(address)
        init = os.fork()  # PID 1 of the new PID namespace
        if init == 0:
            try:
                listener.close()
                chan.close()
                _init(args.command, env, user)
            finally:
                os._exit(REFUSED)
        with listener:
            return asyncio.run(_forward(listener, chan, init, args.parent, auth))
    finally:
        # The connector goes when its channel closes: once this program has exited, nothing
        # of the rollout is left.
        chan.close()
        os.waitpid(connector, 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

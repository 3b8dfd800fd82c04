"""Test-only mitmproxy script: makes the running interceptor fail on purpose.

Loaded after the entry script (``MitmProcess(extra_scripts=[FAULTS])``), never by ``make
run``. The test names a JSON file with ``--set faults_file=...`` and writes into it, at any
time, what should fail:

- ``{"raise": "Rewrite.request"}``: that hook of that addon raises ``InjectedFault`` (before
  doing its work) on every flow but the control API's;
- ``{"skip": "Rewrite.request"}``: that hook returns at once without doing its work, as a
  step with a bug that returns early would (no exception: only the Gate's ``ready`` check
  can catch it);
- ``{"disk_full": true}``: every trace write puts half its bytes on the file and then fails
  with ENOSPC, as a full disk does in the middle of a record;
- ``{"writer_dies": true}``: the trace writer thread ends (``SystemExit``, which no
  ``except Exception`` stops; mitmproxy's own terminal log raises it when it cannot print)
  half-way through its next write;
- ``{"fetch_fails": true}``: the Relay's Fetch (addons/gateway/transport/relay.py) raises right after the
  request went out to the upstream, as a bug in reading the answer would;
- ``{"fetch_blind": true}``: Fetch does not see the client go (``Drain.gone`` says it is
  there), so a client that leaves is found only by mitmproxy's ``error`` after the answer was
  read whole (the race the Relay's ``take_over`` covers); logs ``BLIND_SAID`` when it hid one;
- ``{"fetch_unwatched": true}``: Fetch does not look at the client's connection on its own
  (``Drain._watch``, every 0.25 s): only mitmproxy's ``client_disconnected`` tells it; logs
  ``UNWATCHED_SAID`` when it kept one from looking;
- ``{"read_on_fails": true}``: the Drain's read of an answer whose client went away
  (``Drain._read_rest`` once the drain has taken it over) raises, as a bug there would;
- ``{"passdown_fails": N}``: the relay's write of a streamed answer down its loopback
  connection to mitmproxy (``_Loopback.write``, addons/gateway/transport/relay.py) raises from its N+1th piece
  on (the head is the first), as a bug there would;
- ``{}``: nothing fails.

The hooks are replaced inside their guards (each guarded hook's ``__wrapped__``, on the addon
objects of the script's ``addons`` list), so the mechanism under test (addons/mitm/gate.py) is
exactly the one that runs in production.
"""

from __future__ import annotations

import errno
import inspect
import json
import logging
import os
import weakref

from mitmproxy import ctx, http
from mitmproxy.connection import ConnectionState
from mitmproxy.addonmanager import traverse

from interceptor.addons.gateway.transport import relay
from interceptor.addons.mitm.gate import FLOW_HOOKS, GUARDED
from interceptor.trace import store


log = logging.getLogger(__name__)
# Logged when ``fetch_blind`` hid a client that had gone: a test of the race it makes asserts
# it, so a fault that stopped applying (a renamed method) fails the test instead of passing it
# by another branch.
BLIND_SAID = "faults: fetch_blind hid the client's leaving"
UNWATCHED_SAID = "faults: fetch_unwatched kept Drain._watch from looking"  # likewise


class InjectedFault(RuntimeError):
    pass


class Faults:
    def __init__(self) -> None:
        self.path = ""
        self._stamp: int | None = None
        self._spec: dict = {}

    def load(self, loader) -> None:
        loader.add_option("faults_file", str, "", "JSON file naming what should fail (tests only).")

    def configure(self, updated: set[str]) -> None:
        if "faults_file" in updated:
            self.path = ctx.options.faults_file

    def spec(self) -> dict:
        try:
            stamp = os.stat(self.path).st_mtime_ns
        except OSError:
            return {}
        if stamp != self._stamp:
            with open(self.path) as f:
                self._spec = json.loads(f.read() or "{}")
            self._stamp = stamp
        return self._spec

    def running(self) -> None:
        for addon in traverse(ctx.master.addons.chain):
            for hook in FLOW_HOOKS:
                guarded = getattr(addon, hook, None)
                if isinstance(getattr(guarded, GUARDED, None), str):
                    self._arm(guarded)
        write_all = store._write_all

        def full_disk(fd: int, data: bytes) -> None:
            if self.spec().get("writer_dies"):
                os.write(fd, data[: len(data) // 2])
                raise SystemExit("injected: the writer thread ends")
            if self.spec().get("disk_full"):
                os.write(fd, data[: len(data) // 2])
                raise OSError(errno.ENOSPC, "No space left on device")
            write_all(fd, data)

        store._write_all = full_disk
        send = relay.Drain._send

        async def sent_then_fails(drain, *args):
            sent = await send(drain, *args)
            if drain.fetching and self.spec().get("fetch_fails"):
                raise InjectedFault("injected into Drain.fetch, after the request went out")
            return sent

        relay.Drain._send = sent_then_fails
        watch = relay.Drain._watch

        def unwatched(drain) -> None:
            if not self.spec().get("fetch_unwatched"):
                return watch(drain)
            if drain not in unseen:
                unseen.add(drain)
                log.info(f"{UNWATCHED_SAID}: the Drain of {drain.ex.session.id!r}")

        unseen: weakref.WeakSet = weakref.WeakSet()
        relay.Drain._watch = unwatched
        read_rest = relay.Drain._read_rest

        async def read_rest_fails(drain, *args):
            if drain.taken and self.spec().get("read_on_fails"):
                raise InjectedFault("injected into Drain._read_rest")
            return await read_rest(drain, *args)

        relay.Drain._read_rest = read_rest_fails
        pass_down = relay._Loopback.write

        def passdown_fails(down, data: bytes) -> bool:
            after = self.spec().get("passdown_fails")
            if after is not None:
                down.pieces = getattr(down, "pieces", 0) + 1
                if down.pieces > after:
                    raise InjectedFault("injected into _Loopback.write")
            return pass_down(down, data)

        relay._Loopback.write = passdown_fails
        gone = relay.Drain.gone

        def blind(drain) -> bool:
            if not self.spec().get("fetch_blind"):
                return gone(drain)
            if not drain.taken and not drain.flow.client_conn.state & ConnectionState.CAN_READ and drain not in hidden:
                hidden.add(drain)  # once per exchange (Drain._watch asks every 0.25 s)
                log.info(f"{BLIND_SAID}: the Drain of {drain.ex.session.id!r} was not told")
            return False

        hidden: weakref.WeakSet = weakref.WeakSet()
        relay.Drain.gone = blind

    def _arm(self, guarded) -> None:
        original = guarded.__wrapped__
        name = getattr(guarded, GUARDED)

        def check(flow) -> bool:
            """False: skip the hook."""
            if isinstance(flow, http.HTTPFlow) and flow.request.path.startswith("/_interceptor/"):
                return True
            spec = self.spec()
            if spec.get("raise") == name:
                raise InjectedFault(f"injected into {name}")
            return spec.get("skip") != name

        if inspect.iscoroutinefunction(original):
            async def armed(flow, *args):
                if check(flow):
                    return await original(flow, *args)
        else:
            def armed(flow, *args):
                if check(flow):
                    return original(flow, *args)
        guarded.__wrapped__ = armed


addons = [Faults()]

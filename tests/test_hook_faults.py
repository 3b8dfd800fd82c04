"""Nothing a session's hook does can hurt the proxy or another session.

Through a real mitmdump and the real openai SDK: whatever a hook raises (``BaseException``
included: ``SystemExit``, ``KeyboardInterrupt``, ``CancelledError``, ``GeneratorExit``, a
user's own subclass), at whatever boundary (request, response, request stop, response stop,
between-turn stop, the tool route), sync or async, is that session's ``hook_error``, while
another session's stream, held open mid-way until the failure is on the record, still
completes; a hook that never returns is a ``hook_error`` after the session's limit (or the
proxy's ``intercept_hook_timeout``); blocked plain hooks of many sessions do not keep another
session's hook from running. The pool itself (``addons/gateway/policy/hookpool.py``) is also tested in process.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import textwrap
import threading

import httpx
import openai
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from interceptor.trace import read_trace
from mitm import MitmProcess
from provider import ProviderSimulator, Reply, ToolCall
from clients import KEY_ENV, REAL_KEY
from test_tool_route import route

OPTION_LIMIT = 3  # intercept_hook_timeout of this module's proxy, in seconds

KINDS = {  # a hook of each kind, ``RAISE`` where it fails
    "request": "@intercept\n{a}def h(request: Request, ctx: HookContext):\n    RAISE\n",
    "response": "@intercept\n{a}def h(response: Response, ctx: HookContext):\n    RAISE\n",
    "request_stop": "@stop\n{a}def h(request: Request, ctx: HookContext) -> bool:\n    RAISE\n",
    "response_stop": "@stop\n{a}def h(response: Response, ctx: HookContext) -> bool:\n    RAISE\n",
    "between_stop": "@stop\n{a}def h(ctx: HookContext) -> bool:\n    RAISE\n",
    # Fails only when the tool route asks: the model request before it must pass.
    "tool_route": "@intercept\n{a}def h(request: Request, ctx: HookContext):\n"
                  "    if ctx.tool_phase is None:\n        return None\n    RAISE\n",
}
RAISES = {
    "SystemExit": "raise SystemExit(3)",
    "KeyboardInterrupt": "raise KeyboardInterrupt('from a hook')",
    "CancelledError": "raise asyncio.CancelledError('from a hook')",
    "GeneratorExit": "raise GeneratorExit('from a hook')",
    "Custom": "raise Custom('from a hook')",
    "RuntimeError": "raise RuntimeError('from a hook')",
}
HEAD = """\
import asyncio, socket, threading
from interceptor.hooks import HookContext, Request, Response, intercept, stop

class Custom(BaseException):
    pass

"""


def hooks_file(tmp_path, body: str, name: str = "hooks.py") -> str:
    path = tmp_path / name
    path.write_text(HEAD + textwrap.dedent(body))
    return str(path)


@pytest.fixture(scope="module")
def sim():
    with ProviderSimulator() as s:
        yield s


@pytest.fixture(scope="module")
def proxy(sim):
    proc = MitmProcess(options={"intercept_upstream": sim.url("/v1"), "intercept_api_key_env": KEY_ENV,
                                "intercept_hook_timeout": str(OPTION_LIMIT)},
                       env={KEY_ENV: REAL_KEY})
    proc.start()
    yield proc
    proc.cleanup()


def client(proxy: MitmProcess, s: dict, key: str, timeout: float = 60) -> openai.OpenAI:
    """The session's own openai client; ``key`` picks the simulator's script (``x-sim-key``)."""
    return openai.OpenAI(api_key=s["model_secret"], max_retries=0, timeout=timeout, default_headers={"x-sim-key": key},
                         http_client=httpx.Client(proxy=s["env"]["HTTPS_PROXY"],
                                                  verify=ssl.create_default_context(cafile=s["env"]["SSL_CERT_FILE"])))


def ask(oai: openai.OpenAI, text: str = "hi", **kwargs):
    return oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": text}], **kwargs)


class Bystander:
    """Another session's stream, held open by the simulator after its first events until
    ``finish``: if anything the failing hook did ended the proxy, this stream is cut."""

    DELTAS = ["one ", "two ", "three ", "four"]

    def __init__(self, proxy: MitmProcess, sim: ProviderSimulator, key: str) -> None:
        self.proxy = proxy
        self.session = proxy.create_session(hooks=None, upstream={"base_url": sim.url("/v1")})
        self.resume, self.started = threading.Event(), threading.Event()
        sim.script(Reply(text=self.DELTAS, pause_before=3, resume=self.resume), key=key)
        self.oai = client(proxy, self.session, key)
        self.text: list[str] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        assert self.started.wait(30), f"the bystander's stream never started: {self.error!r}"

    def _read(self) -> None:
        try:
            for chunk in ask(self.oai, stream=True):
                if chunk.choices and chunk.choices[0].delta.content:
                    self.text.append(chunk.choices[0].delta.content)
                    self.started.set()
        except BaseException as e:  # noqa: BLE001 - the test reports it
            self.error = e
            self.started.set()

    def finish(self) -> None:
        assert self.thread.is_alive() and self.error is None, "the stream ended before it was let go on"
        self.resume.set()
        self.thread.join(60)
        assert self.error is None, f"the bystander's stream broke: {self.error!r}"
        assert "".join(self.text) == "".join(self.DELTAS)
        status, _ = self.proxy.api("DELETE", f"sessions/{self.session['id']}")
        assert status == 200
        trace = read_trace(self.session["trace_path"])
        assert [(c.error, c.finish_reason) for c in trace.calls] == [(None, "stop")]
        assert trace.nodes[trace.calls[0].node].message.text() == "".join(self.DELTAS)


def summary(proxy: MitmProcess, s: dict) -> dict:
    status, body = proxy.api("GET", f"sessions/{s['id']}")
    assert status == 200, body
    return body


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("exc", list(RAISES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_anything_a_hook_raises_is_its_sessions_hook_error(proxy, sim, tmp_path, kind, exc, mode):
    """The hook's session gets a 500 ``hook_error`` naming what the hook raised, its rollout
    stops with ``hook_error`` on the record; the proxy answers on; another session's stream,
    open the whole time, completes."""
    body = KINDS[kind].format(a="async " if mode == "async" else "").replace("RAISE", RAISES[exc])
    path = hooks_file(tmp_path, body)
    key = f"{kind}-{exc}-{mode}"
    other = Bystander(proxy, sim, key + "-bystander")
    s = proxy.create_session(hooks={"module": path}, upstream={"base_url": sim.url("/v1")})
    oai = client(proxy, s, key)
    if kind == "tool_route":
        sim.script(Reply(tool_calls=[ToolCall(name="ls", arguments={}, id="call_1")]), key=key)
        assert ask(oai).choices[0].message.tool_calls[0].id == "call_1"
        status, answer = route(proxy, s["model_secret"], {"tool_call_id": "call_1", "name": "ls", "phase": "before"})
        assert status == 500, answer
        message = answer["error"]["message"]
        assert answer["error"]["type"] == "hook_error"
    else:
        sim.script(Reply(text="sampled"), key=key)
        with pytest.raises(openai.InternalServerError) as e:
            ask(oai)
        assert e.value.body["type"] == "hook_error" and e.value.response.headers["x-should-retry"] == "false"
        message = e.value.message
    assert f"hook h: raised {'CancelledError' if exc == 'CancelledError' else exc}" in message
    assert summary(proxy, s)["stop_condition"] == "hook_error"
    other.finish()
    status, _ = proxy.api("DELETE", f"sessions/{s['id']}")
    assert status == 200
    trace = read_trace(s["trace_path"])
    assert (trace.stop_condition, trace.stopped_by) == ("hook_error", "hook")
    if kind != "tool_route":
        assert trace.calls[-1].error.type == "hook_error"
    assert proxy.proc.poll() is None


HANGS = {
    "sync": "@stop\ndef h(ctx: HookContext) -> bool:\n    threading.Event().wait()\n",
    "async": "@stop\nasync def h(ctx: HookContext) -> bool:\n    await asyncio.Event().wait()\n",
    # Cancelled when its time is up, it goes on waiting: the exchange does not wait for it.
    "async_deaf": "@stop\nasync def h(ctx: HookContext) -> bool:\n    while True:\n        try:\n"
                  "            await asyncio.Event().wait()\n        except asyncio.CancelledError:\n            pass\n",
}


@pytest.mark.parametrize("limit", [0.5, None], ids=["session", "option"])
@pytest.mark.parametrize("how", list(HANGS))
def test_a_hook_that_does_not_return_is_a_hook_error_after_the_limit(proxy, sim, tmp_path, how, limit):
    """The session's ``hook_timeout`` (else the proxy's ``intercept_hook_timeout``) ends the
    wait: a 500 ``hook_error`` that names the limit, and the rollout stops on the record."""
    s = proxy.create_session(hooks={"module": hooks_file(tmp_path, HANGS[how])},
                             upstream={"base_url": sim.url("/v1")}, **({"hook_timeout": limit} if limit else {}))
    with pytest.raises(openai.InternalServerError) as e:
        ask(client(proxy, s, f"hang-{how}"))
    assert e.value.body["type"] == "hook_error"
    assert f"hook h: did not return within {limit or OPTION_LIMIT:g} s" in e.value.message
    assert summary(proxy, s)["stop_condition"] == "hook_error"
    assert proxy.api("DELETE", f"sessions/{s['id']}")[0] == 200
    assert read_trace(s["trace_path"]).calls[-1].error.type == "hook_error"


@pytest.mark.parametrize("limit", [0, -1, 1e9, "soon"])
def test_a_session_limit_that_is_not_a_positive_number_of_seconds_is_a_400(proxy, limit):
    status, answer = proxy.api("POST", "sessions", {"hook_timeout": limit})
    assert status == 400 and "hook_timeout" in answer["error"]["message"], answer


def test_the_option_out_of_range_stops_the_proxy_at_start(sim):
    proc = MitmProcess(options={"intercept_hook_timeout": "0", "intercept_upstream": sim.url("/v1")})
    proc.start(expect_failure=True)
    try:
        assert proc.wait(30) != 0
        assert "intercept_hook_timeout must be between 1 and 86400 seconds" in proc.log()
    finally:
        proc.cleanup()


# asyncio's default executor has min(32, cpu_count + 4) threads (concurrent.futures'
# ThreadPoolExecutor): one more blocked session than that would starve a shared pool on any machine.
BLOCKED = max(8, min(32, (os.cpu_count() or 1) + 4))

BLOCKING = """\
@stop
def h(ctx: HookContext) -> bool:
    if "port" in ctx.config:  # held until the test lets it go
        with socket.create_connection(("127.0.0.1", ctx.config["port"])) as s:
            s.recv(1)
    return False
"""


def test_blocked_plain_hooks_of_many_sessions_do_not_delay_another_sessions_hook(proxy, sim, tmp_path):
    """Each of BLOCKED sessions has a plain hook blocked (on a socket the test holds); another
    session's hook runs and its request is answered while they all still wait."""
    path = hooks_file(tmp_path, BLOCKING)
    sim.default = Reply(text="served")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(60)
        port = listener.getsockname()[1]
        answers: list[str] = []

        def blocked() -> None:
            s = proxy.create_session(hooks={"module": path, "config": {"port": port}}, hook_timeout=300,
                                     upstream={"base_url": sim.url("/v1")})
            answers.append(ask(client(proxy, s, "blocked", timeout=120)).choices[0].message.content)

        threads = [threading.Thread(target=blocked, daemon=True) for _ in range(BLOCKED)]
        for t in threads:
            t.start()
        held = []
        try:
            for n in range(BLOCKED):
                try:
                    held.append(listener.accept()[0])
                except TimeoutError:
                    pytest.fail(f"only {n} of {BLOCKED} sessions' hooks started")
            free = proxy.create_session(hooks={"module": path}, upstream={"base_url": sim.url("/v1")})
            assert ask(client(proxy, free, "free", timeout=30)).choices[0].message.content == "served"
            assert all(t.is_alive() for t in threads) and answers == []  # all still held
        finally:
            for conn in held:
                conn.sendall(b"x")
                conn.close()
            for t in threads:
                t.join(120)
            sim.default = None
    assert answers == ["served"] * BLOCKED


# --- the pool, in process ----------------------------------------------------------------------

def test_a_sessions_threads_stuck_past_the_limit_fail_fast_and_come_back():
    """All of a session's threads stuck in hooks that passed the limit: the next plain hook is
    a failure at once (no thread, no wait); once one returns, hooks run again. A closed pool
    lets its idle threads go and opens again for a late call."""
    from interceptor.addons.gateway.policy.hookpool import WORKERS, HookPool, Late, Stuck

    async def main() -> None:
        release = threading.Event()
        pool = HookPool(timeout=0.2)
        for _ in range(WORKERS):
            with pytest.raises(Late):
                await pool.run_sync(release.wait)
        with pytest.raises(Stuck):
            await pool.run_sync(lambda: 1)
        release.set()
        while pool.stuck:  # the stuck threads tell the loop as they return
            await asyncio.sleep(0)
        assert await pool.run_sync(lambda: 2) == 2
        pool.close()
        assert await pool.run_sync(lambda: 3) == 3

    asyncio.run(main())


def test_the_proxys_own_cancellation_is_still_a_cancellation():
    """A task running a hook that is cancelled from outside (shutdown, a flow killed) is
    cancelled, and so is the hook's own task; only a hook's own CancelledError is the hook's."""
    from interceptor.addons.gateway.policy.hookpool import HookPool, Raised

    async def main() -> None:
        pool = HookPool(timeout=30)
        started, cancelled = asyncio.Event(), asyncio.Event()

        async def hook() -> None:
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise

        task = asyncio.ensure_future(pool.run_async(hook))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(cancelled.wait(), 30)  # a bound, not a synchronisation: it is set or never

        async def own() -> None:
            raise asyncio.CancelledError("the hook's own")

        with pytest.raises(Raised) as e:
            await pool.run_async(own)
        assert isinstance(e.value.raised, asyncio.CancelledError)

    asyncio.run(main())


# --- the property: any exception class, anywhere in a hook ---------------------------------------

BASES = [BaseException, Exception, SystemExit, KeyboardInterrupt, GeneratorExit, asyncio.CancelledError,
         StopIteration, StopAsyncIteration, ValueError, TimeoutError, MemoryError, RecursionError]


@settings(max_examples=150, deadline=None)
@given(bases=st.lists(st.sampled_from(BASES), min_size=1, max_size=3, unique=True), is_async=st.booleans(),
       after_await=st.booleans(), str_raises=st.sampled_from([None, AttributeError, SystemExit]))
def test_whatever_a_hook_raises_is_a_hook_failure(bases, is_async, after_await, str_raises):
    """Any exception class (built-in or a user's own, several bases, even one whose ``str()``
    itself raises), raised by a plain or an async hook at once or after an await: ``call``
    raises HookFailure naming the hook, never anything else."""
    from interceptor.addons.gateway.policy.hookrun import HookFailure, call
    from interceptor.hooks import HookContext
    from interceptor.trace.hooks import HookSpec

    namespace = {}
    if str_raises is not None:
        def broken_str(self):
            raise str_raises("no text for this one")
        namespace["__str__"] = broken_str
    try:
        kind = type("Drawn", tuple(bases), namespace)
    except TypeError:  # bases whose layouts cannot be combined
        assume(False)

    async def async_hook(ctx):
        if after_await:
            await asyncio.sleep(0)
        raise kind()

    def sync_hook(ctx):
        raise kind()

    spec = HookSpec(fn=async_hook if is_async else sync_hook, kind="stop", boundary="between", priority=0,
                    name="h", wants_ctx="ctx", value_arg=None, is_async=is_async)

    async def main() -> None:
        # A coroutine's StopIteration is a RuntimeError by the time it leaves it (PEP 479).
        name = "RuntimeError" if is_async and issubclass(kind, StopIteration) else "Drawn"
        with pytest.raises(HookFailure, match=f"^hook h: raised {name}: "):
            await call(spec, HookContext(session_id="s"))

    asyncio.run(main())

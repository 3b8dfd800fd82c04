"""The reference interception server as a benchmark path: verifiers' own ``InterceptionServer``
(``verifiers.v1.interception.server``, PrimeIntellect's verifiers from PyPI), started the way
its rollouts start it, with a small control API beside it so a benchmark in another process
can make sessions and read their traces.

    .venv-bench/verifiers/bin/python bench/verifiers_serve.py --upstream URL --key-env VAR

Runs in verifiers' own virtual environment (bench/compare.py installs it there), so it
imports nothing of this project. A rollout registers a ``RolloutSession`` (its model context:
the model to impose and an eval client config naming the upstream and the variable that
holds its key) on the server and hands the harness the server's base URL and the session's
model secret as its ``OPENAI_BASE_URL``/``OPENAI_API_KEY``; the control API below does the
same for the benchmark's clients:

- ``POST /sessions`` ``{"n": 16, "model": "m"}``: registers ``n`` sessions imposing ``m``,
  answers ``{"secrets": [...]}``;
- ``GET /sessions``: per session, in registration order, what its trace holds: ``calls``,
  ``errors`` (calls with an error), ``turns``, ``nodes``, ``models`` (each call's model as
  sent upstream), ``branches``.

Prints ``listening on <base url> control <control url>`` once both accept connections and
serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from aiohttp import web
from verifiers.v1.clients import ModelContext
from verifiers.v1.configs.client import EvalClientConfig
from verifiers.v1.interception.server import InterceptionServer
from verifiers.v1.session import RolloutSession
from verifiers.v1.trace import AgentInfo, Trace, TraceTask


def summary(session: RolloutSession) -> dict:
    trace = session.trace
    try:
        branches = len(trace.branches)
    except Exception:  # noqa: BLE001 - a trace verifiers cannot fold is reported, not hidden
        branches = -1
    return {"calls": len(trace.calls), "errors": sum(c.error is not None for c in trace.calls),
            "turns": trace.num_turns, "nodes": len(trace.nodes), "models": sorted({c.model or "" for c in trace.calls}),
            "branches": branches}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", required=True, help="the provider's base URL, e.g. http://127.0.0.1:PORT/v1")
    ap.add_argument("--key-env", required=True, help="the environment variable holding the provider key")
    args = ap.parse_args()
    server = InterceptionServer()  # no tunnel: the harness is on this host, as in a local eval
    await server.start()
    client = EvalClientConfig(base_url=args.upstream, api_key_var=args.key_env)
    sessions: list[RolloutSession] = []

    async def make(request: web.Request) -> web.Response:
        spec = await request.json()
        secrets = []
        for _ in range(int(spec.get("n", 1))):
            session = RolloutSession(ctx=ModelContext(model=spec["model"], client=client),
                                     trace=Trace(task=TraceTask(type="bench", data={}), agent=AgentInfo(config={})))
            secrets.append(server.register(session)[0])
            sessions.append(session)
        return web.json_response({"secrets": secrets})

    async def read(request: web.Request) -> web.Response:
        return web.json_response({"sessions": [summary(s) for s in sessions]})

    app = web.Application()
    app.router.add_post("/sessions", make)
    app.router.add_get("/sessions", read)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    control = "http://127.0.0.1:%d" % site._server.sockets[0].getsockname()[1]
    print(f"listening on {server.base_url} control {control}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    await server.stop()


if __name__ == "__main__":
    asyncio.run(main())

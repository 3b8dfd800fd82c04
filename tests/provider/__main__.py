"""Run the simulator as its own process, for benchmarks and harness runs:

    python -m tests.provider --port 0 [--script replies.json] [--exchanges capture.json]

prints `listening on http://127.0.0.1:PORT` (flushed) once it accepts connections, and
serves until SIGINT/SIGTERM. Replies come from the script file, then the default (an
echo of the last user message, or the file's "default" template). More can be queued
while it runs with `POST /_sim/script`; `GET /_sim/requests` returns the request log.

Script file: a JSON list of reply objects (the `Reply` fields; `tool_calls` as objects
with name/arguments/id/type; `raw` is body text, `raw_file` a path), or an object
    {"replies": [...], "keys": {"session-a": [...]}, "default": {...}, "exchanges": [path]}
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from typing import Any

from .reply import Reply
from .server import ProviderSimulator


def load_script(sim: ProviderSimulator, path: str) -> None:
    with open(path) as f:
        spec: Any = json.load(f)
    if isinstance(spec, list):
        spec = {"replies": spec}
    sim.script(*[Reply.from_dict(r) for r in spec.get("replies", [])])
    for key, replies in (spec.get("keys") or {}).items():
        sim.script(*[Reply.from_dict(r) for r in replies], key=key)
    for exchange_file in spec.get("exchanges", []):
        sim.script_exchange_file(exchange_file)
    if spec.get("default") is not None:
        sim.default = Reply.from_dict(spec["default"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.provider", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (the default)")
    parser.add_argument("--script", help="JSON file of scripted replies (see module docstring)")
    parser.add_argument("--exchanges", action="append", default=[], help="an anthropic-exchanges/*.json to replay; repeatable")
    parser.add_argument("--default-model", default="sim-model", help="model name when a request names none")
    parser.add_argument("--verbose", action="store_true", help="log every request on stderr")
    args = parser.parse_args(argv)

    sim = ProviderSimulator(args.host, args.port, default_model=args.default_model, quiet=not args.verbose)
    if args.script:
        load_script(sim, args.script)
    for path in args.exchanges:
        sim.script_exchange_file(path)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with sim:
        print(f"listening on {sim.base_url}", flush=True)
        while not stop.wait(0.5):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

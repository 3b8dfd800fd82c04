"""An MCP tool server (stdio) that reads its task and keeps the rollout's state through the proxy.

    python examples/mcp_task_server.py ENV_FILE

``ENV_FILE`` is what ``run_harness.py --tool-server-env ENV_FILE`` writes: the task and state
URLs and the session's state secret. The server reads it itself, so the secret is in no
harness's environment or launch config (Claude Code's ``--mcp-config`` names only this
command and the file). Its tool ``submit`` records the model's answer in the state: the
evaluator scores the state, and the model, holding only the model secret, cannot write it
any other way. ``give_up`` ends the rollout (``POST /_interceptor/stop``): the harness's next
model request is refused, and the trace's footer says why.

Needs the ``mcp`` package (2.x); the HTTP calls are the standard library's, straight to the
proxy's port (no proxy in between: the routes are the proxy's own).
"""

from __future__ import annotations

import json
import shlex
import sys
import urllib.request

from mcp.server.mcpserver import MCPServer


def read_env_file(path: str) -> dict[str, str]:
    env = {}
    with open(path) as f:
        for line in f:
            name, sep, value = line.strip().partition("=")
            if sep:
                env[name] = shlex.split(value)[0] if value else ""
    return env


ENV = read_env_file(sys.argv[1])
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def call(method: str, url: str, body: object = None, **headers: str):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Authorization": f"Bearer {ENV['INTERCEPT_STATE_SECRET']}", **headers})
    with DIRECT.open(req, timeout=15) as r:
        return json.loads(r.read()), r.headers  # case-insensitive


server = MCPServer("task")


@server.tool()
def submit(answer: str) -> str:
    """Submit the final answer to the task. Call it exactly once, with the answer."""
    task, _ = call("GET", ENV["INTERCEPT_TASK_URL"])
    state, headers = call("GET", ENV["INTERCEPT_STATE_URL"])
    attempts = int(state.get("attempts", 0)) + 1
    written, _ = call("PATCH", ENV["INTERCEPT_STATE_URL"], {"answer": answer, "attempts": attempts,
                                                          "task": task["task"].get("name")},
                      **{"Content-Type": "application/merge-patch+json", "If-Match": headers.get("ETag")})
    return f"submitted {answer!r} for task {task['task'].get('name')!r} (state version {written['version']})"


@server.tool()
def give_up(reason: str) -> str:
    """Give up on the task for good, saying why in a few words. The rollout ends."""
    answer, _ = call("POST", ENV["INTERCEPT_STOP_URL"], {"reason": f"gave_up: {reason}"[:200]},
                     **{"Content-Type": "application/json"})
    return f"the rollout is over ({answer['condition']})"


if __name__ == "__main__":
    server.run("stdio")

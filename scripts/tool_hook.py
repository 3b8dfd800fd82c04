"""Claude Code's ``PreToolUse``/``PostToolUse`` command hook, answered by the proxy's tool route.

    python -m interceptor.scripts.tool_hook

``run_harness.py --tool-hooks`` writes it into the harness's own settings (its temporary
HOME's ``~/.claude/settings.json``). Claude Code runs it around every tool call with the call
on stdin (``hook_event_name``, ``tool_name``, ``tool_input``, ``tool_use_id``, and after the
call ``tool_response``); it asks ``POST /_interceptor/tool`` on the proxy named by
``HTTPS_PROXY``, with the key Claude Code itself holds (``ANTHROPIC_API_KEY``: the session's
model secret), and answers in Claude Code's hook format:

- ``block`` (before): the call is denied with the block content as the reason, so it never
  runs; ``stop``: denied too, and Claude Code is told to stop (``continue: false``);
- ``rewrite`` (after): the tool's output is replaced (``updatedToolOutput``). Claude Code
  2.1.332 applies it to MCP tools; for its own tools (Bash, Read, ...) it ignores the change
  from a hook in the user's settings and keeps the original in its transcript. Either way the
  proxy enforces the decision at the model boundary: the model reads the rewritten content;
- anything that goes wrong (no proxy, a hook error) denies a call before it runs (exit 2:
  Claude Code blocks the call and shows the message to the model): fail closed.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import unquote, urlsplit

DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the route is the proxy's own
TIMEOUT = 590  # below the hook timeout run_harness writes (600 s): the evaluator's hooks may be slow


def route_url(env: dict[str, str]) -> tuple[str, str]:
    """The tool route's URL on the proxy ``HTTPS_PROXY`` names, and the model secret to send."""
    proxy = env.get("HTTPS_PROXY") or env.get("https_proxy") or ""
    u = urlsplit(proxy)
    if not u.hostname or not u.port:
        raise RuntimeError("HTTPS_PROXY does not name the proxy (run the harness through run_harness.py)")
    secret = env.get("ANTHROPIC_API_KEY") or unquote(u.password or "")
    return f"http://{u.hostname}:{u.port}/_interceptor/tool", secret


def request_body(event: dict[str, Any]) -> dict[str, Any]:
    phase = "before" if event.get("hook_event_name") == "PreToolUse" else "after"
    body: dict[str, Any] = {"phase": phase, "tool_call_id": event.get("tool_use_id") or "",
                            "name": event.get("tool_name"), "arguments": event.get("tool_input")}
    if phase == "after":
        response = event.get("tool_response")
        body["content"] = response
        body["is_error"] = bool(isinstance(response, dict) and (response.get("is_error") or response.get("interrupted")))
    return body


def ask(event: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    url, secret = route_url(env)
    req = urllib.request.Request(url, data=json.dumps(request_body(event)).encode(), method="POST", headers={
        "content-type": "application/json", "authorization": f"Bearer {secret}"})
    try:
        with DIRECT.open(req, timeout=TIMEOUT) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {e.code}"
        raise RuntimeError(f"the proxy's tool route answered {e.code}: {message}") from None


def answer(event: dict[str, Any], decision: dict[str, Any]) -> dict[str, Any] | None:
    """Claude Code's hook output for the route's decision (None: nothing to say)."""
    name = event.get("hook_event_name")
    action = decision.get("action")
    if action == "stop":
        reason = f"the rollout is over: {decision.get('reason')}"
        out: dict[str, Any] = {"continue": False, "stopReason": reason}
        if name == "PreToolUse":
            out["hookSpecificOutput"] = {"hookEventName": "PreToolUse", "permissionDecision": "deny",
                                         "permissionDecisionReason": reason}
        return out
    if name == "PreToolUse" and action == "block":
        return {"hookSpecificOutput": {"hookEventName": "PreToolUse", "permissionDecision": "deny",
                                       "permissionDecisionReason": _text(decision.get("content"))}}
    if name == "PostToolUse" and action in ("rewrite", "block"):  # block: a blocked tool ran all the same
        return {"hookSpecificOutput": {"hookEventName": "PostToolUse",
                                       "updatedToolOutput": _text(decision.get("content"))}}
    return None


def _text(value: Any) -> str:
    if isinstance(value, list):  # text parts
        return "".join(p.get("text", "") for p in value if isinstance(p, dict))
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def main() -> int:
    try:
        event = json.load(sys.stdin)
        decision = ask(event, dict(os.environ))
    except Exception as e:  # noqa: BLE001 - fail closed: a call the proxy did not allow does not run
        print(f"interceptor tool route unavailable, the tool call is not allowed: {e}", file=sys.stderr)
        return 2  # PreToolUse: Claude Code blocks the call; PostToolUse: it shows this to the model
    out = answer(event, decision)
    if out is not None:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

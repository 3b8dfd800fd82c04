"""What test modules import beside fixtures: the real key the proxy under test holds, and
the SDK clients of a session.

Kept out of conftest.py on purpose: pytest imports conftest itself (as ``conftest``, or under
a package name with rootdir-based paths), and ``from conftest import`` in a test module
imports it a second time as another module, so a fixture or a constant there exists twice.
"""

from __future__ import annotations

import json
import os
import socket

REAL_KEY = "sk-real-provider-key-for-tests-0123456789"
KEY_ENV = "INTERCEPT_TEST_PROVIDER_KEY"

# A local port that refuses connections and that no other process can take while the tests
# run: bound by this process for its lifetime, never listening (connecting gets
# ECONNREFUSED). A port found free and closed again could be anyone's by the time a proxy
# dials it, and an upstream is declared when its proxy starts, so the port must outlive tests.
_DEAD = socket.socket()
_DEAD.bind(("127.0.0.1", 0))
DEAD_PORT = _DEAD.getsockname()[1]


def dead_upstream() -> str:
    """intercept_upstreams declaring ``dead``: an upstream that refuses every connection."""
    return json.dumps({"dead": {"base_url": f"http://127.0.0.1:{DEAD_PORT}/v1", "api_key_env": KEY_ENV}})


def session_clients(session: dict):
    """openai and anthropic clients for a session: default base URLs, the session secret as
    the key, the proxy and CA from the environment (``harness_env`` must be applied first)."""
    import anthropic
    import openai

    assert os.environ.get("HTTPS_PROXY"), "apply the session env first"
    secret = session["model_secret"]
    return (
        openai.OpenAI(api_key=secret, max_retries=0, timeout=30),
        anthropic.Anthropic(api_key=secret, max_retries=0, timeout=30),
    )


def chat_turns(oai, first: str, turns: int, follow: str = "go on {k}", model: str = "gpt-4o") -> list[dict]:
    """A Chat agent loop of ``turns`` requests through ``oai``: ``first`` as the user's
    message, then each reply and a follow-up (``follow`` with ``k``, the turn); the history
    the last request restated and its reply."""
    messages = [{"role": "user", "content": first}]
    for k in range(turns):
        r = oai.chat.completions.create(model=model, messages=messages)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": follow.format(k=k)}]
    return messages

"""The manual's example commands are the ones a test runs: here the control-API example of
docs/sessions.md (where the README's moved), run by bash as written, with only the proxy's port and confdir put in for the defaults
(8080, ~/.mitmproxy) that parallel tests cannot share."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "docs" / "sessions.md"


def _block_with(marker: str) -> str:
    for block in re.findall(r"```sh\n(.*?)```", PAGE.read_text(), re.S):
        if marker in block:
            return block
    raise AssertionError(f"no sh block with {marker!r} in {PAGE}")


def test_the_control_api_example_creates_a_session(proxy):
    script = _block_with("/_interceptor/sessions")
    script = script.replace("~/.mitmproxy", str(proxy.confdir)).replace("127.0.0.1:8080", f"127.0.0.1:{proxy.port}")
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    created = json.loads(out.stdout)
    assert created["model_secret"].startswith("sk-ic-m-") and created["env"]["HTTPS_PROXY"].endswith(f":{proxy.port}")
    status, summary = proxy.api("GET", f"sessions/{created['id']}")
    assert status == 200 and not summary["sealed"]

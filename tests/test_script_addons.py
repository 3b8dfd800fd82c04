"""mitmproxy sees the entry script's addons as they are: each under its own guessable name, with
its options and commands, dispatched by mitmproxy's own AddonManager, which nothing replaces.

Its own tools (``mitmdump --options``, the commands, mitmweb) then show every addon, and a
new mitmproxy's dispatch behaviour reaches every hook instead of being bypassed.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from mitmproxy import command, hooks
from mitmproxy.addonmanager import traverse
from mitmproxy.proxy import server_hooks  # noqa: F401 - registers the connection hooks in hooks.all_hooks
from mitmproxy.proxy.layers.http import HttpRequestHook
from mitmproxy.test import taddons, tflow

from interceptor.addons.gateway.faults import FAULT_KEY, Fault
from interceptor.client.proxy import mitmdump_bin
from mitm import SCRIPT, MitmProcess
from waiting import wait_until
from test_addons import _load_script

ROOT = Path(__file__).resolve().parent.parent
OBSERVE = Path(__file__).with_name("observe_addons.py")
# Names an operator or a test would guess for the steps a request passes (the lower-cased class).
GUESSED = ("settings", "control", "claim", "bodycap", "rewrite", "retry", "replay", "stops", "relay",
           "tee", "gate", "annotate", "status", "fetch", "redact")


def _names(addons: list) -> list[str]:
    return [type(a).__name__.lower() for a in addons]


def _documented_options() -> set[str]:
    """The options the generated options reference (docs/reference/options.md) lists."""
    found: set[str] = set()
    for line in (ROOT / "docs" / "reference" / "options.md").read_text().splitlines():
        if line.startswith("| `intercept_"):
            found |= set(re.findall(r"`(intercept_\w+)`", line.split("|")[1]))
    return found


def test_the_scripts_addons_are_the_addons_themselves_each_under_its_own_name():
    script = _load_script()
    names = _names(script.addons)
    assert set(GUESSED) <= set(names), set(GUESSED) - set(names)
    assert len(set(names)) == len(names)  # mitmproxy refuses a second addon of one name
    with taddons.context() as tctx:
        tctx.master.addons.add(script)  # as mitmproxy's script loader registers a loaded script
        manager = tctx.master.addons
        for addon in script.addons:
            assert type(addon).__module__.startswith("interceptor.addons."), type(addon)
            assert manager.get(type(addon).__name__.lower()) is addon
        assert [a for a in traverse([script]) if a is not script] == script.addons
        # mitmproxy calls any truthy hook attribute it finds (and raises if one is not callable)
        for addon in script.addons:
            for hook in hooks.all_hooks:
                value = getattr(addon, hook, None)
                assert not value or callable(value), f"{type(addon).__name__}.{hook} is not a hook"


def test_a_guarded_addons_commands_and_options_are_mitmproxys_too():
    """The guard leaves the addon's commands, options and name where mitmproxy looks for them,
    and its guarded hook still keeps a fault on the flow."""
    from interceptor.addons.mitm.gate import guard

    class Probe:
        def load(self, loader):
            loader.add_option("intercept_probe", int, 3, "A test option.")

        @command.command("interceptor.probe")
        def probe(self) -> int:
            return 42

        def request(self, flow):
            raise RuntimeError("probe")

    addon = guard(Probe())
    with taddons.context(addon) as tctx:
        assert tctx.master.addons.get("probe") is addon
        assert tctx.master.commands.call("interceptor.probe") == 42
        assert tctx.master.commands.execute("interceptor.probe") == 42
        assert tctx.options.intercept_probe == 3
        flow = tflow.tflow()
        tctx.master.event_loop.run_until_complete(tctx.master.addons.handle_lifecycle(HttpRequestHook(flow)))
        assert flow.metadata[FAULT_KEY] == Fault("Probe.request", "raised RuntimeError")
        tctx.master.event_loop.run_until_complete(tctx.master.done())  # its log handlers go with it
    script = _load_script()
    with taddons.context() as tctx:  # every command an addon of the script has, registered
        tctx.master.addons.add(script)
        for addon in script.addons:
            for attr in dir(type(addon)):
                name = getattr(getattr(type(addon), attr, None), "command_name", None)
                if name is not None:
                    assert tctx.master.commands.commands[name].func.__self__ is addon


def test_mitmdump_options_lists_every_option_of_the_script(tmp_path):
    """``mitmdump -s addons/interception.py --options``: mitmproxy's own listing holds every
    option the script's addons add, and the options reference documents exactly those
    (tests/test_docs.py checks each row's default and help against the code)."""
    script = _load_script()
    with taddons.context() as tctx:
        tctx.master.addons.add(script)
        added = {k for k in tctx.options.keys() if k.startswith("intercept_")}
    out = subprocess.run([mitmdump_bin(), "-s", str(SCRIPT), "--set", f"confdir={tmp_path / 'conf'}",
                          "--set", f"intercept_trace_dir={tmp_path / 'traces'}", "--options"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    listed = set(re.findall(r"^(intercept_\w+):", out.stdout, re.M))
    assert added and listed == added, (added ^ listed)
    assert _documented_options() == listed, (_documented_options() ^ listed)


def test_a_running_mitmdump_holds_every_addon_by_name_and_its_own_dispatcher(tmp_path):
    """The real proxy, with tests/observe_addons.py after the script: at ``running`` the
    AddonManager holds the script's addons in order, each under its lower-cased class name, and
    none of its methods is replaced on the instance (its ``trigger_event`` dispatches)."""
    seen_file = tmp_path / "seen.json"
    with MitmProcess(options={"observe_file": str(seen_file)}, extra_scripts=[OBSERVE]) as proc:
        def seen() -> bool:  # written once mitmproxy's running hook reached the observer
            assert proc.proc.poll() is None, proc.log()[-3000:]
            return seen_file.exists()
        wait_until(seen, 60, lambda: f"{seen_file} written:\n{proc.log()[-3000:]}")
        seen = json.loads(seen_file.read_text())
    script = _load_script()
    assert [name for name, _ in seen["addons"]] == _names(script.addons)
    assert all(name == cls.lower() for name, cls in seen["addons"])
    assert seen["replaced"] == []
    assert seen["commands"] == sorted(
        getattr(getattr(type(a), attr), "command_name") for a in script.addons for attr in dir(type(a))
        if hasattr(getattr(type(a), attr, None), "command_name"))

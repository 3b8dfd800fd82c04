"""Test-only mitmproxy script: what a running mitmdump holds of the entry script.

Loaded after the entry script (``MitmProcess(extra_scripts=[OBSERVE])``); at ``running`` (after
every addon before it has started) it writes to ``observe_file``, as JSON: the addons of
this project that mitmproxy's AddonManager holds, by the name it holds them under, in its
order; the commands they registered; and which of the AddonManager's own methods its
instance holds in its place (none: mitmproxy's dispatcher is its own).
"""

from __future__ import annotations

import inspect
import json
import os

from mitmproxy import ctx
from mitmproxy.addonmanager import AddonManager, traverse


class Observe:
    def load(self, loader) -> None:
        loader.add_option("observe_file", str, "", "JSON file the observation is written to (tests only).")

    def running(self) -> None:
        manager = ctx.master.addons
        ours = [a for a in traverse(manager.chain) if type(a).__module__.startswith("interceptor.")]
        methods = {name for name, _ in inspect.getmembers(AddonManager, callable) if not name.startswith("__")}
        seen = {
            "addons": [[name, type(a).__name__] for name, a in manager.lookup.items() if any(a is o for o in ours)],
            "commands": sorted(path for path, cmd in ctx.master.commands.commands.items()
                               if any(getattr(cmd.func, "__self__", None) is o for o in ours)),
            "replaced": sorted(methods & set(vars(manager))),
        }
        tmp = f"{ctx.options.observe_file}.tmp"
        with open(tmp, "w") as f:
            json.dump(seen, f)
        os.replace(tmp, ctx.options.observe_file)  # the test waits for the whole file


addons = [Observe()]

"""Load a session's hooks module once, when the session is made, and sort its hooks.

A dotted name is imported as usual; a file path is loaded under a private module name
(``_interceptor_hooks_<digest>``), so a user's ``hooks.py`` or ``claim.py`` never replaces a
module of the proxy (mitmproxy puts ``addons/`` on ``sys.path``) nor another session's.
A file is loaded again when it changed (its modification time or size), as mitmproxy reloads
a script: an evaluator who edits ``hooks.py`` while the proxy runs a night of rollouts gets the
new code in every session made after the edit, never a stale copy without a word. A session
made before keeps the functions it started with; the trace's header names the file's sha256
(``HookSet.sha256``), so which code rewrote a rollout is on its record.
Anything wrong (the import fails, no function is marked, a signature names no boundary) is
one ``HookError`` naming ``hooks: <module>:<function>: <reason>``: a 400 at
``POST /_interceptor/sessions``, a one-line exit at start for the option or a sessions file.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from interceptor.trace.hooks import HookError, HookSpec, spec_of

_lock = threading.Lock()
# A file's module as it last was: (modification time, size), its sha256, the module. Loaded
# once per version however many sessions name it; only the latest version is kept here.
_cache: dict[str, tuple[tuple[int, int], str, ModuleType]] = {}


@dataclass(frozen=True)
class HookSet:
    """A module's hooks by boundary, each list in run order ``(-priority, name)``."""

    module: str
    sha256: str | None = None  # of the file a path names (None for a dotted module name)
    request: tuple[HookSpec, ...] = ()
    response: tuple[HookSpec, ...] = ()
    request_stops: tuple[HookSpec, ...] = ()
    response_stops: tuple[HookSpec, ...] = ()
    between_stops: tuple[HookSpec, ...] = ()
    names: tuple[str, ...] = field(default=())

    @property
    def holds_responses(self) -> bool:
        """Only a session with a response hook or stop holds the answer back."""
        return bool(self.response or self.response_stops)


def _is_path(module: str) -> bool:
    return module.endswith(".py") or "/" in module or module.startswith(".")


def _import(module: str) -> tuple[ModuleType, str | None]:
    """The module and, for a file, its sha256."""
    if not _is_path(module):
        return importlib.import_module(module), None
    path = Path(module).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no file {path}")
    key = str(path)
    with _lock:
        st = path.stat()
        version = (st.st_mtime_ns, st.st_size)
        hit = _cache.get(key)
        if hit is not None and hit[0] == version:
            return hit[2], hit[1]
        source = path.read_bytes()  # what runs is what is digested: compiled from these bytes
        name = "_interceptor_hooks_" + hashlib.sha256(key.encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"{path} is not a Python module")
        mod = importlib.util.module_from_spec(spec)
        before = sys.modules.get(name)
        sys.modules[name] = mod  # dataclasses and pickling look the module up by name
        try:
            # dont_inherit: not this module's ``from __future__ import annotations``.
            exec(compile(source, str(path), "exec", dont_inherit=True), mod.__dict__)
        except BaseException:
            if before is not None:
                sys.modules[name] = before  # the last good version stays for its sessions
            else:
                sys.modules.pop(name, None)
            raise
        digest = hashlib.sha256(source).hexdigest()
        _cache[key] = (version, digest, mod)
        return mod, digest


def load_hooks(module: str) -> HookSet:
    """Import ``module`` and collect its marked functions; see the module docstring."""
    try:
        mod, digest = _import(module)
    except Exception as e:  # the user's code: any error is theirs to read
        raise HookError(f"hooks: {module}: cannot import: {type(e).__name__}: {e}") from e
    specs: list[HookSpec] = []
    for attr, value in sorted(vars(mod).items()):
        if callable(value):
            spec = spec_of(value, f"hooks: {module}:{attr}")
            if spec is not None:
                specs.append(spec)
    if not specs:
        raise HookError(f"hooks: {module}: no hooks: mark functions with "
                        "@interceptor.hooks.intercept or @interceptor.hooks.stop")
    names = [s.name for s in specs if s.kind == "stop"]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise HookError(f"hooks: {module}: two stops named {', '.join(dup)}; give each its own name")

    def pick(kind: str, boundary: str) -> tuple[HookSpec, ...]:
        return tuple(sorted((s for s in specs if s.kind == kind and s.boundary == boundary), key=lambda s: s.order))

    return HookSet(module=module, sha256=digest, request=pick("intercept", "request"), response=pick("intercept", "response"),
                   request_stops=pick("stop", "request"), response_stops=pick("stop", "response"),
                   between_stops=pick("stop", "between"), names=tuple(s.name for s in specs))

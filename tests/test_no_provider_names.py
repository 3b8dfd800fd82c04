"""No addon, script or client module names a provider: what differs between APIs is the dialect's.

A provider named outside ``dialects/`` (a dialect's name compared as a string, a provider host, a
dialect object imported by name) is a branch that a new API does not take and a changed one
breaks silently; the dialect says it instead (``Dialect.tokens``, ``Dialect.hosts``...). Read off
the source with ``ast``: string constants that equal a registered dialect's name or one of its
hosts (docstrings aside), and imports of a dialect object (``from interceptor.dialects import
CHAT``). Known exceptions are listed with the reason and only shrink: an entry that no longer
occurs fails too.
"""

from __future__ import annotations

import ast
from pathlib import Path

from interceptor.dialects import REGISTRY

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("addons", "scripts", "client", "hooks")
NAMES = frozenset(d.name for d in REGISTRY)
HOSTS = frozenset(h for d in REGISTRY for h in d.hosts)
OBJECTS = frozenset(name for name in dir(__import__("interceptor.dialects", fromlist=["*"]))
                    if any(getattr(__import__("interceptor.dialects", fromlist=["*"]), name) is d for d in REGISTRY))

ALLOWED: dict[str, str] = {
    "addons/gateway/transport/wsserve.py": "to fix: serves the Responses WebSocket by the dialect's name; a "
                                           "dialect's WebSocket transport belongs to the dialect",
}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def named(source: str, path: str = "<planted>") -> list[str]:
    """Each place ``source`` names a provider, as ``line: what``."""
    tree = ast.parse(source, path)
    skip = _docstrings(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if node.value in NAMES or node.value.lower() in HOSTS:
                found.append((node.lineno, f"{node.lineno}: {node.value!r}"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("interceptor.dialects"):
            found += [(node.lineno, f"{node.lineno}: imports {a.name}") for a in node.names if a.name in OBJECTS]
    return [what for _, what in sorted(found)]


def test_no_addon_script_or_client_names_a_provider():
    found = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            hits = named(path.read_text(), rel)
            if hits:
                found[rel] = hits
    problems = [f"names a provider: {rel}: {hits}" for rel, hits in found.items() if rel not in ALLOWED]
    problems += [f"no longer occurs, delete its entry: {rel}" for rel in ALLOWED if rel not in found]
    assert not problems, "\n".join(problems)


def test_the_check_sees_each_way_of_naming_one():
    planted = '''"""A docstring may say chat and api.openai.com."""
from interceptor.dialects import CHAT, DIALECTS
if ex.dialect.name == "responses":
    pass
host = "api.anthropic.com"
fine = DIALECTS.get(name)
'''
    assert named(planted) == ["2: imports CHAT", "3: 'responses'", "5: 'api.anthropic.com'"]
    assert OBJECTS == {"CHAT", "RESPONSES", "ANTHROPIC", "GEMINI"}

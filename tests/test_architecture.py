"""The architecture's rules, read off the product's source with ``ast`` (nothing is imported):

1. **No internals.** mitmproxy is used through its documented API only, nothing of another
   library is replaced at run time, and no private attribute of mitmproxy, asyncio, CPython or
   any other library is touched. A mitmproxy release changes its internals without notice:
   code that reads or patches them breaks silently (duplicated or reordered bytes, a bypassed
   dispatcher), where code on the documented API fails loudly or keeps working. Checked:

   - ``X._name`` (also ``getattr(X, "_name")``, ``from lib import _name``) unless X is
     provably ours: ``self``/``cls``, a module, class or function of the product, or a
     parameter, local or attribute annotated with or assigned from a class of ours (narrowed
     by ``isinstance``). What the source cannot prove ours fails: annotate it. Documented
     underscore names (``os._exit``, namedtuple's ``_replace``...) pass;
   - ``object.__new__(C)`` unless C is provably a class of ours: it builds around C's
     constructor, on C's private layout;
   - ``X.__dict__`` or ``vars(X)`` written to (item set, ``pop``, ``update``...) unless X is
     provably ours;
   - monkeypatching: assigning or deleting an attribute of another library's module, class or
     function; assigning a function to an attribute of its object (a replaced method);
     ``setattr``/``delattr``/``object.__setattr__`` on anything of theirs;
   - an import of a mitmproxy module its API reference does not list. The reference
     (https://docs.mitmproxy.org/stable/api/events.html and the modules in its sidebar):
     ``addonmanager``, ``certs``, ``connection``, ``contentviews``, ``coretypes.multidict``,
     ``dns``, ``flow``, ``http``, ``net.server_spec``, ``proxy.context``,
     ``proxy.mode_specs``, ``proxy.server_hooks``, ``tcp``, ``tls``, ``udp``, ``websocket``;
     and what the addon guides use (https://docs.mitmproxy.org/stable/addons/overview/,
     https://docs.mitmproxy.org/stable/addons/commands/): ``ctx``, ``exceptions``,
     ``command``, ``flowfilter``, ``types``, ``version``. The event hooks' data classes are
     documented in those modules (``proxy.server_hooks``, ``tls``), so ``mitmproxy.hooks``
     itself is not on the list.

   A private name of another product module is not this rule's business (the cycle and
   layering rules see those couplings).
2. **Layering.** Dependencies point one way, trace <- hooks <- dialects <- gateway <- addons <-
   scripts/client: no module imports from a layer above its own, whether the import is at the
   top, under ``if TYPE_CHECKING:`` or inside a function. ``interceptor.hooks`` is the
   evaluator's face of ``interceptor.trace.hooks``: it imports only the trace and promises to
   pull in no addon, and nothing of ours imports it, so it sits right above the trace.
3. **No import cycle** of any kind (type-only and function-local imports included): a cycle
   means no module in it can be read, tested or replaced alone.

Each rule's known violations are an explicit allowlist below with the reason for each entry:
a file for rules 1 and 2; for rule 3 the import that closes a cycle (a list of whole cycles by
their modules would not see a new import between two modules already in one). The tests fail
on a violation not listed AND on an entry that no longer occurs, so the lists only shrink.
The checks' own tests plant violations in a copy of the tree and watch each check catch them.
"""
from __future__ import annotations

import ast
import builtins
import configparser
import functools
import shutil
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------------------------
# The allowlists: what the tree breaks today. An entry leaves when its code does.

INTERNALS_ALLOWED: dict[str, str] = {}

LAYERS_ALLOWED: dict[str, str] = {}

# An import that closes a cycle, (importer, imported) under ``interceptor.``; the test takes
# these out of the graph and finds no cycle in what is left.
_EXCHANGE = ("removed by the redesign: the shared exchange names addons' private types (type-only); "
             "a stage's state lives in that stage")
CYCLES_ALLOWED: dict[tuple[str, str], str] = {
    ("addons.gateway.exchange", "addons.gateway.transport.relay"): _EXCHANGE,
}

# ---------------------------------------------------------------------------------------------
# The rules' data

MITMPROXY_DOCUMENTED = frozenset({
    "mitmproxy.addonmanager", "mitmproxy.certs", "mitmproxy.connection", "mitmproxy.contentviews",
    "mitmproxy.coretypes.multidict", "mitmproxy.dns", "mitmproxy.flow", "mitmproxy.http",
    "mitmproxy.net.server_spec", "mitmproxy.proxy.context", "mitmproxy.proxy.mode_specs",
    "mitmproxy.proxy.server_hooks", "mitmproxy.tcp", "mitmproxy.tls", "mitmproxy.udp",
    "mitmproxy.websocket", "mitmproxy.ctx", "mitmproxy.exceptions", "mitmproxy.command",
    "mitmproxy.flowfilter", "mitmproxy.types", "mitmproxy.version",
})

MITMPROXY_PACKAGES = frozenset({"mitmproxy", "mitmproxy.proxy", "mitmproxy.coretypes", "mitmproxy.net"})

# Names with one leading underscore that their library documents as public.
DOCUMENTED_UNDERSCORE = frozenset({
    "os._exit",  # https://docs.python.org/3/library/os.html#os._exit
})
DICT_WRITES = frozenset({"pop", "popitem", "update", "clear", "setdefault", "__setitem__", "__delitem__"})
# namedtuple's documented methods and fields (https://docs.python.org/3/library/collections.html)
NAMEDTUPLE_API = frozenset({"_replace", "_asdict", "_fields", "_make", "_field_defaults"})

# Lowest first; a module may import its own layer and those below it. Longest prefix wins.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("trace", ("interceptor.trace",)),
    ("hooks", ("interceptor.hooks",)),
    ("dialects", ("interceptor.dialects",)),
    ("gateway", ("interceptor.gateway", "interceptor.addons.gateway")),
    ("addons", ("interceptor.addons",)),
    ("scripts/client", ("interceptor.scripts", "interceptor.client")),
]


# ---------------------------------------------------------------------------------------------
# Reading the tree


@dataclass
class Module:
    name: str  # interceptor.addons.mitm.claim
    path: str  # addons/mitm/claim.py, relative to the root
    tree: ast.Module
    package: bool
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    functions: dict[str, ast.AST] = field(default_factory=dict)
    globals: dict[str, ast.expr] = field(default_factory=dict)
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # alias -> (module, name)


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (a product module, or a foreign dotted name)
    line: int
    kind: str  # "top", "type-checking" or "function-local"


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    rule: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [{self.rule}] {self.what}"


def package_dirs(root: Path) -> dict[str, str]:
    """setup.cfg's package_dir: folder -> package (``addons`` -> ``interceptor.addons``)."""
    cfg = configparser.ConfigParser()
    cfg.read(root / "setup.cfg")
    mapping = {}
    for line in cfg["options"].get("package_dir", "").splitlines():
        if "=" in line:
            package, folder = (part.strip() for part in line.split("=", 1))
            mapping[folder] = package
    assert mapping, "setup.cfg has no package_dir: teach this test the new layout"
    return mapping


def relative_base(module: Module, level: int, name: str | None) -> str:
    parts = module.name.split(".")
    if not module.package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (level - 1)] if level > 1 else parts
    return ".".join(parts + ([name] if name else []))


class Program:
    """Every product module, parsed, with what each one defines and imports."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.modules: dict[str, Module] = {}
        for folder, package in package_dirs(root).items():
            for path in sorted((root / folder).rglob("*.py")):
                rel = path.relative_to(root / folder)
                parts = [package, *rel.with_suffix("").parts]
                is_package = parts[-1] == "__init__"
                if is_package:
                    parts = parts[:-1]
                name = ".".join(parts)
                tree = ast.parse(path.read_text(), str(path))
                self.modules[name] = Module(name, str(path.relative_to(root)), tree, is_package)
        for module in self.modules.values():
            self._index(module)

    def is_product(self, dotted: str) -> bool:
        return dotted == "interceptor" or dotted.startswith("interceptor.")

    def _index(self, module: Module) -> None:
        for node in module.tree.body:
            if isinstance(node, ast.ClassDef):
                module.classes[node.name] = node
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                module.functions[node.name] = node
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        module.globals[target.id] = node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
                module.globals[node.target.id] = node.value
        for node in ast.walk(module.tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                module.imports.update(self.bindings(module, node))

    def bindings(self, module: Module, node: ast.Import | ast.ImportFrom) -> dict[str, tuple[str, str | None]]:
        out: dict[str, tuple[str, str | None]] = {}
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    out[alias.asname] = (alias.name, None)
                else:
                    top = alias.name.split(".")[0]
                    out[top] = (top, None)
        else:
            base = relative_base(module, node.level, node.module) if node.level else (node.module or "")
            for alias in node.names:
                if alias.name != "*":
                    out[alias.asname or alias.name] = (base, alias.name)
        return out

    def imports(self, module: Module) -> list[Import]:
        """Every import of ``module``: at the top, type-only, function-local (a module-level
        ``try`` or ``if`` counts as the top)."""
        found: list[Import] = []

        def visit(node: ast.AST, kind: str) -> None:
            for child in ast.iter_child_nodes(node):
                child_kind = kind
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    child_kind = "function-local"
                elif isinstance(child, ast.If) and kind == "top" and is_type_checking(child.test):
                    for stmt in child.body:
                        visit_one(stmt, "type-checking")
                    for stmt in child.orelse:
                        visit_one(stmt, kind)
                    continue
                visit_one(child, child_kind)

        def visit_one(node: ast.AST, kind: str) -> None:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    found.append(Import(module.name, alias.name, node.lineno, kind))
            elif isinstance(node, ast.ImportFrom):
                base = relative_base(module, node.level, node.module) if node.level else (node.module or "")
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    target = sub if sub in self.modules or (not self.is_product(base) and alias.name != "*") else base
                    found.append(Import(module.name, target, node.lineno, kind))
            visit(node, kind)

        visit(module.tree, "top")
        return found

    @functools.cached_property
    def graph(self) -> dict[str, dict[str, Import]]:
        """Product module -> product module it imports -> the first such import."""
        edges: dict[str, dict[str, Import]] = {name: {} for name in self.modules}
        for module in self.modules.values():
            for imp in self.imports(module):
                target = imp.target
                while target and target not in self.modules and self.is_product(target):
                    target = target.rpartition(".")[0]  # a name imported from a package's __init__
                if target in self.modules and target != module.name:
                    edges[module.name].setdefault(target, imp)
        return edges


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


# ---------------------------------------------------------------------------------------------
# Rule 1: what an expression is, as far as the source tells


OWN, FOREIGN, UNKNOWN = "own", "foreign", "unknown"
STATIC, OBJECT = "static", "object"  # a module, class or function reached by name; an instance


@dataclass(frozen=True)
class Kind:
    origin: str  # OWN, FOREIGN or UNKNOWN
    what: str = OBJECT  # STATIC or OBJECT
    ref: str = ""  # own: the module or class's dotted name; foreign: a dotted name for the message


NOTHING = Kind(UNKNOWN)
NONE = Kind(UNKNOWN, OBJECT, "None")
BUILTIN_NAMES = frozenset(dir(builtins))


def joined(kinds: list[Kind]) -> Kind:
    """``a or b``, ``a if c else b``: foreign if any part is, ours if every part is (None aside)."""
    kinds = [k for k in kinds if k is not NONE] or kinds
    if any(k.origin == FOREIGN for k in kinds):
        return next(k for k in kinds if k.origin == FOREIGN)
    if kinds and all(k.origin == OWN for k in kinds):
        return kinds[0]
    return NOTHING


class Scope:
    """What the names of one function (or the module) are: parameters by annotation, locals by
    their assignments, ``self`` and ``cls`` by the enclosing class, narrowed by ``isinstance``."""

    def __init__(self, checker: Checker, module: Module, cls: ast.ClassDef | None,
                 parent: Scope | None = None) -> None:
        self.checker, self.module, self.cls, self.parent = checker, module, cls, parent
        self.names: dict[str, Kind] = {}
        self.possible: dict[str, list[Kind]] = {}  # each kind of thing a local is assigned

    def lookup(self, name: str) -> Kind:
        scope: Scope | None = self
        while scope is not None:
            if name in scope.names:
                return scope.names[name]
            scope = scope.parent
        return self.checker.symbol(self.module, name)

    def narrowed(self, test: ast.expr) -> Scope:
        """This scope where ``test`` holds: ``isinstance(x, C)`` (alone or in an ``and``)."""
        found: dict[str, Kind] = {}
        tests = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
        for t in tests:
            if (isinstance(t, ast.Call) and isinstance(t.func, ast.Name) and t.func.id == "isinstance"
                    and len(t.args) == 2 and isinstance(t.args[0], ast.Name)):
                classes = t.args[1].elts if isinstance(t.args[1], ast.Tuple) else [t.args[1]]
                found[t.args[0].id] = joined([self.instance(self.kind(c)) for c in classes])
        if not found:
            return self
        inner = Scope(self.checker, self.module, self.cls, self)
        inner.names.update(found)
        return inner

    def instance(self, k: Kind) -> Kind:
        """An instance of what ``k`` names as a class (for annotations and constructor calls)."""
        if k.origin == UNKNOWN:
            return k
        return Kind(k.origin, OBJECT, k.ref)

    def annotation(self, node: ast.expr | None) -> Kind:
        if node is None:
            return NOTHING
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                node = ast.parse(node.value, mode="eval").body
            except SyntaxError:
                return NOTHING
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            parts = [node.left, node.right]
            parts = [p for p in parts if not (isinstance(p, ast.Constant) and p.value is None)]
            return joined([self.annotation(p) for p in parts])
        if isinstance(node, ast.Subscript):
            base = self.kind(node.value)
            if base.ref.endswith("Optional") and base.origin == FOREIGN:
                return self.annotation(node.slice)
            return self.instance(base)
        k = self.kind(node)
        if k.ref in ("typing.Any", "builtins.object"):
            return NOTHING
        return self.instance(k)

    def kind(self, node: ast.expr) -> Kind:
        c = self.checker
        if isinstance(node, ast.Name):
            return self.lookup(node.id)
        if isinstance(node, ast.Attribute):
            return c.attribute(self.kind(node.value), node.attr)
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id == "type" and len(node.args) == 1:
                k = self.kind(node.args[0])
                return Kind(k.origin, STATIC, k.ref) if k.origin != UNKNOWN else k
            if isinstance(node.func, ast.Name) and node.func.id == "super":
                return Kind(OWN, OBJECT, "")
            if ast.unparse(node.func) == "object.__new__" and node.args:
                return self.instance(self.kind(node.args[0]))
            return c.called(self.kind(node.func))
        if isinstance(node, ast.BoolOp):
            return joined([self.kind(v) for v in node.values])
        if isinstance(node, ast.IfExp):
            return joined([self.narrowed(node.test).kind(node.body), self.kind(node.orelse)])
        if isinstance(node, ast.NamedExpr):
            return self.kind(node.value)
        if isinstance(node, ast.Subscript):
            k = self.kind(node.value)
            return Kind(FOREIGN, OBJECT, k.ref + "[]") if k.origin == FOREIGN else NOTHING
        if isinstance(node, ast.Constant) and node.value is None:
            return NONE
        if isinstance(node, ast.Lambda):
            return Kind(OWN, STATIC, "lambda")
        if isinstance(node, (ast.Constant, ast.List, ast.Dict, ast.Set, ast.Tuple, ast.JoinedStr,
                             ast.ListComp, ast.DictComp, ast.SetComp, ast.GeneratorExp)):
            return Kind(FOREIGN, OBJECT, "builtins." + type(node).__name__.lower())
        return NOTHING


class Checker:
    """Rule 1 over the whole program."""

    def __init__(self, program: Program) -> None:
        self.program = program
        self._symbols: dict[tuple[str, str], Kind] = {}
        self._attrs: dict[str, dict[str, Kind]] = {}
        self.violations: list[Violation] = []

    # -- names ---------------------------------------------------------------------------------

    def symbol(self, module: Module, name: str) -> Kind:
        key = (module.name, name)
        if key in self._symbols:
            return self._symbols[key]
        self._symbols[key] = NOTHING  # a cycle of definitions resolves to nothing
        self._symbols[key] = k = self._symbol(module, name)
        return k

    def _symbol(self, module: Module, name: str) -> Kind:
        if name in module.classes:
            return Kind(OWN, STATIC, f"{module.name}.{name}")
        if name in module.functions:
            return Kind(OWN, STATIC, f"{module.name}.{name}")
        if name in module.imports:
            source, attr = module.imports[name]
            return self.imported(source, attr)
        if name in module.globals:
            return Scope(self, module, None).kind(module.globals[name])
        if name in BUILTIN_NAMES:
            return Kind(FOREIGN, STATIC, f"builtins.{name}")
        return NOTHING

    def imported(self, source: str, attr: str | None) -> Kind:
        p = self.program
        if not p.is_product(source):
            return Kind(FOREIGN, STATIC, source if attr is None else f"{source}.{attr}")
        if attr is None:
            return Kind(OWN, STATIC, source)
        if f"{source}.{attr}" in p.modules:
            return Kind(OWN, STATIC, f"{source}.{attr}")
        if source in p.modules:
            k = self.symbol(p.modules[source], attr)
            return k if k.origin != UNKNOWN else Kind(OWN, OBJECT, "")
        return Kind(OWN, OBJECT, "")

    def attribute(self, base: Kind, attr: str) -> Kind:
        if base.origin == FOREIGN:
            return Kind(FOREIGN, base.what, f"{base.ref}.{attr}")
        if base.origin == UNKNOWN:
            return NOTHING
        p = self.program
        if base.what == STATIC and base.ref in p.modules:  # a module of ours
            return self.imported(base.ref, attr)
        cls = self.own_class(base.ref)
        if cls is None:
            return NOTHING
        return self.class_attrs(base.ref).get(attr, NOTHING)

    def called(self, func: Kind) -> Kind:
        if func.origin == FOREIGN and func.what == OBJECT and func.ref.startswith("builtins."):
            return NOTHING  # what a container of ours hands out (``d.get(k)``, ``items.pop()``)
        if func.origin == FOREIGN:
            return Kind(FOREIGN, OBJECT, func.ref + "()")
        if func.origin == OWN and func.what == STATIC:
            if self.own_class(func.ref) is not None:
                return Kind(OWN, OBJECT, func.ref)
            found = self.own_function(func.ref)
            if found is not None:
                module, fn = found
                return Scope(self, module, None).annotation(fn.returns)
        return NOTHING

    def defined(self, ref: str, table: str) -> tuple[Module, ast.AST] | None:
        """``ref`` (``interceptor.x.Name``) in one of a module's tables (``classes``, ``functions``)."""
        module_name, _, name = ref.rpartition(".")
        module = self.program.modules.get(module_name)
        if module is not None and name in getattr(module, table):
            return module, getattr(module, table)[name]
        return None

    def own_class(self, ref: str) -> tuple[Module, ast.ClassDef] | None:
        return self.defined(ref, "classes")  # type: ignore[return-value]

    def own_function(self, ref: str) -> tuple[Module, ast.AST] | None:
        found = self.defined(ref, "functions")
        if found is not None:
            return found
        owner, _, name = ref.rpartition(".")
        cls = self.own_class(owner)
        if cls is not None:
            for node in cls[1].body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    return cls[0], node
        return None

    def class_attrs(self, ref: str) -> dict[str, Kind]:
        """A class of ours: its methods, and its attributes' kinds from annotations in the body,
        ``self.x: T`` and ``self.x = ...`` in its methods, and its bases of ours."""
        if ref in self._attrs:
            return self._attrs[ref]
        attrs: dict[str, Kind] = {}
        self._attrs[ref] = attrs
        found = self.own_class(ref)
        if found is None:
            return attrs
        module, cls = found
        scope = Scope(self, module, cls)
        for base in cls.bases:
            b = scope.kind(base)
            if b.origin == OWN:
                attrs.update(self.class_attrs(b.ref))
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                props = any(isinstance(d, ast.Name) and d.id in ("property", "cached_property")
                            or isinstance(d, ast.Attribute) and d.attr == "cached_property"
                            for d in node.decorator_list)
                attrs[node.name] = scope.annotation(node.returns) if props else Kind(OWN, STATIC, f"{ref}.{node.name}")
            elif isinstance(node, ast.ClassDef):
                attrs[node.name] = Kind(OWN, STATIC, "")
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                attrs[node.target.id] = scope.annotation(node.annotation)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        attrs.setdefault(t.id, scope.kind(node.value))
        seen: dict[str, list[Kind]] = {}
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                fscope = self.function_scope(module, cls, node, scope)
                for stmt in ast.walk(node):
                    if isinstance(stmt, ast.AnnAssign) and is_self_attr(stmt.target):
                        seen.setdefault(stmt.target.attr, []).append(fscope.annotation(stmt.annotation))
                    elif isinstance(stmt, ast.Assign):
                        for target in stmt.targets:
                            for t, v in pairs(target, stmt.value):
                                if is_self_attr(t):
                                    seen.setdefault(t.attr, []).append(fscope.kind(v) if v is not None else NOTHING)
        for name, kinds in seen.items():
            if name not in attrs or attrs[name].origin == UNKNOWN:
                attrs[name] = joined(kinds)
        return attrs

    def function_scope(self, module: Module, cls: ast.ClassDef | None, fn: ast.AST, parent: Scope) -> Scope:
        """A function's names: parameters (``self``/``cls`` by the class), imports, defs, and
        assignments (a name assigned several kinds of thing is what ``joined`` makes of them)."""
        scope = Scope(self, module, cls, parent)
        args = fn.args
        params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
        static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in getattr(fn, "decorator_list", []))
        classmethod_ = any(isinstance(d, ast.Name) and d.id == "classmethod" for d in getattr(fn, "decorator_list", []))
        for i, a in enumerate(params):
            if i == 0 and cls is not None and not static and fn in cls.body:
                ref = f"{module.name}.{cls.name}"
                scope.names[a.arg] = Kind(OWN, STATIC if classmethod_ else OBJECT, ref)
            elif i == 0 and a.arg in ("self", "cls") and a.annotation is None:
                scope.names[a.arg] = Kind(OWN, OBJECT, "")  # a method defined outside its class
            else:
                scope.names[a.arg] = scope.annotation(a.annotation)
        for a in (args.vararg, args.kwarg):
            if a is not None:
                scope.names[a.arg] = NOTHING
        assigned: dict[str, list[Kind]] = {}
        body = fn.body if isinstance(fn.body, list) else []
        for stmt in walk_local(body):
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                for alias, (source, attr) in self.program.bindings(module, stmt).items():
                    scope.names[alias] = self.imported(source, attr)
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                scope.names[stmt.name] = Kind(OWN, STATIC, "")
        for stmt in walk_local(body):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                assigned.setdefault(stmt.target.id, []).append(scope.annotation(stmt.annotation))
            elif isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    for t, v in pairs(target, stmt.value):
                        if isinstance(t, ast.Name):
                            assigned.setdefault(t.id, []).append(scope.kind(v) if v is not None else NOTHING)
            elif isinstance(stmt, (ast.For, ast.AsyncFor, ast.comprehension)):
                for t in ast.walk(stmt.target):
                    if isinstance(t, ast.Name):
                        assigned.setdefault(t.id, []).append(NOTHING)
            elif isinstance(stmt, (ast.With, ast.AsyncWith)):
                for item in stmt.items:
                    if isinstance(item.optional_vars, ast.Name):
                        assigned.setdefault(item.optional_vars.id, []).append(NOTHING)
            elif isinstance(stmt, ast.NamedExpr):
                assigned.setdefault(stmt.target.id, []).append(scope.kind(stmt.value))
            elif isinstance(stmt, ast.ExceptHandler) and stmt.name:
                assigned.setdefault(stmt.name, []).append(scope.annotation(stmt.type) if stmt.type else NOTHING)
        for name, kinds in assigned.items():
            if name in scope.names and scope.names[name].origin != UNKNOWN:
                kinds = [scope.names[name], *kinds]
            scope.names[name] = joined(kinds)
            scope.possible[name] = kinds
        return scope

    # -- the rule ------------------------------------------------------------------------------

    def check(self) -> list[Violation]:
        for module in self.program.modules.values():
            self.check_imports(module)
            top = Scope(self, module, None)
            self.visit(module, module.tree.body, top)
        return self.violations

    def flag(self, module: Module, node: ast.AST, rule: str, what: str) -> None:
        self.violations.append(Violation(module.path, node.lineno, rule, what))

    def check_imports(self, module: Module) -> None:
        for node in ast.walk(module.tree):
            names: list[tuple[str, str | None]] = []
            if isinstance(node, ast.Import):
                names = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [(node.module or "", alias.name) for alias in node.names]
            for source, attr in names:
                if source == "mitmproxy" or source.startswith("mitmproxy."):
                    candidates = [source] + ([f"{source}.{attr}"] if attr else [])
                    if source == "mitmproxy" and attr is None:
                        continue  # a bare ``import mitmproxy``: its attribute chains are checked
                    if not any(c in MITMPROXY_DOCUMENTED for c in candidates):
                        shown = f"{source}.{attr}" if attr else source
                        self.flag(module, node, "mitmproxy-api", f"imports {shown}, not in mitmproxy's API reference")
                if attr and attr.startswith("_") and not attr.startswith("__") and not self.program.is_product(source):
                    self.flag(module, node, "private", f"imports {source}.{attr}, a private name of another library")

    def visit(self, module: Module, body: list[ast.stmt], scope: Scope) -> None:
        for stmt in body:
            self.visit_node(module, stmt, scope)
            # ``if not isinstance(x, C): return``: x is a C below
            if (isinstance(stmt, ast.If) and not stmt.orelse and isinstance(stmt.test, ast.UnaryOp)
                    and isinstance(stmt.test.op, ast.Not) and stmt.body
                    and isinstance(stmt.body[-1], (ast.Return, ast.Raise, ast.Continue, ast.Break))):
                scope = scope.narrowed(stmt.test.operand)

    def visit_node(self, module: Module, node: ast.AST, scope: Scope) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for d in getattr(node, "decorator_list", []):
                self.visit_node(module, d, scope)
            for default in [*node.args.defaults, *[d for d in node.args.kw_defaults if d is not None]]:
                self.visit_node(module, default, scope)
            inner = self.function_scope(module, scope.cls, node, scope)
            if isinstance(node, ast.Lambda):
                self.visit_node(module, node.body, inner)
            else:
                self.visit(module, node.body, inner)
            return
        if isinstance(node, ast.ClassDef):
            for part in [*node.bases, *node.keywords, *node.decorator_list]:
                self.visit_node(module, part, scope)
            class_scope = Scope(self, module, node, scope if scope.parent is not None else None)
            self.visit(module, node.body, class_scope)
            return
        if isinstance(node, (ast.If, ast.While)):
            self.visit_node(module, node.test, scope)
            self.visit(module, node.body, scope.narrowed(node.test))
            self.visit(module, node.orelse, scope)
            return
        if isinstance(node, ast.IfExp):
            self.visit_node(module, node.test, scope)
            self.visit_node(module, node.body, scope.narrowed(node.test))
            self.visit_node(module, node.orelse, scope)
            return
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
            current = scope
            for value in node.values:
                self.visit_node(module, value, current)
                current = current.narrowed(value)
            return
        if isinstance(node, ast.Attribute):
            self.check_attribute(module, node, scope)
        elif isinstance(node, ast.Call):
            self.check_call(module, node, scope)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            value = getattr(node, "value", None)
            for target in targets:
                for t, v in pairs(target, value):
                    self.check_store(module, t, v, scope)
        for child in ast.iter_child_nodes(node):
            self.visit_node(module, child, scope)

    def check_attribute(self, module: Module, node: ast.Attribute, scope: Scope) -> None:
        attr = node.attr
        base = scope.kind(node.value)
        shown = ast.unparse(node.value)
        if base.origin == FOREIGN and base.what == STATIC and base.ref in MITMPROXY_PACKAGES:
            dotted = f"{base.ref}.{attr}"  # after a bare ``import mitmproxy``
            if dotted not in MITMPROXY_DOCUMENTED and dotted not in MITMPROXY_PACKAGES:
                self.flag(module, node, "mitmproxy-api", f"uses {dotted}, not in mitmproxy's API reference")
        if not attr.startswith("_") or attr.startswith("__") or attr in NAMEDTUPLE_API:
            return
        if base.origin == OWN or f"{base.ref}.{attr}" in DOCUMENTED_UNDERSCORE:
            return
        self.flag(module, node, "private", f"{shown}.{attr}: {describe(base)}")

    def check_call(self, module: Module, node: ast.Call, scope: Scope) -> None:
        func = node.func
        name = ast.unparse(func)
        args = node.args
        if name == "object.__new__" and args:
            k = scope.kind(args[0])
            if not (k.origin == OWN and self.own_class(k.ref) is not None):
                self.flag(module, node, "object.__new__", f"object.__new__({ast.unparse(args[0])}): {describe(k)}, "
                                                         "built around its constructor")
        if name in ("getattr", "hasattr", "setattr", "delattr", "object.__setattr__", "object.__getattribute__",
                    "object.__delattr__") and len(args) >= 2:
            target = scope.kind(args[0])
            literal = args[1].value if isinstance(args[1], ast.Constant) and isinstance(args[1].value, str) else None
            if literal is not None and literal.startswith("_") and not literal.startswith("__") and not ours(target):
                self.flag(module, node, "private", f"{name}({ast.unparse(args[0])}, {literal!r}): {describe(target)}")
            if literal == "__dict__" and not ours(target):
                self.flag(module, node, "__dict__", f"{name}({ast.unparse(args[0])}, '__dict__'): {describe(target)}")
            if name in ("setattr", "delattr", "object.__setattr__", "object.__delattr__") and target.origin == FOREIGN:
                self.flag(module, node, "monkeypatch", f"{name} on {ast.unparse(args[0])}: {describe(target)}")
        if isinstance(func, ast.Attribute) and func.attr in DICT_WRITES:
            self.check_dict_write(module, func.value, scope)

    def check_dict_write(self, module: Module, container: ast.expr, scope: Scope) -> None:
        """``X.__dict__`` (or ``vars(X)``) written to: X's attributes changed behind its class."""
        if isinstance(container, ast.Attribute) and container.attr == "__dict__":
            owner = container.value
        elif (isinstance(container, ast.Call) and isinstance(container.func, ast.Name)
              and container.func.id == "vars" and len(container.args) == 1):
            owner = container.args[0]
        else:
            return
        k = scope.kind(owner)
        if not ours(k):
            self.flag(module, container, "__dict__", f"{ast.unparse(container)} written: {describe(k)}")

    def check_store(self, module: Module, target: ast.expr, value: ast.expr | None, scope: Scope) -> None:
        """Assigning (or deleting) an attribute of another library's module, class or function is
        patching it; of its object, when what is assigned is a function (a replaced method)."""
        if isinstance(target, ast.Subscript):
            self.check_dict_write(module, target.value, scope)
            return
        if not isinstance(target, ast.Attribute):
            return
        if target.attr == "__dict__":
            self.check_dict_write(module, target, scope)
        base = scope.kind(target.value)
        if base.origin != FOREIGN:
            return
        shown = ast.unparse(target)
        if base.what == STATIC:
            self.flag(module, target, "monkeypatch", f"{shown} = ...: replaces an attribute of {describe(base)}")
        elif value is not None and self.callable_value(value, scope):
            self.flag(module, target, "monkeypatch", f"{shown} = {ast.unparse(value)}: replaces a method of "
                                                     f"{describe(base)}")

    def callable_value(self, value: ast.expr, scope: Scope) -> bool:
        if isinstance(value, ast.Lambda):
            return True
        k = scope.kind(value)
        if k.origin == OWN and k.what == STATIC:
            return True
        if isinstance(value, ast.Attribute):
            bases = [scope.kind(value.value)]
            if isinstance(value.value, ast.Name):
                bases += scope.possible.get(value.value.id, [])
            if any(b.origin == OWN and self.own_function(f"{b.ref}.{value.attr}") is not None for b in bases):
                return True  # a bound method of ours (whatever else the name may hold)
        if isinstance(value, ast.Call):
            called = ast.unparse(value.func)
            if called.endswith("partial") or called.endswith("MethodType"):
                return True
        return False


def ours(k: Kind) -> bool:
    return k.origin == OWN


def describe(k: Kind) -> str:
    if k.origin == FOREIGN:
        return f"{k.ref} is another library's"
    if k.origin == UNKNOWN:
        return "not provably ours (annotate it with a class of ours, or leave the attribute alone)"
    return "ours"


def is_self_attr(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def pairs(target: ast.expr, value: ast.expr | None):
    """(target, value) for each name a (possibly tuple) assignment binds; value None when the
    shapes differ."""
    if isinstance(target, (ast.Tuple, ast.List)):
        if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
            for t, v in zip(target.elts, value.elts):
                yield from pairs(t, v)
        else:
            for t in target.elts:
                yield from pairs(t, None)
    elif isinstance(target, ast.Starred):
        yield from pairs(target.value, None)
    else:
        yield target, value


def walk_local(body: list[ast.stmt]):
    """Every node of a function's body, not descending into nested functions or classes."""
    stack: list[ast.AST] = list(reversed(body))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


# ---------------------------------------------------------------------------------------------
# Rules 2 and 3


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), rank)
    return None if best is None else best[1]


def layering_violations(program: Program) -> list[Violation]:
    found = []
    for source, targets in program.graph.items():
        mine = layer_of(source)
        assert mine is not None, f"{source} is in no layer: add its package to LAYERS"
        for target, imp in targets.items():
            theirs = layer_of(target)
            if theirs is not None and theirs > mine:
                found.append(Violation(program.modules[source].path, imp.line, "layering",
                                       f"{source} ({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0]}), "
                                       f"a layer above ({imp.kind} import)"))
    return found


def cycles(imports: dict[str, dict[str, Import]]) -> list[tuple[frozenset[str], list[Import]]]:
    """Each strongly connected set of modules (Tarjan's algorithm, iterative), with one
    shortest cycle through it as the imports that close it."""
    graph = {name: sorted(targets) for name, targets in imports.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[frozenset[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            children = graph[node]
            if i < len(children):
                work.append((node, i + 1))
                child = children[i]
                if child not in index:
                    work.append((child, 0))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            if low[node] == index[node]:
                members = set()
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    members.add(top)
                    if top == node:
                        break
                if len(members) > 1:
                    components.append(frozenset(members))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    found = []
    for component in components:
        first = min(component)
        # the shortest way from ``first`` back to itself inside the component (breadth first)
        previous: dict[str, str] = {}
        frontier, done = [first], False
        while frontier and not done:
            following = []
            for node in frontier:
                for child in graph[node]:
                    if child not in component:
                        continue
                    if child == first:
                        previous[first] = node
                        done = True
                        break
                    if child not in previous:
                        previous[child] = node
                        following.append(child)
                if done:
                    break
            frontier = following
        path, node = [], first
        while True:
            before = previous[node]
            path.append(imports[before][node])
            node = before
            if node == first:
                break
        found.append((component, list(reversed(path))))
    return sorted(found, key=lambda c: (-len(c[0]), min(c[0])))


def show_cycle(component: frozenset[str], path: list[Import]) -> str:
    steps = " -> ".join(f"{imp.source} ({imp.kind}, line {imp.line})" for imp in path)
    return f"{len(component)} modules: {sorted(component)}\n    one cycle: {steps} -> {path[0].source}"


# ---------------------------------------------------------------------------------------------
# The tests


def compared(found: dict, allowed: dict, show) -> list[str]:
    """What to fix: violations whose entry is not allowed, and allowed entries that no longer
    occur (delete them: the list only shrinks)."""
    problems = [f"not allowed: {show(key)}\n" + "\n".join(f"    {v}" for v in found[key])
                for key in sorted(found, key=str) if key not in allowed]
    problems += [f"no longer occurs, delete its allowlist entry: {show(key)} ({allowed[key]})"
                 for key in sorted(allowed, key=str) if key not in found]
    return problems


def by_file(violations: list[Violation]) -> dict[str, list[Violation]]:
    out: dict[str, list[Violation]] = {}
    for v in violations:
        out.setdefault(v.path, []).append(v)
    return out


def reaches(graph: dict[str, dict[str, Import]], start: str, goal: str) -> bool:
    seen, todo = {start}, [start]
    while todo:
        for child in graph.get(todo.pop(), {}):
            if child == goal:
                return True
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return False


def cycle_problems(program: Program, allowed: dict[tuple[str, str], str]) -> list[str]:
    """Each cycle left once the allowed imports are taken out of the graph, and each allowed
    import that is gone or closes no cycle any more. (Allowing whole cycles by their modules
    would not see a new import between two modules already in one.)"""
    full = program.graph
    named = {("interceptor." + a, "interceptor." + b): reason for (a, b), reason in allowed.items()}
    kept = {source: {target: imp for target, imp in targets.items() if (source, target) not in named}
            for source, targets in full.items()}
    problems = [f"not allowed: an import cycle of {show_cycle(component, path)}" for component, path in cycles(kept)]
    for (source, target), reason in sorted(named.items()):
        entry = f"{source.removeprefix('interceptor.')} -> {target.removeprefix('interceptor.')} ({reason})"
        if target not in full.get(source, {}):
            problems.append(f"no longer occurs, delete its allowlist entry: {entry}")
        elif not reaches(full, target, source):
            problems.append(f"closes no cycle any more, delete its allowlist entry: {entry}")
    return problems


@pytest.fixture(scope="module")
def program() -> Program:
    return Program(ROOT)


def test_no_internals_of_mitmproxy_asyncio_or_any_other_library(program):
    problems = compared(by_file(Checker(program).check()), INTERNALS_ALLOWED, str)
    assert not problems, "\n".join(problems)


def test_imports_point_down_the_layers(program):
    problems = compared(by_file(layering_violations(program)), LAYERS_ALLOWED, str)
    assert not problems, "\n".join(problems)


def test_no_import_cycle(program):
    problems = cycle_problems(program, CYCLES_ALLOWED)
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# The checks catch what they are for: violations planted in a copy of the tree


PLANTED_INTERNALS = '''
import asyncio
import os
import tempfile

import mitmproxy
from typing import TYPE_CHECKING

from mitmproxy import addonmanager, ctx, http
from mitmproxy.proxy import layers  # flagged: undocumented module
from mitmproxy.proxy.events import DataReceived  # flagged: undocumented module
from asyncio.streams import _DEFAULT_LIMIT  # flagged: a private name
from interceptor.trace.graph import Graph

if TYPE_CHECKING:
    from mitmproxy.utils import human  # flagged: undocumented, even type-only


def _helper() -> int:
    return 1


class Own:
    _shared = 0

    def __init__(self, lock: asyncio.Lock, graph: Graph) -> None:
        self._count = _helper()
        self.lock = lock
        self.reader = asyncio.StreamReader()
        self.graph = graph

    def fine(self, other: Own, anything) -> int:
        if isinstance(anything, Own):
            anything._count += 1
        self.__dict__.pop("_count", None)
        return self._count + other._count + Own._shared + self.graph._nodes_ + (os._exit is None)

    def waiters(self) -> int:
        return len(self.lock._waiters)  # flagged: asyncio's private

    def buffered(self) -> int:
        return len(self.reader._buffer)  # flagged: asyncio's private

    @classmethod
    def make(cls) -> Own:
        return object.__new__(cls)


async def handler_of(flow: http.HTTPFlow):
    lock = ctx.master._lock  # flagged: mitmproxy's private
    probe = getattr(flow.server_conn, "_state", None)  # flagged: by name
    spill = tempfile.SpooledTemporaryFile()
    return lock, probe, spill._rolled  # flagged: CPython's private


def unknown(thing):
    return thing._secret  # flagged: not provably ours


def build() -> http.Response:
    return object.__new__(http.Response)  # flagged: around mitmproxy's constructor


def layer_of(flow) -> object:
    return mitmproxy.proxy.layers.http.HttpLayer  # flagged: an undocumented module, by attribute


def patch(manager: addonmanager.AddonManager, flow: http.HTTPFlow) -> None:
    manager.__dict__.pop("trigger_event", None)  # flagged: another library's __dict__
    vars(manager)["x"] = 1  # flagged: another library's __dict__
    setattr(manager, "trigger", print)  # flagged: setattr on another library's object
    manager.trigger_event = _helper  # flagged: a method replaced
    asyncio.sleep = _helper  # flagged: a module's function replaced
    http.Response.make = staticmethod(_helper)  # flagged: a class's method replaced
    flow.response = http.Response.make(200)
    flow.metadata["x"] = 1
'''


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Program:
    """A copy of the product with a violation of each rule added (the shared tree untouched)."""
    root = tmp_path_factory.mktemp("planted")
    shutil.copy(ROOT / "setup.cfg", root / "setup.cfg")
    for folder in package_dirs(ROOT):
        shutil.copytree(ROOT / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    files = {
        "addons/zz_internals.py": PLANTED_INTERNALS,
        # layering: the trace reaching up into the addons, three ways
        "trace/zz_up_top.py": "from interceptor.addons.mitm import claim\n",
        "trace/zz_up_typed.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                 "    from interceptor.addons.gateway.exchange import Exchange\n"),
        "trace/zz_up_local.py": "def f():\n    from interceptor.scripts import replay_trace\n",
        # a cycle closed by a function-local import, and one by a type-only import
        "dialects/zz_a.py": "import interceptor.dialects.zz_b\n",
        "dialects/zz_b.py": "def f():\n    from interceptor.dialects import zz_a\n",
        "dialects/zz_c.py": "from interceptor.dialects.zz_d import D\n",
        "dialects/zz_d.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                             "    from interceptor.dialects.zz_c import C\nclass D: ...\n"),
    }
    for rel, source in files.items():
        (root / rel).write_text(textwrap.dedent(source))
    return Program(root)


def test_the_internals_check_flags_exactly_the_planted_lines(planted):
    flagged = {v.line for v in Checker(planted).check() if v.path == "addons/zz_internals.py"}
    lines = PLANTED_INTERNALS.splitlines()
    expected = {i for i, line in enumerate(lines, 1) if "# flagged" in line}
    assert flagged == expected, (
        f"missed: {[lines[i - 1].strip() for i in sorted(expected - flagged)]}; "
        f"wrongly flagged: {[lines[i - 1].strip() for i in sorted(flagged - expected)]}")


def test_the_layering_check_flags_each_way_up(planted):
    found = {(v.path, v.what.rpartition("(")[2].rstrip(")")) for v in layering_violations(planted)
             if "zz_" in v.path}
    assert found == {("trace/zz_up_top.py", "top import"), ("trace/zz_up_typed.py", "type-checking import"),
                     ("trace/zz_up_local.py", "function-local import")}


def test_the_cycle_check_finds_function_local_and_type_only_cycles(planted):
    found = {component for component, _ in cycles(planted.graph)}
    for pair in (("interceptor.dialects.zz_a", "interceptor.dialects.zz_b"),
                 ("interceptor.dialects.zz_c", "interceptor.dialects.zz_d")):
        assert frozenset(pair) in found, found
    problems = [p for p in cycle_problems(planted, CYCLES_ALLOWED) if "zz_" in p]
    assert len(problems) == 2 and all("not allowed" in p for p in problems), problems
    assert any("function-local" in p for p in problems) and any("type-checking" in p for p in problems)


def test_an_allowlist_entry_that_no_longer_occurs_fails(planted):
    problems = compared({}, {"addons/gone.py": "removed by the redesign: it went"}, str)
    assert problems == ["no longer occurs, delete its allowlist entry: addons/gone.py "
                        "(removed by the redesign: it went)"]
    allowed = dict(CYCLES_ALLOWED)
    allowed[("dialects.zz_b", "dialects.zz_a")] = "planted"
    allowed[("dialects.zz_a", "dialects.zz_c")] = "planted: no such import"
    allowed[("trace.zz_up_top", "addons.mitm.claim")] = "planted: an import on no cycle"
    problems = [p for p in cycle_problems(planted, allowed) if "zz_" in p]
    assert [p.split(":")[0] for p in problems] == ["not allowed", "no longer occurs, delete its allowlist entry",
                                                   "closes no cycle any more, delete its allowlist entry"], problems

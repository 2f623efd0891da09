"""The house the tree promises (docs/architecture.md), and the checker that reads it from
source: a foundation both wings stand on, a worker wing (the engine's GPU processes) and a
coordinator wing (``tiercache serve``, no torch) that never import each other, the link
(the engines' side of the control plane and the wire both sides speak) beside the worker
wing, below the coordinator wing's control server and the adapters and never importing
either wing, engine adapters above all three, and the tools and the CLI on top.

The checker takes sources (module name -> text), not files, so its own tests feed it a
copy of the tree with one module changed (tests/test_layer_guard.py). An import is found
however it is written: ``import a.b``, ``from a import b`` (relative too), a name taken
from a package whose ``__init__`` re-exports it lazily (``_EXPORTS``: ``from tiercache
import OffloadingManager`` is an import of ``tiercache.index.manager``, as is
``tiercache.OffloadingManager`` after ``import tiercache``), ``importlib.import_module``
of a string, and a registry's ``"tiercache.x.y:attr"`` strings (``TIER_FACTORIES``,
``BACKEND_FACTORIES``). A computed ``import_module`` outside a registry's resolver is a
finding of its own: nothing could tell what it loads. What a process loads at run time is
checked by the processes themselves (``process_loads``, tests/test_loads.py).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "tiercache"
ROOT = "tiercache"
# Each group lists its layers from the bottom up: a module may import its own layer, a
# lower one of its group, and any layer of a group below its own (``BELOW``).
GROUPS = {
    "foundation": ["errors", "specs", "results", "pages", "sizes", "loglimit", "backend_kind",
                   "config", "numa", "region"],
    "worker": ["device", "native", "planning", "backends", "transfer"],
    "link": ["link"],
    "coordinator": ["eviction", "tiers", "index", "events", "control", "metrics", "service"],
    "adapters": ["vllm", "sglang"],
    "top": ["tools", "cli", "__main__"],
}
BELOW = {
    "foundation": set(),
    "worker": {"foundation"},
    "link": {"foundation"},
    "coordinator": {"foundation", "link"},
    "adapters": {"foundation", "worker", "link", "coordinator"},
    "top": {"foundation", "worker", "link", "coordinator", "adapters"},
}
# Pairs that never meet, in either direction: the wings; the worker wing and the link (a
# worker never speaks to the coordinator: the scheduler does); one engine's adapter and
# another's.
NEVER = [("worker", "coordinator"), ("worker", "link"), ("vllm", "sglang")]
LAYERS = [layer for layers in GROUPS.values() for layer in layers]
GROUP_OF = {layer: group for group, layers in GROUPS.items() for layer in layers}
GPU_PACKAGES = frozenset({"torch", "triton"})  # never on the coordinator's side
# The verbs a lower tier never calls: the index's (the chain alone reserves, pins, books).
INDEX_VERBS = frozenset({
    "prepare_store", "complete_store", "prepare_load", "complete_load", "lease",
    "lease_batch", "complete_write", "complete_read", "quarantine", "quarantine_slots",
    "release_quarantine", "release", "reserve_promotion", "pin_for_tier"})
# Computed ``getattr`` calls a tier module may make, each reviewed: (module, the call as
# ast.unparse writes it) -> why it cannot name an index verb.
REVIEWED_TIER_GETATTRS = {
    ("tiercache.tiers", "getattr(config, name)"):
        "a config section by its registry name (TIER_FACTORIES' keys)",
    ("tiercache.tiers", "getattr(importlib.import_module(module), attr)"):
        "a registry entry's callable ('module:callable', followed as an import)",
}
_MODULE_STRING = re.compile(r"tiercache(\.\w+)*(:\w+)?")


def read_tree(package: Path = PACKAGE) -> dict[str, str]:
    """Every module of the package, by name, with its source."""
    sources = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        sources[".".join((ROOT,) + parts)] = path.read_text()
    return sources


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def allowed(own: str, other: str) -> bool:
    """May a module of layer ``own`` import one of layer ``other``?"""
    own_group, other_group = GROUP_OF[own], GROUP_OF[other]
    if own_group == other_group:
        if own_group == "adapters":
            return own == other  # one engine's adapter never imports another's
        layers = GROUPS[own_group]
        return layers.index(other) <= layers.index(own)
    return other_group in BELOW[own_group]


class Tree:
    """The package's modules parsed once, with every import edge resolved."""

    def __init__(self, sources: dict[str, str], parsed: dict[str, ast.Module] | None = None):
        self.sources = sources
        self.trees = {name: (parsed or {}).get(name) or ast.parse(text)
                      for name, text in sources.items()}
        self.exports = {name: _exports(tree) for name, tree in self.trees.items()}

    def changed(self, module: str, source: str) -> Tree:
        """This tree with ``module``'s source replaced (or added); the rest not re-parsed."""
        parsed = {name: tree for name, tree in self.trees.items() if name != module}
        return Tree({**self.sources, module: source}, parsed)

    def is_package(self, module: str) -> bool:
        return any(other.startswith(module + ".") for other in self.sources)

    def _from(self, module: str, node: ast.ImportFrom) -> str | None:
        if not node.level:
            return node.module
        base = module.split(".")
        if not self.is_package(module):
            base = base[:-1]
        base = base[:len(base) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))

    def _name_in(self, package: str, name: str) -> str:
        """The module ``from package import name`` loads for ``name``."""
        child = f"{package}.{name}"
        if child in self.sources:
            return child
        return self.exports.get(package, {}).get(name, package)

    def imports(self, module: str, type_only: bool = True) -> set[str]:
        """Every tiercache module ``module`` imports, anywhere in the file (inside functions
        too; under ``if TYPE_CHECKING`` unless ``type_only`` is False)."""
        return {name for name, _ in self.edges(module, type_only) if name in self.sources}

    def edges(self, module: str, type_only: bool = True) -> Iterator[tuple[str, int]]:
        """(imported name, line) for every import of ``module``, tiercache or not."""
        tree = self.trees[module]
        skipped = set() if type_only else _type_checking_nodes(tree)
        # a package's lazy ``_EXPORTS`` table loads nothing itself: it resolves the names
        # others import through it (``_name_in``)
        skipped |= {id(n) for node in tree.body if _is_exports(node) for n in ast.walk(node)}
        root_names = {alias.asname or alias.name for node in ast.walk(tree)
                      if isinstance(node, ast.Import) for alias in node.names
                      if alias.name == ROOT}
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.ImportFrom):
                source = self._from(module, node)
                if source is None:
                    continue
                for alias in node.names:
                    yield self._name_in(source, alias.name), node.lineno
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    yield alias.name, node.lineno
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in root_names:
                yield self._name_in(ROOT, node.attr), node.lineno
            elif isinstance(node, ast.Call) and _is_import_call(node) and node.args \
                    and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                yield node.args[0].value, node.lineno
            elif isinstance(node, ast.Dict):  # a registry: "tiercache.x.y:callable" values
                for value in node.values:
                    if isinstance(value, ast.Constant) and isinstance(value.value, str) \
                            and _MODULE_STRING.fullmatch(value.value):
                        yield value.value.partition(":")[0], value.lineno

    def computed_imports(self, module: str) -> list[str]:
        """``import_module(x)`` of a computed ``x`` where no registry or ``_EXPORTS`` of the
        module says what ``x`` may be."""
        tree = self.trees[module]
        has_registry = any(
            isinstance(node, ast.Dict) and any(
                isinstance(v, ast.Constant) and isinstance(v.value, str)
                and _MODULE_STRING.fullmatch(v.value) for v in node.values)
            for node in ast.walk(tree))
        return [f"{module}:{node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
                if isinstance(node, ast.Call) and _is_import_call(node) and node.args
                and not isinstance(node.args[0], ast.Constant) and not has_registry]


def _exports(tree: ast.Module) -> dict[str, str]:
    """A package's lazy re-exports: its module-level ``_EXPORTS = {name: module}``."""
    for node in tree.body:
        if _is_exports(node):
            assert isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
            return {k.value: v.value for k, v in zip(node.value.keys, node.value.values)
                    if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)}
    return {}


def _is_exports(node: ast.stmt) -> bool:
    return isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and any(
        isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets)


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    return {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
            for n in ast.walk(node)}


def _is_import_call(node: ast.Call) -> bool:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name in ("import_module", "__import__")


# ------------------------------------------------------------------ the rules


def upward_imports(tree: Tree) -> list[str]:
    """Imports of a higher layer, or of the other wing (type-only imports count)."""
    wrong = []
    for module in tree.sources:
        own = layer(module)
        if own is None:
            continue
        for other_module in sorted(tree.imports(module)):
            other = layer(other_module)
            if other is not None and not allowed(own, other):
                wrong.append(f"{module} ({GROUP_OF[own]}) imports {other_module} "
                             f"({GROUP_OF[other]})")
    return wrong


def cycles(tree: Tree) -> list[list[str]]:
    """Import cycles at run time (an import inside a function counts: it only moves the
    cycle; a type-only reference does not load)."""
    graph = {module: tree.imports(module, type_only=False) - {module} for module in tree.sources}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    found = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for other in sorted(graph[module]):
            if state.get(other) == 1:
                found.append(path[path.index(other):] + [other])
            elif other not in state:
                visit(other, path + [other])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def gpu_imports_on_the_coordinator_side(tree: Tree) -> list[str]:
    """torch or triton imported (anywhere in the file, type-only too) by a module of the
    foundation or the coordinator wing: everything ``tiercache serve`` may load."""
    return sorted(f"{module}:{line} imports {name}" for module in tree.sources
                  if GROUP_OF.get(layer(module) or "") in ("foundation", "coordinator")
                  for name, line in tree.edges(module)
                  if name.split(".")[0] in GPU_PACKAGES)


def computed_imports(tree: Tree) -> list[str]:
    return [found for module in sorted(tree.sources) for found in tree.computed_imports(module)]


def tier_breaches(tree: Tree) -> list[str]:
    """A lower tier knows the index only by its one-way contract (``tiers/base.py``, the
    tiers' own layer, below the index): it imports nothing of the index, names no index
    verb (an attribute, or a ``getattr`` string), and computes no attribute name, outside
    the reviewed calls."""
    wrong = []
    for module in _tier_modules(tree):
        wrong.extend(f"{module} imports {other}" for other in sorted(tree.imports(module))
                     if other.startswith("tiercache.index"))
        for node in ast.walk(tree.trees[module]):
            if isinstance(node, ast.Attribute) and node.attr in INDEX_VERBS:
                wrong.append(f"{module}:{node.lineno} calls .{node.attr}")
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" \
                    and len(node.args) >= 2:
                name = node.args[1]
                call = ast.unparse(node)
                if isinstance(name, ast.Constant):
                    if name.value in INDEX_VERBS:
                        wrong.append(f"{module}:{node.lineno} {call}: an index verb")
                elif (module, call) not in REVIEWED_TIER_GETATTRS:
                    wrong.append(f"{module}:{node.lineno} {call}: a computed attribute name")
    return wrong


def _tier_modules(tree: Tree) -> Iterable[str]:
    return sorted(m for m in tree.sources if m == "tiercache.tiers"
                  or m.startswith("tiercache.tiers."))

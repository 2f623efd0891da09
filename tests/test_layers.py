"""The import order the tree promises (docs/architecture.md): the coordinator side and
the index never import torch, no module imports a layer above its own (type-only imports
included: nothing is exempt), the module graph has no cycle, and page-locking the region
loads neither the copy backends nor the native build step."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tiercache"
# lower index = lower layer; a module may import its own layer or lower ones
LAYERS = ["errors", "specs", "pages", "sizes", "device", "native", "planning", "backends",
          "config", "region", "index", "tiers", "transfer", "metrics", "service", "vllm",
          "tools", "cli"]


def test_the_coordinator_side_never_imports_torch():
    code = ("import sys, tiercache.service.coordinator, tiercache.index.client, "
            "tiercache.metrics.collector, tiercache.cli; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"


def test_page_locking_the_region_loads_no_copy_backend_and_no_native_code():
    code = ("import sys, tiercache.region.pinning, tiercache.region.shared; "
            "print(sorted(m for m in sys.modules if m.startswith('tiercache.native') "
            "or m.startswith('tiercache.backends.') and m.count('.') == 2 "
            "and m.rsplit('.', 1)[1] not in ('kind', 'base')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"  # the stats block's BackendKind (and the registry's contract) only


def _module_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("tiercache",) + parts)


def _modules() -> dict[str, Path]:
    return {_module_of(path): path for path in PACKAGE.rglob("*.py")}


def _imports(path: Path, modules: dict[str, Path], type_only: bool = True) -> set[str]:
    """Every tiercache module ``path`` imports, anywhere in the file (imports inside
    functions included; those under ``if TYPE_CHECKING`` unless ``type_only`` is False):
    ``from a.b import c`` is module a.b.c when that is a module, else a.b."""
    tree = ast.parse(path.read_text())
    skipped = set() if type_only else {
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
        and ast.unparse(node.test) == "TYPE_CHECKING" for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in modules}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_no_module_imports_a_higher_layer():
    modules = _modules()
    upward = []
    for module, path in modules.items():
        own = _layer(module)
        if own is None:
            continue
        for other_module in _imports(path, modules):
            other = _layer(other_module)
            if other is not None and LAYERS.index(other) > LAYERS.index(own):
                upward.append(f"{module} imports {other_module}")
    assert not upward, upward


def test_the_module_graph_has_no_cycle():
    """No module imports one that imports it back, at run time (an import inside a
    function counts: it only moves the cycle; a type-only reference does not load)."""
    modules = _modules()
    graph = {module: _imports(path, modules, type_only=False) - {module}
             for module, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for other in sorted(graph[module]):
            if state.get(other) == 1:
                cycles.append(path[path.index(other):] + [other])
            elif other not in state:
                visit(other, path + [other])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles

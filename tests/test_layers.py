"""The house the tree promises (docs/architecture.md): a foundation both wings stand on,
a worker wing (runs in the engine's GPU processes) and a coordinator wing (runs in
``tiercache serve``, no torch) that never import each other, engine adapters above both,
and the tools and the CLI on top. Inside a group, no module imports a layer above its own
(type-only imports included: nothing is exempt); the module graph has no cycle;
page-locking the region loads neither a copy backend nor native code; the coordinator
side never imports torch; no module is longer than ``MAX_LINES``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tiercache"
# Each group lists its layers from the bottom up: a module may import its own layer, a
# lower one of its group, and any layer of a group below its own (``BELOW``).
GROUPS = {
    "foundation": ["errors", "specs", "pages", "sizes", "loglimit", "backend_kind", "config",
                   "numa", "region"],
    "worker": ["device", "native", "planning", "backends", "transfer"],
    "coordinator": ["eviction", "index", "tiers", "events", "control", "metrics", "service"],
    "adapters": ["vllm", "sglang"],
    "top": ["tools", "cli", "__main__"],
}
BELOW = {
    "foundation": set(),
    "worker": {"foundation"},
    "coordinator": {"foundation"},
    "adapters": {"foundation", "worker", "coordinator"},
    "top": {"foundation", "worker", "coordinator", "adapters"},
}
# Pairs that never meet, in either direction: the wings, and one engine's adapter and another's.
NEVER = [("worker", "coordinator"), ("vllm", "sglang")]
LAYERS = [layer for layers in GROUPS.values() for layer in layers]
GROUP_OF = {layer: group for group, layers in GROUPS.items() for layer in layers}
MAX_LINES = 450


def test_the_coordinator_side_never_imports_torch():
    code = ("import sys, tiercache.service.coordinator, tiercache.control.client, "
            "tiercache.metrics.collector, tiercache.cli; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"


def test_page_locking_the_region_loads_no_copy_backend_and_no_native_code():
    code = ("import sys, tiercache.device.pinning, tiercache.region.shared; "
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


def _allowed(own: str, other: str) -> bool:
    own_group, other_group = GROUP_OF[own], GROUP_OF[other]
    if own_group == other_group:
        layers = GROUPS[own_group]
        if own_group == "adapters":
            return own == other  # one engine's adapter never imports another's
        return layers.index(other) <= layers.index(own)
    return other_group in BELOW[own_group]


def test_no_module_imports_a_higher_layer_or_the_other_wing():
    modules = _modules()
    wrong = []
    for module, path in modules.items():
        own = _layer(module)
        if own is None:
            continue
        for other_module in _imports(path, modules):
            other = _layer(other_module)
            if other is not None and not _allowed(own, other):
                wrong.append(f"{module} ({GROUP_OF[own]}) imports {other_module} "
                             f"({GROUP_OF[other]})")
    assert not wrong, wrong


def test_the_never_pairs_are_never_allowed():
    """The rule above forbids each never pair both ways (a change to GROUPS or BELOW that
    let one wing see the other fails here, not silently)."""
    for a, b in NEVER:
        a_layers = GROUPS.get(a, [a])
        b_layers = GROUPS.get(b, [b])
        for x in a_layers:
            for y in b_layers:
                assert not _allowed(x, y) and not _allowed(y, x), (x, y)


def test_every_top_level_module_has_a_place():
    unplaced = sorted({m.split(".")[1] for m in _modules() if m.count(".") >= 1}
                      - set(LAYERS) - {"__init__"})
    assert not unplaced, f"modules outside the house: {unplaced}; add them to GROUPS"


def test_no_module_is_longer_than_one_reading():
    long = sorted((len(p.read_text().splitlines()), str(p.relative_to(PACKAGE)))
                  for p in [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.c")]
                  if len(p.read_text().splitlines()) > MAX_LINES)
    assert not long, f"over {MAX_LINES} lines: {long}"


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


def test_tiers_know_the_index_only_by_its_one_way_contract():
    """A lower tier imports nothing of the index but ``lower_tier`` (it answers, moves bytes
    and reports; the tier chain alone reserves, pins and books), and calls no index verb."""
    modules = _modules()
    wrong = sorted(f"{module} imports {other}"
                   for module, path in modules.items() if module.startswith("tiercache.tiers")
                   for other in _imports(path, modules)
                   if other.startswith("tiercache.index") and other != "tiercache.index.lower_tier")
    assert not wrong, wrong
    verbs = ("prepare_store", "complete_store", "prepare_load", "complete_load", "lease(",
             "prepare_write", "complete_write", "prepare_read", "complete_read", "quarantine")
    calls = sorted(f"{path.name}: {verb}" for path in (PACKAGE / "tiers").glob("*.py")
                   for verb in verbs if f".{verb}" in path.read_text())
    assert not calls, calls

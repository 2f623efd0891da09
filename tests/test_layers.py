"""The house the tree promises (docs/architecture.md; ``house``: the groups, the layers and
the checker that reads them from source): inside a group, no module imports a layer above
its own (type-only imports included: nothing is exempt), nor the other wing; the module
graph has no cycle; the foundation and the coordinator wing never import torch; a lower
tier knows the index only by its contract; every import can be resolved. Imports are
followed through the package root's and packages' lazy exports, ``importlib`` strings and
registries (the checker's own tests: tests/test_layer_guard.py). What each process loads
at run time: tests/test_loads.py and the engines' test_vllm_loads and test_sglang_loads. Page-locking the region
loads neither a copy backend nor native code. How long a function may be (a rule about
concerns, not a file's line count): tests/test_function_length.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from house import (
    GROUPS, LAYERS, NEVER, Tree, allowed, computed_imports, cycles,
    gpu_imports_on_the_coordinator_side, read_tree, tier_breaches, upward_imports,
)


@pytest.fixture(scope="module")
def tree() -> Tree:
    return Tree(read_tree())


def test_page_locking_the_region_loads_no_copy_backend_and_no_native_code():
    code = ("import sys, tiercache.device.pinning, tiercache.region.shared; "
            "print(sorted(m for m in sys.modules if m.startswith('tiercache.native') "
            "or m.startswith('tiercache.backends.') and m.count('.') == 2 "
            "and m.rsplit('.', 1)[1] not in ('kind', 'base')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"  # the stats block's BackendKind (and the registry's contract) only


def test_no_module_imports_a_higher_layer_or_the_other_wing(tree):
    assert not upward_imports(tree)


def test_the_never_pairs_are_never_allowed():
    """The rule above forbids each never pair both ways (a change to GROUPS or BELOW that
    let one wing see the other fails here, not silently)."""
    for a, b in NEVER:
        for x in GROUPS.get(a, [a]):
            for y in GROUPS.get(b, [b]):
                assert not allowed(x, y) and not allowed(y, x), (x, y)


def test_every_top_level_module_has_a_place(tree):
    unplaced = sorted({m.split(".")[1] for m in tree.sources if m.count(".") >= 1}
                      - set(LAYERS))
    assert not unplaced, f"modules outside the house: {unplaced}; add them to GROUPS"


def test_the_module_graph_has_no_cycle(tree):
    assert not cycles(tree)


def test_the_coordinator_side_never_imports_torch(tree):
    assert not gpu_imports_on_the_coordinator_side(tree)


def test_every_dynamic_import_is_resolved(tree):
    assert not computed_imports(tree)


def test_tiers_know_the_index_only_by_its_one_way_contract(tree):
    """A lower tier imports nothing of the index (it answers, moves bytes and reports; the
    tier chain alone reserves, pins and books), and calls no index verb."""
    assert not tier_breaches(tree)

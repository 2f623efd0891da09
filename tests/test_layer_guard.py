"""The layer guard's own tests (``house``): each way around it that issue 38 found passed
the old test on a copy of the tree, and here fails it. Each case is the real tree's
tree with one module changed (or one added), checked as tests/test_layers.py checks
the tree."""

from __future__ import annotations

import pytest

from house import (
    Tree, computed_imports, cycles, gpu_imports_on_the_coordinator_side, read_tree,
    tier_breaches, upward_imports,
)


@pytest.fixture(scope="module")
def tree() -> Tree:
    return Tree(read_tree())


def changed(tree: Tree, module: str, added: str) -> Tree:
    """The tree with ``added`` appended to ``module`` (a new module if it is not there)."""
    return tree.changed(module, tree.sources.get(module, "") + "\n" + added + "\n")


DISK = "tiercache.tiers.disk"


def test_the_real_tree_passes(tree):
    assert not (upward_imports(tree) or cycles(tree) or tier_breaches(tree)
                or gpu_imports_on_the_coordinator_side(tree) or computed_imports(tree))


def test_an_import_through_the_package_root_is_the_module_that_defines_it(tree):
    tree = changed(tree, DISK, "from tiercache import OffloadingManager")
    assert "tiercache.index.manager" in tree.imports(DISK)
    assert f"{DISK} imports tiercache.index.manager" in tier_breaches(tree)


def test_an_attribute_of_the_imported_package_root_is_followed(tree):
    tree = changed(tree, DISK, "import tiercache\n\nMANAGER = tiercache.OffloadingManager")
    assert f"{DISK} imports tiercache.index.manager" in tier_breaches(tree)


def test_the_package_root_leads_upward_too(tree):
    """``attach`` is the worker wing's: the index importing it through the root is the
    coordinator wing importing the other wing."""
    tree = changed(tree, "tiercache.index.manager", "from tiercache import attach")
    assert ("tiercache.index.manager (coordinator) imports tiercache.transfer.worker (worker)"
            in upward_imports(tree))


def test_a_package_s_lazy_exports_are_followed(tree):
    tree = changed(tree, "tiercache.region.names", "from tiercache.events import NodeEventStream")
    assert "tiercache.events.stream" in tree.imports("tiercache.region.names")
    assert ("tiercache.region.names (foundation) imports tiercache.events.stream "
            "(coordinator)") in upward_imports(tree)


def test_the_link_imports_nothing_of_the_coordinator_wing(tree):
    """The engines' side of the control plane loads in engine processes: the control
    server's verb table (even type-only) or the event publisher there is a finding."""
    tree = changed(tree, "tiercache.link.client", "from tiercache.control.verbs import StoreCheck")
    tree = changed(tree, "tiercache.link.describe", "from tiercache.events import NodeEventStream")
    found = upward_imports(tree)
    assert ("tiercache.link.client (link) imports tiercache.control.verbs (coordinator)"
            in found)
    assert ("tiercache.link.describe (link) imports tiercache.events.stream (coordinator)"
            in found)


def test_the_worker_wing_and_the_link_never_meet(tree):
    """A worker never speaks to the coordinator (its scheduler does), and the link knows no
    GPU."""
    tree = changed(tree, "tiercache.transfer.worker", "from tiercache.link.client import Client")
    tree = changed(tree, "tiercache.link.jobs", "from tiercache.device.events import Stream")
    found = upward_imports(tree)
    assert "tiercache.transfer.worker (worker) imports tiercache.link.client (link)" in found
    assert "tiercache.link.jobs (link) imports tiercache.device.events (worker)" in found


def test_a_tier_naming_the_chain_s_host_slots_verbs_fails(tree):
    tree = changed(tree, DISK, "def sneak(host, keys):\n    return host.reserve_promotion(keys)")
    assert [f for f in tier_breaches(tree) if f.endswith("calls .reserve_promotion")]


def test_the_tier_chain_knows_the_manager_only_as_host_slots(tree):
    """The chain holds a ``HostSlots``; importing the manager (even type-only) would let it
    reach an engine's verbs."""
    assert "tiercache.index.manager" not in tree.imports("tiercache.index.tiering")
    assert "tiercache.index.host_slots" in tree.imports("tiercache.index.tiering")


def test_the_tier_chain_reads_the_index_only_through_host_slots(tree):
    """Neither the chain nor its feeds import the table: what they read of host memory's
    index are ``HostSlots``' reads, under the index's lock."""
    for module in ("tiercache.index.tiering", "tiercache.index.feeds"):
        assert not {"tiercache.index.table", "tiercache.index.manager"} & tree.imports(module)
    assert "tiercache.index.host_slots" in tree.imports("tiercache.index.feeds")


def test_a_relative_import_is_resolved(tree):
    tree = changed(tree, DISK, "from ..index import manager")
    assert f"{DISK} imports tiercache.index.manager" in tier_breaches(tree)


def test_importlib_with_a_string_is_an_import(tree):
    tree = changed(tree, DISK, "import importlib\n\n\ndef sneak():\n"
                                  "    return importlib.import_module('tiercache.index.manager')")
    assert f"{DISK} imports tiercache.index.manager" in tier_breaches(tree)


def test_a_computed_importlib_name_is_a_finding_of_its_own(tree):
    tree = changed(tree, DISK, "import importlib\n\n\ndef sneak(part):\n"
                                  "    return importlib.import_module('tiercache.index.' + part)")
    assert [f for f in computed_imports(tree) if f.startswith(f"{DISK}:")]


def test_a_computed_getattr_verb_name_in_a_tier_fails(tree):
    tree = changed(tree, DISK, "def sneak(index, keys):\n"
                                  "    return getattr(index, 'prepare_' + 'store')(keys)")
    found = [f for f in tier_breaches(tree) if "a computed attribute name" in f]
    assert found and found[0].startswith(f"{DISK}:")


def test_a_getattr_of_a_verb_by_its_name_in_a_tier_fails(tree):
    tree = changed(tree, DISK, "def sneak(index, keys):\n"
                                  "    return getattr(index, 'complete_store')(keys)")
    assert [f for f in tier_breaches(tree) if "an index verb" in f]


def test_a_verb_call_in_a_tier_fails(tree):
    tree = changed(tree, DISK, "def sneak(index, keys):\n    return index.lease(keys)")
    assert [f for f in tier_breaches(tree) if f.endswith("calls .lease")]


def test_the_reviewed_getattrs_are_the_only_computed_ones(tree):
    """The registry's own resolver passes; the same call in a tier module does not."""
    tree = changed(tree, DISK, "import importlib\n\n\ndef resolve(module, attr):\n"
                                  "    return getattr(importlib.import_module(module), attr)")
    assert [f for f in tier_breaches(tree) if f.startswith(f"{DISK}:")]


@pytest.mark.parametrize("statement", ["import torch", "from torch import cuda",
                                       "def f():\n    import triton.language"])
def test_torch_in_a_coordinator_module_fails(tree, statement):
    tree = changed(tree, "tiercache.index.tiering", statement)
    assert [f for f in gpu_imports_on_the_coordinator_side(tree)
            if f.startswith("tiercache.index.tiering:")]


def test_a_type_only_torch_import_in_the_foundation_still_fails(tree):
    """Type-only imports count for the layers: nothing is exempt."""
    tree = changed(tree, "tiercache.region.shared",
                   "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch")
    assert gpu_imports_on_the_coordinator_side(tree)


def test_a_cycle_through_a_registry_string_is_found(tree):
    tree = changed(tree, "tiercache.tiers.builders",
                   "FACTORIES = {'x': 'tiercache.tiers:configured_tiers'}")
    assert any(c[0] == "tiercache.tiers" and "tiercache.tiers.builders" in c
               for c in cycles(tree))

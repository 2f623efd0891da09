"""Rank slices in their node, on this machine's real memory: the coordinator binds each
slice before fallocate (read back through another process's mapping), a fake 8-GPU,
2-node sysfs tree drives its calls, the worker's pre-fault binds, counts and records,
and every way it can fall short (off, unknown node, failed call) is recorded, not hidden."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import math
import mmap
import multiprocessing as mp
import os

import pytest

from tiercache.numa.mempolicy import PAGE_BYTES, PolicyMode, policy_at
from tiercache.numa.placement import NumaPlacement, NumaState
from tiercache.numa.topology import HostTopology, NodeChoice
from tiercache.region.placement import SlicePlacer
from tiercache.region.shared import SharedOffloadRegion

from fake_sysfs import make_tree
from numa_children import slice_policies
from numa_maps import numa_maps_line, numa_maps_pages

SPAWN = mp.get_context("spawn")
HOST = HostTopology.read()
NODE = HOST.memory_nodes[0]
ABSENT = max(HOST.memory_nodes) + 1


def _placement_off(config):
    return dataclasses.replace(config, region=dataclasses.replace(config.region,
                                                                  numa_placement=False))


def _planned(world_size: int) -> list[tuple[PolicyMode, tuple[int, ...]]]:
    """The policy each slice gets on this host: its rank's node, where one is known."""
    return [(PolicyMode.DEFAULT, ()) if c.node is None else (PolicyMode.PREFERRED, (c.node,))
            for c in HOST.rank_nodes(world_size)]


def _policies_seen_by_another_process(name: str):
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=slice_policies, args=(name, child))
    proc.start()
    assert parent.poll(60), "the child sent no policies"
    header, slices = parent.recv()
    proc.join(10)
    return header, slices


def test_the_coordinator_binds_each_slice_before_fallocate_and_the_file_keeps_it(
        make_config, instance_name):
    said: list[str] = []
    region = SharedOffloadRegion.create(make_config(), log_step=said.append, reserve_now=False)
    try:
        layout = region.layout
        header, slices = _policies_seen_by_another_process(instance_name)
        assert header == (PolicyMode.DEFAULT, ())  # the header is the coordinator's
        assert slices == _planned(layout.world_size)
        if HOST.single_node is not None:
            assert said[0] == ("NUMA: rank slices bound before fallocate (MPOL_PREFERRED): "
                               f"ranks 0-1 -> node {NODE} (the host's only memory node)")
        assert said.index(next(s for s in said if s.startswith("allocated"))) > 0
        reserver = region.reserver(lambda rows: None)  # what `serve` runs in the background
        assert reserver is not None
        reserver.run()
        # fallocate still backed every byte: the binding changed where, not whether
        assert os.stat(region.path).st_blocks * 512 >= layout.total_bytes
        assert _policies_seen_by_another_process(instance_name)[1] == slices
    finally:
        region.close()


def test_placement_off_makes_no_binding_call(make_config, instance_name):
    said: list[str] = []
    region = SharedOffloadRegion.create(_placement_off(make_config()), log_step=said.append)
    try:
        _, slices = _policies_seen_by_another_process(instance_name)
        assert slices == [(PolicyMode.DEFAULT, ())] * region.layout.world_size
        assert not [s for s in said if "NUMA" in s]
    finally:
        region.close()


def test_an_8_gpu_2_node_sysfs_tree_drives_the_coordinators_calls(make_config, tmp_path):
    """Ranks 0-3 are bound to node 0 and 4-7 to node 1. On a host without node 1 the
    kernel refuses those four calls: each is said, and the region is still made."""
    topology = HostTopology.read(make_tree(tmp_path))
    said: list[str] = []
    region = SharedOffloadRegion.create(make_config(world_size=8), log_step=said.append,
                                        topology=topology)
    try:
        layout = region.layout
        got = [policy_at(region.base_address + layout.slice_offset(r)) for r in range(8)]
        assert got[:4] == [(PolicyMode.PREFERRED, (0,))] * 4
        if 1 in HOST.memory_nodes:
            assert got[4:] == [(PolicyMode.PREFERRED, (1,))] * 4
            assert said[0].startswith("NUMA: rank slices bound before fallocate "
                                      "(MPOL_PREFERRED): ranks 0-3 -> node 0; ranks 4-7 -> node 1")
        else:
            assert got[4:] == [(PolicyMode.DEFAULT, ())] * 4
            assert said[0] == ("NUMA: rank slices bound before fallocate (MPOL_PREFERRED): "
                               "ranks 0-3 -> node 0 (GPU r in PCI bus order)")
            failures = [s for s in said if s.startswith("NUMA: binding failed")]
            assert [f.split(",")[1].split(":")[0].strip() for f in failures] == [
                f"rank {r} -> node 1" for r in range(4, 8)]
            assert all("EINVAL" in f and "the rank's worker reports where that is" in f
                       for f in failures)
        assert region.info().state.label == "ready"
    finally:
        region.close()


def test_a_gpu_node_the_firmware_does_not_give_binds_nothing_and_says_why(make_config,
                                                                           tmp_path):
    gpus = {"0000:18:00.0": -1, "0000:9a:00.0": -1}
    topology = HostTopology.read(make_tree(tmp_path, gpus=gpus))
    said: list[str] = []
    region = SharedOffloadRegion.create(make_config(), log_step=said.append, topology=topology)
    try:
        assert said[0].startswith("NUMA: rank 0 not bound (GPU 0 in PCI bus order "
                                  "(0000:18:00.0): sysfs numa_node is -1")
        assert "their workers bind and move their slices" in said[0]
        layout = region.layout
        assert [policy_at(region.base_address + layout.slice_offset(r))
                for r in range(2)] == [(PolicyMode.DEFAULT, ())] * 2
    finally:
        region.close()


# ---------------------------------------------------------------- the worker's part

@pytest.fixture
def unbound(make_config):
    """A region the coordinator left unbound: what the worker does is all there is."""
    config = _placement_off(make_config())
    region = SharedOffloadRegion.create(config)
    yield config
    region.close()


def _slice(worker: SharedOffloadRegion, rank: int) -> tuple[int, int]:
    layout = worker.layout
    return (worker.base_address + layout.slice_offset(rank),
            math.ceil(layout.slice_used_bytes / PAGE_BYTES))


def test_the_worker_binds_its_slice_counts_it_and_numa_maps_agrees(unbound, instance_name):
    worker = SharedOffloadRegion.attach(instance_name, 1)
    try:
        seconds = worker.prefault_slice(2, NodeChoice(NODE, "test"), numa_placement=True)
        start, pages = _slice(worker, 1)
        snap = worker.stats(1).snapshot()
        assert snap.prefault_seconds == pytest.approx(seconds, abs=1e-6)
        numa = snap.numa
        assert (numa.state, numa.node, numa.slice_pages, numa.local_pages) == (
            NumaState.PLACED, NODE, pages, pages)
        assert numa.local_ratio == 1.0 and numa.seconds > 0
        assert policy_at(start) == (PolicyMode.PREFERRED, (NODE,))
        line = numa_maps_line(os.getpid(), start)  # the bound slice is a mapping of its own
        assert f"prefer:{NODE}" in line and numa_maps_pages(line) == {NODE: pages}
        assert worker.stats(0).snapshot().numa == NumaPlacement()  # the other rank: untouched
    finally:
        worker.close()


def test_placement_off_counts_but_binds_nothing(unbound, instance_name):
    worker = SharedOffloadRegion.attach(instance_name, 0)
    try:
        worker.prefault_slice(2, NodeChoice(NODE, "test"), numa_placement=False)
        start, pages = _slice(worker, 0)
        numa = worker.stats(0).snapshot().numa
        assert (numa.state, numa.node, numa.slice_pages, numa.local_pages) == (
            NumaState.OFF, NODE, pages, pages)
        assert policy_at(start) == (PolicyMode.DEFAULT, ())  # no call was made
    finally:
        worker.close()


def test_an_unknown_node_is_recorded_and_logged_with_its_reason(unbound, instance_name, caplog):
    worker = SharedOffloadRegion.attach(instance_name, 0)
    try:
        with caplog.at_level(logging.WARNING, logger="tiercache.region.placement"):
            worker.prefault_slice(2, NodeChoice(None, "sysfs numa_node is -1 on 2 nodes"))
        numa = worker.stats(0).snapshot().numa
        assert (numa.state, numa.node, numa.local_ratio) == (NumaState.UNKNOWN_NODE, None, None)
        assert "node of its device is not known (sysfs numa_node is -1 on 2 nodes)" in caplog.text
        assert policy_at(_slice(worker, 0)[0]) == (PolicyMode.DEFAULT, ())
    finally:
        worker.close()


def test_a_failed_binding_is_recorded_and_logged_and_the_attach_goes_on(unbound, instance_name,
                                                                        caplog):
    worker = SharedOffloadRegion.attach(instance_name, 1)
    try:
        with caplog.at_level(logging.WARNING, logger="tiercache.region.placement"):
            seconds = worker.prefault_slice(2, NodeChoice(ABSENT, "a node this host lacks"))
        snap = worker.stats(1).snapshot()
        assert seconds > 0 and snap.prefault_seconds > 0  # the pre-fault still ran
        assert (snap.numa.state, snap.numa.node, snap.numa.local_ratio) == (
            NumaState.FAILED, ABSENT, None)
        assert f"NUMA placement on node {ABSENT} (a node this host lacks) failed" in caplog.text
        assert "EINVAL" in caplog.text
    finally:
        worker.close()


def test_without_a_node_the_pre_fault_records_no_placement(unbound, instance_name):
    worker = SharedOffloadRegion.attach(instance_name, 0)
    try:
        worker.prefault_slice(2)
        assert worker.stats(0).snapshot().numa == NumaPlacement()
    finally:
        worker.close()


def test_pages_that_cannot_move_are_counted_as_elsewhere_and_said(caplog):
    """The move path against the kernel: a range half in memory; moving the other half
    finds nothing to move (-ENOENT), so half is local and the warning counts why."""
    pages = 32
    with mmap.mmap(-1, pages * PAGE_BYTES) as m:
        m[: pages // 2 * PAGE_BYTES] = b"\x01" * (pages // 2 * PAGE_BYTES)
        address = ctypes.addressof(ctypes.c_char.from_buffer(m))
        placer = SlicePlacer(address, pages * PAGE_BYTES, pages * PAGE_BYTES - 100,
                             NodeChoice(NODE, "test"), enabled=True, rank=5)
        with caplog.at_level(logging.WARNING, logger="tiercache.region.placement"):
            placer.before_touch()
            placement = placer.after_touch(3)
    assert (placement.state, placement.slice_pages, placement.local_pages) == (
        NumaState.PLACED, pages, pages // 2)
    assert (f"rank 5: {pages // 2} of the slice's {pages} pages are not on node {NODE} after "
            f"moving: 0 mapped by another process too (such as a second engine attached to "
            f"this rank), {pages // 2} not in memory, 0 refused otherwise") in caplog.text


# ---------------------------------------------------------------- trust

@pytest.fixture
def other_user():
    import users

    yield from users.other_user()


_HOSTILE = """
import ctypes, mmap, os, sys
from tiercache.numa.mempolicy import bind_preferred
try:
    fd = os.open(sys.argv[1], os.O_RDWR)
except PermissionError:
    print("no open")
    sys.exit(0)
m = mmap.mmap(fd, int(sys.argv[2]))
bind_preferred(ctypes.addressof(ctypes.c_char.from_buffer(m)), int(sys.argv[2]), 0)
print("bound")
"""


def test_another_local_user_can_neither_map_the_region_nor_set_its_placement(
        make_config, instance_name, other_user):
    """The policy lives on the region file: whoever can map it can re-bind it. Only its
    owner can (0600): a hostile user's attempt stops at the open."""
    region = SharedOffloadRegion.create(make_config())
    try:
        run = other_user.run([other_user.python, "-c", _HOSTILE, region.path,
                              str(region.layout.total_bytes)])
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == "no open"
        _, slices = _policies_seen_by_another_process(instance_name)
        assert slices == _planned(region.layout.world_size)
    finally:
        region.close()

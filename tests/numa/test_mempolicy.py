"""The NUMA calls on real mappings of this machine: a binding is read back (by another
process too, for a /dev/shm file), page nodes agree with /proc/self/numa_maps, a node
that does not exist is an error naming the call and the errno."""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing as mp
import os

import numpy as np
import pytest

from tiercache.errors import ArgumentError, NumaError
from tiercache.numa.mempolicy import (
    MAX_NODES, PAGE_BYTES, PolicyMode, bind_preferred, move_to_node, page_nodes, policy_at,
)
from tiercache.numa.topology import HostTopology

from numa_maps import numa_maps_line, numa_maps_pages

NODE = HostTopology.read().memory_nodes[0]
ABSENT = max(HostTopology.read().memory_nodes) + 1  # no such node on this host
PAGES = 64


def _address(mapping: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mapping))


def test_a_binding_is_read_back_and_numa_maps_shows_it():
    with mmap.mmap(-1, PAGES * PAGE_BYTES) as m:
        address = _address(m)
        assert policy_at(address) == (PolicyMode.DEFAULT, ())
        half = PAGES // 2 * PAGE_BYTES
        bind_preferred(address + half, half, NODE)
        assert policy_at(address + half) == (PolicyMode.PREFERRED, (NODE,))
        assert policy_at(address) == (PolicyMode.DEFAULT, ())  # only the range is bound
        assert f"prefer:{NODE}" in numa_maps_line(os.getpid(), address + half)


def test_page_nodes_count_only_pages_in_memory_and_agree_with_numa_maps():
    with mmap.mmap(-1, PAGES * PAGE_BYTES) as m:
        address = _address(m)
        bind_preferred(address, PAGES * PAGE_BYTES, NODE)  # its own line in numa_maps
        nodes = page_nodes(address, PAGES * PAGE_BYTES)
        assert nodes.dtype == np.int32 and len(nodes) == PAGES
        assert (nodes == -2).all()  # -ENOENT: nothing touched yet
        m[: PAGES // 4 * PAGE_BYTES] = b"x" * (PAGES // 4 * PAGE_BYTES)
        nodes = page_nodes(address, PAGES * PAGE_BYTES)
        assert (nodes[: PAGES // 4] == NODE).all() and (nodes[PAGES // 4:] == -2).all()
        counted = numa_maps_pages(numa_maps_line(os.getpid(), address))
        assert counted == {NODE: PAGES // 4}
        # moving pages to the node they are on leaves them there, and says so per page
        status = move_to_node(np.arange(address, address + 4 * PAGE_BYTES, PAGE_BYTES,
                                        dtype=np.uint64), NODE)
        assert (status == NODE).all()
        assert len(page_nodes(address, 0)) == 0


def _child_policy(name: str, offset: int, conn) -> None:
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    with mmap.mmap(fd, offset * 2) as m:
        address = _address(m)
        conn.send((policy_at(address), policy_at(address + offset)))
    os.close(fd)


def test_a_binding_on_a_dev_shm_mapping_is_the_files_and_another_process_sees_it(
        instance_name):
    """What lets the coordinator place pages before fallocate: the policy set through its
    mapping is the file's, so another process mapping the file reads it back."""
    name, size = f"tiercache-{instance_name}", 2 * PAGES * PAGE_BYTES
    fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as m:
            bind_preferred(_address(m) + size // 2, size // 2, NODE)
        os.posix_fallocate(fd, 0, size)
        parent, child = mp.get_context("spawn").Pipe()
        proc = mp.get_context("spawn").Process(target=_child_policy,
                                               args=(name, size // 2, child))
        proc.start()
        assert parent.poll(60)
        first, second = parent.recv()
        proc.join(10)
        assert first == (PolicyMode.DEFAULT, ())
        assert second == (PolicyMode.PREFERRED, (NODE,))
    finally:
        os.close(fd)
        os.unlink(f"/dev/shm/{name}")


def test_a_node_that_does_not_exist_is_an_error_naming_the_call_and_errno():
    with mmap.mmap(-1, PAGES * PAGE_BYTES) as m:
        with pytest.raises(NumaError, match=rf"mbind \(MPOL_PREFERRED, node {ABSENT}\) over "
                                            rf"{PAGES * PAGE_BYTES} bytes at .* failed: EINVAL"):
            bind_preferred(_address(m), PAGES * PAGE_BYTES, ABSENT)
        assert policy_at(_address(m)) == (PolicyMode.DEFAULT, ())


@pytest.mark.parametrize("node", [-1, MAX_NODES, "0"])
def test_a_node_outside_the_mask_is_refused_before_any_call(node):
    with mmap.mmap(-1, PAGE_BYTES) as m, pytest.raises(
            ArgumentError, match=f"NUMA node {node!r}: allowed 0..{MAX_NODES - 1}"):
        bind_preferred(_address(m), PAGE_BYTES, node)


def test_unaligned_or_empty_ranges_are_refused():
    with mmap.mmap(-1, 2 * PAGE_BYTES) as m:
        with pytest.raises(ArgumentError, match="aligned"):
            bind_preferred(_address(m) + 1, PAGE_BYTES, NODE)
        with pytest.raises(ArgumentError, match="positive"):
            bind_preferred(_address(m), 0, NODE)
        with pytest.raises(ArgumentError, match="aligned"):
            page_nodes(_address(m) + 8, PAGE_BYTES)

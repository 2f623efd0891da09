"""The node of a worker's host caches, from where their memory really is (CPU test of
``tiercache.device.locality``; the GPU path: test_locality_gpu.py)."""

from __future__ import annotations

import ctypes
import mmap

import torch

from tiercache.device.locality import caches_node, host_node
from tiercache.numa.mempolicy import PAGE_BYTES, page_nodes
from tiercache.numa.topology import HostTopology


def test_host_caches_are_on_the_node_their_memory_is_on():
    caches = torch.ones(64, PAGE_BYTES, dtype=torch.uint8)
    address = caches.data_ptr() + 3  # any byte of the first page
    (expected,) = page_nodes(address - address % PAGE_BYTES, PAGE_BYTES)
    choice = caches_node(torch.device("cpu"), address, HostTopology.read())
    assert expected >= 0 and choice.node == expected
    assert choice.why == f"the host caches' memory is on node {expected}"


def test_caches_not_in_memory_yet_have_no_node_and_say_so():
    with mmap.mmap(-1, 4 * PAGE_BYTES) as m:
        address = ctypes.addressof(ctypes.c_char.from_buffer(m))
        choice = host_node(address)
        assert choice.node is None
        assert choice.why == f"the host caches' first page ({address:#x}) is not in memory yet"
        m[0] = 1
        assert host_node(address).node == HostTopology.read().memory_nodes[0]

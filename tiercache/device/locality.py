"""Which NUMA node a worker's copies run against: the node its rank's slice belongs on.

* **GPU caches:** the GPU's PCI device node (``HostTopology.device_node``: sysfs
  ``numa_node``, the host's only memory node on a one-node host, else unknown). The
  PCI bus id comes from the driver (``cuDeviceGetPCIBusId``) for this process's device
  ordinal, so ``CUDA_VISIBLE_DEVICES`` and CUDA's device order are already applied: the
  worker names the GPU it really uses, which the coordinator cannot know.
* **Host caches** (the ``cpu`` backend, a host-to-host engine): the node of the memory
  the caches' first page is on (``move_pages`` in query mode): a memcpy between two
  nodes crosses the socket link as a DMA would. A first page not in memory yet is an
  unknown node, said so.

Never a guess: an unknown node is a ``NodeChoice`` without a node and the reason, which
the worker logs and exports (``NumaState.UNKNOWN_NODE``).
"""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING

from tiercache.device.driver import CudaDriver
from tiercache.errors import BackendError, NumaError
from tiercache.numa.mempolicy import PAGE_BYTES, page_nodes
from tiercache.numa.topology import HostTopology, NodeChoice

if TYPE_CHECKING:
    import torch


def gpu_node(index: int, topology: HostTopology) -> NodeChoice:
    """The node of CUDA device ``index`` of this process (torch has initialised CUDA)."""
    try:
        bus_id = CudaDriver().pci_bus_id(index)
    except BackendError as e:
        return NodeChoice(None, f"the PCI bus id of cuda:{index} could not be read: {e}")
    return topology.device_node(bus_id, f"GPU cuda:{index}")


def host_node(address: int) -> NodeChoice:
    """The node of the host memory page at ``address`` of this process."""
    page = address - address % PAGE_BYTES
    try:
        (node,) = page_nodes(page, PAGE_BYTES)
    except NumaError as e:
        return NodeChoice(None, f"the node of the host caches' memory could not be read: {e}")
    if node < 0:
        why = ("not in memory yet" if -node == errno.ENOENT
               else errno.errorcode.get(-int(node), str(node)))
        return NodeChoice(None, f"the host caches' first page ({address:#x}) is {why}")
    return NodeChoice(int(node), f"the host caches' memory is on node {node}")


def caches_node(device: torch.device, first_page_address: int,
                topology: HostTopology) -> NodeChoice:
    """The node a worker over caches on ``device`` (whose first page is at
    ``first_page_address``) places its slice on."""
    if device.type == "cuda":
        import torch

        index = torch.cuda.current_device() if device.index is None else device.index
        return gpu_node(index, topology)
    return host_node(first_page_address)

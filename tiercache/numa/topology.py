"""The host's NUMA nodes and its GPUs' nodes, read from sysfs under a root path (``/sys``
on a real host; a test builds a fake tree and passes its root).

What is read:

* ``devices/system/node/has_memory``: the nodes that have memory (``0-1``, ``0,2-3``).
  Without ``devices/system/node`` the kernel has no NUMA support.
* ``bus/pci/devices/<bus id>/numa_node`` of a PCI device: its node, ``-1`` when the
  firmware did not say; ``vendor`` and ``class`` pick out the NVIDIA GPUs (vendor
  ``0x10de``, class VGA ``0x0300xx`` or 3D controller ``0x0302xx``).

How a device's node is decided (``HostTopology.device_node``), and why:

* its ``numa_node`` when that is a node with memory;
* on a host with one memory node, that node, whatever the device says: ``-1`` is what
  one-node hosts (and VMs) report, and there is nowhere else for a page to be;
* otherwise unknown, with the reason (``-1`` on a host of several nodes, no such device,
  a node without memory): never a guess such as node 0, which on two sockets is wrong
  for half the GPUs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from tiercache.errors import ArgumentError

SYSFS_ROOT = "/sys"
NVIDIA_VENDOR = "0x10de"
_GPU_CLASSES = ("0x0300", "0x0302")  # VGA controller, 3D controller
_BUS_ID = re.compile(r"^([0-9a-fA-F]{1,8}):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")


def sysfs_bus_id(text: str) -> str:
    """A PCI bus id as sysfs names it (``0000:3b:00.0``) from the forms drivers print
    (``00000000:3B:00.0`` from the CUDA driver and nvidia-smi, ``0000:3b:00.0``)."""
    match = _BUS_ID.match(text.strip())
    if match is None:
        raise ArgumentError(f"PCI bus id {text!r}: expected domain:bus:device.function in hex, "
                            "e.g. '0000:3b:00.0'")
    domain, bus, device, function = (int(g, 16) for g in match.groups())
    return f"{domain:04x}:{bus:02x}:{device:02x}.{function:x}"


def _bus_key(bus_id: str) -> tuple[int, ...]:
    match = _BUS_ID.match(bus_id)
    assert match is not None, bus_id
    return tuple(int(g, 16) for g in match.groups())


def parse_node_list(text: str) -> tuple[int, ...]:
    """``0-1,4`` -> (0, 1, 4): the kernel's node list format."""
    nodes: list[int] = []
    for part in filter(None, text.strip().split(",")):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ArgumentError(f"node list {text!r}: expected ranges like '0-1,4'")
        nodes.extend(range(int(low), int(high or low) + 1))
    return tuple(sorted(set(nodes)))


@dataclass(frozen=True)
class NodeChoice:
    """The NUMA node a rank slice belongs on, or None when it is not known; ``why`` says
    how it was found, or why it is unknown (shown in logs)."""

    node: int | None
    why: str

    @property
    def known(self) -> bool:
        return self.node is not None


@dataclass(frozen=True)
class PciGpu:
    bus_id: str  # as sysfs names it
    numa_node: int  # as sysfs says: -1 when the firmware did not say


@dataclass(frozen=True)
class HostTopology:
    """The memory nodes and the NVIDIA GPUs (in PCI bus order) of one host."""

    root: str
    numa_supported: bool
    memory_nodes: tuple[int, ...]
    gpus: tuple[PciGpu, ...]

    @classmethod
    def read(cls, root: str | os.PathLike[str] = SYSFS_ROOT) -> HostTopology:
        base = Path(root)
        node_dir = base / "devices/system/node"
        supported = node_dir.is_dir()
        memory: tuple[int, ...] = ()
        if supported:
            has_memory = _read(node_dir / "has_memory")
            memory = parse_node_list(has_memory) if has_memory is not None else tuple(
                sorted(int(p.name[4:]) for p in node_dir.glob("node[0-9]*")))
        gpus = []
        for device in _entries(base / "bus/pci/devices"):
            if not _BUS_ID.match(device.name) or _read(device / "vendor") != NVIDIA_VENDOR:
                continue
            if not (_read(device / "class") or "").startswith(_GPU_CLASSES):
                continue
            gpus.append(PciGpu(device.name, _node_of(device)))
        gpus.sort(key=lambda g: _bus_key(g.bus_id))
        return cls(str(base), supported, memory, tuple(gpus))

    @property
    def single_node(self) -> int | None:
        """The host's only memory node, if it has exactly one."""
        return self.memory_nodes[0] if len(self.memory_nodes) == 1 else None

    def device_node(self, bus_id: str, what: str) -> NodeChoice:
        """The node of the PCI device ``bus_id`` (any form ``sysfs_bus_id`` reads); ``what``
        names it in ``why`` (e.g. "GPU cuda:3")."""
        bus_id = sysfs_bus_id(bus_id)
        if not self.numa_supported:
            return NodeChoice(None, f"this kernel has no NUMA support (no {self.root}"
                                    "/devices/system/node)")
        device = Path(self.root) / "bus/pci/devices" / bus_id
        raw = _node_of(device) if device.is_dir() else None
        return self._choice(raw, f"{what} ({bus_id})")

    def _choice(self, raw: int | None, who: str) -> NodeChoice:
        nodes = ",".join(map(str, self.memory_nodes)) or "none"
        if raw is not None and raw in self.memory_nodes:
            return NodeChoice(raw, f"{who} is on node {raw}")
        if self.single_node is not None:
            said = "no such device in sysfs" if raw is None else f"sysfs says node {raw}"
            return NodeChoice(self.single_node, f"the host's only memory node ({who}: {said})")
        if raw is None:
            return NodeChoice(None, f"{who} is not in {self.root}/bus/pci/devices")
        if raw < 0:
            return NodeChoice(None, f"{who}: sysfs numa_node is {raw} (the firmware does not "
                                    f"say) on a host with memory nodes {nodes}")
        return NodeChoice(None, f"{who} is on node {raw}, which has no memory (memory "
                                f"nodes: {nodes})")

    def rank_nodes(self, world_size: int) -> tuple[NodeChoice, ...]:
        """What the coordinator binds each rank's slice to before it allocates the region.

        It cannot see which GPU a rank's worker will use, so it takes the rule an engine
        spanning the node's GPUs follows (rank r drives the r-th GPU in PCI bus order: CUDA's
        order with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, and its default order for identical
        GPUs). A worker that finds its GPU elsewhere moves its slice's pages at attach
        (``tiercache.region.placement``)."""
        if world_size < 1:
            raise ArgumentError(f"world_size = {world_size}: must be >= 1")
        if not self.numa_supported:
            return (NodeChoice(None, "this kernel has no NUMA support"),) * world_size
        if self.single_node is not None:
            return (NodeChoice(self.single_node, "the host's only memory node"),) * world_size
        choices = []
        for rank in range(world_size):
            if rank >= len(self.gpus):
                choices.append(NodeChoice(None, f"no GPU {rank} in PCI bus order (the host has "
                                                f"{len(self.gpus)})"))
                continue
            gpu = self.gpus[rank]
            choices.append(self._choice(gpu.numa_node, f"GPU {rank} in PCI bus order"
                                                       f" ({gpu.bus_id})"))
        return tuple(choices)


def _read(path: Path) -> str | None:
    """A sysfs attribute's text; None when it cannot be read (absent, or the kernel says
    no): the callers treat that as "not said", never as a reason to stop."""
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _entries(directory: Path) -> list[Path]:
    try:
        return sorted(directory.iterdir(), key=lambda p: p.name)
    except OSError:
        return []


def _node_of(device: Path) -> int:
    """A device's ``numa_node``; -1 (not said) when the file is missing or unreadable."""
    raw = _read(device / "numa_node")
    try:
        return int(raw) if raw is not None else -1
    except ValueError:
        return -1

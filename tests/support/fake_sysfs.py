"""Fake sysfs trees for ``tiercache.numa.topology``: the files it reads, laid out as the
kernel lays them out, under a temporary root."""

from __future__ import annotations

from pathlib import Path

# An 8-GPU, two-socket host as DGX H100-class machines lay it out: four GPUs behind each
# socket's PCIe switches (bus ids as sysfs names them), listed here out of bus order.
EIGHT_GPUS_TWO_NODES = {
    "0000:9a:00.0": 1, "0000:18:00.0": 0, "0000:2a:00.0": 0, "0000:ab:00.0": 1,
    "0000:3a:00.0": 0, "0000:ba:00.0": 1, "0000:5d:00.0": 0, "0000:db:00.0": 1,
}
# Not GPUs: a NIC of NVIDIA (ConnectX, vendor 0x15b3), an NVSwitch (NVIDIA, bridge class)
# and a host bridge; none may be taken for a GPU.
OTHER_DEVICES = {
    "0000:29:00.0": ("0x15b3", "0x020000", 0),
    "0000:05:00.0": ("0x10de", "0x068000", 0),
    "0000:00:00.0": ("0x8086", "0x060000", -1),
}


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def make_tree(root: Path, memory_nodes: str = "0-1", gpus: dict[str, int] | None = None,
              others: dict[str, tuple[str, str, int]] | None = None,
              numa: bool = True) -> Path:
    """A sysfs tree: ``devices/system/node`` (``has_memory``, one ``nodeN`` directory per
    node in the list) unless ``numa`` is False, and ``bus/pci/devices/<bus id>/`` with
    ``vendor``, ``class`` and ``numa_node`` for each GPU (3D controllers of NVIDIA) and
    each other device. Returns ``root``."""
    if numa:
        node_dir = root / "devices/system/node"
        _write(node_dir / "has_memory", memory_nodes)
        _write(node_dir / "online", memory_nodes)
        from tiercache.numa.topology import parse_node_list

        for node in parse_node_list(memory_nodes):
            (node_dir / f"node{node}").mkdir(parents=True, exist_ok=True)
    gpus = EIGHT_GPUS_TWO_NODES if gpus is None else gpus
    devices = {bus: ("0x10de", "0x030200", node) for bus, node in gpus.items()}
    devices.update(OTHER_DEVICES if others is None else others)
    for bus, (vendor, klass, node) in devices.items():
        device = root / "bus/pci/devices" / bus
        _write(device / "vendor", vendor)
        _write(device / "class", klass)
        _write(device / "numa_node", str(node))
    (root / "bus/pci/devices").mkdir(parents=True, exist_ok=True)
    return root

"""The host's nodes and GPUs from sysfs: fake trees (an 8-GPU, 2-node host; unknown nodes;
no NUMA) drive the per-rank choice, and the real /sys of this machine is read as it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiercache.errors import ArgumentError
from tiercache.numa.topology import HostTopology, parse_node_list, sysfs_bus_id

from fake_sysfs import EIGHT_GPUS_TWO_NODES, make_tree


def test_eight_gpus_on_two_nodes_put_ranks_0_to_3_on_node_0_and_4_to_7_on_node_1(tmp_path):
    topology = HostTopology.read(make_tree(tmp_path))
    assert topology.memory_nodes == (0, 1) and topology.single_node is None
    # the NIC, the NVSwitch and the host bridge are not GPUs; GPUs come in PCI bus order
    assert [g.bus_id for g in topology.gpus] == sorted(EIGHT_GPUS_TWO_NODES)
    choices = topology.rank_nodes(8)
    assert [c.node for c in choices] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert choices[4].why == "GPU 4 in PCI bus order (0000:9a:00.0) is on node 1"
    # an engine of 4 ranks over the first four GPUs; more ranks than GPUs: said, not guessed
    assert [c.node for c in topology.rank_nodes(4)] == [0, 0, 0, 0]
    tail = topology.rank_nodes(10)[8:]
    assert [c.node for c in tail] == [None, None]
    assert tail[0].why == "no GPU 8 in PCI bus order (the host has 8)"


def test_a_worker_finds_its_gpus_node_by_the_bus_id_the_driver_prints(tmp_path):
    topology = HostTopology.read(make_tree(tmp_path))
    for bus_id, node in EIGHT_GPUS_TWO_NODES.items():
        driver_form = "0000" + bus_id.upper()  # 00000000:9A:00.0, as cuDeviceGetPCIBusId
        choice = topology.device_node(driver_form, "GPU cuda:0")
        assert (choice.node, choice.known) == (node, True)
        assert choice.why == f"GPU cuda:0 ({bus_id}) is on node {node}"


def test_an_unknown_node_is_said_with_its_reason_never_guessed(tmp_path):
    gpus = {"0000:18:00.0": -1, "0000:9a:00.0": 1, "0000:ab:00.0": 2}
    topology = HostTopology.read(make_tree(tmp_path, memory_nodes="0-1", gpus=gpus))
    firmware, fine, memoryless = topology.rank_nodes(3)
    assert firmware.node is None and not firmware.known
    assert "sysfs numa_node is -1 (the firmware does not say) on a host with memory nodes 0,1" \
        in firmware.why
    assert fine.node == 1
    assert memoryless.node is None and "node 2, which has no memory" in memoryless.why
    missing = topology.device_node("0000:77:00.0", "GPU cuda:5")
    assert missing.node is None and "is not in" in missing.why and "GPU cuda:5" in missing.why


def test_a_one_node_host_places_everything_on_its_node_whatever_devices_say(tmp_path):
    gpus = {"0000:18:00.0": -1, "0000:2a:00.0": 3}  # -1 is what one-node hosts report
    topology = HostTopology.read(make_tree(tmp_path, memory_nodes="0", gpus=gpus))
    assert topology.single_node == 0
    assert [c.node for c in topology.rank_nodes(3)] == [0, 0, 0]
    choice = topology.device_node("0000:18:00.0", "GPU cuda:0")
    assert choice.node == 0 and "the host's only memory node" in choice.why


def test_a_kernel_without_numa_support_places_nothing(tmp_path):
    topology = HostTopology.read(make_tree(tmp_path, numa=False))
    assert not topology.numa_supported
    assert {c.node for c in topology.rank_nodes(2)} == {None}
    choice = topology.device_node("0000:18:00.0", "GPU cuda:0")
    assert choice.node is None and "no NUMA support" in choice.why


def test_garbage_in_a_numa_node_file_reads_as_not_said(tmp_path):
    root = make_tree(tmp_path, gpus={"0000:18:00.0": 0, "0000:9a:00.0": 1})
    (root / "bus/pci/devices/0000:9a:00.0/numa_node").write_text("banana\n")
    (root / "bus/pci/devices/0000:18:00.0/numa_node").unlink()
    topology = HostTopology.read(root)
    assert [g.numa_node for g in topology.gpus] == [-1, -1]
    assert [c.node for c in topology.rank_nodes(2)] == [None, None]


@pytest.mark.parametrize("text, expected", [
    ("0000:3b:00.0", "0000:3b:00.0"), ("00000000:3B:00.0", "0000:3b:00.0"),
    ("0001:c1:1f.7", "0001:c1:1f.7"), ("10000:01:00.0", "10000:01:00.0"),
])
def test_bus_ids_are_named_as_sysfs_names_them(text, expected):
    assert sysfs_bus_id(text) == expected


@pytest.mark.parametrize("bad", ["", "3b:00.0", "0000:3b:00", "0000:3b:00.8", "../../etc:00:00.0",
                                 "0000:3g:00.0"])
def test_a_malformed_bus_id_is_refused_naming_it(bad):
    with pytest.raises(ArgumentError, match="PCI bus id"):
        sysfs_bus_id(bad)


def test_node_lists_parse_as_the_kernel_writes_them():
    assert parse_node_list("0-1,4,6-7\n") == (0, 1, 4, 6, 7)
    assert parse_node_list("") == ()
    with pytest.raises(ArgumentError, match="node list"):
        parse_node_list("0-x")


def test_this_machine_is_read_as_its_sysfs_says():
    topology = HostTopology.read()
    node_dir = Path("/sys/devices/system/node")
    with_memory = sorted(int(p.name[4:]) for p in node_dir.glob("node[0-9]*")
                         if _mem_total_kb(p) > 0)
    assert list(topology.memory_nodes) == with_memory
    if len(with_memory) == 1:
        assert {c.node for c in topology.rank_nodes(8)} == {with_memory[0]}


def _mem_total_kb(node: Path) -> int:
    for line in (node / "meminfo").read_text().splitlines():
        if "MemTotal:" in line:
            return int(line.split()[-2])
    return 0


def test_an_unreadable_sysfs_attribute_reads_as_not_said(tmp_path):
    """A kernel that refuses an attribute (EIO, EACCES) must not stop a coordinator."""
    root = make_tree(tmp_path, gpus={"0000:18:00.0": 0, "0000:9a:00.0": 1})
    node_file = root / "bus/pci/devices/0000:9a:00.0/numa_node"
    node_file.unlink()
    node_file.mkdir()  # reading a directory fails with an OSError (IsADirectoryError)
    topology = HostTopology.read(root)
    assert [g.numa_node for g in topology.gpus] == [0, -1]

"""A GPU's node (``gpu`` marker): what the driver names the device, and sysfs's node for
it, agree with torch's view of the same device."""

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tiercache.device.driver import CudaDriver  # noqa: E402
from tiercache.device.locality import caches_node  # noqa: E402
from tiercache.numa.topology import HostTopology, sysfs_bus_id  # noqa: E402


def test_each_visible_gpu_is_placed_on_its_pci_devices_node():
    torch.cuda.init()
    topology = HostTopology.read()
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        bus_id = sysfs_bus_id(CudaDriver().pci_bus_id(index))
        assert bus_id == (f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:"
                          f"{props.pci_device_id:02x}.0")
        with open(f"/sys/bus/pci/devices/{bus_id}/numa_node") as f:
            said = int(f.read())
        choice = caches_node(torch.device("cuda", index), 0, topology)
        if said >= 0 and said in topology.memory_nodes:
            assert choice.node == said
        elif topology.single_node is not None:
            assert choice.node == topology.single_node
        else:
            assert choice.node is None and "sysfs numa_node is" in choice.why
        assert bus_id in choice.why and f"cuda:{index}" in choice.why


def test_a_gpu_worker_places_its_slice_on_its_gpus_node(make_config):
    from tiercache.numa.placement import NumaState
    from tiercache.region.shared import SharedOffloadRegion
    from tiercache.transfer.worker import attach

    config = make_config(world_size=1)
    expected = caches_node(torch.device("cuda", 0), 0, HostTopology.read())
    region = SharedOffloadRegion.create(config)
    try:
        caches = [torch.zeros(8, b, dtype=torch.uint8, device="cuda:0")
                  for b in config.kv.page_bytes]
        with attach(config, 0, caches):
            numa = region.stats(0).snapshot().numa
            if expected.known:
                assert (numa.state, numa.node, numa.local_ratio) == (
                    NumaState.PLACED, expected.node, 1.0)
            else:
                assert (numa.state, numa.node) == (NumaState.UNKNOWN_NODE, None)
    finally:
        region.close()

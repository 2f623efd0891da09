"""``Direction``'s meaning (``tiercache/specs.py``): a store writes the region's rows and a
load reads them, whatever stands on the engine's side (GPU memory, or an engine's host
pool in a host-to-host copy, which still travels as ``GPU_TO_CPU``/``CPU_TO_GPU``)."""

from __future__ import annotations

from tiercache.specs import CPULoadStoreSpec, Direction, GPULoadStoreSpec


def test_each_direction_either_stores_or_loads():
    assert Direction.GPU_TO_CPU.stores and not Direction.GPU_TO_CPU.loads
    assert Direction.CPU_TO_GPU.loads and not Direction.CPU_TO_GPU.stores
    assert all(d.stores != d.loads for d in Direction)


def test_a_store_is_the_direction_whose_destination_is_the_region():
    gpu, cpu = GPULoadStoreSpec([1]), CPULoadStoreSpec([2])
    assert Direction.of((gpu, cpu)).stores and Direction.of((cpu, gpu)).loads
    for d in Direction:
        src, dst = d.src_dst("engine side", "region rows")
        assert (dst == "region rows") is d.stores and (src == "region rows") is d.loads

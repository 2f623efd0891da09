"""GPU probe of the block pack/unpack kernel (needs CUDA and triton; not a test).

For each geometry (one dense tensor per layer, 256 scattered blocks, staged's 32 MiB
chunks) prints: the host time of one launch on the public Triton path and on the
compiled launcher (``BlockKernel(compiled_launch=True)``), the host time of one
``PairTables.upload``, and the GPU time and HBM bandwidth (bytes read + written) of
packing and unpacking one full chunk. Usage: ``python benchmarks/block_kernel_probe.py``.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from tiercache.specs import Direction
from tiercache.backends.staged.block_kernel import BlockKernel, PairTables
from tiercache.backends.staged.block_layout import BlockStaging
from tiercache.pages import PageArray
from tiercache.region.layout import RegionLayout
from tiercache.specs import CPULoadStoreSpec, GPULoadStoreSpec
from tiercache.planning.planner import TransferPlanner

CHUNK_BYTES = 32 << 20
GPU_BLOCKS, CPU_BLOCKS, BLOCKS = 1024, 512, 256
REPS = 200


def _host_us(fn) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPS):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
        torch.cuda.synchronize()
    return statistics.median(times) / 1e3


def _gpu_us(fn) -> float:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    begin.record()
    for _ in range(20):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1e3 / 20


def probe(num_tensors: int, page: int) -> None:
    gpu_mem = [torch.empty(GPU_BLOCKS * page, dtype=torch.uint8, device="cuda")
               for _ in range(num_tensors)]
    gpu = [PageArray(t.data_ptr(), GPU_BLOCKS, page, page) for t in gpu_mem]
    region = RegionLayout(1, CPU_BLOCKS, (page,) * num_tensors, 1)
    cpu = [PageArray((1 << 46) + region.page_offsets[t], CPU_BLOCKS, region.row_stride, page)
           for t in range(num_tensors)]  # never dereferenced: only the pack side runs
    planner = TransferPlanner(gpu, cpu, 1)
    rng = np.random.default_rng(0)
    gpu_spec = GPULoadStoreSpec(rng.permutation(GPU_BLOCKS)[:BLOCKS])
    cpu_spec = CPULoadStoreSpec(rng.permutation(CPU_BLOCKS)[:BLOCKS])
    staging = BlockStaging.of_geometry(planner.geometry, CHUNK_BYTES)
    layout = staging.layout(planner.block_plan(Direction.GPU_TO_CPU, (gpu_spec, cpu_spec)))
    slot = torch.empty(CHUNK_BYTES, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream()
    tables = PairTables("cuda")
    pairs, token = tables.upload(np.ascontiguousarray(layout.pairs), stream)
    first, count = layout.pair_range(0)
    chunk_bytes = count * num_tensors * page
    name = f"{num_tensors}t x {page >> 10} KiB, {count} blocks per chunk"
    for compiled in (False, True):
        kernel = BlockKernel(staging, "cuda", compiled_launch=compiled)
        for label, launch in (("pack", kernel.pack), ("unpack", kernel.unpack)):
            def run():
                launch(pairs, layout.num_pairs, first, count, slot.data_ptr())
            host = _host_us(run)
            gpu_time = _gpu_us(run)
            print(f"RESULT {name} {label} {'compiled' if compiled else 'public'} launch: host "
                  f"{host:.1f} us, GPU {gpu_time:.1f} us, {2 * chunk_bytes / gpu_time / 1e3:.0f} "
                  "GB/s HBM", flush=True)
    tables.release(token, stream)

    def upload():
        _, t = tables.upload(np.ascontiguousarray(layout.pairs), stream)
        tables.release(t, stream)
    print(f"RESULT {name} PairTables.upload + release ({layout.num_pairs} pairs): host "
          f"{_host_us(upload):.1f} us", flush=True)


def main() -> None:
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for num_tensors, page in ((64, 32 << 10), (32, 16 << 10), (32, 64 << 10), (64, 16 << 10)):
        probe(num_tensors, page)


if __name__ == "__main__":
    main()

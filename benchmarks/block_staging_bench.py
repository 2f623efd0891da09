"""Host time of laying out one transfer for ``staged``: per-page vs block-level (CPU only).

Per-page (today): ``TransferPlanner.plan`` into reused ``PlanBuffers``, then
``plan_staging`` with a reused ``Scratch`` (what ``StagedBackend.submit`` does before
its first driver call). Block-level: ``group_work`` (the planner's validation) +
``BlockStaging.layout`` + the DMAs' absolute slot addresses. Addresses are numbers
(nothing is copied), slots and GPU blocks scattered as an index and an allocator hand
them out; ``load/w``: ``load_whole_rows`` (a load reads whole row images: one DMA per row
even where a row is partly needed). Usage: ``python benchmarks/block_staging_bench.py [reps]``.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from tiercache.specs import Direction
from tiercache.backends.staged.block_layout import BlockStaging
from tiercache.backends.staged.page_layout import Scratch, plan_staging
from tiercache.pages import PageArray
from tiercache.region.layout import RegionLayout
from tiercache.specs import CPULoadStoreSpec, GPULoadStoreSpec
from tiercache.planning.planner import PlanBuffers, TransferPlanner

CHUNK_BYTES = 32 << 20  # staged's defaults
DIRECT_BYTES = 1 << 20
GPU_BLOCKS, CPU_BLOCKS = 4096, 2048


def _planner(num_tensors: int, page: int, factor: int) -> TransferPlanner:
    gpu = [PageArray((1 << 40) + t * GPU_BLOCKS * page, GPU_BLOCKS, page, page)
           for t in range(num_tensors)]
    region = RegionLayout(1, CPU_BLOCKS, (page,) * num_tensors, factor)
    cpu = [PageArray((1 << 46) + region.page_offsets[t], CPU_BLOCKS, region.row_stride, page,
                     factor) for t in range(num_tensors)]
    return TransferPlanner(gpu, cpu, factor)


def _median_us(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


def bench(num_tensors: int, page: int, factor: int, gpu_blocks: int, skip: int, store: bool,
          whole: bool, reps: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    planner = _planner(num_tensors, page, factor)
    rows = -(-(gpu_blocks + skip) // factor)
    gpu_spec = GPULoadStoreSpec(rng.permutation(GPU_BLOCKS)[:gpu_blocks], None, [skip])
    cpu_spec = CPULoadStoreSpec(rng.permutation(CPU_BLOCKS)[:rows])
    spec = (gpu_spec, cpu_spec) if store else (cpu_spec, gpu_spec)
    direction = Direction.GPU_TO_CPU if store else Direction.CPU_TO_GPU
    buffers, scratch = PlanBuffers(), Scratch()
    staging = BlockStaging.of_geometry(planner.geometry, CHUNK_BYTES, load_whole_rows=whole)
    ring = [(1 << 45) + s * (CHUNK_BYTES + DIRECT_BYTES) for s in range(4)]

    def per_page():
        plan = planner.plan(direction, spec, out=buffers)
        host, gpu = (plan.dst, plan.src) if store else (plan.src, plan.dst)
        return plan_staging(host, gpu, plan.sizes, CHUNK_BYTES, DIRECT_BYTES, scratch)

    def work():
        return planner.block_plan(direction, spec)

    done = work()

    def block_layout():
        return staging.layout(done)

    def block():
        layout = staging.layout(work())
        layout.dma_slot_addresses([ring[k % 4] for k in range(layout.num_chunks)])
        return layout

    layout = block()
    old = per_page()
    return {"per_page_us": _median_us(per_page, reps), "plan_us": _median_us(
                lambda: planner.plan(direction, spec, out=buffers), reps),
            "block_us": _median_us(block, reps), "validate_us": _median_us(work, reps),
            "layout_us": _median_us(block_layout, reps),
            "pages": gpu_blocks * num_tensors, "pairs": layout.num_pairs,
            "dmas": int(layout.dma_host.size), "chunks": layout.num_chunks,
            "old_descriptors": int(old.pieces.num_bytes.size + old.direct.num_bytes.size),
            "old_dmas": int(old.dmas.num_bytes.size + old.direct.num_bytes.size)}


CASES = [  # (tensors, page bytes, factor, GPU blocks, skip)
    (64, 32 << 10, 1, 256, 0), (64, 32 << 10, 1, 1, 0),
    (32, 16 << 10, 1, 256, 0), (32, 16 << 10, 1, 1, 0),
    (64, 16 << 10, 1, 256, 0), (64, 16 << 10, 1, 1, 0),
    (32, 64 << 10, 1, 256, 0), (32, 64 << 10, 1, 1, 0),
    (64, 64 << 10, 1, 256, 0),
    (64, 32 << 10, 4, 256, 0), (64, 32 << 10, 4, 255, 1), (64, 32 << 10, 4, 3, 1),
]


def main(argv: list[str]) -> None:
    reps = int(argv[0]) if argv else 200
    print(f"median of {reps} calls, µs; chunk {CHUNK_BYTES >> 20} MiB")
    print(f"{'case':34} {'dir':6} {'per-page':>9} {'(plan)':>7} {'block':>7} {'(valid.)':>8} "
          f"{'(layout)':>8} {'pages':>6} {'pairs':>5} {'DMAs':>5} {'old DMAs':>8} {'chunks':>6}")
    for tensors, page, factor, blocks, skip in CASES:
        for store, whole in ((True, False), (False, False), (False, True)):
            r = bench(tensors, page, factor, blocks, skip, store, whole, reps)
            name = f"{blocks} blk x {tensors}t x {page >> 10} KiB F={factor}" + \
                (f" skip={skip}" if skip else "")
            print(f"{name:34} {'store' if store else 'load/w' if whole else 'load':6} {r['per_page_us']:9.1f} "
                  f"{r['plan_us']:7.1f} {r['block_us']:7.1f} {r['validate_us']:8.1f} "
                  f"{r['layout_us']:8.1f} {r['pages']:6} {r['pairs']:5} {r['dmas']:5} "
                  f"{r['old_dmas']:8} {r['chunks']:6}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

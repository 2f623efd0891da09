"""vLLM 0.33's own CPU-offload copy, replicated, for ``tiercache replay``'s ``vllm_native``
bandwidth (issue 40). GPU machine; not a test.

vLLM's compiled ops cannot run on the device machine (its wheel is far over what a device
call may carry, and the machine has no network), so this replays what
``ops.swap_blocks_batch`` does, as ``shared/research/vllm_kv_offload.md`` §4.2 reads it
from vLLM's source: **one** ``cuMemcpyBatchAsync`` per transfer over every (src, dst, size)
descriptor, on a non-default stream, ``srcAccessOrder`` STREAM for stores and ANY for
loads, pinned host memory; for Llama-3-8B's 32 KiB pages the handler takes this DMA path
both ways (its Triton path is for pages under 28 KiB). Two layouts: per-layer tensors (one
descriptor per block per tensor: 64 x 32 KiB) and vLLM's cross-layer block (one 2 MiB
descriptor per block). The figure is the engine view: wall clock from the call to the
stream's end event, 256 scattered blocks a transfer, median of ``--reps``; the ceiling
(one large pinned copy) is measured in the same run.

    PYTHONPATH=. python3 benchmarks/vllm_native_copy_gpu.py --json $OUT/vllm_native.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from tiercache.device.driver import CudaDriver, MemcpyAttributes, SrcAccessOrder

PAGE = 32 << 10
TENSORS = 64
BLOCKS = 256
GPU_BLOCKS = 1024
CPU_BLOCKS = 1024


def engine_view(driver: CudaDriver, stream: torch.cuda.Stream, src: np.ndarray,
                dst: np.ndarray, sizes: np.ndarray, order: SrcAccessOrder) -> float:
    attrs = MemcpyAttributes(srcAccessOrder=int(order))
    end = torch.cuda.Event()
    t = time.perf_counter()
    handle = driver.enter(stream, 0)
    failure = driver.memcpy_batch(dst.ctypes.data, src.ctypes.data, sizes.ctypes.data,
                                  int(sizes.size), attrs, handle)
    assert failure is None, failure
    end.record(stream)
    end.synchronize()
    return time.perf_counter() - t


def descriptors(gpu_bases, cpu_bases, gpu_blocks, cpu_blocks, unit: int, store: bool):
    g = np.array([b + i * unit for b in gpu_bases for i in gpu_blocks], dtype=np.uint64)
    c = np.array([b + i * unit for b in cpu_bases for i in cpu_blocks], dtype=np.uint64)
    sizes = np.full(g.size, unit, dtype=np.uint64)
    return (g, c, sizes) if store else (c, g, sizes)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json")
    args = p.parse_args()
    from tiercache.tools.bench.rig import probe_rig

    rig, ceiling = probe_rig(5)
    del rig
    print("ceiling " + " ".join(f"{k} {v:.1f}" for k, v in ceiling.items()) + " GB/s",
          flush=True)
    driver, stream = CudaDriver(), torch.cuda.Stream()
    rng = np.random.default_rng(40)
    layouts = {
        "per-layer (64 x 32 KiB descriptors a block)": (
            [torch.empty(GPU_BLOCKS * PAGE, dtype=torch.uint8, device="cuda")
             for _ in range(TENSORS)],
            [torch.empty(CPU_BLOCKS * PAGE, dtype=torch.uint8).pin_memory()
             for _ in range(TENSORS)], PAGE),
        "cross-layer (one 2 MiB descriptor a block)": (
            [torch.empty(GPU_BLOCKS * PAGE * TENSORS, dtype=torch.uint8, device="cuda")],
            [torch.empty(CPU_BLOCKS * PAGE * TENSORS, dtype=torch.uint8).pin_memory()],
            PAGE * TENSORS),
    }
    result = {"ceiling_gbps": ceiling, "layouts": {}}
    for name, (gpu, cpu, unit) in layouts.items():
        cpu_blocks = CPU_BLOCKS
        gb, cb = [t.data_ptr() for t in gpu], [t.data_ptr() for t in cpu]
        nbytes = BLOCKS * PAGE * TENSORS
        row = {}
        for label, store, order, ceil in (
                ("store", True, SrcAccessOrder.STREAM, ceiling["gpu_to_cpu"]),
                ("load", False, SrcAccessOrder.ANY, ceiling["cpu_to_gpu"])):
            times = []
            for rep in range(args.reps + 3):
                gblocks = rng.choice(GPU_BLOCKS, BLOCKS, replace=False)
                cblocks = rng.choice(cpu_blocks, BLOCKS, replace=False)
                src, dst, sizes = descriptors(gb, cb, gblocks, cblocks, unit, store)
                elapsed = engine_view(driver, stream, src, dst, sizes, order)
                if rep >= 3:
                    times.append(elapsed)
            gbps = nbytes / statistics.median(times) / 1e9
            row[label] = {"gbps": gbps, "ratio": gbps / ceil,
                          "descriptors": int(BLOCKS * len(gb))}
        result["layouts"][name] = row
        print(f"{name}: store {row['store']['gbps']:.1f} GB/s ({row['store']['ratio']:.2f}), "
              f"load {row['load']['gbps']:.1f} GB/s ({row['load']['ratio']:.2f})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

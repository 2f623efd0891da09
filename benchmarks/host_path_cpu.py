"""The host time of a staged block transfer's two native steps on a CPU machine (not a
test): planning (``TransferPlanner.block_plan``, validated in C) and queueing to the chunk
loop (``ChunkLoop.submit``), the loop's driver calls being C functions that do nothing.
The bench's default workload (64 tensors x 32 KiB, 256 scattered blocks); medians of REPS
calls, warm (back to back) and cold (after the CPU wrote 256 MiB). Usage:
``python benchmarks/host_path_cpu.py``. For the shape of the Python around the C, not for
figures of a GPU machine.
"""

from __future__ import annotations

import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tiercache.backends.staged.block_layout import BlockStaging
from tiercache.native.chunk_loop import KERNEL_ARGS, ChunkLoop, LoopDriver, LoopKernel
from tiercache.pages import PageArray
from tiercache.planning.planner import TransferPlanner
from tiercache.specs import CPULoadStoreSpec, Direction, GPULoadStoreSpec

REPS = 300
PAGE, TENSORS, BLOCKS = 32 << 10, 64, 256


def noop_library() -> ctypes.CDLL:
    src = Path(tempfile.mkdtemp()) / "noop.c"
    src.write_text("int tc_noop(void) { return 0; }\n")
    out = src.with_suffix(".so")
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return ctypes.CDLL(str(out))


def main() -> None:
    gpu_blocks, rows = 2 * BLOCKS, 4 * BLOCKS
    gpu = [PageArray(0x7000_0000_0000 + t * gpu_blocks * PAGE, gpu_blocks, PAGE, PAGE)
           for t in range(TENSORS)]
    cpu = [PageArray(0x1000_0000_0000 + t * PAGE, rows, TENSORS * PAGE, PAGE)
           for t in range(TENSORS)]
    planner = TransferPlanner(gpu, cpu, 1)
    rng = np.random.default_rng(0)
    spec = (GPULoadStoreSpec(rng.permutation(gpu_blocks)[:BLOCKS]),
            CPULoadStoreSpec(rng.permutation(rows)[:BLOCKS]))
    staging = BlockStaging.of_geometry(planner.geometry, 32 << 20, True)
    lib = noop_library()
    noop = ctypes.cast(lib.tc_noop, ctypes.c_void_p).value
    driver = LoopDriver(noop, noop, noop, noop, noop, 13000, 0)
    kernel = LoopKernel((1, 2), 128, (16, 8), 1, 0, KERNEL_ARGS, (0, 0, 0, 0))
    slot_bytes = (32 << 20) + (1 << 20)
    loop = ChunkLoop(driver, kernel, staging.loop_geometry(), dma_stream=3,
                     ring_base=0x5000_0000_0000, slot_bytes=slot_bytes,
                     free_events=[11, 12, 13, 14], ready_events=[21, 22, 23, 24],
                     begin_event=31, done_event=32, attrs=(bytes(24), bytes(24)))
    table = np.empty(4 * BLOCKS, dtype=np.int64)
    g2c = Direction.GPU_TO_CPU
    flood = np.empty(256 << 20, dtype=np.uint8)

    def plan():
        return planner.block_plan(g2c, spec)

    p = plan()

    def submit():
        loop.submit(stream=5, after=6, prev_end=7, start_event=8, end_event=9, table_event=10,
                    direction=g2c, validated=p.buffer, num_pairs=p.num_pairs, num_works=p.num_works,
                    table=table.__array_interface__["data"][0], keep=p)

    def both():
        q = plan()
        loop.submit(stream=5, after=6, prev_end=7, start_event=8, end_event=9, table_event=10,
                    direction=g2c, validated=q.buffer, num_pairs=q.num_pairs, num_works=q.num_works,
                    table=table.__array_interface__["data"][0], keep=q)

    for label, fn in (("block_plan", plan), ("ChunkLoop.submit", submit),
                      ("block_plan + submit", both)):
        for state, between in (("warm", lambda: None), ("cold", lambda: flood.fill(1))):
            times = []
            for i in range(REPS + 10):
                loop.wait()
                between()
                t0 = time.perf_counter_ns()
                fn()
                if i >= 10:
                    times.append(time.perf_counter_ns() - t0)
            times.sort()
            print(f"RESULT {label:22s} {state}: p50 {statistics.median(times) / 1e3:7.1f} us  "
                  f"p90 {times[int(0.9 * len(times))] / 1e3:7.1f} us", flush=True)
    loop.close()


if __name__ == "__main__":
    sys.exit(main())

"""Where the host time of one block-level ``staged`` transfer goes (GPU machine; not a test).

The bench's default workload (64 tensors x 32 KiB, 256 scattered blocks, 16 chunks of 32
MiB): each step of ``StagedBackend.submit`` (the Python block path) timed alone (median of REPS, the
stream drained between calls), then cProfile over whole calls. Output feeds
docs/benchmarks.md. Usage: ``python benchmarks/host_path_profile.py``.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time

import numpy as np
import torch

from tiercache.device.driver import SrcAccessOrder
from tiercache.backends.base import Ordering
from tiercache.backends.staged.backend import StagedBackend
from tiercache.specs import Direction
from tiercache.tools.bench.rig import GpuRig
from tiercache.tools.bench.workloads import KIB, TRANSFER_BYTES, Workload

REPS = 50
G2C = Direction.GPU_TO_CPU


def host_us(fn, stream) -> float:
    for _ in range(5):
        fn()
    stream.synchronize()
    times = []
    for _ in range(REPS):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
        stream.synchronize()
    return statistics.median(times) / 1e3


def main() -> None:
    rig = GpuRig(0, TRANSFER_BYTES)
    w = Workload.for_page(32 * KIB)
    plans = rig.plans(w)
    stream = rig.streams[0]
    staged = StagedBackend(0, geometry=plans.planner.geometry, native=False)  # the Python pipeline
    staging, kernel, tables = staged._blocks
    spec = plans.store_spec
    plan = plans.planner.block_plan(G2C, spec)
    layout = staging.layout(plan)
    bases = np.array([staged._ring_base + (k % staged.num_slots) * staged.slot_bytes
                      for k in range(layout.num_chunks)], np.uint64)
    dmas = staged._block_dmas(layout, bases, True)
    handle = staged.driver.enter(stream, staged._ce.device)
    first, count = layout.pair_range(0)
    addr, token = tables.upload(layout.pairs, stream)
    tables.release(token, stream)
    drv = staged.driver
    ev = drv.event_create()

    def upload():
        _, t = tables.upload(layout.pairs, stream)
        tables.release(t, stream)

    def events():
        drv.event_record(ev, handle)
        drv.stream_wait_event(staged._dma, ev)

    def launch():
        with torch.cuda.stream(stream):
            kernel.pack(addr, layout.num_pairs, first, count, int(bases[0]))

    steps = {
        "block_plan (validate 256 pairs)": lambda: plans.planner.block_plan(G2C, spec),
        "staging.layout": lambda: staging.layout(plan),
        "PairTables upload+release": upload,
        "DMA arrays (slot addresses)": lambda: staged._block_dmas(layout, bases, True),
        "driver.enter (stream handle)": lambda: drv.enter(stream, staged._ce.device),
        "torch.cuda.stream enter/exit": lambda: torch.cuda.stream(stream).__enter__(),
        "one pack launch (compiled)": launch,
        "one chunk's DMA batch": lambda: staged._ce.submit_range(
            dmas, int(layout.dma_first[0]), int(layout.dma_first[1]), SrcAccessOrder.STREAM,
            staged._dma),
        "event record + stream wait": events,
        "whole submit": lambda: staged.submit(plan, Ordering(stream)),
        "plan + submit": lambda: staged.submit(
            plans.planner.block_plan(G2C, spec), Ordering(stream)),
    }
    print(f"workload {w.label()}: {layout.num_chunks} chunks, {layout.num_pairs} pairs, "
          f"{layout.dma_bytes.size} DMAs", flush=True)
    for name, fn in steps.items():
        print(f"RESULT {name:34s} {host_us(fn, stream):8.1f} us", flush=True)
    prof = cProfile.Profile()
    for _ in range(20):
        prof.enable()
        staged.submit(plans.planner.block_plan(G2C, spec), Ordering(stream))
        prof.disable()
        stream.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    staged.close()


if __name__ == "__main__":
    main()

"""Where the host time of one ``transfer_async`` goes, through the real handlers, with the
default backend (GPU machine; not a test). Output feeds docs/benchmarks.md ("Host path").

The bench's default workload (64 tensors x 32 KiB, 256 scattered blocks): the steps of a
staged block transfer timed alone (median of REPS), then cProfile over whole
``transfer_async`` calls of a 256-block store and of a one-block load (the device drained
between calls). Usage: ``python benchmarks/engine_call_profile.py [backend]``.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time

import numpy as np

from tiercache.device.streams import CudaStreams
from tiercache.specs import Direction
from tiercache.tools.bench.rig import BenchBackend, GpuRig
from tiercache.tools.bench.workloads import KIB, TRANSFER_BYTES, Workload
from tiercache.transfer.wiring import build_handlers

REPS = 200
G2C = Direction.GPU_TO_CPU


def host_us(fn, sync) -> float:
    times = []
    for i in range(REPS + 10):
        t0 = time.perf_counter_ns()
        fn()
        if i >= 10:
            times.append(time.perf_counter_ns() - t0)
        sync()
    return statistics.median(times) / 1e3


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "auto"
    rig = GpuRig(0, TRANSFER_BYTES)
    w = Workload.for_page(32 * KIB)
    plans = rig.plans(w)
    built = rig.backends(BenchBackend.parse(name), w, plans.planner)
    handlers = build_handlers(plans.planner, built, CudaStreams(rig.device))
    jobs = iter(range(1, 1 << 30))

    def drain() -> None:
        while handlers.gpu_to_cpu_handler.num_in_flight or handlers.cpu_to_gpu_handler.num_in_flight:
            handlers.get_finished()

    store = lambda: handlers.transfer_async(next(jobs), plans.store_spec)  # noqa: E731
    one = lambda: handlers.transfer_async(next(jobs), plans.one_load_spec)  # noqa: E731
    staged = getattr(built[G2C], "chosen", built[G2C])
    steps = {"transfer_async, 256-block store": store, "transfer_async, 1-block load": one,
             "block_plan (validate 256 pairs)":
                 lambda: plans.planner.block_plan(G2C, plans.store_spec)}
    if getattr(staged, "_blocks", None) is not None:
        staging, _, tables = staged._blocks
        plan = plans.planner.block_plan(G2C, plans.store_spec)
        layout = staging.layout(plan)
        steps["staging.layout"] = lambda: staging.layout(plan)
        steps["PairTables.upload"] = lambda: tables.upload(layout.pairs, rig.streams[0])
    for label, fn in steps.items():
        print(f"RESULT {label:36s} {host_us(fn, drain):8.1f} us", flush=True)

    def after_store() -> None:  # the host's caches as a 512 MiB store leaves them
        store()
        drain()

    def after_load() -> None:
        handlers.transfer_async(next(jobs), plans.load_spec)
        drain()

    flood = np.empty(512 << 20, dtype=np.uint8)

    def after_memset() -> None:  # the CPU itself writes 512 MiB: every cache level flushed
        flood.fill(1)

    global REPS
    reps, REPS = REPS, 30
    for label in ("block_plan (validate 256 pairs)", "transfer_async, 1-block load",
                  "transfer_async, 256-block store"):
        for what, sync in (("after a store", after_store), ("after a load", after_load),
                           ("after a 512 MiB memset", after_memset)):
            print(f"RESULT {label + ', ' + what:64s} {host_us(steps[label], sync):8.1f} us",
                  flush=True)
    REPS = reps

    def behind(fn) -> float:  # a second call while the first transfer runs: code warm
        fn()
        t0 = time.perf_counter_ns()
        fn()
        took = time.perf_counter_ns() - t0
        drain()
        return took / 1e3

    for label, fn, reps in (("store behind a store", store, 30),
                            ("1-block load behind a 1-block load", one, 100)):
        print(f"RESULT {'transfer_async, ' + label:64s} "
              f"{statistics.median(behind(fn) for _ in range(reps)):8.1f} us", flush=True)
    for label, fn in (("256-block store", store), ("1-block load", one)):
        spans = Spans()
        for _ in range(REPS):
            fn()
            drain()
        spans.stop()
        print(f"--- wall time inside transfer_async, {label} (mean of {REPS} calls, nested)")
        spans.report(REPS)
    for label, fn in (("256-block store", store), ("1-block load", one)):
        prof = cProfile.Profile()
        for _ in range(50):
            prof.enable()
            fn()
            prof.disable()
            drain()
        print(f"--- cProfile: transfer_async, {label} (50 calls)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    handlers.shutdown()


class Spans:
    """Wall time of selected functions, by wrapping them (restored by ``stop``)."""

    TARGETS = [
        ("tiercache.transfer.handlers", "SingleDirectionOffloadingHandler", "transfer_async"),
        ("tiercache.planning.planner", "TransferPlanner", "block_plan"),
        ("tiercache.transfer.planned_path", "PlannedPath", "transfer"),
        ("torch.cuda", "Stream", "wait_stream"),
        ("tiercache.backends.staged.backend", "StagedBackend", "plan"),
        ("tiercache.native.chunk_loop", "ChunkLoop", "validate"),
        ("tiercache.backends.staged.backend", "StagedBackend", "_queue"),
        ("tiercache.device.driver", "CudaDriver", "enter"),
        ("tiercache.backends.staged.block_layout", "BlockStaging", "layout"),
        ("tiercache.backends.staged.block_kernel", "PairTables", "upload"),
        ("tiercache.native.chunk_loop", "ChunkLoop", "submit"),
        ("tiercache.backends.ce", "CeBackend", "copy"),
        ("tiercache.device.driver", "CudaDriver", "memcpy_batch"),
    ]

    def __init__(self, targets: list[tuple[str, str, str]] | None = None) -> None:
        import importlib

        self.total: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.names: list[str] = []
        self._saved = []
        for module, cls_name, attr in targets or self.TARGETS:
            cls = getattr(importlib.import_module(module), cls_name)
            original = cls.__dict__.get(attr)
            if original is None:
                continue
            self._saved.append((cls, attr, original))
            self.names.append(f"{cls_name}.{attr}")
            setattr(cls, attr, self._wrap(f"{cls_name}.{attr}", original))

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter_ns() - t0)
        return timed

    def add(self, name: str, ns: int) -> None:
        """One timed call of ``name`` (a subclass may keep them otherwise)."""
        self.total[name] = self.total.get(name, 0) + ns
        self.calls[name] = self.calls.get(name, 0) + 1

    def stop(self) -> None:
        for cls, attr, original in self._saved:
            setattr(cls, attr, original)

    def report(self, reps: int) -> None:
        for name, ns in self.total.items():
            print(f"RESULT   {name:44s} {ns / reps / 1e3:8.1f} us  ({self.calls[name] / reps:.1f} calls)")



class PerCallSpans(Spans):
    """``Spans`` kept per call: ``current`` collects the open call's times (ns) by name;
    None: nothing is kept."""

    def __init__(self, targets: list[tuple[str, str, str]] | None = None) -> None:
        self.current: dict[str, int] | None = None
        super().__init__(targets)

    def add(self, name: str, ns: int) -> None:
        if self.current is not None:
            self.current[name] = self.current.get(name, 0) + ns


if __name__ == "__main__":
    main()

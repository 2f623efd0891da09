"""The ``cpu`` backend's bench: host buffers on both sides, against one large memmove."""

from __future__ import annotations

import ctypes
import time

import numpy as np

from tiercache.backends.base import Ordering
from tiercache.backends.cpu import CpuCopyBackend
from tiercache.backend_kind import BackendKind
from tiercache.device.host_streams import HostStreams
from tiercache.planning.plans import CopyPlan
from tiercache.specs import Direction
from tiercache.tools.bench.report import Progress, Report, fmt_rate
from tiercache.tools.bench.workloads import GPU_TRANSFERS, HOST_TRANSFERS, KIB, MIB, Workload


def _store_plan(src: np.ndarray, dst: np.ndarray, w: Workload, seed: int) -> CopyPlan:
    """A store of random blocks of per-tensor "GPU" pages in ``src`` into random region
    rows in ``dst``, tensor-major (the order does not matter to the cpu backend)."""
    rng = np.random.default_rng(seed)
    b, page = w.blocks_per_transfer, w.page_bytes
    layout = w.host_layout()
    gpu_base = np.uint64(src.ctypes.data) \
        + np.arange(w.num_tensors, dtype=np.uint64) * np.uint64(GPU_TRANSFERS * b * page)
    blocks = rng.permutation(GPU_TRANSFERS * b)[:b].astype(np.uint64)
    rows = rng.permutation(HOST_TRANSFERS * b)[:b].astype(np.uint64)
    gpu = (gpu_base[:, None] + blocks[None, :] * np.uint64(page)).ravel()
    offsets = np.asarray(layout.page_offsets, dtype=np.uint64)
    host = (np.uint64(dst.ctypes.data) + rows[None, :] * np.uint64(layout.row_stride)
            + offsets[:, None]).ravel()
    return CopyPlan(gpu, host, np.full(gpu.size, page, dtype=np.uint64), Direction.GPU_TO_CPU)


def _memmove_gbps(src: np.ndarray, dst: np.ndarray, num_bytes: int, reps: int) -> float:
    ctypes.memmove(dst.ctypes.data, src.ctypes.data, num_bytes)  # warm-up
    t0 = time.perf_counter()
    for _ in range(reps):
        ctypes.memmove(dst.ctypes.data, src.ctypes.data, num_bytes)
    return num_bytes * reps / (time.perf_counter() - t0) / 1e9


def run_cpu(args) -> Report:
    """Stores through the cpu backend on a host stream, per page size."""
    transfer = args.cpu_transfer_mib * MIB
    report = Report(machine="host only (cpu backend)")
    src = np.random.default_rng(0).integers(0, 256, GPU_TRANSFERS * transfer, dtype=np.uint8)
    dst = np.ones(HOST_TRANSFERS * transfer, dtype=np.uint8)  # touched: no first-touch faults
    ceiling = _memmove_gbps(src, dst, transfer, args.reps)
    report.ceiling = {"gpu_to_cpu": ceiling, "cpu_to_gpu": ceiling, "both": ceiling}
    progress = Progress(1 + len(args.page_kib))
    progress.step("ceiling (one memmove)", f"{ceiling:.1f} GB/s")
    platform = HostStreams()
    stream, event, backend = platform.new_stream(), platform.new_timing_event(), CpuCopyBackend()
    try:
        for page_kib in args.page_kib:
            page = int(page_kib * KIB)
            w = Workload.for_page(page, transfer_bytes=transfer, max_tensors=args.tensors)
            plan = _store_plan(src, dst, w, seed=page)
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                backend.submit(plan, Ordering(stream))
                event.record(stream)
                event.synchronize()
                times.append(time.perf_counter() - t0)
            rate = plan.num_bytes / float(np.median(times)) / 1e9
            label = BackendKind.CPU.label
            report.add(workload=w.label(), page_bytes=page, backend=label, kind=label,
                       gpu_to_cpu=rate)
            progress.step(f"{w.label()} cpu copy", fmt_rate(rate, ceiling))
    finally:
        platform.close()
    return report

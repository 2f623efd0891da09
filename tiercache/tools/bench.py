"""``tiercache bench``: how fast each copy backend moves KV pages, against the same run's
ceiling (one large pinned copy), on this machine.

Default workload: a Llama-3-8B-like rank — 64 tensors (32 layers x K, V) of 32 KiB
pages, 256 blocks per transfer (16384 pages, 512 MiB) — and the page-size sweep keeps
512 MiB per transfer (16 KiB: 512 blocks; 64 KiB: 128; 2 MiB: one cross-layer tensor,
256 blocks). Host memory is pinned and laid out in region rows (``RegionLayout``);
GPU and host block ids are random, so nothing merges by luck. Plans come from the real
``TransferPlanner`` (its descriptor order is what ``staged`` sees in production).

Figures (every rate also as a ratio to the same-run ceiling):
  * per page size x backend: store (gpu_to_cpu), load (cpu_to_gpu), both at once;
  * ``--matmul``: a bf16 matmul's speed beside continuous both-ways copies;
  * one block (64 pages) latency, GPU-timed, against 1.5 x wire time + 20 µs;
  * host-side submit time of one 16384-page transfer (``copy_async``), and the
    planner's time for it.
``--backend cpu`` measures the cpu backend against one large memmove (any machine).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tiercache.backends.base import CopyPlan
from tiercache.region.layout import RegionLayout
from tiercache.pages import PageArray
from tiercache.transfer.planner import PlanBuffers, TransferPlanner
from tiercache.specs import CPULoadStoreSpec, GPULoadStoreSpec, TransferSpec
from tiercache.region.stats import Direction

KIB, MIB = 1 << 10, 1 << 20
TRANSFER_BYTES = 512 * MIB
DEFAULT_TENSORS = 64
GPU_BACKENDS = ("auto", "ce", "staged", "kernel")
TARGETS = {"direction": 0.93, "both": 0.85, "matmul": 0.95, "submit_us": 100.0}
MATMUL_N = 8192
GATE_CYCLES = 1_000_000_000  # ~0.5 s of GPU clock: time to submit every copy round


@dataclass(frozen=True)
class Workload:
    page_bytes: int
    num_tensors: int
    blocks_per_transfer: int

    @classmethod
    def for_page(cls, page_bytes: int, transfer_bytes: int = TRANSFER_BYTES,
                 max_tensors: int = DEFAULT_TENSORS) -> Workload:
        tensors = max(1, min(max_tensors, transfer_bytes // (page_bytes * 256)))
        return cls(page_bytes, tensors, max(1, transfer_bytes // (page_bytes * tensors)))

    @property
    def pages(self) -> int:
        return self.num_tensors * self.blocks_per_transfer

    @property
    def transfer_bytes(self) -> int:
        return self.pages * self.page_bytes

    def label(self) -> str:
        size = f"{self.page_bytes // MIB} MiB" if self.page_bytes >= MIB else f"{self.page_bytes // KIB} KiB"
        return f"{size} x {self.num_tensors}t x {self.blocks_per_transfer}b"


@dataclass
class Progress:
    """One line per finished step on stderr: ``[i/n] what ... result``."""

    total: int
    done: int = 0

    def step(self, what: str, result: str) -> None:
        self.done += 1
        print(f"[{self.done}/{self.total}] {what:42s} {result}", file=sys.stderr, flush=True)


@dataclass
class RigPlans:
    """One workload's planner over the rig's buffers, a store and a disjoint load (spec
    and plan), and one-block specs for the latency figure."""

    planner: TransferPlanner
    store_spec: TransferSpec
    load_spec: TransferSpec
    store: CopyPlan
    load: CopyPlan
    one_store_spec: TransferSpec
    one_load_spec: TransferSpec


@dataclass
class Report:
    machine: str
    ceiling: dict[str, float] = field(default_factory=dict)  # GB/s
    rows: list[dict] = field(default_factory=list)

    def add(self, **row) -> None:
        self.rows.append(row)


def _plan_arrays(gpu_base: np.ndarray, gpu_stride: int, host_base: int, layout: RegionLayout,
                 gpu_blocks: np.ndarray, host_rows: np.ndarray, page_bytes: int):
    """Tensor-major descriptors for the cpu backend (order does not matter to it)."""
    gpu = (gpu_base[:, None] + gpu_blocks[None, :].astype(np.uint64) * np.uint64(gpu_stride)).ravel()
    offsets = np.asarray(layout.page_offsets, dtype=np.uint64)
    host = (np.uint64(host_base) + host_rows[None, :].astype(np.uint64) * np.uint64(layout.row_stride)
            + offsets[:, None]).ravel()
    return gpu, host, np.full(gpu.size, page_bytes, dtype=np.uint64)


def _fmt_rate(gbps: float, ceiling: float) -> str:
    return f"{gbps:6.1f} GB/s ({gbps / ceiling:.2f})"


# ====================================================================== GPU
class GpuRig:
    """One pinned host buffer and one GPU buffer, carved per workload."""

    def __init__(self, device: int, transfer_bytes: int):
        import torch

        self.torch = torch
        self.device = torch.device("cuda", device)
        torch.cuda.set_device(self.device)
        self.transfer_bytes = transfer_bytes
        # host: 4 transfers' worth of rows (store and load sets never overlap), plus slack
        self.host = torch.empty(4 * transfer_bytes + 64 * MIB, dtype=torch.uint8, pin_memory=True)
        self.gpu = torch.empty(2 * transfer_bytes + 64 * MIB, dtype=torch.uint8, device=self.device)
        self.host.fill_(0x5A)
        self.gpu.random_(0, 256)
        self.streams = [torch.cuda.Stream(device=self.device) for _ in range(3)]
        self.ceiling_gbps: dict[str, float] = {}

    def plans(self, w: Workload, seed: int = 0) -> RigPlans:
        """The planner over per-layer GPU tensors and region rows; a store set and a
        disjoint load set of random blocks."""
        rng = np.random.default_rng(seed)
        b, page = w.blocks_per_transfer, w.page_bytes
        layout = RegionLayout(1, 4 * b, (page,) * w.num_tensors)
        gpu_pages = [PageArray(self.gpu.data_ptr() + t * 2 * b * page, 2 * b, page, page)
                     for t in range(w.num_tensors)]
        cpu_pages = [PageArray(self.host.data_ptr() + layout.page_offsets[t], 4 * b,
                               layout.row_stride, page) for t in range(w.num_tensors)]
        planner = TransferPlanner(gpu_pages, cpu_pages, 1)
        gpu_blocks = rng.permutation(2 * b)
        rows = rng.permutation(4 * b)
        store = (GPULoadStoreSpec(gpu_blocks[:b]), CPULoadStoreSpec(rows[:b]))
        load = (CPULoadStoreSpec(rows[b:2 * b]), GPULoadStoreSpec(gpu_blocks[b:2 * b]))
        return RigPlans(planner, store, load, planner.plan(store), planner.plan(load),
                        (GPULoadStoreSpec(gpu_blocks[:1]), CPULoadStoreSpec(rows[:1])),
                        (CPULoadStoreSpec(rows[b:b + 1]), GPULoadStoreSpec(gpu_blocks[b:b + 1])))

    # ------------------------------------------------------------ timing
    def time_gpu(self, submit: Callable[[], object], stream, reps: int, warm: int = 2,
                 stat: Callable = np.median) -> float:
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        seconds = []
        for rep in range(warm + reps):
            start.record(stream)
            token = submit()
            end.record(stream)
            end.synchronize()
            del token
            if rep >= warm:
                seconds.append(start.elapsed_time(end) / 1e3)
        return stat(seconds)

    def time_both(self, submit_store: Callable[[object], object],
                  submit_load: Callable[[object], object], reps: int, warm: int = 2,
                  stat: Callable = np.median) -> float:
        torch = self.torch
        s1, s2 = self.streams[0], self.streams[1]
        start = torch.cuda.Event(enable_timing=True)
        e1, e2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        seconds = []
        for rep in range(warm + reps):
            start.record(s1)
            s2.wait_event(start)
            t1 = submit_store(s1)
            t2 = submit_load(s2)
            e1.record(s1)
            e2.record(s2)
            e1.synchronize()
            e2.synchronize()
            del t1, t2
            if rep >= warm:
                seconds.append(max(start.elapsed_time(e1), start.elapsed_time(e2)) / 1e3)
        return stat(seconds)

    def ceiling(self, reps: int) -> dict[str, float]:
        """Best of ``2 * reps`` (the ceiling is what the link can do; backends get medians)."""
        reps = 2 * reps
        n = self.transfer_bytes
        h, h2 = self.host[:n], self.host[n:2 * n]
        d, d2 = self.gpu[:n], self.gpu[n:2 * n]
        s1 = self.streams[0]
        torch = self.torch

        def on(stream, fn):
            with torch.cuda.stream(stream):
                fn()

        h2d = n / self.time_gpu(lambda: on(s1, lambda: d.copy_(h, non_blocking=True)), s1, reps,
                                stat=min)
        d2h = n / self.time_gpu(lambda: on(s1, lambda: h.copy_(d, non_blocking=True)), s1, reps,
                                stat=min)
        both = 2 * n / self.time_both(
            lambda s: on(s, lambda: h2.copy_(d2, non_blocking=True)),
            lambda s: on(s, lambda: d.copy_(h, non_blocking=True)), reps, stat=min)
        self.ceiling_gbps = {"gpu_to_cpu": d2h / 1e9, "cpu_to_gpu": h2d / 1e9, "both": both / 1e9}
        return self.ceiling_gbps


def _make_backend(name: str, direction: Direction, rig: GpuRig, w: Workload, host_stride: int):
    from tiercache.backends.ce import CeBackend
    from tiercache.backends.kernel import KernelBackend
    from tiercache.backends.staged import StagedBackend

    device = rig.device.index
    if name == "ce":
        return CeBackend(device)
    if name == "ce-stream":
        from tiercache.backends.driver import SrcAccessOrder

        return CeBackend(device, load_access_order=SrcAccessOrder.STREAM)
    if name == "kernel":
        return KernelBackend(device)
    if name == "staged":
        return StagedBackend(device)
    if name.startswith("staged-"):  # staged-CHUNKMIB-SLOTS, e.g. staged-32-2
        _, chunk_mib, slots = name.split("-")
        return StagedBackend(device, chunk_bytes=int(chunk_mib) * MIB, num_slots=int(slots))
    if name == "auto":
        return _auto_backend(direction, rig, w, host_stride)
    raise SystemExit(f"unknown backend {name!r}; choose from {GPU_BACKENDS + ('cpu',)}")


def _auto_backend(direction: Direction, rig: GpuRig, w: Workload, host_stride: int):
    from tiercache.backends import BackendContext
    from tiercache.backends.auto import create
    from tiercache.pages import PageArray
    from tiercache.backends.streams import CudaStreams

    layout = RegionLayout(1, 4 * w.blocks_per_transfer, (w.page_bytes,) * w.num_tensors)
    gpu_pages = tuple(PageArray(rig.gpu.data_ptr() + t * 2 * w.blocks_per_transfer * w.page_bytes,
                                2 * w.blocks_per_transfer, w.page_bytes, w.page_bytes)
                      for t in range(w.num_tensors))
    cpu_pages = tuple(PageArray(rig.host.data_ptr() + layout.page_offsets[t], layout.num_blocks,
                                layout.row_stride, w.page_bytes) for t in range(w.num_tensors))
    context = BackendContext(direction, gpu_pages, cpu_pages, rig.device, True,
                             CudaStreams(rig.device))
    return create(context)


def _bench_workload(rig: GpuRig, w: Workload, backends: list[str], reps: int, report: Report,
                    progress: Progress) -> None:
    plans = rig.plans(w)
    store_plan, load_plan = plans.store, plans.load
    ceil = report.ceiling
    layout = RegionLayout(1, 4 * w.blocks_per_transfer, (w.page_bytes,) * w.num_tensors)
    for name in backends:
        store_b = _make_backend(name, Direction.GPU_TO_CPU, rig, w, layout.row_stride)
        load_b = _make_backend(name, Direction.CPU_TO_GPU, rig, w, layout.row_stride)
        s = rig.streams[0]
        row = {"workload": w.label(), "page_bytes": w.page_bytes, "backend": name,
               "store_name": getattr(store_b, "name", name), "load_name": getattr(load_b, "name", name)}
        for key, backend, plan in (("gpu_to_cpu", store_b, store_plan), ("cpu_to_gpu", load_b, load_plan)):
            seconds = rig.time_gpu(lambda: backend.copy_async(plan, s), s, reps)
            row[key] = plan.num_bytes / seconds / 1e9
            progress.step(f"{w.label()} {name} {key}", _fmt_rate(row[key], ceil[key]))
        both = sorted(rig.time_both(lambda st: store_b.copy_async(store_plan, st),
                                    lambda st: load_b.copy_async(load_plan, st), reps, stat=list))
        both_bytes = store_plan.num_bytes + load_plan.num_bytes
        row["both"] = both_bytes / float(np.median(both)) / 1e9
        row["both_min"], row["both_max"] = both_bytes / both[-1] / 1e9, both_bytes / both[0] / 1e9
        progress.step(f"{w.label()} {name} both", _fmt_rate(row["both"], ceil["both"])
                      + f" [{row['both_min']:.1f}..{row['both_max']:.1f}]")
        if w.page_bytes == 32 * KIB and w.num_tensors == DEFAULT_TENSORS:
            row.update(_latency_and_submit(rig, plans, store_b, load_b, reps))
            progress.step(f"{w.label()} {name} latency/submit",
                          f"1 block {row['latency_us']:.0f} us (target {row['latency_target_us']:.0f}), "
                          f"submit {row['submit_us']:.0f} us")
        report.add(**row)
        store_b.close()
        load_b.close()


def _latency_and_submit(rig: GpuRig, plans: RigPlans, store_b, load_b, reps: int) -> dict:
    s = rig.streams[0]
    one = plans.planner.plan(plans.one_store_spec)  # one block: one page per tensor
    one_load = plans.planner.plan(plans.one_load_spec)
    lat = rig.time_gpu(lambda: store_b.copy_async(one, s), s, max(reps, 20), warm=5)
    lat_load = rig.time_gpu(lambda: load_b.copy_async(one_load, s), s, max(reps, 20), warm=5)
    wire_s = one.num_bytes / (min(rig.ceiling_gbps.values()) * 1e9)
    submit, planning = [], []
    buffers = PlanBuffers()
    for _ in range(max(reps, 10)):
        s.synchronize()
        t0 = time.perf_counter()
        plan = plans.planner.plan(plans.store_spec, out=buffers)
        t1 = time.perf_counter()
        token = store_b.copy_async(plan, s)
        submit.append(time.perf_counter() - t1)
        planning.append(t1 - t0)
        s.synchronize()
        del token
    return {"latency_us": lat * 1e6, "latency_load_us": lat_load * 1e6,
            "latency_target_us": (1.5 * wire_s + 20e-6) * 1e6,
            "submit_us": float(np.median(submit)) * 1e6,
            "plan_us": float(np.median(planning)) * 1e6}



def _matmul(rig: GpuRig, store_b, load_b, store_plan: CopyPlan, load_plan: CopyPlan,
            iters: int) -> dict:
    """bf16 matmul TFLOP/s alone and beside continuous both-ways copies."""
    torch = rig.torch
    a = torch.randn(MATMUL_N, MATMUL_N, device=rig.device, dtype=torch.bfloat16)
    b = torch.randn(MATMUL_N, MATMUL_N, device=rig.device, dtype=torch.bfloat16)
    out = torch.empty_like(a)
    flop = 2 * MATMUL_N ** 3
    mm_stream = rig.streams[2]
    s1, s2 = rig.streams[0], rig.streams[1]

    def run_matmul(n: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(mm_stream):
            start.record()
            for _ in range(n):
                torch.matmul(a, b, out=out)
            end.record()
        return start, end

    st, en = run_matmul(10)  # warm up
    en.synchronize()

    def solo() -> float:
        st, en = run_matmul(iters)
        en.synchronize()
        return st.elapsed_time(en) / 1e3

    solo_runs = [solo() for _ in range(3)]
    round_s = 2 * store_plan.num_bytes / (rig.ceiling_gbps["both"] * 1e9)
    rounds = int(np.ceil(max(solo_runs) * 1.3 / round_s)) + 2
    torch.cuda.synchronize()
    # a gate: copies and matmul queue behind one sleep, so they start together however
    # long the host takes to submit the copies
    gate = torch.cuda.Event()
    with torch.cuda.stream(mm_stream):
        torch.cuda._sleep(GATE_CYCLES)
        gate.record()
    tokens = []
    c_start = torch.cuda.Event(enable_timing=True)
    s1.wait_event(gate)
    c_start.record(s1)
    s2.wait_event(c_start)
    t0 = time.perf_counter()
    for _ in range(rounds):
        tokens.append(store_b.copy_async(store_plan, s1))
        tokens.append(load_b.copy_async(load_plan, s2))
    submitted_before_gate = not gate.query()
    submit_s = time.perf_counter() - t0
    st, en = run_matmul(iters)
    c1, c2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    c1.record(s1)
    c2.record(s2)
    torch.cuda.synchronize()
    beside_s = st.elapsed_time(en) / 1e3
    solo_runs.append(solo())  # after: the card's clocks as they are now
    solo_s = float(np.median(solo_runs))
    copy_s = max(c_start.elapsed_time(c1), c_start.elapsed_time(c2)) / 1e3
    copies_cover = copy_s >= beside_s
    tokens.clear()
    return {"matmul_solo_tflops": flop * iters / solo_s / 1e12,
            "matmul_beside_tflops": flop * iters / beside_s / 1e12,
            "matmul_ratio": solo_s / beside_s,
            "matmul_solo_spread": (max(solo_runs) - min(solo_runs)) / solo_s,
            "copy_both_gbps_beside": 2 * rounds * store_plan.num_bytes / copy_s / 1e9,
            "copies_covered_matmul": copies_cover and submitted_before_gate,
            "copy_submit_s": submit_s}


def _run_gpu(args) -> Report:
    import torch

    rig = GpuRig(args.device, TRANSFER_BYTES)
    props = torch.cuda.get_device_properties(rig.device)
    from tiercache.backends.driver import CudaDriver

    drv = CudaDriver()
    report = Report(machine=f"{props.name}, {props.multi_processor_count} SMs, driver CUDA "
                            f"{drv.driver_version}, torch {torch.__version__}, "
                            f"batch ABI {drv.batch_abi}")
    pages = [int(p * KIB) for p in args.page_kib]
    backends = args.backend
    workloads = [Workload.for_page(p, max_tensors=args.tensors) for p in pages]
    n_steps = 1 + len(workloads) * len(backends) * 3 + len(backends) \
        + (len(args.matmul_backends) if args.matmul else 0)
    progress = Progress(n_steps)
    report.ceiling = rig.ceiling(args.reps)
    progress.step("ceiling (one 512 MiB pinned copy)",
                  " ".join(f"{k} {v:.1f}" for k, v in report.ceiling.items()) + " GB/s")
    for w in workloads:
        _bench_workload(rig, w, backends, args.reps, report, progress)
    if args.matmul:
        w = Workload.for_page(32 * KIB, max_tensors=args.tensors)
        plans = rig.plans(w, seed=1)
        sp, lp = plans.store, plans.load
        layout = RegionLayout(1, 4 * w.blocks_per_transfer, (w.page_bytes,) * w.num_tensors)
        for name in args.matmul_backends:
            sb = _make_backend(name, Direction.GPU_TO_CPU, rig, w, layout.row_stride)
            lb = _make_backend(name, Direction.CPU_TO_GPU, rig, w, layout.row_stride)
            m = _matmul(rig, sb, lb, sp, lp, args.matmul_iters)
            progress.step(f"matmul beside {name} both-ways",
                          f"{m['matmul_beside_tflops']:.0f}/{m['matmul_solo_tflops']:.0f} TFLOP/s "
                          f"({m['matmul_ratio']:.3f}), copies {m['copy_both_gbps_beside']:.1f} GB/s")
            report.add(workload=w.label(), backend=name, mode="matmul", **m)
            sb.close()
            lb.close()
    return report


# ====================================================================== CPU
def _run_cpu(args) -> Report:
    """The cpu backend on host buffers, against one large memmove."""
    import ctypes

    from tiercache.backends.cpu import CpuCopyBackend
    from tiercache.backends.host_streams import HostStreams

    transfer = args.cpu_transfer_mib * MIB
    report = Report(machine="host only (cpu backend)")
    platform = HostStreams("cpu")
    backend = CpuCopyBackend()
    src = np.random.default_rng(0).integers(0, 256, 2 * transfer, dtype=np.uint8)
    dst = np.ones(4 * transfer, dtype=np.uint8)  # touched: no first-touch faults in timings
    ctypes.memmove(dst.ctypes.data, src.ctypes.data, transfer)
    t0 = time.perf_counter()
    for _ in range(args.reps):
        ctypes.memmove(dst.ctypes.data, src.ctypes.data, transfer)
    ceiling = transfer * args.reps / (time.perf_counter() - t0) / 1e9
    report.ceiling = {"gpu_to_cpu": ceiling, "cpu_to_gpu": ceiling, "both": ceiling}
    pages = [int(p * KIB) for p in args.page_kib]
    progress = Progress(1 + len(pages))
    progress.step("ceiling (one memmove)", f"{ceiling:.1f} GB/s")
    stream = platform.new_stream()
    for p in pages:
        w = Workload.for_page(p, transfer_bytes=transfer, max_tensors=args.tensors)
        rng = np.random.default_rng(p)
        layout = RegionLayout(1, 4 * w.blocks_per_transfer, (w.page_bytes,) * w.num_tensors)
        gpu_base = np.uint64(src.ctypes.data) + np.arange(w.num_tensors, dtype=np.uint64) \
            * np.uint64(2 * w.blocks_per_transfer * p)
        g, h, sizes = _plan_arrays(gpu_base, p, dst.ctypes.data, layout,
                                   rng.permutation(2 * w.blocks_per_transfer)[:w.blocks_per_transfer],
                                   rng.permutation(4 * w.blocks_per_transfer)[:w.blocks_per_transfer], p)
        plan = CopyPlan(g, h, sizes, Direction.GPU_TO_CPU)
        event = platform.new_timing_event()
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            backend.copy_async(plan, stream)
            event.record(stream)
            event.synchronize()
            times.append(time.perf_counter() - t0)
        rate = plan.num_bytes / float(np.median(times)) / 1e9
        report.add(workload=w.label(), page_bytes=p, backend="cpu", gpu_to_cpu=rate)
        progress.step(f"{w.label()} cpu copy", _fmt_rate(rate, ceiling))
    platform.close()
    return report


# ====================================================================== output
def format_report(report: Report) -> str:
    c = report.ceiling
    lines = [f"machine: {report.machine}",
             "ceiling: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in c.items()), "",
             f"{'workload':24s} {'backend':14s} {'gpu_to_cpu':>20s} {'cpu_to_gpu':>20s} {'both':>20s}"]
    for r in report.rows:
        if r.get("mode") == "matmul":
            continue
        cells = [(_fmt_rate(r[k], c[k]) if k in r else "-") for k in ("gpu_to_cpu", "cpu_to_gpu", "both")]
        name = r["backend"]
        if name == "auto":
            name = f"auto={r['store_name']}/{r['load_name']}"
        lines.append(f"{r['workload']:24s} {name:14s} {cells[0]:>20s} {cells[1]:>20s} {cells[2]:>20s}")
    lat = [r for r in report.rows if "latency_us" in r]
    if lat:
        lines += ["", f"{'backend':14s} {'1-block store us':>17s} {'load us':>8s} {'target us':>10s} "
                      f"{'submit 16k us':>14s} {'plan 16k us':>12s}"]
        for r in lat:
            lines.append(f"{r['backend']:14s} {r['latency_us']:17.0f} {r['latency_load_us']:8.0f} "
                         f"{r['latency_target_us']:10.0f} {r['submit_us']:14.0f} "
                         f"{r['plan_us']:12.0f}")
    mm = [r for r in report.rows if r.get("mode") == "matmul"]
    if mm:
        lines += ["", f"{'matmul beside':14s} {'solo TFLOP/s':>12s} {'beside':>8s} {'ratio':>6s} "
                      f"{'copies GB/s':>12s}"]
        for r in mm:
            lines.append(f"{r['backend']:14s} {r['matmul_solo_tflops']:12.0f} "
                         f"{r['matmul_beside_tflops']:8.0f} {r['matmul_ratio']:6.3f} "
                         f"{r['copy_both_gbps_beside']:8.1f} ({r['copy_both_gbps_beside'] / c['both']:.2f})"
                         + ("" if r["copies_covered_matmul"] else " [copies ended first]"))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tiercache bench", description=__doc__.split("\n")[0])
    p.add_argument("--backend", nargs="+", default=None,
                   help=f"backends to measure: {', '.join(GPU_BACKENDS)} or cpu "
                        "(default: all GPU backends, or cpu without CUDA)")
    p.add_argument("--page-kib", nargs="+", type=float, default=[16, 32, 64, 2048])
    p.add_argument("--tensors", type=int, default=DEFAULT_TENSORS)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--matmul", action="store_true", help="matmul beside both-ways copies")
    p.add_argument("--matmul-backends", nargs="+", default=["auto", "ce", "staged", "kernel"])
    p.add_argument("--matmul-iters", type=int, default=40)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--cpu-transfer-mib", type=int, default=64)
    p.add_argument("--json", help="write every figure to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.backend is None:
        try:
            import torch

            cuda = torch.cuda.is_available()
        except ImportError:
            cuda = False
        args.backend = list(GPU_BACKENDS) if cuda else ["cpu"]
    if args.backend == ["cpu"]:
        report = _run_cpu(args)
    elif "cpu" in args.backend:
        raise SystemExit("--backend cpu runs alone (it measures host memory only)")
    else:
        report = _run_gpu(args)
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": report.machine, "ceiling": report.ceiling, "rows": report.rows},
                      fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

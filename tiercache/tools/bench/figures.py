"""The GPU figures: rates per workload and backend, one-block latency and submit time, and
a matmul's speed beside continuous copies."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from tiercache.backends.base import CopyBackend, Plan
from tiercache.planning.planner import PlanBuffers
from tiercache.planning.plans import PlanForm
from tiercache.specs import Direction
from tiercache.tools.bench.engine import engine_pattern, run_step
from tiercache.tools.bench.report import Progress, Report, fmt_rate
from tiercache.tools.bench.rig import BenchBackend, GpuRig, RigPlans, submit_now
from tiercache.tools.bench.workloads import KIB, TRANSFER_BYTES, Workload

G2C, C2G = Direction.GPU_TO_CPU, Direction.CPU_TO_GPU
MATMUL_N = 8192
MATMUL_WARMUP = 10
MATMUL_PAIRS = 5  # rounds of solo, beside copies, solo (the median round is reported)
COPY_COVER = 1.3  # copies are sized to outlast the matmul by this factor
GATE_CYCLES = 1_000_000_000  # ~0.5 s of GPU clock: time to submit every copy round
LATENCY_REPS, LATENCY_WARM, SUBMIT_REPS = 20, 5, 10


def bench_workload(rig: GpuRig, w: Workload, backends: list[BenchBackend], reps: int,
                   report: Report, progress: Progress, pattern_steps: int = 0) -> None:
    """Store, load and both-ways rates of each backend on ``w`` (plus latency and submit
    time on the default workload)."""
    plans = rig.plans(w)
    ceil, s = report.ceiling, rig.streams[0]
    for backend in backends:
        built = rig.backends(backend, w, plans.planner)
        store, load = plans.for_backend(built)
        row: dict[str, Any] = {
            "workload": w.label(), "page_bytes": w.page_bytes, "backend": backend.label,
            "kind": backend.kind.label, "store_name": built[G2C].kind.label,
            "load_name": built[C2G].kind.label,
            "block_level": [built[d].plan_form is PlanForm.BLOCKS for d in (G2C, C2G)]}
        for direction, plan in ((G2C, store), (C2G, load)):
            seconds = rig.time_gpu(partial(submit_now, built[direction], plan, s), s, reps)
            row[direction.label] = plan.num_bytes / seconds / 1e9
            progress.step(f"{w.label()} {backend.label} {direction.label}",
                          fmt_rate(row[direction.label], ceil[direction.label]))
        both = sorted(rig.time_both(partial(submit_now, built[G2C], store),
                                    partial(submit_now, built[C2G], load), reps, stat=list))
        both_bytes = store.num_bytes + load.num_bytes
        row["both"] = both_bytes / float(np.median(both)) / 1e9
        row["both_min"], row["both_max"] = both_bytes / both[-1] / 1e9, both_bytes / both[0] / 1e9
        progress.step(f"{w.label()} {backend.label} both", fmt_rate(row["both"], ceil["both"])
                      + f" [{row['both_min']:.1f}..{row['both_max']:.1f}]")
        if w.is_default:
            row.update(latency_and_submit(rig, plans, built[G2C], built[C2G], reps))
            progress.step(f"{w.label()} {backend.label} latency/submit",
                          f"1 block {row['latency_us']:.0f} us (target "
                          f"{row['latency_target_us']:.0f}), submit {row['submit_us']:.0f} us")
        row.update(engine_view(rig, plans, built, reps))
        progress.step(f"{w.label()} {backend.label} engine view",
                      f"store {row['engine_gpu_to_cpu']:.1f} load {row['engine_cpu_to_gpu']:.1f} "
                      f"both {row['engine_both']:.1f} GB/s, transfer_async "
                      f"{row['engine_submit_us']:.0f}/{row['engine_submit_load_us']:.0f} us, "
                      f"1 block load {row['engine_one_block_us']:.0f} us")
        if pattern_steps:  # the engine view's handlers closed the backends: fresh ones
            fresh = rig.backends(backend, w, plans.planner)
            row.update(engine_pattern(rig, plans, fresh, pattern_steps, ceil))
            for made in fresh.values():
                made.close()
            progress.step(f"{w.label()} {backend.label} engine pattern",
                          f"both {row['pattern_store_first_ratio']:.2f}/"
                          f"{row['pattern_load_first_ratio']:.2f} (torch "
                          f"{row['pattern_control_ratio']:.2f}), calls p50/p99 "
                          f"{row['pattern_store_call_p50_us']:.0f}/"
                          f"{row['pattern_store_call_p99_us']:.0f} us, 1 block "
                          f"{row['pattern_one_block_p50_us']:.0f}/"
                          f"{row['pattern_one_block_p99_us']:.0f} us")
        report.add(**row)
        for made in built.values():
            made.close()


def engine_view(rig: GpuRig, plans: RigPlans, built: dict[Direction, CopyBackend],
                reps: int) -> dict[str, float]:
    """What an engine sees, through the real handlers (as ``attach`` builds them): wall
    clock from the ``transfer_async`` call to the job's result in ``get_finished`` (planning
    included; scattered slots and blocks), each way, both at once and one block; and the
    host time of the ``transfer_async`` call alone."""
    from tiercache.device.streams import CudaStreams
    from tiercache.transfer.wiring import build_handlers

    handlers = build_handlers(plans.planner, built, CudaStreams(rig.device))
    jobs = iter(range(1, 1 << 30))

    def run(specs) -> tuple[float, list[float]]:
        """Submit ``specs`` back to back; (wall seconds until all reported, call seconds)."""
        rig.torch.cuda.synchronize()
        wall, calls, _ = run_step(handlers, jobs, specs, spin=True)
        return wall, calls

    def median(specs, pick) -> float:
        run(specs)  # warm-up
        return float(np.median([pick(*run(specs)) for _ in range(max(reps, SUBMIT_REPS))]))

    store_bytes = plans.store.num_bytes
    load_bytes = plans.load.num_bytes
    out = {
        "engine_gpu_to_cpu": store_bytes / median([plans.store_spec], lambda w, c: w) / 1e9,
        "engine_cpu_to_gpu": load_bytes / median([plans.load_spec], lambda w, c: w) / 1e9,
        "engine_both": (store_bytes + load_bytes)
        / median([plans.store_spec, plans.load_spec], lambda w, c: w) / 1e9,
        "engine_submit_us": median([plans.store_spec], lambda w, c: c[0]) * 1e6,
        "engine_submit_load_us": median([plans.load_spec], lambda w, c: c[0]) * 1e6,
        "engine_submit_one_us": median([plans.one_load_spec], lambda w, c: c[0]) * 1e6,
        "engine_one_block_us": median([plans.one_load_spec], lambda w, c: w) * 1e6,
    }
    handlers.shutdown()
    return out


def latency_and_submit(rig: GpuRig, plans: RigPlans, store_b: CopyBackend, load_b: CopyBackend,
                       reps: int) -> dict[str, float]:
    """One block each way, GPU-timed; the host time of planning and submitting a store."""
    s = rig.streams[0]
    one = plans.make(store_b, G2C, plans.one_store_spec)  # one block: one page per tensor
    one_load = plans.make(load_b, C2G, plans.one_load_spec)
    timed = partial(rig.time_gpu, stream=s, reps=max(reps, LATENCY_REPS), warm=LATENCY_WARM)
    lat = timed(partial(submit_now, store_b, one, s))
    lat_load = timed(partial(submit_now, load_b, one_load, s))
    wire_s = one.num_bytes / (min(rig.ceiling_gbps.values()) * 1e9)
    submit, planning = [], []
    buffers = PlanBuffers()
    for _ in range(max(reps, SUBMIT_REPS)):
        s.synchronize()
        t0 = time.perf_counter()
        plan = plans.planner.plan_as(store_b.plan_form, G2C, plans.store_spec, buffers)
        t1 = time.perf_counter()
        token = submit_now(store_b, plan, s)
        submit.append(time.perf_counter() - t1)
        planning.append(t1 - t0)
        s.synchronize()
        del token
    return {"latency_us": lat * 1e6, "latency_load_us": lat_load * 1e6,
            "latency_target_us": (1.5 * wire_s + 20e-6) * 1e6,
            "submit_us": float(np.median(submit)) * 1e6,
            "plan_us": float(np.median(planning)) * 1e6}


class _Matmul:
    """A bf16 ``MATMUL_N``² matmul on the rig's third stream, timed by events."""

    def __init__(self, rig: GpuRig):
        torch = self.torch = rig.torch
        self.a, self.b = (torch.randn(MATMUL_N, MATMUL_N, device=rig.device,
                                      dtype=torch.bfloat16) for _ in range(2))
        self.out = torch.empty_like(self.a)
        self.stream = rig.streams[2]
        self.flop = 2 * MATMUL_N ** 3

    def enqueue(self, iters: int):
        """``iters`` matmuls after what the stream holds; returns (start, end) events."""
        torch = self.torch
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        with torch.cuda.stream(self.stream):
            start.record()
            for _ in range(iters):
                torch.matmul(self.a, self.b, out=self.out)
            end.record()
        return start, end

    def solo_s(self, iters: int) -> float:
        start, end = self.enqueue(iters)
        end.synchronize()
        return start.elapsed_time(end) / 1e3


@dataclass
class _GatedCopies:
    """Copy rounds queued behind a gate (one long sleep on the matmul stream), so copies
    and matmul start together however long the host takes to submit the copies."""

    start: Any  # event: the copies' start
    tokens: list
    submit_s: float
    submitted_before_gate: bool

    @classmethod
    def enqueue(cls, rig: GpuRig, gate_stream, store_b: CopyBackend, load_b: CopyBackend,
                store_plan: Plan, load_plan: Plan, rounds: int) -> _GatedCopies:
        torch = rig.torch
        s1, s2 = rig.streams[0], rig.streams[1]
        gate = torch.cuda.Event()
        with torch.cuda.stream(gate_stream):
            torch.cuda._sleep(GATE_CYCLES)
            gate.record()
        start = torch.cuda.Event(enable_timing=True)
        s1.wait_event(gate)
        start.record(s1)
        s2.wait_event(start)
        t0 = time.perf_counter()
        tokens = []
        for _ in range(rounds):
            tokens.append(submit_now(store_b, store_plan, s1))
            tokens.append(submit_now(load_b, load_plan, s2))
        return cls(start, tokens, time.perf_counter() - t0, not gate.query())


def matmul_beside_copies(rig: GpuRig, store_b: CopyBackend, load_b: CopyBackend,
                         store_plan: Plan, load_plan: Plan, iters: int) -> dict:
    """bf16 matmul TFLOP/s alone and beside continuous both-ways copies, in
    ``MATMUL_PAIRS`` rounds of solo, beside, solo: each round's ratio is against the mean
    of the two solo runs around it (the card's clocks drift by up to ~10 % within one
    call, more than the effect measured); the figures are the median round's, with the
    lowest round's ratio beside."""
    mm = _Matmul(rig)
    mm.solo_s(MATMUL_WARMUP)
    rounds = [_matmul_round(rig, mm, store_b, load_b, store_plan, load_plan, iters)
              for _ in range(MATMUL_PAIRS)]
    ratios = [r["matmul_ratio"] for r in rounds]
    median = rounds[int(np.argsort(ratios)[len(ratios) // 2])]
    return {**median, "matmul_min_ratio": min(ratios), "matmul_ratios": ratios}


def _matmul_round(rig: GpuRig, mm: _Matmul, store_b: CopyBackend, load_b: CopyBackend,
                  store_plan: Plan, load_plan: Plan, iters: int) -> dict:
    torch = rig.torch
    before = mm.solo_s(iters)
    round_s = 2 * store_plan.num_bytes / (rig.ceiling_gbps["both"] * 1e9)
    rounds = int(np.ceil(before * COPY_COVER / round_s)) + 2
    torch.cuda.synchronize()
    copies = _GatedCopies.enqueue(rig, mm.stream, store_b, load_b, store_plan, load_plan, rounds)
    mm_start, mm_end = mm.enqueue(iters)
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    for end, stream in zip(ends, rig.streams[:2]):
        end.record(stream)
    torch.cuda.synchronize()
    beside_s = mm_start.elapsed_time(mm_end) / 1e3
    after = mm.solo_s(iters)
    solo_s = (before + after) / 2
    copy_s = max(copies.start.elapsed_time(end) for end in ends) / 1e3
    return {"matmul_solo_tflops": mm.flop * iters / solo_s / 1e12,
            "matmul_beside_tflops": mm.flop * iters / beside_s / 1e12,
            "matmul_ratio": solo_s / beside_s,
            "matmul_solo_spread": abs(before - after) / solo_s,
            "copy_both_gbps_beside": 2 * rounds * store_plan.num_bytes / copy_s / 1e9,
            "copies_covered_matmul": copy_s >= beside_s and copies.submitted_before_gate,
            "copy_submit_s": copies.submit_s}


def run_gpu(args) -> Report:
    import torch

    from tiercache.device.driver import CudaDriver

    rig = GpuRig(args.device, TRANSFER_BYTES)
    props = torch.cuda.get_device_properties(rig.device)
    drv = CudaDriver()
    report = Report(machine=f"{props.name}, {props.multi_processor_count} SMs, driver CUDA "
                            f"{drv.driver_version}, torch {torch.__version__}, "
                            f"batch ABI {drv.batch_abi}")
    workloads = [Workload.for_page(int(p * KIB), max_tensors=args.tensors) for p in args.page_kib]
    progress = Progress(1 + len(workloads) * len(args.backend) * (5 if args.pattern_steps else 4)
                        + len(args.backend)
                        + (len(args.matmul_backends) if args.matmul else 0))
    report.ceiling = rig.ceiling(args.reps)
    progress.step("ceiling (one 512 MiB pinned copy)",
                  " ".join(f"{k} {v:.1f}" for k, v in report.ceiling.items()) + " GB/s")
    for w in workloads:
        bench_workload(rig, w, args.backend, args.reps, report, progress, args.pattern_steps)
    if args.matmul:
        w = Workload.for_page(32 * KIB, max_tensors=args.tensors)
        plans = rig.plans(w, seed=1)
        for backend in args.matmul_backends:
            built = rig.backends(backend, w, plans.planner)
            m = matmul_beside_copies(rig, built[G2C], built[C2G], *plans.for_backend(built),
                                     args.matmul_iters)
            progress.step(f"matmul beside {backend.label} both-ways",
                          f"{m['matmul_beside_tflops']:.0f}/{m['matmul_solo_tflops']:.0f} "
                          f"TFLOP/s ({m['matmul_ratio']:.3f}), copies "
                          f"{m['copy_both_gbps_beside']:.1f} GB/s")
            report.add(workload=w.label(), backend=backend.label, kind=backend.kind.label,
                       mode="matmul", **m)
            for made in built.values():
                made.close()
    return report

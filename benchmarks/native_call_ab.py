"""The host time of ``transfer_async`` with one native call per transfer against the Python
plan + submit path, alternated step by step in one process (GPU machine; not a test).

Runs with another checkout can only be compared run against run, and this machine's
runs drift by 2x; here both paths meet the same machine, caches and busy thread. The
engine's pattern (``tiercache.tools.bench.engine``): per step the step's Python, then a
256-block store and a 256-block load back to back, polled until both are reported, with
another Python thread running in bursts; steps alternate between the handlers' native
path and a planned path over the same backends (the handler's path swapped). Then
one-block loads, alternated the same way (call to result, spin-polled). Last, the native
path with its parts timed per call (wrapping adds ~1 µs a span), the native call's own
steps from the clock it reads between them (``ChunkLoop.transfer_spans``).

Usage: ``python benchmarks/native_call_ab.py [--page-kib 16 32 64] [--steps 200] [--json F]``.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from engine_call_profile import PerCallSpans  # noqa: E402  (benchmarks/ is on sys.path when run)

from tiercache.device.streams import CudaStreams
from tiercache.specs import Direction
from tiercache.tools.bench.engine import STEP_PYTHON_S, BusyPython, python_for, run_step
from tiercache.tools.bench.rig import BenchBackend, GpuRig
from tiercache.tools.bench.workloads import KIB, TRANSFER_BYTES, Workload
from tiercache.transfer.planned_path import PlannedPath
from tiercache.transfer.wiring import build_handlers

G2C, C2G = Direction.GPU_TO_CPU, Direction.CPU_TO_GPU
WARM = 10
MODES = ("native", "python")
C_STEPS = ("c:validate", "c:fence", "c:mark", "c:queue")
SPANS = [
    ("tiercache.transfer.native_path", "NativePath", "transfer"),
    ("tiercache.native.chunk_loop", "ChunkLoop", "transfer"),
]


def pct(values, q) -> float:
    return float(np.percentile(np.asarray(values) / 1e3, q)) if values else float("nan")


def run(rig: GpuRig, kib: int, steps: int) -> dict:
    w = Workload.for_page(kib * KIB)
    plans = rig.plans(w)
    built = rig.backends(BenchBackend.parse("auto"), w, plans.planner)
    streams = CudaStreams(rig.device)
    handlers = build_handlers(plans.planner, built, streams)
    natives = {d: handlers.handler(d).path for d in Direction}
    assert all(p.native for p in natives.values()), \
        "auto did not choose a backend with a native path"
    planned = {d: PlannedPath(d, built[d], plans.planner, streams) for d in Direction}
    jobs = iter(range(1, 1 << 30))

    def use(mode: str) -> None:  # the paths share the backends: one FIFO per direction
        for d in Direction:
            handlers.handler(d)._path = natives[d] if mode == "native" else planned[d]

    def step(specs, spin=False) -> tuple[float, list[float]]:
        """The step's Python, then ``specs`` (wall seconds, each call's ns)."""
        python_for(STEP_PYTHON_S)
        wall, took, _ = run_step(handlers, jobs, specs, spin)
        return wall, [t * 1e9 for t in took]

    calls = {(m, d): [] for m in MODES for d in Direction}
    walls = {m: [] for m in MODES}
    one = {m: [] for m in MODES}
    one_calls = {m: [] for m in MODES}
    both = plans.store.num_bytes + plans.load.num_bytes
    with BusyPython():
        for i in range(2 * (WARM + steps)):
            mode = MODES[i % 2]
            use(mode)
            order = [G2C, C2G] if (i // 2) % 2 == 0 else [C2G, G2C]
            specs = [plans.store_spec if d is G2C else plans.load_spec for d in order]
            wall, took = step(specs)
            if i >= 2 * WARM:
                walls[mode].append(both / wall / 1e9)
                for d, t in zip(order, took):
                    calls[(mode, d)].append(t)
        for i in range(2 * (WARM + steps)):
            mode = MODES[i % 2]
            use(mode)
            wall, took = step([plans.one_load_spec], spin=True)
            if i >= 2 * WARM:
                one[mode].append(wall * 1e9)
                one_calls[mode] += took
        use("native")
        spans = PerCallSpans(SPANS)
        parts: list[dict[str, int]] = []
        try:
            for i in range(WARM + steps):
                python_for(STEP_PYTHON_S)
                for d, spec in ((G2C, plans.store_spec), (C2G, plans.load_spec)):
                    spans.current = {}
                    t0 = time.perf_counter_ns()
                    handlers.transfer_async(next(jobs), spec)
                    spans.current["call"] = time.perf_counter_ns() - t0
                    c_spans = natives[d]._call.__self__.transfer_spans()  # the C's steps
                    for k, name in enumerate(C_STEPS):
                        spans.current[name] = c_spans[k] - (c_spans[k - 1] if k else 0)
                    if i >= WARM:
                        parts.append(spans.current)
                    spans.current = None
                while handlers.gpu_to_cpu_handler.num_in_flight or \
                        handlers.cpu_to_gpu_handler.num_in_flight:
                    handlers.get_finished()
                    time.sleep(0)
        finally:
            spans.stop()
    handlers.shutdown()  # closes the backends
    out = {"workload": w.label()}
    for m in MODES:
        for d in Direction:
            out[f"{m}_{d.label}_call_p50_us"] = pct(calls[(m, d)], 50)
            out[f"{m}_{d.label}_call_p99_us"] = pct(calls[(m, d)], 99)
        out[f"{m}_both_gbps_p50"] = float(np.median(walls[m]))
        out[f"{m}_one_block_spin_p50_us"] = pct(one[m], 50)
        out[f"{m}_one_block_spin_p99_us"] = pct(one[m], 99)
        out[f"{m}_one_call_p50_us"] = pct(one_calls[m], 50)
        out[f"{m}_one_call_p99_us"] = pct(one_calls[m], 99)
    names = sorted({k for p in parts for k in p})
    out["native_parts_p50_us"] = {k: pct([p.get(k, 0) for p in parts], 50) for k in names}
    out["native_parts_p99_us"] = {k: pct([p.get(k, 0) for p in parts], 99) for k in names}
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--page-kib", nargs="+", type=int, default=[16, 32, 64])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--timing-marks", action="store_true",
                   help="compute marks with timing enabled (as before markers), for A/B")
    p.add_argument("--json")
    args = p.parse_args()
    if args.timing_marks:
        CudaStreams.new_marker = CudaStreams.new_timing_event
    rig = GpuRig(0, TRANSFER_BYTES)
    rows = []
    for kib in args.page_kib:
        r = run(rig, kib, args.steps)
        rows.append(r)
        for m in MODES:
            print(f"RESULT {r['workload']:22s} {m:6s} call us p50/p99 store "
                  f"{r[f'{m}_gpu_to_cpu_call_p50_us']:.0f}/{r[f'{m}_gpu_to_cpu_call_p99_us']:.0f} "
                  f"load {r[f'{m}_cpu_to_gpu_call_p50_us']:.0f}/"
                  f"{r[f'{m}_cpu_to_gpu_call_p99_us']:.0f} | both {r[f'{m}_both_gbps_p50']:.1f} "
                  f"GB/s | one block: call {r[f'{m}_one_call_p50_us']:.0f}/"
                  f"{r[f'{m}_one_call_p99_us']:.0f}, spin to result "
                  f"{r[f'{m}_one_block_spin_p50_us']:.0f}/{r[f'{m}_one_block_spin_p99_us']:.0f}",
                  flush=True)
        print("       native parts p50/p99 us: " + ", ".join(
            f"{k} {r['native_parts_p50_us'][k]:.0f}/{r['native_parts_p99_us'][k]:.0f}"
            for k in r["native_parts_p50_us"]), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()

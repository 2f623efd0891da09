"""Where the slow ``transfer_async`` calls of the engine's pattern spend their time (GPU
machine; not a test).

The bench's engine pattern (``tiercache.tools.bench.engine``): per step the step's Python,
then a 256-block store and a 256-block load submitted back to back (the second with the
first in flight), then ``get_finished`` polled until both are reported. Each call is cut
into spans by wrapping the functions it runs (``SPANS``, inclusive wall time, nested
spans counted in their parents too); what no span covers is the handler's own Python.
Reported: the call's p50/p90/p99/max, each span's mean over the median calls (the middle
20 %) and over the slowest 2 %, and the slowest calls one by one. Also per call: whether
the other Python thread ran during it, whether a garbage collection did, and what the
chunk loop's thread was doing (its last job's issue time).

Per call also the calling thread's own counters (``getrusage(RUSAGE_THREAD)``): minor page
faults, voluntary context switches (it blocked: a lock, a futex) and involuntary ones (it
was preempted), and steal time of the whole machine (``/proc/stat``) over each run.

Modes: ``busy`` (another Python thread runs in bursts, as the bench) and ``quiet``.
Usage: ``python benchmarks/call_tail_probe.py [--page-kib 32] [--steps 300] [--json F]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import time
from contextlib import nullcontext

import numpy as np

from engine_call_profile import PerCallSpans  # noqa: E402  (benchmarks/ is on sys.path when run)

from tiercache.device.streams import CudaStreams
from tiercache.specs import Direction
from tiercache.tools.bench.engine import STEP_PYTHON_S, BusyPython, python_for
from tiercache.tools.bench.rig import BenchBackend, GpuRig
from tiercache.tools.bench.workloads import KIB, TRANSFER_BYTES, Workload
from tiercache.transfer.wiring import build_handlers

G2C, C2G = Direction.GPU_TO_CPU, Direction.CPU_TO_GPU
WARM = 10
SPANS = [  # the native whole-transfer path (staged), then the plan + submit path's steps
    ("tiercache.transfer.native_path", "NativePath", "transfer"),
    ("tiercache.planning.planner", "TransferPlanner", "plan_as"),
    ("tiercache.transfer.planned_path", "PlannedPath", "transfer"),
    ("tiercache.device.streams", "CudaStreams", "mark_current"),
    ("tiercache.backends.auto", "AutoBackend", "submit"),
    ("tiercache.backends.staged.backend", "StagedBackend", "_queue"),
    ("tiercache.device.driver", "CudaDriver", "enter"),
    ("tiercache.device.driver", "CudaDriver", "event_record"),
    ("tiercache.device.driver", "CudaDriver", "event_done"),
    ("tiercache.backends.staged.block_kernel", "PairTables", "reserve"),
    ("tiercache.native.chunk_loop", "ChunkLoop", "submit"),
]


def run(rig: GpuRig, kib: int, steps: int, busy_mode: bool, rec: PerCallSpans) -> dict:
    w = Workload.for_page(kib * KIB)
    plans = rig.plans(w)
    built = rig.backends(BenchBackend.parse("auto"), w, plans.planner)
    handlers = build_handlers(plans.planner, built, CudaStreams(rig.device))
    loops = []
    for made in built.values():
        chosen = getattr(made, "chosen", made)
        loop = getattr(chosen, "chunk_loop", None)
        loops.append(loop)
    jobs = iter(range(1, 1 << 30))
    calls: list[dict] = []
    gcs = [0]

    def on_gc(phase, info):
        if phase == "start":
            gcs[0] += 1

    gc.callbacks.append(on_gc)
    steal0 = steal_ticks()
    busy = BusyPython() if busy_mode else nullcontext()
    with busy:
        for i in range(WARM + steps):
            order = [G2C, C2G] if i % 2 == 0 else [C2G, G2C]
            python_for(STEP_PYTHON_S)
            pending = set()
            for k, d in enumerate(order):
                job = next(jobs)
                rounds = busy.rounds if busy_mode else 0
                g0 = gcs[0]
                rec.current = {}
                u0 = resource.getrusage(resource.RUSAGE_THREAD)
                t0 = time.perf_counter_ns()
                handlers.transfer_async(job, plans.store_spec if d is G2C else plans.load_spec)
                total = time.perf_counter_ns() - t0
                u1 = resource.getrusage(resource.RUSAGE_THREAD)
                spans, rec.current = rec.current, None
                pending.add(job)
                if i >= WARM:
                    calls.append({"total": total, "second": k, "dir": d.label,
                                  "other_ran": (busy.rounds != rounds) if busy_mode else False,
                                  "gc": gcs[0] != g0, "minflt": u1.ru_minflt - u0.ru_minflt,
                                  "nvcsw": u1.ru_nvcsw - u0.ru_nvcsw,
                                  "nivcsw": u1.ru_nivcsw - u0.ru_nivcsw, **spans})
            while pending:
                for r in handlers.get_finished():
                    if not r.success:
                        raise AssertionError(f"job {r.job_id} failed")
                    pending.discard(r.job_id)
                time.sleep(0)
            if i >= WARM:  # the loop threads' last jobs: picked -> issued (us)
                issue = [round((s[2] - s[1]) / 1e3) for s in (lp.stamps() for lp in loops if lp)]
                calls[-1]["loop_issue_us"] = calls[-2]["loop_issue_us"] = issue
    gc.callbacks.remove(on_gc)
    steal = steal_ticks() - steal0
    handlers.shutdown()
    for made in built.values():
        made.close()
    return {"workload": w.label(), "busy": busy_mode, "calls": calls, "steal_ticks": steal}


def steal_ticks() -> int:
    """The machine's steal time so far (USER_HZ ticks, all CPUs; /proc/stat)."""
    with open("/proc/stat") as fh:
        fields = fh.readline().split()
    return int(fields[8]) if len(fields) > 8 else 0


def report(result: dict, names: list[str]) -> None:
    calls = result["calls"]
    totals = np.array([c["total"] for c in calls]) / 1e3
    order = np.argsort(totals)
    n = len(order)
    mid = [calls[j] for j in order[int(n * 0.4):int(n * 0.6)]]
    slow = [calls[j] for j in order[int(n * 0.98):]]
    label = f"{result['workload']} {'busy' if result['busy'] else 'quiet'}"
    p = np.percentile(totals, [50, 90, 99])
    print(f"RESULT {label}: call us p50 {p[0]:.0f} p90 {p[1]:.0f} p99 {p[2]:.0f} max "
          f"{totals.max():.0f}; other thread ran in {np.mean([c['other_ran'] for c in calls]):.2f}"
          f" of calls, gc in {sum(c['gc'] for c in calls)}; second call p50 "
          f"{np.median([c['total'] for c in calls if c['second']]) / 1e3:.0f} first "
          f"{np.median([c['total'] for c in calls if not c['second']]) / 1e3:.0f}", flush=True)
    print(f"  steal over the run {result['steal_ticks']} ticks", flush=True)
    for group, rows in (("middle 20%", mid), ("slowest 2%", slow)):
        print(f"  {group:11s} per call: minor faults {np.mean([c['minflt'] for c in rows]):.1f}, "
              f"blocked {np.mean([c['nvcsw'] for c in rows]):.2f}, preempted "
              f"{np.mean([c['nivcsw'] for c in rows]):.2f}", flush=True)
        means = {k: np.mean([c.get(k, 0) for c in rows]) / 1e3 for k in ["total"] + names}
        print(f"  {group:11s} " + "  ".join(f"{k.split('.')[-1]} {v:.0f}"
                                            for k, v in means.items()), flush=True)
    for j in order[-6:]:
        c = calls[j]
        print(f"  slow call {c['total'] / 1e3:7.0f} us {c['dir']} second={c['second']} "
              f"other_ran={c['other_ran']} gc={c['gc']} faults={c['minflt']} "
              f"blocked={c['nvcsw']} preempted={c['nivcsw']} loop issue us "
              f"{c.get('loop_issue_us')} | "
              + " ".join(f"{k.split('.')[-1]}={c[k] / 1e3:.0f}" for k in names if k in c),
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--page-kib", nargs="+", type=int, default=[32])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--json")
    args = p.parse_args()
    rig = GpuRig(0, TRANSFER_BYTES)
    rec = PerCallSpans(SPANS)
    out = []
    for kib in args.page_kib:
        for busy_mode in (True, False, True):
            result = run(rig, kib, args.steps, busy_mode, rec)
            report(result, rec.names)
            out.append(result)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh)


if __name__ == "__main__":
    main()

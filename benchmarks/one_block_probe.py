"""Where a one-block load's time goes, call to result, in the engine's pattern (GPU machine;
not a test).

Per step, as ``tiercache.tools.bench.engine``: the step's own Python, then one block loaded
through the real handlers (``auto``), then ``get_finished`` polled with the GIL let go
between polls; another Python thread busy in bursts throughout. Each step is cut by the
clock (``time.monotonic_ns``, the clock the chunk loop stamps with) into:

* ``before``: from the call to the job reaching ``tc_submit`` (planning, fence, events);
* ``wake``: from ``tc_submit`` to the job being picked up (0 when the caller issues it);
* ``issue``: the job's driver calls;
* ``after``: from issued to the caller seeing the result; ``gpu`` (stream-timed start to
  end, the result's ``transfer_time``) is part of it, the rest is detection;
* ``total``.

Modes: ``loop`` (every job to the loop's thread) and ``inline`` (a small job on an idle loop
issued by the caller); each polled letting go of the GIL between polls (as the bench), or
``_spin`` (keeping it: the other thread cannot take it between polls, so the result is
seen when it is there), or ``_quiet`` (no other Python thread). Controls, same step shape:
one plain torch copy of the block's bytes (the floor of "call, copy, see it"; its GPU time
beside), and a Python no-op of the call's length (the host's own noise at p99).

Usage: ``python benchmarks/one_block_probe.py [--page-kib 16 32] [--steps 300] [--json F]``.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from tiercache.backends.auto import AutoBackend
from tiercache.backends.staged.backend import StagedBackend
from tiercache.device.streams import CudaStreams
from tiercache.specs import Direction
from tiercache.tools.bench.engine import STEP_PYTHON_S, BusyPython, python_for, python_work
from tiercache.tools.bench.rig import BenchBackend, GpuRig, probe_rig
from tiercache.tools.bench.workloads import KIB, Workload
from tiercache.transfer.wiring import build_handlers

WARM = 10


def pct(values, q):
    return float(np.percentile(np.asarray(values, dtype=float), q)) / 1e3  # ns -> us


def summary(parts: dict[str, list[int]]) -> dict[str, float]:
    out = {}
    for name, values in parts.items():
        out[f"{name}_p50_us"], out[f"{name}_p99_us"] = pct(values, 50), pct(values, 99)
    return out


def probe(rig: GpuRig, kib: int, steps: int) -> dict:
    w = Workload.for_page(kib * KIB)
    plans = rig.plans(w)
    built = rig.backends(BenchBackend.parse("auto"), w, plans.planner)
    load = built[Direction.CPU_TO_GPU]
    chosen = load.chosen if isinstance(load, AutoBackend) else load
    loop = chosen.chunk_loop if isinstance(chosen, StagedBackend) else None
    handlers = build_handlers(plans.planner, built, CudaStreams(rig.device))
    jobs = iter(range(1, 1 << 30))
    one_bytes = plans.one_load_spec[1].block_ids.size * sum(
        g.pair_bytes for g in plans.planner.groups)
    row: dict = {"workload": w.label(), "backend": chosen.kind.label, "one_bytes": one_bytes}
    inline_pairs = loop.geometry.one_chunk_pairs if loop is not None else None  # as the backend

    def one_step(spin: bool, parts: dict[str, list[int]], record: bool) -> bool:
        python_for(STEP_PYTHON_S)
        job = next(jobs)
        t0 = time.monotonic_ns()
        handlers.transfer_async(job, plans.one_load_spec)
        t1 = time.monotonic_ns()
        result = None
        while result is None:
            for r in handlers.get_finished():
                result = r
            if result is None and not spin:
                time.sleep(0)  # the GIL let go between polls
        t2 = time.monotonic_ns()
        assert result.success
        if not record:
            return False
        gpu = int(result.transfer_time * 1e9)
        parts["call"].append(t1 - t0)
        parts["total"].append(t2 - t0)
        parts["gpu"].append(gpu)
        if loop is None:
            return False
        submitted, picked, issued, was_inline, _ = loop.stamps()
        parts["before"].append(submitted - t0)
        parts["wake"].append(picked - submitted)
        parts["issue"].append(issued - picked)
        parts["after"].append(t2 - issued)
        parts["detect"].append(t2 - issued - gpu)
        return was_inline

    def interleaved(spin: bool, tag: str) -> None:
        """The modes alternate step by step, so that the machine's drift hits both."""
        names = ("loop", "inline") if loop is not None else ("python",)
        parts = {m: {k: [] for k in ("before", "wake", "issue", "after", "gpu", "detect",
                                     "call", "total")} for m in names}
        inline_seen = dict.fromkeys(names, 0)
        for i in range(WARM + steps):
            for mode in names:
                if loop is not None:
                    loop.set_inline(-1 if mode == "loop" else inline_pairs)
                inline_seen[mode] += one_step(spin, parts[mode], i >= WARM)
        for mode in names:
            row[mode + tag] = {**summary({k: v for k, v in parts[mode].items() if v}),
                               "inline_share": inline_seen[mode] / steps}

    with BusyPython():
        interleaved(False, "")
        interleaved(True, "_spin")
        row["torch"] = torch_control(rig, one_bytes, steps, spin=False)
        row["torch_spin"] = torch_control(rig, one_bytes, steps, spin=True)
        row["noop"] = noop_control(steps)
    interleaved(False, "_quiet")  # no other Python thread
    row["torch_quiet"] = torch_control(rig, one_bytes, steps, spin=False)
    handlers.shutdown()
    for made in built.values():
        made.close()
    return row


def torch_control(rig: GpuRig, n: int, steps: int, spin: bool) -> dict:
    """One plain copy of the block's bytes, issued and polled the same way."""
    torch = rig.torch
    src, dst = rig.host[:n], rig.gpu[:n]
    stream = rig.streams[0]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    totals, calls, gpus = [], [], []
    for i in range(WARM + steps):
        python_for(STEP_PYTHON_S)
        t0 = time.monotonic_ns()
        with torch.cuda.stream(stream):
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        t1 = time.monotonic_ns()
        while not end.query():
            if not spin:
                time.sleep(0)
        t2 = time.monotonic_ns()
        if i >= WARM:
            calls.append(t1 - t0)
            totals.append(t2 - t0)
            gpus.append(int(start.elapsed_time(end) * 1e6))
    return summary({"call": calls, "gpu": gpus, "total": totals})


def noop_control(steps: int) -> dict:
    """A fixed bit of Python (about a call's length), timed as the calls are."""
    took = []
    for _ in range(WARM + steps):
        python_for(STEP_PYTHON_S)
        t0 = time.monotonic_ns()
        python_work(40)
        took.append(time.monotonic_ns() - t0)
    return summary({"work": took[WARM:]})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--page-kib", nargs="+", type=int, default=[16, 32])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--json")
    args = p.parse_args()
    rig, ceiling = probe_rig()
    rows = []
    for kib in args.page_kib:
        row = probe(rig, kib, args.steps)
        row["wire_us"] = row["one_bytes"] / (ceiling["cpu_to_gpu"] * 1e9) * 1e6
        row["target_us"] = 1.5 * row["wire_us"] + 20
        rows.append(row)
        print(f"== {row['workload']} ({row['backend']}), one block {row['one_bytes']} B, "
              f"wire {row['wire_us']:.0f} us, target {row['target_us']:.0f} us")
        for mode in [m + v for m in ("loop", "inline", "python", "torch")
                     for v in ("", "_spin", "_quiet")] + ["noop"]:
            if mode in row:
                r = row[mode]
                print(f"  {mode:13s} " + "  ".join(
                    f"{k[:-7]} {r[k]:.0f}/{r[k[:-7] + '_p99_us']:.0f}"
                    for k in r if k.endswith("_p50_us"))
                    + (f"  inline share {r['inline_share']:.2f}" if "inline_share" in r
                       else ""), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"ceiling": ceiling, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

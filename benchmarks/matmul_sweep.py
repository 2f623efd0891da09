"""A matmul beside both-ways staged copies, for several shapes of the pack/unpack kernels'
launches (GPU machine; not a test). Each setting builds ``staged`` with the block kernel's
``max_programs`` (programs per launch; None: one per (pair, tensor)) and ``num_warps``,
then runs ``matmul_beside_copies`` (the bench's ``--matmul`` figure) and, with
``--engine``, the bench's engine view without the matmul (each way, both at once, one
block; wall clock through the real handlers); the settings alternate round by round so
that the card's drift hits all of them.

Usage: ``python benchmarks/matmul_sweep.py [--rounds 3] [--iters 40] [--settings none/4 256/4]
[--engine] [--page-kib 32] [--json F]`` (a setting is ``max_programs/num_warps``, ``none``: one program per
(pair, tensor)).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import tiercache.backends.staged.backend as staged_backend
from tiercache.backends.staged.block_kernel import BlockKernel
from tiercache.specs import Direction
from tiercache.tools.bench.figures import engine_view, matmul_beside_copies
from tiercache.tools.bench.rig import BenchBackend, GpuRig
from tiercache.tools.bench.workloads import KIB, TRANSFER_BYTES, Workload

SETTINGS = ("none/4", "256/4", "64/4", "64/2", "none/2")


def parse_setting(text: str) -> tuple[int | None, int]:
    programs, warps = text.split("/")
    return (None if programs == "none" else int(programs)), int(warps)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS))
    p.add_argument("--engine", action="store_true")
    p.add_argument("--page-kib", type=int, default=32)
    p.add_argument("--json")
    args = p.parse_args()
    settings = [parse_setting(s) for s in args.settings]
    rig = GpuRig(0, TRANSFER_BYTES)
    rig.ceiling(3)
    print(f"ceiling {rig.ceiling_gbps}", flush=True)
    w = Workload.for_page(args.page_kib * KIB)
    print(f"workload {w.label()}", flush=True)
    plans = rig.plans(w, seed=1)
    rows: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for max_programs, warps in settings:
            label = f"max_programs={max_programs} warps={warps}"
            def kernel(*a, _programs=max_programs, _warps=warps, **k):  # the setting wins
                k.update(max_programs=_programs, num_warps=_warps)
                return BlockKernel(*a, **k)
            staged_backend.BlockKernel = kernel
            built = rig.backends(BenchBackend.parse("staged"), w, plans.planner)
            try:
                m = matmul_beside_copies(rig, built[Direction.GPU_TO_CPU],
                                         built[Direction.CPU_TO_GPU], *plans.for_backend(built),
                                         args.iters)
                if args.engine:
                    m.update(engine_view(rig, plans, built, 5))
            finally:
                for made in built.values():
                    made.close()
            rows.setdefault(label, []).append(m)
            print(f"round {r} {label:32s} matmul {m['matmul_ratio']:.3f} "
                  f"({m['matmul_beside_tflops']:.0f}/{m['matmul_solo_tflops']:.0f} TFLOP/s, "
                  f"solo spread {m['matmul_solo_spread']:.3f})  copies "
                  f"{m['copy_both_gbps_beside']:.1f} GB/s "
                  f"({m['copy_both_gbps_beside'] / rig.ceiling_gbps['both']:.2f} of both-ways "
                  f"ceiling) covered {m['copies_covered_matmul']}", flush=True)
            if args.engine:
                c = rig.ceiling_gbps
                print(f"round {r} {label:32s} engine view: store {m['engine_gpu_to_cpu']:.1f} "
                      f"({m['engine_gpu_to_cpu'] / c['gpu_to_cpu']:.2f}) load "
                      f"{m['engine_cpu_to_gpu']:.1f} ({m['engine_cpu_to_gpu'] / c['cpu_to_gpu']:.2f})"
                      f" both {m['engine_both']:.1f} ({m['engine_both'] / c['both']:.2f}) one block "
                      f"{m['engine_one_block_us']:.0f} us", flush=True)
    print("== medians")
    for label, ms in rows.items():
        ratio = float(np.median([m["matmul_ratio"] for m in ms]))
        gbps = float(np.median([m["copy_both_gbps_beside"] for m in ms]))
        print(f"RESULT {label:32s} matmul {ratio:.3f} (min "
              f"{min(m['matmul_ratio'] for m in ms):.3f})  copies {gbps:.1f} GB/s "
              f"({gbps / rig.ceiling_gbps['both']:.2f})")
        if args.engine:
            c = rig.ceiling_gbps
            med = {k: float(np.median([m[k] for m in ms])) for k in
                   ("engine_gpu_to_cpu", "engine_cpu_to_gpu", "engine_both", "engine_one_block_us")}
            print(f"RESULT {label:32s} engine view: store {med['engine_gpu_to_cpu'] / c['gpu_to_cpu']:.2f}"
                  f" load {med['engine_cpu_to_gpu'] / c['cpu_to_gpu']:.2f} both "
                  f"{med['engine_both'] / c['both']:.2f} of ceilings, one block "
                  f"{med['engine_one_block_us']:.0f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceiling": rig.ceiling_gbps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

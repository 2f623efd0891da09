"""A matmul beside both-ways staged copies, for several shapes of the pack/unpack kernels'
launches (GPU machine; not a test). Each setting builds ``staged`` with the block kernel's
``max_programs`` (programs per launch; None: one per (pair, tensor)) and ``num_warps``,
then runs ``matmul_beside_copies`` (the bench's ``--matmul`` figure); the settings
alternate round by round so that the card's drift hits all of them.

Usage: ``python scripts/matmul_sweep.py [--rounds 3] [--iters 40] [--json F]``.
"""

from __future__ import annotations

import argparse
import functools
import json

import numpy as np

import tiercache.backends.staged.backend as staged_backend
from tiercache.backends.staged.block_kernel import BlockKernel
from tiercache.specs import Direction
from tiercache.tools.bench.figures import matmul_beside_copies
from tiercache.tools.bench.rig import BenchBackend, GpuRig
from tiercache.tools.bench.workloads import KIB, TRANSFER_BYTES, Workload

SETTINGS = ((None, 4), (256, 4), (64, 4), (64, 2), (None, 2))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--json")
    args = p.parse_args()
    rig = GpuRig(0, TRANSFER_BYTES)
    rig.ceiling(3)
    print(f"ceiling {rig.ceiling_gbps}", flush=True)
    w = Workload.for_page(32 * KIB)
    plans = rig.plans(w, seed=1)
    rows: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for max_programs, warps in SETTINGS:
            label = f"max_programs={max_programs} warps={warps}"
            staged_backend.BlockKernel = functools.partial(BlockKernel, num_warps=warps,
                                                           max_programs=max_programs)
            built = rig.backends(BenchBackend.parse("staged"), w, plans.planner)
            try:
                m = matmul_beside_copies(rig, built[Direction.GPU_TO_CPU],
                                         built[Direction.CPU_TO_GPU], *plans.for_backend(built),
                                         args.iters)
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
    print("== medians")
    for label, ms in rows.items():
        ratio = float(np.median([m["matmul_ratio"] for m in ms]))
        gbps = float(np.median([m["copy_both_gbps_beside"] for m in ms]))
        print(f"RESULT {label:32s} matmul {ratio:.3f} (min "
              f"{min(m['matmul_ratio'] for m in ms):.3f})  copies {gbps:.1f} GB/s "
              f"({gbps / rig.ceiling_gbps['both']:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceiling": rig.ceiling_gbps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

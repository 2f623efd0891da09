"""The engine's pattern (``tiercache.tools.bench.engine``) alone, for before/after runs of
two checkouts on one machine (GPU machine; not a test).

Usage: ``PYTHONPATH=<checkout> python benchmarks/engine_pattern.py [--page-kib 16 32 64]
[--steps 40] [--backend auto] [--json FILE]``. The checkout needs
``tiercache/tools/bench/engine.py`` (copy it into an older one). Prints the ceiling and
one line per workload; every figure goes to the JSON.
"""

from __future__ import annotations

import argparse
import json

import tiercache
from tiercache.tools.bench.engine import engine_pattern
from tiercache.tools.bench.rig import BenchBackend, GpuRig
from tiercache.tools.bench.workloads import KIB, TRANSFER_BYTES, Workload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--page-kib", nargs="+", type=int, default=[16, 32, 64])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--backend", default="auto")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()
    rig = GpuRig(0, TRANSFER_BYTES)
    ceiling = rig.ceiling(args.reps)
    print(f"package {tiercache.__file__}")
    print("ceiling " + " ".join(f"{k} {v:.1f}" for k, v in ceiling.items()) + " GB/s",
          flush=True)
    rows = []
    for kib in args.page_kib:
        w = Workload.for_page(kib * KIB)
        plans = rig.plans(w)
        built = rig.backends(BenchBackend.parse(args.backend), w, plans.planner)
        row = engine_pattern(rig, plans, built, args.steps, ceiling)
        for made in built.values():
            made.close()
        row["workload"] = w.label()
        rows.append(row)
        print(f"RESULT {w.label():22s} both store-first {row['pattern_store_first_ratio']:.2f} "
              f"[{row['pattern_store_first_min_ratio']:.2f}] load-first "
              f"{row['pattern_load_first_ratio']:.2f} [{row['pattern_load_first_min_ratio']:.2f}]"
              f" torch {row['pattern_control_ratio']:.2f} [{row['pattern_control_min_ratio']:.2f}]"
              f" | call us p50/p99 store {row['pattern_store_call_p50_us']:.0f}/"
              f"{row['pattern_store_call_p99_us']:.0f} load {row['pattern_load_call_p50_us']:.0f}/"
              f"{row['pattern_load_call_p99_us']:.0f} one {row['pattern_one_call_p50_us']:.0f}/"
              f"{row['pattern_one_call_p99_us']:.0f} | 1-block us "
              f"{row['pattern_one_block_p50_us']:.0f}/{row['pattern_one_block_p99_us']:.0f} "
              f"(target {row['pattern_one_block_target_us']:.0f}) | calls that lost the GIL "
              f"{row['pattern_calls_interrupted']:.2f}, {row['pattern_gc_collections']} GCs "
              f"(longest {row['pattern_gc_max_ms']:.1f} ms) | native "
              f"{row.get('pattern_native_store')}/{row.get('pattern_native_load')}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"ceiling": ceiling, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

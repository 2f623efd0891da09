"""Both-ways copies, rep by rep, in this process (GPU machine; not a test): the plain
pinned copies (the ceiling's) and ``auto`` on the bench's 32 KiB workloads, then the
matmul-beside figure. Run it in several processes to see whether a "low mode" (both ways
at ~0.55 of the both-ways ceiling on every rep) is a property of a process. Usage:
``python benchmarks/low_mode_probe.py [tensors ...]``."""

from __future__ import annotations

import sys

from tiercache.specs import Direction
from tiercache.tools.bench.figures import matmul_beside_copies
from tiercache.tools.bench.rig import BenchBackend, GpuRig, submit_now
from tiercache.tools.bench.workloads import KIB, TRANSFER_BYTES, Workload

G2C, C2G = Direction.GPU_TO_CPU, Direction.CPU_TO_GPU


def main() -> None:
    rig = GpuRig(0, TRANSFER_BYTES)
    ceiling = rig.ceiling(5)
    n = rig.transfer_bytes
    h, h2, d, d2 = rig.host[:n], rig.host[n:2 * n], rig.gpu[:n], rig.gpu[n:2 * n]

    def copy(dst, src, stream) -> None:
        with rig.torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    plain = rig.time_both(lambda s: copy(h2, d2, s), lambda s: copy(d, h, s), 8, stat=list)
    print("RESULT plain both-ways, per rep:",
          " ".join(f"{2 * n / t / 1e9 / ceiling['both']:.2f}" for t in plain), flush=True)
    for tensors in [int(a) for a in sys.argv[1:]] or [32, 64]:
        w = Workload.for_page(32 * KIB, max_tensors=tensors)
        plans = rig.plans(w, seed=1)
        built = rig.backends(BenchBackend.parse("auto"), w, plans.planner)
        store, load = plans.for_backend(built)
        both = rig.time_both(lambda s: submit_now(built[G2C], store, s),
                             lambda s: submit_now(built[C2G], load, s), 8, stat=list)
        rates = [(store.num_bytes + load.num_bytes) / t / 1e9 / ceiling["both"] for t in both]
        print(f"RESULT auto both-ways {w.label()}, per rep:",
              " ".join(f"{r:.2f}" for r in rates), flush=True)
        m = matmul_beside_copies(rig, built[G2C], built[C2G], store, load, 40)
        print(f"RESULT matmul beside auto {w.label()}: ratio {m['matmul_ratio']:.3f}, copies "
              f"{m['copy_both_gbps_beside'] / ceiling['both']:.2f} of both-ways, solo spread "
              f"{m['matmul_solo_spread']:.3f}, covered {m['copies_covered_matmul']}", flush=True)
        for made in built.values():
            made.close()
    print(f"RESULT ceiling {ceiling}", flush=True)


if __name__ == "__main__":
    main()

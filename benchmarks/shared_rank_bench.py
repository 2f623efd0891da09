"""Several engine processes on one GPU, all attached to rank 0 of one coordinator (GPU
machine; not a test). What two vLLM instances sharing a node's coordinator look like when
they share a GPU: each process maps and pins the rank's slice in its own CUDA context and
moves its own blocks through the real worker path (``attach`` -> ``submit_store`` /
``submit_load`` -> handlers -> the configured backend), disjoint slots per engine.

Per engine and in aggregate: wall-clock GB/s from the submit call to the job's result, all
engines starting each repetition together (a barrier), against the same-run ceiling (one
512 MiB pinned copy each way, in the parent before the engines start); every loaded block
is compared with what was stored. Usage:

    python benchmarks/shared_rank_bench.py [--engines 2] [--page-kib 32] [--tensors 64]
        [--blocks 256] [--reps 8] [--backend auto]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time

import numpy as np

MIB = 1 << 20


def _ceiling() -> dict[str, float]:
    import torch

    n = 512 * MIB
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(n, dtype=torch.uint8, device="cuda")
    rates = {}
    for name, dst, src in (("gpu_to_cpu", host, gpu), ("cpu_to_gpu", gpu, host)):
        best = 0.0
        for _ in range(6):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = max(best, n / (time.perf_counter() - t0) / 1e9)
        rates[name] = best
    return rates


def _engine(index: int, config, args, barrier, results) -> None:
    import torch

    from tiercache.specs import CPULoadStoreSpec, GPULoadStoreSpec
    from tiercache.transfer.worker import attach

    torch.cuda.set_device(0)
    page = int(args.page_kib * 1024)
    gpu_blocks = 2 * args.blocks
    caches = [torch.randint(0, 256, (gpu_blocks, page), dtype=torch.uint8, device="cuda")
              for _ in range(args.tensors)]
    worker = attach(config, 0, caches, backend=args.backend)
    rng = np.random.default_rng(index)
    first_slot = index * 2 * args.blocks  # engines use disjoint slots
    src = rng.permutation(args.blocks).tolist()  # blocks 0..B-1 stored
    dst = (args.blocks + rng.permutation(args.blocks)).tolist()  # loaded into B..2B-1
    slots = (first_slot + rng.permutation(2 * args.blocks)[:args.blocks]).tolist()
    nbytes = args.blocks * args.tensors * page
    timings: dict[str, list[tuple[float, float]]] = {"gpu_to_cpu": [], "cpu_to_gpu": []}
    job = 0
    for rep in range(args.reps + 1):
        for direction in ("gpu_to_cpu", "cpu_to_gpu"):
            job += 1
            torch.cuda.synchronize()
            barrier.wait()
            t0 = time.perf_counter()
            if direction == "gpu_to_cpu":
                worker.submit_store(job, GPULoadStoreSpec(src), CPULoadStoreSpec(slots))
            else:
                worker.submit_load(job, CPULoadStoreSpec(slots), GPULoadStoreSpec(dst))
            while not any(r.job_id == job for r in worker.get_finished()):
                pass
            t1 = time.perf_counter()
            if rep:  # the first round warms up
                timings[direction].append((t0, t1))
    wrong = sum(int(not torch.equal(c[src], c[dst])) for c in caches)
    worker.close()
    results.put((index, nbytes, timings, wrong))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--page-kib", type=float, default=32)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--backend", default="auto")
    args = p.parse_args()

    from tiercache.config import Config, KVGeometry, RegionConfig
    from tiercache.service.process import CoordinatorProcess

    ceiling = _ceiling()
    page = int(args.page_kib * 1024)
    config = Config(name=f"shared-rank-{int(time.time())}", world_size=1,
                    kv=KVGeometry(page_bytes=(page,) * args.tensors),
                    region=RegionConfig(capacity_bytes=None,
                                        num_blocks=2 * args.blocks * args.engines,
                                        prefault_threads=8,
                                        attachments_per_rank=max(4, args.engines)))
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, CoordinatorProcess(config, tmp):
        barrier, results = ctx.Barrier(args.engines), ctx.Queue()
        procs = [ctx.Process(target=_engine, args=(i, config, args, barrier, results))
                 for i in range(args.engines)]
        for proc in procs:
            proc.start()
        got = [results.get(timeout=600) for _ in procs]
        for proc in procs:
            proc.join(60)
    print(f"ceiling: gpu_to_cpu {ceiling['gpu_to_cpu']:.1f} GB/s, cpu_to_gpu "
          f"{ceiling['cpu_to_gpu']:.1f} GB/s (one 512 MiB pinned copy, best of 6)")
    print(f"{args.engines} engine processes on one GPU, all on rank 0; {args.tensors} x "
          f"{args.page_kib:g} KiB pages, {args.blocks} scattered blocks per transfer, "
          f"backend {args.backend}")
    for direction in ("gpu_to_cpu", "cpu_to_gpu"):
        per = []
        for index, nbytes, timings, wrong in sorted(got):
            rate = statistics.median(nbytes / (t1 - t0) / 1e9 for t0, t1 in timings[direction])
            per.append(rate)
            print(f"  engine {index} {direction}: {rate:.1f} GB/s "
                  f"({rate / ceiling[direction]:.2f}); wrong tensors {wrong}")
        spans = [max(t[r][1] for t in (g[2][direction] for g in got))
                 - min(t[r][0] for t in (g[2][direction] for g in got))
                 for r in range(args.reps)]
        total = sum(g[1] for g in got)
        agg = statistics.median(total / s / 1e9 for s in spans)
        print(f"  aggregate {direction}: {agg:.1f} GB/s ({agg / ceiling[direction]:.2f} of the "
              f"ceiling; sum of per-engine medians {sum(per):.1f})")


if __name__ == "__main__":
    main()

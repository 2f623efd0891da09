"""Copies to and from host rows that are not page-locked yet (issue 41, item 1): the
bounce buffer (``tiercache.backends.bounce``) against ``ce`` handed the pageable rows
(the driver's own staging: what the unpinned path was before), in one run beside the
ceiling (one large pinned copy each way).

The host side is a /dev/shm file of ``--gib`` GiB, ``posix_fallocate``\\ d (as the
coordinator reserves a slice) and mapped, never registered: the first pass over it takes
the page faults a worker meets before its pre-fault reaches a row (*first touch*), later
passes meet mapped pages (*faulted*). The GPU side is a Llama-3-8B rank's pages (64 tensors
of 32 KiB); each transfer moves ``--blocks`` blocks of 2 MiB rows to or from scattered
slots. Rates are wall clock, submit to the stream's end (the engine's view; the bounce path
holds the caller for its host side anyway). Threads: the copy pool's threads besides the
caller (the worker's default is ``host_copy.default_threads()``).

    PYTHONPATH=. python3 benchmarks/bounce_gpu.py --json $OUT/bounce.json

Results: docs/benchmarks.md, "Instant on (issue 41, item 1)", "The bounce buffer".
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import time

import numpy as np
import torch

from tiercache.backends.base import Ordering
from tiercache.backends.bounce import BounceBackend
from tiercache.backends.ce import CeBackend
from tiercache.planning.plans import CopyPlan
from tiercache.specs import Direction
from tiercache.transfer.host_copy import HostCopyPool, default_threads

PAGE = 32 << 10
TENSORS = 64
ROW = PAGE * TENSORS


def plans(host_base: int, slots: int, caches: list[torch.Tensor], blocks: int,
          rng: np.random.Generator) -> dict[Direction, CopyPlan]:
    """One store and one load of ``blocks`` GPU blocks to/from scattered slots (row-major
    host rows: a block's 64 pages back to back, as in the region)."""
    chosen = rng.choice(slots, size=blocks, replace=False)
    gpu = np.array([[c[b].data_ptr() for c in caches] for b in range(blocks)],
                   dtype=np.uint64).ravel()
    host = (np.uint64(host_base) + chosen.astype(np.uint64)[:, None] * np.uint64(ROW)
            + np.arange(TENSORS, dtype=np.uint64)[None, :] * np.uint64(PAGE)).ravel()
    sizes = np.full(gpu.size, PAGE, dtype=np.uint64)
    return {Direction.GPU_TO_CPU: CopyPlan(gpu, host, sizes, Direction.GPU_TO_CPU),
            Direction.CPU_TO_GPU: CopyPlan(host, gpu, sizes, Direction.CPU_TO_GPU)}


def timed(backend, plan: CopyPlan, stream: torch.cuda.Stream) -> float:
    t = time.perf_counter()
    backend.submit(plan, Ordering(stream))
    stream.synchronize()
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", default=f"1,3,{default_threads()}")
    parser.add_argument("--json")
    args = parser.parse_args()
    from tiercache.tools.bench.rig import probe_rig

    rig, ceiling = probe_rig(5)
    del rig
    torch.cuda.empty_cache()
    num_bytes = int(args.gib * (1 << 30)) // ROW * ROW
    slots = num_bytes // ROW
    path = f"/dev/shm/bounce-bench-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    caches = [torch.randint(0, 256, (args.blocks, PAGE), dtype=torch.uint8, device="cuda")
              for _ in range(TENSORS)]
    rng = np.random.default_rng(41)
    stream = torch.cuda.Stream()
    results: dict[str, dict] = {"ceiling_gbps": ceiling, "gib": args.gib,
                                "blocks": args.blocks, "row_bytes": ROW, "runs": {}}
    try:
        os.posix_fallocate(fd, 0, num_bytes)
        m = mmap.mmap(fd, num_bytes)
        anchor = (ctypes.c_char * num_bytes).from_buffer(m)
        base = ctypes.addressof(anchor)
        device = torch.cuda.current_device()
        candidates = [("ce_pageable", lambda d: CeBackend(device))]
        for n in [int(x) for x in args.threads.split(",")]:
            candidates.append((f"bounce_t{n}",
                               lambda d, n=n: BounceBackend(device, HostCopyPool(n))))
        for name, build in candidates:
            run: dict[str, dict] = {}
            for direction in Direction:
                backend = build(direction)
                try:
                    plan = plans(base, slots, caches, args.blocks, rng)[direction]
                    # the first pass over fresh slots takes their faults (and the
                    # backend's warm-up); the median is over the same, faulted, rows
                    times = [timed(backend, plan, stream) for _ in range(args.reps + 1)]
                    gb = args.blocks * ROW / 1e9
                    med = statistics.median(times[1:])
                    key = "gpu_to_cpu" if direction is Direction.GPU_TO_CPU else "cpu_to_gpu"
                    run[direction.label] = {"gbps": gb / med, "ratio": gb / med / ceiling[key],
                                            "first_s": times[0], "median_s": med}
                finally:
                    backend.close()
            results["runs"][name] = run
            print(name + " " + " ".join(f"{d} {r['gbps']:.2f} GB/s ({r['ratio']:.3f})"
                                         for d, r in run.items()), flush=True)
        del anchor
        m.close()
    finally:
        os.close(fd)
        os.unlink(path)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

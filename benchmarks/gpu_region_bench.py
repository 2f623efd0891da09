"""Issue 2 benchmark on a GPU machine: a 16 GiB region created, pre-faulted and pinned by two
ranks (each its own slice, in its own process), next to one large pinned copy measured in the
same run. Prints a table; writes JSON to $OUT when set.

    PYTHONPATH=. python3 benchmarks/gpu_region_bench.py [--gib 16] [--threads 16]
"""

import argparse
import json
import multiprocessing as mp
import os
import time

import torch

from tiercache.config import Config, KVGeometry, PinningPolicy, RegionConfig
from tiercache.device.pinning import HostPinner
from tiercache.region.shared import SharedOffloadRegion


def copy_gbps(host, dev, reps: int) -> dict:
    """Median GB/s of one host<->device copy each way, timed with events on a side stream."""
    s = torch.cuda.Stream()
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(s):
                a.record(); dst.copy_(src, non_blocking=True); b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        out[name] = host.numel() / sorted(times)[len(times) // 2] / 1e9
    return out


def ceiling(num_bytes: int = 1 << 30) -> dict:
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    return copy_gbps(host, torch.empty(num_bytes, dtype=torch.uint8, device="cuda"), 5)


def worker(name: str, rank: int, threads: int, q) -> None:
    t0 = time.perf_counter()
    region = SharedOffloadRegion.attach(name, rank, timeout_s=30)
    t_attach = time.perf_counter() - t0
    torch.cuda.init(); torch.empty(1, device="cuda")  # context creation outside the pin timing
    t_prefault = region.prefault_slice(threads)  # what tiercache.attach does before pinning
    t1 = time.perf_counter()
    region.pin(PinningPolicy.REQUIRED, HostPinner())
    t_pin = time.perf_counter() - t1
    rows = torch.from_numpy(region.rank_array(rank).reshape(-1)[: 1 << 30])
    rates = copy_gbps(rows, torch.empty(rows.numel(), dtype=torch.uint8, device="cuda"), 3)
    t2 = time.perf_counter()
    del rows
    region.close()
    q.put({"rank": rank, "attach_s": t_attach, "prefault_s": t_prefault, "pin_s": t_pin, "unpin_close_s": time.perf_counter() - t2,
           "pinned_bytes": region.layout.slice_used_bytes, "copy_gbps": rates})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, default=16)
    ap.add_argument("--threads", type=int, default=4, help="pre-fault threads per worker")
    args = ap.parse_args()
    ceil = ceiling()
    name = f"bench-{os.getpid()}"
    # Llama-3-8B-like rank rows: 64 tensors x 32 KiB = 2 MiB per CPU block
    cfg = Config(name=name, world_size=2, kv=KVGeometry(page_bytes=(32768,) * 64),
                 region=RegionConfig(capacity_bytes=args.gib << 30, prefault_threads=args.threads,
                                     pinning=PinningPolicy.REQUIRED),
                 exporter=Config().exporter)
    t0 = time.perf_counter()
    region = SharedOffloadRegion.create(cfg, log_step=print)
    t_ready = time.perf_counter() - t0
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(name, r, args.threads, q)) for r in range(2)]
    for p in procs:
        p.start()
    ranks = sorted((q.get(timeout=300) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join(60)
    total = region.layout.total_bytes
    times = region.setup_times
    region.close()
    pin_wall = max(r["prefault_s"] + r["pin_s"] for r in ranks)
    ready_pinned = t_ready + pin_wall
    result = {
        "gpu": torch.cuda.get_device_name(), "region_bytes": total, "prefault_threads": args.threads,
        "ceiling_gbps": ceil, "allocate_s": times.allocate_s,
        "create_total_s": t_ready, "ranks": ranks, "ready_plus_pinned_s": ready_pinned,
        "ready_plus_pinned_gibps": total / ready_pinned / (1 << 30),
    }
    print(json.dumps(result, indent=1))
    print("\n| step | seconds |\n|---|---|")
    print(f"| fallocate {total / (1 << 30):.1f} GiB | {times.allocate_s:.2f} |")
    print(f"| create total (checks + fallocate + header; READY) | {t_ready:.2f} |")
    for r in ranks:
        print(f"| rank {r['rank']}: pre-fault own {r['pinned_bytes'] / (1 << 30):.2f} GiB slice "
              f"({args.threads} threads) + pin (ranks in parallel) | {r['prefault_s']:.2f} + {r['pin_s']:.2f} |")
    print(f"| region ready + pinned | {ready_pinned:.2f} ({result['ready_plus_pinned_gibps']:.2f} GiB/s) |")
    print(f"ceiling (1 GiB cudaHostAlloc) H2D {ceil['h2d']:.1f} GB/s, D2H {ceil['d2h']:.1f} GB/s")
    for r in ranks:
        c = r["copy_gbps"]
        print(f"rank {r['rank']} 1 GiB from its pinned slice: H2D {c['h2d']:.1f} GB/s "
              f"({c['h2d'] / ceil['h2d']:.2f}x), D2H {c['d2h']:.1f} GB/s ({c['d2h'] / ceil['d2h']:.2f}x)")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "region_bench.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

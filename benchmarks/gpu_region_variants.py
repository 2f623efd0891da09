"""Where does region set-up time go? Variants of (coordinator fallocate, coordinator pre-fault,
worker pre-fault of its own slice) followed by each of 2 ranks pinning its 8 GiB slice, each
variant run twice, in an interleaved order. Usage: PYTHONPATH=. python3 benchmarks/gpu_region_variants.py
"""

import mmap
import multiprocessing as mp
import os
import time

from tiercache.region.hostmem import fallocate, prefault
from tiercache.region.layout import RegionLayout
from tiercache.device.pinning import HostPinner

import numpy as np
import ctypes

GIB = 1 << 30
LAYOUT = RegionLayout(world_size=2, num_blocks=4096, page_bytes=(32768,) * 64)  # 2 x 8 GiB


def _map(path):
    fd = os.open(path, os.O_RDWR)
    m = mmap.mmap(fd, LAYOUT.total_bytes)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    view = np.ctypeslib.as_array((ctypes.c_uint8 * LAYOUT.total_bytes).from_address(addr))
    return fd, m, addr, view


def worker(path, rank, threads, q):
    import torch
    torch.cuda.init(); torch.empty(1, device="cuda")
    fd, m, addr, view = _map(path)
    t0 = time.perf_counter()
    if threads:
        prefault(addr, view, LAYOUT.prefault_ranges(threads, LAYOUT.slice_offset(rank),
                                                    LAYOUT.slice_used_bytes), threads)
    t1 = time.perf_counter()
    p = HostPinner(0)
    p.pin([(addr + o, n) for o, n in LAYOUT.registrations(rank)])
    t2 = time.perf_counter()
    p.unpin()
    q.put((rank, t1 - t0, t2 - t1))


def variant(falloc, coord_threads, worker_threads):
    path = f"/dev/shm/tiercache-variant-{os.getpid()}"
    t0 = time.perf_counter()
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, LAYOUT.total_bytes)
    if falloc:
        fallocate(fd, LAYOUT.total_bytes, path)
    t1 = time.perf_counter()
    if coord_threads:
        _, m, addr, view = _map(path)
        prefault(addr, view, LAYOUT.prefault_ranges(coord_threads), coord_threads)
        del view; m.close()
    t2 = time.perf_counter()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(path, r, worker_threads, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = sorted(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join()
    os.unlink(path); os.close(fd)
    wprefault = max(r[1] for r in res); wpin = max(r[2] for r in res)
    total = (t1 - t0) + (t2 - t1) + max(r[1] + r[2] for r in res)
    return dict(falloc=falloc, coord_threads=coord_threads, worker_threads=worker_threads,
                alloc_s=t1 - t0, coord_prefault_s=t2 - t1, worker_prefault_s=wprefault,
                pin_s=wpin, total_s=total, gibps=LAYOUT.total_bytes / GIB / total)


if __name__ == "__main__":
    import sys
    variants = [(True, 0, 0), (True, 0, 4), (True, 16, 0), (False, 0, 4)]
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    rows = []
    for rep in range(reps):
        for v in (variants if rep % 2 == 0 else variants[::-1]):
            r = variant(*v); r["rep"] = rep; rows.append(r)
            print(r, flush=True)
    import statistics
    print("\nmedians:")
    for v in variants:
        tot = [r["total_s"] for r in rows if (r["falloc"], r["coord_threads"], r["worker_threads"]) == v]
        print(v, "median total", round(statistics.median(tot), 2), "all", [round(t, 2) for t in tot])
    print("\n| fallocate | coord prefault threads | worker prefault threads/rank | alloc s | coord prefault s | worker prefault s | pin s | total s | GiB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['falloc']} | {r['coord_threads']} | {r['worker_threads']} | {r['alloc_s']:.2f} | "
              f"{r['coord_prefault_s']:.2f} | {r['worker_prefault_s']:.2f} | {r['pin_s']:.2f} | "
              f"{r['total_s']:.2f} | {r['gibps']:.2f} |")

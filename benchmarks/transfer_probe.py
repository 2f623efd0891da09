"""Exploration for the transfer engine (issue 3): raw copy-engine behaviour the backends
depend on. Not part of the product; its output feeds docs/benchmarks.md decisions.

  * 2 MiB units H2D/D2H on 1, 2 or 4 streams, STREAM vs ANY source order
  * device-to-device batch of 16384 x 32 KiB (the staged CE packer)
  * host time of one cuMemcpyBatchAsync over 16384 descriptors; event and launch costs
  * plan_staging time, sorted and unsorted
"""
import time

import numpy as np
import torch

from tiercache.backends.ce import CeBackend
from tiercache.device.driver import CudaDriver, SrcAccessOrder
from tiercache.backends.staged.page_layout import plan_staging
from tiercache.tools.bench.rig import GpuRig
from tiercache.tools.bench.workloads import KIB, MIB, Workload

rig = GpuRig(0, 512 * MIB)
drv = CudaDriver()
ce = CeBackend(0, drv)
streams = [torch.cuda.Stream() for _ in range(4)]
handles = [s.cuda_stream for s in streams]
print("driver", drv.driver_version, "batch abi", drv.batch_abi, flush=True)


def timed(fn, reps=5, warm=2):
    ts = []
    for r in range(warm + reps):
        torch.cuda.synchronize()
        st = torch.cuda.Event(enable_timing=True); en = torch.cuda.Event(enable_timing=True)
        st.record(streams[0])
        for s in streams[1:]:
            s.wait_event(st)
        fn()
        for s in streams[1:]:
            ev = torch.cuda.Event(); ev.record(s); streams[0].wait_event(ev)
        en.record(streams[0]); en.synchronize()
        if r >= warm:
            ts.append(st.elapsed_time(en) / 1e3)
    return float(np.median(ts))


# 2 MiB units: 256 random host rows <-> contiguous GPU 2 MiB pieces
rng = np.random.default_rng(0)
rows = rng.permutation(1024)[:256].astype(np.uint64)
unit = 2 * MIB
host = np.uint64(rig.host.data_ptr()) + rows * np.uint64(unit)
gpu = np.uint64(rig.gpu.data_ptr()) + rng.permutation(256).astype(np.uint64) * np.uint64(unit)
sizes = np.full(256, unit, np.uint64)
nbytes = 256 * unit
for order in (SrcAccessOrder.STREAM, SrcAccessOrder.ANY):
    for nstreams in (1, 2, 4):
        for name, src, dst in (("H2D", host, gpu), ("D2H", gpu, host)):
            def go():
                parts = np.array_split(np.arange(256), nstreams)
                for i, p in enumerate(parts):
                    ce.enqueue(np.ascontiguousarray(src[p]), np.ascontiguousarray(dst[p]),
                              np.ascontiguousarray(sizes[p]), order, handles[i])
            t = timed(go)
            print(f"RESULT 2MiB-units {name} order={order.name} streams={nstreams}: {nbytes / t / 1e9:.1f} GB/s", flush=True)
# both ways with 2 MiB units, 1 stream each
def both():
    ce.enqueue(host[:128].copy(), gpu[:128].copy(), sizes[:128].copy(), SrcAccessOrder.ANY, handles[0])
    ce.enqueue(gpu[128:].copy(), host[128:].copy(), sizes[128:].copy(), SrcAccessOrder.STREAM, handles[1])
t = timed(both)
print(f"RESULT 2MiB-units both 1+1 streams: {nbytes / t / 1e9:.1f} GB/s", flush=True)

# D2D batch 16384 x 32 KiB pages -> contiguous staging
w = Workload.for_page(32 * KIB)
store = rig.plans(w).store
g, h, s = store.src, store.dst, store.sizes
stage = torch.empty(512 * MIB, dtype=torch.uint8, device="cuda")
stage_addr = np.uint64(stage.data_ptr()) + np.arange(g.size, dtype=np.uint64) * np.uint64(32 * KIB)
for nstreams in (1, 2, 4):
    def d2d():
        parts = np.array_split(np.arange(g.size), nstreams)
        for i, p in enumerate(parts):
            ce.enqueue(np.ascontiguousarray(g[p]), np.ascontiguousarray(stage_addr[p]),
                      np.ascontiguousarray(s[p]), SrcAccessOrder.STREAM, handles[i])
    t = timed(d2d)
    print(f"RESULT D2D-batch 16384x32KiB streams={nstreams}: {512 * MIB / t / 1e9:.1f} GB/s ({t * 1e3:.2f} ms)", flush=True)
for page_kib in (16, 64):
    n = (512 * MIB) // (page_kib * KIB)
    src_a = np.uint64(rig.gpu.data_ptr()) + rng.permutation(n).astype(np.uint64) * np.uint64(page_kib * KIB)
    dst_a = np.uint64(stage.data_ptr()) + np.arange(n, dtype=np.uint64) * np.uint64(page_kib * KIB)
    sz = np.full(n, page_kib * KIB, np.uint64)
    t = timed(lambda: ce.enqueue(src_a, dst_a, sz, SrcAccessOrder.STREAM, handles[0]))
    print(f"RESULT D2D-batch {n}x{page_kib}KiB: {512 * MIB / t / 1e9:.1f} GB/s", flush=True)

# host cost of one batch call over 16384 descriptors
ts = []
for _ in range(10):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ce.enqueue(g, h, s, SrcAccessOrder.STREAM, handles[0])
    ts.append(time.perf_counter() - t0)
torch.cuda.synchronize()
print(f"RESULT host cuMemcpyBatchAsync 16384 descriptors: {np.median(ts) * 1e6:.0f} us", flush=True)
ts = []
for _ in range(10):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ce.enqueue(g[:64].copy(), h[:64].copy(), s[:64].copy(), SrcAccessOrder.STREAM, handles[0])
    ts.append(time.perf_counter() - t0)
print(f"RESULT host cuMemcpyBatchAsync 64 descriptors: {np.median(ts) * 1e6:.1f} us", flush=True)
ev = drv.event_create()
t0 = time.perf_counter()
for _ in range(1000):
    drv.event_record(ev, handles[0]); drv.stream_wait_event(handles[1], ev)
print(f"RESULT raw event record+wait: {(time.perf_counter() - t0) / 1000 * 1e6:.2f} us", flush=True)
tev = torch.cuda.Event()
t0 = time.perf_counter()
for _ in range(1000):
    tev.record(streams[0]); streams[1].wait_event(tev)
print(f"RESULT torch event record+wait: {(time.perf_counter() - t0) / 1000 * 1e6:.2f} us", flush=True)
torch.cuda.synchronize()
for name, hh in (("sorted", np.sort(h)), ("unsorted", h)):
    t0 = time.perf_counter()
    for _ in range(20):
        plan_staging(hh, g, s, 16 * MIB)
    print(f"RESULT plan_staging 16384 {name}: {(time.perf_counter() - t0) / 20 * 1e6:.0f} us", flush=True)
t0 = time.perf_counter()
for _ in range(20):
    np.argsort(h)
print(f"RESULT argsort 16384: {(time.perf_counter() - t0) / 20 * 1e6:.0f} us", flush=True)

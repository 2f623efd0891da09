"""Exploration for issue 3's staged path: where its host time goes, and whether the
both-ways figures depend on which hardware work queue each DMA stream lands on.
Not part of the product; its output feeds docs/benchmarks.md.

  * host cost of a Triton launch (public path and the compiled kernel's own launcher)
  * host cost of upload_table, event calls, cuMemcpyBatchAsync of 1/8/256 x 2 MiB
  * plan_staging on a tensor-major and a host-ordered 16384-page plan
  * both ways on 2 MiB units with the two streams 1, 8 and 16 pool streams apart
    (torch's pool streams map round robin onto CUDA_DEVICE_MAX_CONNECTIONS queues)
  * ``ce``: one plan in sub-batches, GPU-timed (does the engine start mid-call?)
"""
import os
import sys
import time

import numpy as np
import torch

from tiercache.backends.ce import CeBackend
from tiercache.device.driver import CudaDriver, SrcAccessOrder
from tiercache.backends.staged.page_layout import Scratch, plan_staging
from tiercache.backends.triton_copy import CopyKernel, _copy_descriptors, upload_table
from tiercache.specs import Direction
from tiercache.tools.bench.rig import GpuRig
from tiercache.tools.bench.workloads import KIB, MIB, Workload


def host_us(fn, n=200, warm=20, sync=None):
    ts = []
    for i in range(warm + n):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        if i >= warm:
            ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e6


def both_ways_probe(gap_list):
    drv = CudaDriver()
    ce = CeBackend(0, drv)
    host = torch.empty(1024 * MIB, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(1024 * MIB, dtype=torch.uint8, device="cuda")
    unit = 2 * MIB
    rng = np.random.default_rng(0)
    h = np.uint64(host.data_ptr()) + rng.permutation(512).astype(np.uint64) * np.uint64(unit)
    g = np.uint64(gpu.data_ptr()) + rng.permutation(512).astype(np.uint64) * np.uint64(unit)
    sz = np.full(256, unit, np.uint64)
    streams = [torch.cuda.Stream() for _ in range(max(gap_list) + 1)]
    env = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "default")
    for gap in gap_list:
        a, b = streams[0], streams[gap]
        rates = []
        for rep in range(6):
            torch.cuda.synchronize()
            st = torch.cuda.Event(enable_timing=True)
            ea, eb = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            st.record(a)
            b.wait_event(st)
            ce.enqueue(g[:256].copy(), h[:256].copy(), sz, SrcAccessOrder.STREAM, a.cuda_stream)
            ce.enqueue(h[256:].copy(), g[256:].copy(), sz, SrcAccessOrder.ANY, b.cuda_stream)
            ea.record(a)
            eb.record(b)
            torch.cuda.synchronize()
            if rep:
                rates.append(2 * 256 * unit / (max(st.elapsed_time(ea), st.elapsed_time(eb)) / 1e3) / 1e9)
        print(f"RESULT both-ways 2MiB units, streams {gap} apart, MAX_CONNECTIONS={env}: "
              f"median {np.median(rates):.1f} GB/s (min {min(rates):.1f} max {max(rates):.1f})",
              flush=True)


def ce_split_probe():
    """Does the copy engine start before cuMemcpyBatchAsync has walked every descriptor?
    One plan submitted in sub-batches of ``split`` descriptors, GPU-timed from an event
    recorded before the first call (host submit time included, as in the benchmark)."""
    from tiercache.device.driver import DescriptorArrays

    rig = GpuRig(0, 512 * MIB)
    ce = CeBackend(0, CudaDriver())
    plans = rig.plans(Workload.for_page(32 * KIB))
    s = rig.streams[0]
    one_store = plans.planner.plan(Direction.GPU_TO_CPU, plans.one_store_spec)
    one_load = plans.planner.plan(Direction.CPU_TO_GPU, plans.one_load_spec)
    for label, plan, splits in (("1 block", one_store, (64, 32, 16, 8)),
                                ("1 block load", one_load, (64, 32, 16, 8)),
                                ("16384 pages", plans.store, (16384, 1024, 256, 64)),
                                ("16384 pages load", plans.load, (16384, 1024, 256))):
        arrays = DescriptorArrays.of(plan.src, plan.dst, plan.sizes)
        order = SrcAccessOrder.STREAM if "load" not in label else SrcAccessOrder.ANY
        n = plan.num_descriptors
        for split in splits:
            def submit():
                for a in range(0, n, split):
                    ce.submit_range(arrays, a, min(a + split, n), order, s.cuda_stream)
            t = float(rig.time_gpu(submit, s, 20, warm=5))
            print(f"RESULT ce {label} in batches of {split}: {t * 1e6:.0f} us GPU-timed, "
                  f"{plan.num_bytes / t / 1e9:.1f} GB/s", flush=True)


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "main"
    if mode == "both":
        both_ways_probe([1, 8, 16])
        return
    if mode == "ce":
        ce_split_probe()
        return
    torch.cuda.set_device(0)
    s = torch.cuda.Stream()
    drv = CudaDriver()
    buf = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    base = np.uint64(buf.data_ptr())
    n = 64
    src = base + np.arange(n, dtype=np.uint64) * np.uint64(4096)
    dst = base + np.uint64(32 * MIB) + np.arange(n, dtype=np.uint64) * np.uint64(4096)
    sizes = np.full(n, 4096, np.uint64)
    kern = CopyKernel(264)
    with torch.cuda.stream(s):
        table = upload_table(src, dst, sizes, s)
        kern.launch(table, 0, n)
        torch.cuda.synchronize()

        def launch():
            kern.launch(table, 0, n)
        print(f"RESULT triton launch (public path): {host_us(launch):.1f} us", flush=True)
        # the compiled kernel, launched through its own launcher (Triton-private API)
        try:
            from triton import knobs
            import triton.language as tl
            compiled = _copy_descriptors[(n,)](table.device, n, 0, n, DTYPE=tl.int64, ELEM_BYTES=8,
                                               ALIGN_BYTES=16, BLOCK=kern.block_elements(16),
                                               num_warps=4)
            meta = compiled.metadata
            print("RESULT compiled metadata: shared", meta.shared, "scratch",
                  getattr(meta, "global_scratch_size", None),
                  getattr(meta, "profile_scratch_size", None), flush=True)
            ptx = compiled.asm.get("ptx", "")
            entry = ptx[ptx.find(".entry"):ptx.find(")", ptx.find(".entry"))]
            print("RESULT ptx params:", entry.count(".param"), entry.replace("\n", " ")[:400],
                  flush=True)
            stream_h = s.cuda_stream
            variants = {
                "all args": (table.device, n, 0, n, tl.int64, 8, 16, kern.block_elements(16)),
                "runtime args": (table.device, n, 0, n),
            }
            for label, args in variants.items():
                def direct():
                    compiled.run(n, 1, 1, stream_h, compiled.function, compiled.packed_metadata,
                                 None, knobs.runtime.launch_enter_hook,
                                 knobs.runtime.launch_exit_hook, *args)
                try:
                    direct()
                    torch.cuda.synchronize()
                    print(f"RESULT triton launch (compiled.run, {label}): {host_us(direct):.1f} us",
                          flush=True)
                except Exception as e:  # exploration: report and go on
                    print(f"RESULT compiled.run {label} failed: {type(e).__name__}: {e}", flush=True)
        except Exception as e:  # exploration: report and go on
            print(f"RESULT compiled kernel failed: {type(e).__name__}: {e}", flush=True)
        torch.cuda.synchronize()

    big_n = 16384
    g = base + np.arange(big_n, dtype=np.uint64) * np.uint64(1024)
    print(f"RESULT upload_table 16384: {host_us(lambda: upload_table(g, g, g, s)):.1f} us",
          flush=True)
    print(f"RESULT upload_table 64: {host_us(lambda: upload_table(src, dst, sizes, s)):.1f} us",
          flush=True)
    ev = drv.event_create()
    h1, h2 = s.cuda_stream, torch.cuda.Stream().cuda_stream
    print(f"RESULT event_record: {host_us(lambda: drv.event_record(ev, h1), n=2000):.2f} us",
          flush=True)
    print(f"RESULT stream_wait_event: {host_us(lambda: drv.stream_wait_event(h2, ev), n=2000):.2f} us",
          flush=True)
    torch.cuda.synchronize()

    rig = GpuRig(0, 512 * MIB)
    ce = CeBackend(0, drv)
    unit = 2 * MIB
    rows = np.random.default_rng(0).permutation(1024)[:256].astype(np.uint64)
    hh = np.uint64(rig.host.data_ptr()) + rows * np.uint64(unit)
    gg = np.uint64(rig.gpu.data_ptr()) + np.arange(256, dtype=np.uint64) * np.uint64(unit)
    for count in (1, 8, 256):
        a, b, z = gg[:count].copy(), hh[:count].copy(), np.full(count, unit, np.uint64)
        t = host_us(lambda: ce.enqueue(a, b, z, SrcAccessOrder.STREAM, h1), n=20, warm=3,
                    sync=torch.cuda.synchronize)
        print(f"RESULT host cuMemcpyBatchAsync {count} x 2 MiB: {t:.1f} us", flush=True)
    torch.cuda.synchronize()

    w = Workload.for_page(32 * KIB)
    plan = rig.plans(w).store  # the planner's host order
    gp, hp, sp = plan.src, plan.dst, plan.sizes
    tensor_major = np.argsort(gp)  # GPU order: tensor by tensor
    scratch = Scratch()
    for name, hx, gx, sx in (("tensor-major", hp[tensor_major].copy(), gp[tensor_major].copy(), sp),
                             ("host-ordered", hp, gp, sp)):
        t = host_us(lambda: plan_staging(hx, gx, sx, 32 * MIB, 1 * MIB, scratch), n=50)
        print(f"RESULT plan_staging 16384 {name}: {t:.0f} us", flush=True)
    t = host_us(lambda: np.sort(hp), n=50)
    print(f"RESULT np.sort 16384 u64: {t:.0f} us", flush=True)
    x = np.arange(16384, dtype=np.uint64)
    o = np.empty_like(x)
    print(f"RESULT numpy add 16384: {host_us(lambda: np.add(x, x, out=o), n=500):.1f} us",
          flush=True)


if __name__ == "__main__":
    main()

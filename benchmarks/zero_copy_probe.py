"""Zero-copy against the staging ring for small transfers (GPU machine; not a test).

``staged`` moves a transfer of at most ``transfer.zero_copy_bytes`` in one launch of its
pack / unpack kernel straight between the GPU pages and the pinned host rows. This probe
measures what that gains and what it costs, the two modes alternating transfer by
transfer (the loop's bound switched between 0 and every job) so that the machine's drift
hits both:

* ``gpu``: stream-timed start to end of N-block stores and loads through the real
  handlers, N = 1, 2, 4, ... (where the ring becomes the faster path);
* ``spin``: a one-block load from the call to ``get_finished`` returning it, polled
  keeping the GIL, after 1 ms of the step's own Python (the issue's one-block figure);
* ``matmul``: a bf16 matmul on its own stream, solo and with loads of the largest
  zero-copy size (``--matmul-bytes``) issued beside it every ~0.3 ms in either mode (what
  the zero-copy kernel's programs take from the model).

The one-way ceiling (one large pinned copy) is measured in the same run.
Usage: ``python benchmarks/zero_copy_probe.py [--page-kib 16 32 64] [--reps 40] [--json F]``.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from tiercache.device.streams import CudaStreams
from tiercache.specs import CPULoadStoreSpec, Direction, GPULoadStoreSpec
from tiercache.tools.bench.engine import STEP_PYTHON_S, python_for
from tiercache.tools.bench.rig import BenchBackend, GpuRig, probe_rig
from tiercache.tools.bench.workloads import KIB, Workload
from tiercache.transfer.wiring import build_handlers

MODES = ("ring", "zero")
ALL = 1 << 40


class Rig:
    """One page size's staged handlers, both loops reachable for the mode switch."""

    def __init__(self, rig: GpuRig, kib: int):
        self.w = Workload.for_page(kib * KIB)
        self.plans = rig.plans(self.w)
        self.built = rig.backends(BenchBackend.parse("staged"), self.w, self.plans.planner,
                                  zero_copy_bytes=0)
        self.loops = {d: b.chunk_loop for d, b in self.built.items()}
        assert all(self.loops.values()), "staged without its native loop"
        self.handlers = build_handlers(self.plans.planner, self.built, CudaStreams(rig.device))
        self.jobs = iter(range(1, 1 << 30))
        self.pair_bytes = max(self.plans.planner.pair_bytes)

    def mode(self, name: str) -> None:
        for loop in self.loops.values():
            loop.set_zero_copy(ALL if name == "zero" else 0)

    def spec(self, direction: Direction, n: int):
        if direction is Direction.GPU_TO_CPU:
            gpu, cpu = self.plans.store_spec
            return GPULoadStoreSpec(gpu.block_ids[:n]), CPULoadStoreSpec(cpu.block_ids[:n])
        cpu, gpu = self.plans.load_spec
        return CPULoadStoreSpec(cpu.block_ids[:n]), GPULoadStoreSpec(gpu.block_ids[:n])

    def run(self, spec, spin: bool = True):
        """One transfer, call to result: (wall ns, GPU ns, moved zero-copy)."""
        t0 = time.monotonic_ns()
        assert self.handlers.transfer_async(next(self.jobs), spec)
        result = None
        while result is None:
            for r in self.handlers.get_finished():
                result = r
            if not spin:
                time.sleep(0)
        wall = time.monotonic_ns() - t0
        assert result.success
        zero = self.loops[Direction.of(spec)].stamps().zero_copy
        return wall, int(result.transfer_time * 1e9), zero

    def close(self) -> None:
        self.handlers.shutdown()
        for b in self.built.values():
            b.close()


def gpu_times(r: Rig, blocks: list[int], reps: int) -> list[dict]:
    rows = []
    for direction in Direction:
        for n in blocks:
            spec = r.spec(direction, n)
            got = {m: [] for m in MODES}
            for rep in range(reps + 3):
                for m in MODES:
                    r.mode(m)
                    _, gpu, zero = r.run(spec)
                    assert zero == (m == "zero"), (m, zero)
                    if rep >= 3:
                        got[m].append(gpu)
            rows.append({"direction": direction.label, "blocks": n,
                         "bytes": n * r.pair_bytes,
                         **{f"{m}_gpu_us": float(np.median(v)) / 1e3 for m, v in got.items()}})
    return rows


def one_block_spin(r: Rig, steps: int) -> dict:
    spec = r.plans.one_load_spec
    got = {m: [] for m in MODES}
    for i in range(steps + 10):
        for m in MODES:
            r.mode(m)
            python_for(STEP_PYTHON_S)
            wall, _, _ = r.run(spec)
            if i >= 10:
                got[m].append(wall)
    out = {}
    for m, v in got.items():
        out[f"{m}_p50_us"] = float(np.percentile(v, 50)) / 1e3
        out[f"{m}_p99_us"] = float(np.percentile(v, 99)) / 1e3
    return out


def matmul_cost(rig: GpuRig, r: Rig, rounds: int, blocks: int) -> dict:
    torch = rig.torch
    n = 8192
    a = torch.randn(n, n, device=rig.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=rig.device, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    stream = torch.cuda.Stream(device=rig.device)
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    spec = r.spec(Direction.CPU_TO_GPU, blocks)

    def once(mode: str | None) -> tuple[float, int]:
        with torch.cuda.stream(stream):
            start.record(stream)
            for _ in range(60):
                torch.mm(a, b, out=c)
            end.record(stream)
        loads = 0
        if mode is not None:
            r.mode(mode)
            while not end.query():
                r.run(spec)
                loads += 1
                python_for(0.0003)
        end.synchronize()
        return start.elapsed_time(end), loads

    once(None)
    got: dict[str, list[float]] = {"solo": [], "ring": [], "zero": []}
    loads: dict[str, list[int]] = {"ring": [], "zero": []}
    for _ in range(rounds):
        for m in ("solo", "ring", "zero"):
            ms, k = once(None if m == "solo" else m)
            got[m].append(ms)
            if m != "solo":
                loads[m].append(k)
    solo = float(np.median(got["solo"]))
    return {"solo_ms": solo, "blocks": blocks,
            **{f"{m}_of_solo": [round(solo / x, 4) for x in got[m]] for m in ("ring", "zero")},
            **{f"{m}_loads": loads[m] for m in loads}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--page-kib", nargs="+", type=int, default=[16, 32, 64])
    p.add_argument("--blocks", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--matmul-bytes", type=int, default=4 << 20,
                   help="the loads beside the matmul: as many blocks as fit (at least one)")
    p.add_argument("--json")
    args = p.parse_args()
    rig, ceiling = probe_rig()
    out = {"ceiling": ceiling, "pages": []}
    for kib in args.page_kib:
        r = Rig(rig, kib)
        try:
            rows = gpu_times(r, args.blocks, args.reps)
            spin = one_block_spin(r, args.steps)
            mm = matmul_cost(rig, r, args.rounds, max(1, args.matmul_bytes // r.pair_bytes))
        finally:
            r.close()
        wire = r.pair_bytes / (ceiling["cpu_to_gpu"] * 1e9) * 1e6
        page = {"workload": r.w.label(), "block_bytes": r.pair_bytes, "wire_us": wire,
                "target_us": 1.5 * wire + 20, "gpu": rows, "spin": spin, "matmul": mm}
        out["pages"].append(page)
        print(f"== {r.w.label()}: one block {r.pair_bytes} B, wire {wire:.0f} us, "
              f"target {1.5 * wire + 20:.0f} us", flush=True)
        for row in rows:
            ideal = row["bytes"] / (ceiling[row["direction"]] * 1e9) * 1e6
            print(f"  {row['direction']:10s} {row['blocks']:3d} blocks  ring "
                  f"{row['ring_gpu_us']:7.1f} us  zero {row['zero_gpu_us']:7.1f} us  "
                  f"(wire {ideal:.1f}; zero/ring {row['zero_gpu_us'] / row['ring_gpu_us']:.2f})",
                  flush=True)
        print("  one-block load spin, p50/p99 us: ring {ring_p50_us:.0f}/{ring_p99_us:.0f}  "
              "zero {zero_p50_us:.0f}/{zero_p99_us:.0f}".format(**spin), flush=True)
        if mm:
            print(f"  matmul solo {mm['solo_ms']:.1f} ms; of solo with {mm['blocks']}-block "
                  "loads beside: "
                  f"ring {mm['ring_of_solo']} ({mm['ring_loads']} loads), zero "
                  f"{mm['zero_of_solo']} ({mm['zero_loads']} loads)", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()

"""Plain pinned copies on N GPUs at once, each GPU's host buffer placed on its own NUMA node
("local") or on another node ("remote"): the ceiling tiercache's ranks are compared with
(GPU machine; not a test). Issue 34's measurement; run by benchmarks/numa_bench.py.

One process per GPU (spawn). Each maps an anonymous host buffer, binds it to the chosen
node before touching it (``mbind`` MPOL_PREFERRED, then a pre-fault), counts where its
pages are (``move_pages``), page-locks it (``cuMemHostRegister``) and, after a barrier,
copies it to and from its GPU ``--reps`` times per direction on a stream of its own.
First GPU 0 alone, then every GPU at once; a GPU's rate is its bytes over its own wall
time, the aggregate all bytes over the union of the windows (CLOCK_MONOTONIC is one clock
for the host's processes), as ``tiercache demo --bench`` counts.

    PYTHONPATH=. python3 benchmarks/numa_copy_ceiling.py --gpus 8 --placement local \
        [--mib 1024] [--reps 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing as mp
import sys
import time

import numpy as np

DIRECTIONS = ("gpu_to_cpu", "cpu_to_gpu")
GB = 1e9


def _target(placement: str, gpu_node: int | None, memory_nodes: tuple[int, ...]) -> int | None:
    if gpu_node is None:
        return None
    if placement == "local":
        return gpu_node
    others = [n for n in memory_nodes if n != gpu_node]
    return others[0] if others else None


def gpu_main(index: int, args, barrier, phases, q) -> None:
    import torch

    from tiercache.device.locality import gpu_node
    from tiercache.device.pinning import HostPinner
    from tiercache.numa.mempolicy import bind_preferred, page_nodes
    from tiercache.numa.topology import HostTopology
    from tiercache.region.hostmem import prefault

    torch.cuda.set_device(index)
    torch.cuda.init()
    topology = HostTopology.read()
    choice = gpu_node(index, topology)
    target = _target(args.placement, choice.node, topology.memory_nodes)
    n = args.mib << 20
    buf = mmap.mmap(-1, n)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    if target is not None:
        bind_preferred(address, n, target)
    view = np.frombuffer(buf, dtype=np.uint8)
    prefault(address, view, [(off, min(n - off, 256 << 20)) for off in range(0, n, 256 << 20)],
             4)
    nodes = page_nodes(address, n)
    on_target = float(np.count_nonzero(nodes == target)) / len(nodes) if target is not None \
        else None
    pinner = HostPinner(index)
    pinner.pin([(address, n)])
    host = torch.frombuffer(buf, dtype=torch.uint8)
    gpu = torch.empty(n, dtype=torch.uint8, device=f"cuda:{index}")
    stream = torch.cuda.Stream()
    info = {"gpu": index, "gpu_node": choice.node, "why": choice.why, "host_node": target,
            "host_on_node_ratio": on_target}
    for phase in phases:  # (name, gpus taking part)
        for direction in DIRECTIONS:
            barrier.wait()
            if index not in phase[1]:
                continue
            dst, src = (host, gpu) if direction == "gpu_to_cpu" else (gpu, host)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)  # warm-up
            stream.synchronize()
            start = time.monotonic_ns()
            with torch.cuda.stream(stream):
                for _ in range(args.reps):
                    dst.copy_(src, non_blocking=True)
            stream.synchronize()
            end = time.monotonic_ns()
            q.put({**info, "phase": phase[0], "direction": direction, "bytes": n * args.reps,
                   "started_ns": start, "ended_ns": end})
    del host
    pinner.unpin()
    q.put({"gpu": index, "done": True})


def _aggregate(rows: list[dict]) -> dict:
    window = (max(r["ended_ns"] for r in rows) - min(r["started_ns"] for r in rows)) / 1e9
    total = sum(r["bytes"] for r in rows)
    return {"gpus": len(rows), "gbps": total / window / GB,
            "per_gpu_gbps": {r["gpu"]: r["bytes"] / ((r["ended_ns"] - r["started_ns"]) / 1e9)
                             / GB for r in rows}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--placement", choices=["local", "remote"], required=True)
    ap.add_argument("--mib", type=int, default=1024, help="host buffer per GPU")
    ap.add_argument("--reps", type=int, default=10, help="copies per direction and phase")
    ap.add_argument("--json")
    args = ap.parse_args()
    everyone = list(range(args.gpus))
    phases = [("gpu0_alone", [0]), ("all", everyone)]
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(args.gpus), ctx.Queue()
    procs = [ctx.Process(target=gpu_main, args=(i, args, barrier, phases, q)) for i in everyone]
    for p in procs:
        p.start()
    rows, done = [], 0
    while done < args.gpus:
        row = q.get(timeout=900)
        if row.get("done"):
            done += 1
        else:
            rows.append(row)
    for p in procs:
        p.join(60)
    if any(p.exitcode for p in procs):
        print(f"a GPU process failed: exit codes {[p.exitcode for p in procs]}", file=sys.stderr)
        return 1
    gpus = {r["gpu"]: {k: r[k] for k in ("gpu", "gpu_node", "why", "host_node",
                                         "host_on_node_ratio")} for r in rows}
    doc = {"placement": args.placement, "gpus": args.gpus, "mib": args.mib, "reps": args.reps,
           "per_gpu": [gpus[i] for i in everyone], "phases": {}}
    for name, _ in phases:
        doc["phases"][name] = {d: _aggregate([r for r in rows if r["phase"] == name
                                              and r["direction"] == d]) for d in DIRECTIONS}
    for name, dirs in doc["phases"].items():
        print(f"{args.placement} {name}: " + ", ".join(
            f"{d} {v['gbps']:.1f} GB/s" for d, v in dirs.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

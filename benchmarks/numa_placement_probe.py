"""Where a region's pages land, and what placing them costs (CPU; any host, any node count).

For placement on and off, in turn: the coordinator creates a region (``posix_fallocate``
after the slices are bound, or without binding), then one process per rank attaches
its slice, pre-faults it with the placement around it (``prefault_slice``, as
``tiercache.attach`` does) and reports the seconds and the ``NumaPlacement`` its stats
block records; each rank's device is GPU r when CUDA is present (its PCI node), else the
node the coordinator planned for rank r. Also: how much ``Shmem`` grew at
``posix_fallocate`` (does it allocate the pages?), whether a process that has not touched
them sees them (``move_pages`` before and after its pre-fault), and the time to count a
slice's pages with ``move_pages`` (threads) against reading ``/proc/self/numa_maps``.

    PYTHONPATH=. python3 benchmarks/numa_placement_probe.py [--gib 4] [--ranks 2] [--threads 2]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import re
import time

import numpy as np

from tiercache.config import Config, ExporterConfig, KVGeometry, RegionConfig
from tiercache.numa.mempolicy import PAGE_BYTES, page_nodes
from tiercache.numa.topology import HostTopology, NodeChoice
from tiercache.region.shared import SharedOffloadRegion


def shmem_bytes() -> int:
    with open("/proc/meminfo") as f:
        return int(re.search(r"Shmem:\s+(\d+) kB", f.read()).group(1)) * 1024


def _node_for(rank: int, world: int) -> NodeChoice:
    topology = HostTopology.read()
    try:
        import torch

        if torch.cuda.is_available() and rank < torch.cuda.device_count():
            from tiercache.device.locality import gpu_node

            torch.cuda.init()
            return gpu_node(rank, topology)
    except ImportError:
        pass
    return topology.rank_nodes(world)[rank]


def rank_main(name: str, rank: int, world: int, threads: int, placement: bool, q) -> None:
    region = SharedOffloadRegion.attach(name, rank, timeout_s=60)
    try:
        layout = region.layout
        start = region.base_address + layout.slice_offset(rank)
        used = -(-layout.slice_used_bytes // PAGE_BYTES) * PAGE_BYTES
        before = page_nodes(start, used)
        node = _node_for(rank, world)
        prefault_s = region.prefault_slice(threads, node, placement)
        numa = region.stats(rank).snapshot().numa
        t0 = time.perf_counter()
        after = page_nodes(start, used)  # one thread: the count alone
        count_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        with open("/proc/self/numa_maps") as f:
            f.read()
        numa_maps_s = time.perf_counter() - t0
        nodes, counts = np.unique(after, return_counts=True)
        q.put({"rank": rank, "node": node.node, "why": node.why, "prefault_s": prefault_s,
               "placement": {"state": numa.state.label, "node": numa.node,
                             "local_ratio": numa.local_ratio, "seconds": numa.seconds},
               "mapped_before_prefault": int(np.count_nonzero(before >= 0)),
               "pages": len(after),
               "pages_by_node": {int(n): int(c) for n, c in zip(nodes, counts)},
               "count_one_thread_s": count_s, "numa_maps_read_s": numa_maps_s})
    finally:
        region.close()


def run(args: argparse.Namespace, placement: bool) -> dict:
    name = f"numa-probe-{os.getpid()}-{int(placement)}"
    config = Config(name=name, world_size=args.ranks, kv=KVGeometry(page_bytes=(32768,) * 64),
                    region=RegionConfig(capacity_bytes=args.gib << 30,
                                        prefault_threads=args.threads,
                                        numa_placement=placement),
                    exporter=ExporterConfig(enabled=False))
    shmem0 = shmem_bytes()
    said: list[str] = []
    t0 = time.perf_counter()
    region = SharedOffloadRegion.create(config, log_step=said.append)
    create_s = time.perf_counter() - t0
    grown = shmem_bytes() - shmem0
    try:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=rank_main, args=(name, r, args.ranks, args.threads,
                                                     placement, q))
                 for r in range(args.ranks)]
        for p in procs:
            p.start()
        ranks = sorted((q.get(timeout=600) for _ in procs), key=lambda r: r["rank"])
        for p in procs:
            p.join(60)
    finally:
        region.close()
    return {"numa_placement": placement, "region_bytes": region.layout.total_bytes,
            "create_s": create_s, "allocate_s": region.setup_times.allocate_s,
            "shmem_growth_bytes_at_create": grown, "coordinator_said": said, "ranks": ranks}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    topology = HostTopology.read()
    doc = {"memory_nodes": topology.memory_nodes,
           "gpus": [dataclasses.asdict(g) for g in topology.gpus],
           "runs": [run(args, placement) for placement in (True, False)]}
    for r in doc["runs"]:
        print(f"numa_placement={r['numa_placement']}: region {r['region_bytes'] / 2**30:.2f} GiB,"
              f" create {r['create_s']:.2f} s (fallocate {r['allocate_s']:.2f} s), Shmem grew "
              f"{r['shmem_growth_bytes_at_create'] / 2**30:.2f} GiB at create")
        for line in r["coordinator_said"]:
            if line.startswith("NUMA"):
                print("  coordinator:", line)
        for k in r["ranks"]:
            p = k["placement"]
            print(f"  rank {k['rank']}: device node {k['node']} ({k['why']}); mapped before "
                  f"its pre-fault: {k['mapped_before_prefault']} of {k['pages']} pages; "
                  f"pre-fault {k['prefault_s']:.2f} s; placement {p['state']} node {p['node']} "
                  f"ratio {p['local_ratio']} in {p['seconds']:.3f} s; pages by node "
                  f"{k['pages_by_node']}; count (1 thread) {k['count_one_thread_s']:.3f} s, "
                  f"numa_maps read {k['numa_maps_read_s']:.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()

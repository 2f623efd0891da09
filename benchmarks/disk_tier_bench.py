"""Disk tier throughput against the same disk's raw O_DIRECT rate, measured in one run.

    PYTHONPATH=. python3 benchmarks/disk_tier_bench.py --dir /some/local/dir [--blocks 256]

Raw (the ceiling): O_DIRECT ``pwritev``/``preadv`` from page-aligned buffers, large
sequential (16 MiB per call, one thread) and 2 MiB random (``--threads`` threads at queue
depth 1 each), over a file of the tier's size. Then the tier itself (a real region, index
and ``DiskTier`` in this process, the coordinator's code path): demotion throughput
(every host block written ahead of eviction), promotion throughput (every block read back
into host memory and its CRC checked), and the latency of promoting one block, from the
lookup that starts it to READY. Each figure is also given as a ratio to the raw rate of the
same direction and block size. Prints a markdown table; ``--json`` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

MIB = 1 << 20


def raw_rates(path: str, total_bytes: int, block_bytes: int, threads: int) -> dict:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    os.posix_fallocate(fd, 0, total_bytes)
    out = {}
    big = mmap.mmap(-1, 16 * MIB)
    big.write(os.urandom(16 * MIB))
    for name, call in (("seq_write", os.pwritev), ("seq_read", os.preadv)):
        start = time.perf_counter()
        for offset in range(0, total_bytes, 16 * MIB):
            call(fd, [memoryview(big)[:min(16 * MIB, total_bytes - offset)]], offset)
        if call is os.pwritev:
            os.fsync(fd)
        out[name] = total_bytes / (time.perf_counter() - start)
    num_blocks = total_bytes // block_bytes
    order = np.random.default_rng(1).permutation(num_blocks)
    for name, call in (("rand_write", os.pwritev), ("rand_read", os.preadv)):
        parts = np.array_split(order, threads)

        def work(part):
            buf = mmap.mmap(-1, block_bytes)
            for b in part.tolist():
                call(fd, [memoryview(buf)], b * block_bytes)

        workers = [threading.Thread(target=work, args=(p,)) for p in parts]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if call is os.pwritev:
            os.fsync(fd)
        out[name] = num_blocks * block_bytes / (time.perf_counter() - start)
    one = mmap.mmap(-1, block_bytes)
    latencies = []
    for b in order[:20].tolist():  # one 2 MiB read alone (QD1, nothing else in flight)
        start = time.perf_counter()
        os.preadv(fd, [memoryview(one)], b * block_bytes)
        latencies.append(time.perf_counter() - start)
    out["one_read_ms_p50"] = statistics.median(latencies) * 1e3
    os.close(fd)
    os.unlink(path)
    return out


def tier_rates(directory: str, num_blocks: int, block_bytes: int, threads: int) -> dict:
    from tiercache.config import Config, DiskConfig, ExporterConfig, KVGeometry, RegionConfig
    from tiercache.index.manager import OffloadingManager
    from tiercache.region.ledger import IndexLedger
    from tiercache.region.shared import SharedOffloadRegion
    from tiercache.tiers.disk import DiskTier
    from tiercache.tiers.disk_file import DiskSlotFile

    config = Config(name=f"disk-bench-{os.getpid()}", world_size=1,
                    kv=KVGeometry(page_bytes=(block_bytes,), block_size_factor=1),
                    region=RegionConfig(capacity_bytes=None, num_blocks=num_blocks,
                                        prefault_threads=4),
                    exporter=ExporterConfig(enabled=False),
                    disk=DiskConfig(path=directory, capacity_bytes=num_blocks * (block_bytes + 8192)))
    region = SharedOffloadRegion.create(config)
    try:
        layout = region.layout
        manager = OffloadingManager(num_blocks, ledger=IndexLedger(region.ledger_array()),
                                    region_id=region.region_id)
        file = DiskSlotFile(config.disk.file_path(config.name), config.disk.capacity_bytes,
                            world_size=1, row_stride=layout.row_stride,
                            layout_digest=layout.digest)
        rows = lambda slot: [memoryview(region.rank_array(0)[slot])]  # noqa: E731
        tier = DiskTier(file, manager, rows, io_threads=threads, low_watermark=0.999,
                        queue_blocks=num_blocks, poll_s=0.001)
        manager.set_lower_tiers([tier])
        keys = [b"bench-%d" % i for i in range(num_blocks)]
        out = manager.prepare_store(keys)
        data = region.rank_array(0)
        data[:] = np.random.default_rng(2).integers(0, 256, data.shape, dtype=np.uint8)
        manager.complete_store(keys)
        for key in keys:  # reused blocks: always admitted
            manager.lease([key])
            manager.release([key])
        result = {"direct_io": file.direct_io}
        print("tier: demoting", file=sys.stderr)
        tier.start()
        start = time.perf_counter()
        while tier.snapshot().demotions < num_blocks:
            time.sleep(0.001)
        result["demote"] = num_blocks * block_bytes / (time.perf_counter() - start)
        print("tier: promoting", file=sys.stderr)
        manager.reset()  # host memory forgets every block: they are on disk only
        start = time.perf_counter()
        for i in range(0, num_blocks, 32):
            manager.lookup(keys[i:i + 32])  # starts the promotions (pending)
        while manager.lookup(keys[-1:]) == 0 or tier.snapshot().promotions < num_blocks:
            time.sleep(0.001)
        result["promote"] = num_blocks * block_bytes / (time.perf_counter() - start)
        assert tier.snapshot().checksum_failures == 0
        print("tier: one block at a time", file=sys.stderr)
        latencies = []
        for key in keys[:20]:  # one block at a time, from the lookup that starts it to READY
            manager.reset()
            start = time.perf_counter()
            manager.lookup([key])
            while manager.lookup([key]) == 0:
                time.sleep(0.0001)
            latencies.append(time.perf_counter() - start)
        result["one_block_ms_p50"] = statistics.median(latencies) * 1e3
        result["one_block_ms_max"] = max(latencies) * 1e3
        tier.close()
        del out
        return result
    finally:
        region.close()
        try:
            os.unlink(config.disk.file_path(config.name))
        except FileNotFoundError:
            pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the disk")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--block-mib", type=int, default=2)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    block = args.block_mib * MIB
    total = args.blocks * block
    print(f"disk tier bench: {args.blocks} blocks of {args.block_mib} MiB in {args.dir}, "
          f"{args.threads} threads", file=sys.stderr)
    raw = raw_rates(os.path.join(args.dir, f"raw-{os.getpid()}.bin"), total, block, args.threads)
    print("raw: done", file=sys.stderr)
    tier = tier_rates(args.dir, args.blocks, block, args.threads)
    gb = 1e9
    print("| what | GB/s | ratio to raw (same run) |\n|---|---|---|")
    print(f"| raw O_DIRECT sequential write (16 MiB calls) | {raw['seq_write'] / gb:.2f} | 1 |")
    print(f"| raw O_DIRECT sequential read (16 MiB calls) | {raw['seq_read'] / gb:.2f} | 1 |")
    print(f"| raw O_DIRECT 2 MiB random write ({args.threads} threads, QD1) | "
          f"{raw['rand_write'] / gb:.2f} | 1 |")
    print(f"| raw O_DIRECT 2 MiB random read ({args.threads} threads, QD1) | "
          f"{raw['rand_read'] / gb:.2f} | 1 |")
    print(f"| tier demotion (host → disk, {args.threads} I/O threads) | {tier['demote'] / gb:.2f} | "
          f"{tier['demote'] / raw['rand_write']:.2f} of random write |")
    print(f"| tier promotion (disk → host, CRC checked) | {tier['promote'] / gb:.2f} | "
          f"{tier['promote'] / raw['rand_read']:.2f} of random read |")
    print(f"| one 2 MiB block promoted, lookup to READY | p50 {tier['one_block_ms_p50']:.2f} ms, "
          f"max {tier['one_block_ms_max']:.2f} ms | raw: one 2 MiB read alone p50 "
          f"{raw['one_read_ms_p50']:.2f} ms |")
    print(f"(tier I/O: {'O_DIRECT' if tier['direct_io'] else 'buffered'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"raw": raw, "tier": tier, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

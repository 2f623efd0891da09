"""Cluster tier throughput against Mooncake Store's own batch put/get, measured in one run.

    PYTHONPATH=. python3 benchmarks/cluster_tier_bench.py [--blocks 128] [--block-mib 2]
        [--protocol tcp] [--publish-threads N] [--promote-threads N] [--json PATH]

Starts a ``mooncake_master`` on loopback (free ports; its HTTP metadata server in the same
process) and two nodes in this process, each a Mooncake client with its own segment.

* **Ceiling**: Mooncake's own ``batch_put_from`` / ``batch_get_into`` of ``--blocks``
  objects of ``--block-mib`` MiB between registered buffers (node A puts, node B gets),
  in batches of the sizes the tier uses (16 for puts, 32 for gets), from 1, 2 and 4
  threads at once (the best counts: the tier also keeps several calls in flight); and one
  object got alone (p50).

Each figure is the best of ``--rounds`` rounds (fresh names each round, the last round's
objects removed first, so every round writes segment memory the previous one touched: the
first round pays the segments' page faults, for the ceiling and the tier alike).
* **Tier**: the coordinator's code path without its processes: on node A a real region,
  index and ``ClusterTier`` publish every block an engine stores (write-through: header,
  CRC and the cluster's MAC over the host row, copied into staging, put from there); on
  node B a second region, index and ``ClusterTier`` promote them on lookup (exists,
  reserve host slots, get into staging, copy into the slots, check header, CRC and MAC,
  READY);
  then one block at a time, from the lookup that starts it to READY (the pool asked
  whether it has the block each time: ``exists_ttl_s`` ~0). Every promoted block is
  compared byte for byte with what node A stored.

Prints a markdown table with each tier figure's ratio to the ceiling of its direction;
``--json`` writes the numbers.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

MIB = 1 << 20
PUT_BATCH, GET_BATCH = 16, 32
CEILING_CALLERS = (1, 2, 4)  # Mooncake's own calls from this many threads at once: the best


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def master_binary() -> str:
    """``$MOONCAKE_MASTER``, else the binary inside the installed ``mooncake`` package (what
    its ``mooncake_master`` console script runs; found wherever pip put the package)."""
    if os.environ.get("MOONCAKE_MASTER"):
        return os.environ["MOONCAKE_MASTER"]
    import importlib.util

    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the mooncake package is not installed "
                         "(pip install mooncake-transfer-engine-non-cuda==0.3.13.post1)")
    binary = os.path.join(list(spec.submodule_search_locations)[0], "mooncake_master")
    if not os.access(binary, os.X_OK):
        os.chmod(binary, os.stat(binary).st_mode | 0o111)
    return binary


def start_master(workdir: str):
    rpc, http, metrics = free_port(), free_port(), free_port()
    binary = master_binary()
    log = open(os.path.join(workdir, "master.log"), "w")
    proc = subprocess.Popen(
        [binary, f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
         "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
         f"--http_metadata_server_port={http}", "--metrics_host=127.0.0.1",
         f"--metrics_port={metrics}", "--enable_metric_reporting=false",
         "--default_kv_lease_ttl=1000"],  # a get holds its objects 1 s (rounds remove)
        stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    for port in (rpc, http):
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    proc.kill()
                    raise SystemExit("mooncake_master did not start: see " + log.name) from None
                time.sleep(0.05)
    return proc, f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata"


def make_key_file(workdir: str) -> str:
    """The cluster's key (``cluster.key_file``) for the run's nodes: 32 random bytes, 0600."""
    path = os.path.join(workdir, "cluster.key")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
        f.write(os.urandom(32))
    return path


def cluster_config(master: str, metadata: str, segment_bytes: int, protocol: str,
                   key_file: str, **kw):
    from tiercache.config import ClusterConfig

    return ClusterConfig(master=master, metadata_server=metadata, local_hostname="127.0.0.1",
                         key_file=key_file, segment_bytes=segment_bytes, protocol=protocol,
                         **kw)


def ceiling(master: str, metadata: str, blocks: int, block_bytes: int, protocol: str,
            rounds: int, key_file: str) -> dict:
    """Mooncake's own batch put and get of the same sizes, node A to node B."""
    from tiercache.tiers.mooncake_pool import MooncakePool

    segment = int(blocks * block_bytes * 1.25)
    a = MooncakePool(cluster_config(master, metadata, segment, protocol, key_file))
    b = MooncakePool(cluster_config(master, metadata, segment, protocol, key_file))
    a.open()
    b.open()
    src, dst = mmap.mmap(-1, blocks * block_bytes), mmap.mmap(-1, blocks * block_bytes)
    src_at = ctypes.addressof(ctypes.c_char.from_buffer(src))
    dst_at = ctypes.addressof(ctypes.c_char.from_buffer(dst))
    try:
        src.write(np.random.default_rng(3).integers(0, 256, len(src), np.uint8).tobytes())
        dst.write(bytes(len(dst)))  # both buffers faulted in, as the region is
        a.register(src_at, len(src))
        b.register(dst_at, len(dst))
        parts = [[(src_at + i * block_bytes, block_bytes)] for i in range(blocks)]
        into = [[(dst_at + i * block_bytes, block_bytes)] for i in range(blocks)]
        out = {"put": 0.0, "get": 0.0, "put_callers": 0, "get_callers": 0}
        names: list[str] = []

        def put(batches: list[range]) -> None:
            for part in batches:
                assert set(a.put_from([names[i] for i in part], [parts[i] for i in part])) \
                    == {0}

        def get(batches: list[range]) -> None:
            for part in batches:
                got = b.get_into([names[i] for i in part], [into[i] for i in part])
                assert set(got) == {block_bytes}, got

        for r in range(rounds):
            for callers in CEILING_CALLERS:
                remove_all(a, names)
                names = [f"raw/{r}/{callers}/{i}" for i in range(blocks)]
                dst[:len(dst)] = bytes(len(dst))
                for verb, batch, call in (("put", PUT_BATCH, put), ("get", GET_BATCH, get)):
                    rate = blocks * block_bytes / in_parallel(call, blocks, batch, callers)
                    if rate > out[verb]:
                        out[verb], out[f"{verb}_callers"] = rate, callers
                assert src[:] == dst[:], "Mooncake's own get returned other bytes"
        latencies = []
        for i in range(20):  # one object alone (with its exists, as a lookup asks)
            start = time.perf_counter()
            b.exists(names[i:i + 1])
            b.get_into(names[i:i + 1], into[i:i + 1])
            latencies.append(time.perf_counter() - start)
        out["one_ms_p50"] = statistics.median(latencies) * 1e3
        return out
    finally:
        a.close()
        b.close()
        del src_at, dst_at


def in_parallel(call, blocks: int, batch: int, callers: int) -> float:
    """Seconds for ``callers`` threads to ``call`` their share of the blocks' batches
    (batch ``k`` to thread ``k % callers``)."""
    batches = [range(i, min(i + batch, blocks)) for i in range(0, blocks, batch)]
    failed: list[BaseException] = []

    def run(mine: list[range]) -> None:
        try:
            call(mine)
        except BaseException as e:  # re-raised below, in the caller's thread
            failed.append(e)
    threads = [threading.Thread(target=run, args=(batches[k::callers],))
               for k in range(callers)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    if failed:
        raise failed[0]
    return seconds


def remove_all(pool, names: list[str]) -> None:
    """Remove objects (once their read leases ran out)."""
    deadline = time.monotonic() + 10
    while names and time.monotonic() < deadline:
        names = [n for n, code in zip(names, pool.remove(names)) if code != 0]
        time.sleep(0.02)


class Node:
    """A region, its index and a cluster tier, as a coordinator wires them."""

    def __init__(self, name: str, blocks: int, block_bytes: int, cfg):
        from tiercache.config import Config, ExporterConfig, KVGeometry, RegionConfig
        from tiercache.index.manager import OffloadingManager
        from tiercache.region.ledger import IndexLedger
        from tiercache.region.shared import SharedOffloadRegion
        from tiercache.tiers.cluster import ClusterTier
        from tiercache.tiers.cluster_key import load_cluster_key
        from tiercache.tiers.cluster_object import BlockFormat
        from tiercache.tiers.mooncake_pool import MooncakePool

        config = Config(name=f"cluster-bench-{name}-{os.getpid()}", world_size=1,
                        kv=KVGeometry(page_bytes=(block_bytes,), block_size_factor=1),
                        region=RegionConfig(capacity_bytes=None, num_blocks=blocks,
                                            prefault_threads=2),
                        exporter=ExporterConfig(enabled=False), cluster=cfg)
        self.region = region = SharedOffloadRegion.create(config)
        layout = region.layout
        self.manager = OffloadingManager(blocks, ledger=IndexLedger(region.ledger_array()),
                                         region_id=region.region_id)
        self.pool = MooncakePool(cfg)
        self.pool.open()  # the region is not registered: blocks move through staging

        def rows(slot):
            row = region.rank_array(0)[slot]
            return [(row.ctypes.data, memoryview(row))]

        self.format = fmt = BlockFormat.of(layout, load_cluster_key(cfg.key_file))
        self.tier = ClusterTier(self.pool, self.manager, fmt, rows,
                                capacity_blocks=cfg.segment_bytes // fmt.object_bytes,
                                publish_queue_blocks=cfg.publish_queue_blocks,
                                exists_ttl_s=cfg.exists_ttl_s, retry_s=cfg.retry_s,
                                publish_threads=cfg.publish_threads,
                                promote_threads=cfg.promote_threads)
        self.manager.set_lower_tiers([self.tier])
        self.tier.start()

    def close(self) -> None:
        self.manager.set_lower_tiers([])
        self.tier.close()
        self.pool.close()
        self.region.close()


def tier_rates(master: str, metadata: str, blocks: int, block_bytes: int, protocol: str,
               rounds: int, key_file: str, **threads) -> dict:
    segment = int(blocks * (block_bytes + 4096) * 1.25)
    a = Node("a", blocks, block_bytes, cluster_config(
        master, metadata, segment, protocol, key_file, publish_queue_blocks=blocks,
        **threads))
    b = Node("b", blocks, block_bytes, cluster_config(
        master, metadata, segment, protocol, key_file, exists_ttl_s=1e-3, **threads))
    try:
        result = {"publish": 0.0, "promote": 0.0}
        keys: list[bytes] = []
        for r in range(rounds):
            remove_all(a.pool, [a.format.name(k, 0) for k in keys])
            a.manager.reset()
            b.manager.reset()
            keys = [b"bench-%d-%d" % (r, i) for i in range(blocks)]
            publish, promote = one_round(a, b, keys, block_bytes)
            result["publish"] = max(result["publish"], publish)
            result["promote"] = max(result["promote"], promote)
        print("tier: one block at a time", file=sys.stderr)
        latencies = []
        for key in keys[-20:]:  # from the lookup that starts it to READY
            b.manager.reset()
            time.sleep(0.002)  # the tier's exists answer (1 ms) is stale: asked again
            start = time.perf_counter()
            b.manager.lookup([key])
            while b.manager.lookup([key]) == 0:
                time.sleep(0.0001)
            latencies.append(time.perf_counter() - start)
        result["one_ms_p50"] = statistics.median(latencies) * 1e3
        result["one_ms_max"] = max(latencies) * 1e3
        return result
    finally:
        a.close()
        b.close()


def wait_for_count(tier, counter: str, target: int, failures: tuple[str, ...] = (),
                   timeout_s: float = 120.0) -> None:
    """Until ``tier.stats.<counter>`` reaches ``target``, polling every 0.5 ms; a failure
    counter that moves, or the timeout, stops the benchmark."""
    stats, deadline = tier.stats, time.monotonic() + timeout_s
    while getattr(stats, counter) < target:
        if any(getattr(stats, f) for f in failures) or time.monotonic() > deadline:
            raise SystemExit(f"the tier stopped short: {tier.snapshot()}")
        time.sleep(0.0005)


def one_round(a: Node, b: Node, keys: list[bytes], block_bytes: int) -> tuple[float, float]:
    """Publish ``keys`` from node A, promote them on node B: (publish, promote) bytes/s."""
    blocks = len(keys)
    data = a.region.rank_array(0)
    out = a.manager.prepare_store(keys)
    data[out.store_spec.block_ids] = np.random.default_rng(len(keys)).integers(
        0, 256, (blocks, data.shape[1]), dtype=np.uint8)
    published = a.tier.stats.demotions
    print("tier: publishing", file=sys.stderr)
    start = time.perf_counter()
    a.manager.complete_store(keys)  # an engine's store: every block queued to publish
    # the counters read without the tier's lock or a snapshot: this thread polls for the
    # whole run and must not take CPU or the lock from the threads it measures (the
    # ceiling's loop has no poller beside it)
    wait_for_count(a.tier, "demotions", published + blocks)
    publish = blocks * block_bytes / (time.perf_counter() - start)
    stats = a.tier.snapshot()
    assert (stats.dropped_spills, stats.errors) == (0, 0), stats
    promoted = b.tier.stats.promotions
    print("tier: promoting", file=sys.stderr)
    start = time.perf_counter()
    for i in range(0, blocks, GET_BATCH):
        b.manager.lookup(keys[i:i + GET_BATCH])  # starts the promotions (pending)
    wait_for_count(b.tier, "promotions", promoted + blocks, failures=("checksum_failures",
                                                                       "errors"))
    promote = blocks * block_bytes / (time.perf_counter() - start)
    spec_a = a.manager.prepare_load(keys)
    spec_b = b.manager.prepare_load(keys)
    assert np.array_equal(data[spec_a.block_ids], b.region.rank_array(0)[spec_b.block_ids]), \
        "node B promoted other bytes than node A stored"
    a.manager.complete_load(keys)
    b.manager.complete_load(keys)
    return publish, promote


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--block-mib", type=int, default=2)
    ap.add_argument("--protocol", default="tcp", choices=("tcp", "rdma"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--publish-threads", type=int, help="cluster.publish_threads "
                    "(default: the config's)")
    ap.add_argument("--promote-threads", type=int, help="cluster.promote_threads "
                    "(default: the config's)")
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ.setdefault("GLOG_minloglevel", "2")
    block = args.block_mib * MIB
    with tempfile.TemporaryDirectory(prefix="cluster-bench-") as workdir:
        key_file = make_key_file(workdir)
        proc, master, metadata = start_master(workdir)
        try:
            print(f"cluster tier bench: {args.blocks} blocks of {args.block_mib} MiB, "
                  f"{args.protocol} on loopback", file=sys.stderr)
            raw = ceiling(master, metadata, args.blocks, block, args.protocol, args.rounds,
                          key_file)
            print("ceiling: done", file=sys.stderr)
            threads = {k: v for k, v in (("publish_threads", args.publish_threads),
                                         ("promote_threads", args.promote_threads)) if v}
            tier = tier_rates(master, metadata, args.blocks, block, args.protocol,
                              args.rounds, key_file, **threads)
        finally:
            proc.terminate()
            proc.wait(10)
    gb = 1e9
    print("| what | GB/s | ratio to Mooncake's own (same run) |\n|---|---|---|")
    print(f"| Mooncake batch put, node A ({PUT_BATCH} × {args.block_mib} MiB per call, "
          f"best with {raw['put_callers']} caller(s)) | {raw['put'] / gb:.2f} | 1 |")
    print(f"| Mooncake batch get, node B ({GET_BATCH} × {args.block_mib} MiB per call, "
          f"best with {raw['get_callers']} caller(s)) | {raw['get'] / gb:.2f} | 1 |")
    print(f"| tier publish (host → pool: pin, CRC, MAC, header, staging copy, put) | "
          f"{tier['publish'] / gb:.2f} | "
          f"{tier['publish'] / raw['put']:.2f} of put |")
    print(f"| tier promotion (pool → host: exists, reserve, get, copy, check CRC and MAC) | "
          f"{tier['promote'] / gb:.2f} | {tier['promote'] / raw['get']:.2f} of get |")
    print(f"| one {args.block_mib} MiB block promoted, lookup to READY | p50 "
          f"{tier['one_ms_p50']:.2f} ms, max {tier['one_ms_max']:.2f} ms | Mooncake: exists "
          f"+ get of one object p50 {raw['one_ms_p50']:.2f} ms |")
    if args.json:
        with open(args.json, "w") as f:
            from tiercache.config import ClusterConfig

            used = {k: getattr(args, k) or getattr(ClusterConfig, k)
                    for k in ("publish_threads", "promote_threads")}
            json.dump({"ceiling": raw, "tier": tier, "args": vars(args), "threads": used,
                       "machine": {"cpus": os.cpu_count()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

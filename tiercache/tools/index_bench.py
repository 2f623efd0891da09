"""Benchmarks of the cache index and its control plane (issue 4).

* ``bench_index``: in-process ``lookup`` + ``touch`` of 64-key batches that all hit
  (the scheduler's hot path), in keys per second.
* ``bench_control_plane``: round trips of a 64-key ``lookup`` from N client
  processes to a control server in its own process. ``interval_s=None`` is closed
  loop (each client calls again as soon as it has its answer: saturation);
  otherwise each client calls at Poisson arrivals with that mean gap, as schedulers
  stepping independently do.

``python -m tiercache.tools.index_bench`` runs both and prints a Markdown table;
``--slots 100000,2000000`` runs the scale mode instead (``tiercache.tools.index_scale``:
a real ``tiercache serve`` per capacity: start, RSS, rates, recovery, reset).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from tiercache.link.client import Client
from tiercache.control.standalone import serve_forever
from tiercache.index.manager import OffloadingManager
from tiercache.tools.index_scale import BASE_SLOTS, BATCH_KEYS, scale_main

SPAWN = mp.get_context("spawn")
KEY_BYTES = 32  # a sha256 block hash
START_TIMEOUT_S = 60.0


def _keys(num_keys: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    blob = rng.integers(0, 256, size=num_keys * KEY_BYTES, dtype=np.uint8).tobytes()
    return [blob[i:i + KEY_BYTES] for i in range(0, len(blob), KEY_BYTES)]


def _fill(cache, keys: list[bytes], batch_keys: int = 1024) -> None:
    for i in range(0, len(keys), batch_keys):
        out = cache.prepare_store(keys[i:i + batch_keys])
        if out is None:
            raise RuntimeError("benchmark index too small for its keys")
        cache.complete_store(list(out.keys_to_store))


@dataclass(frozen=True)
class IndexResult:
    policy: str
    batch_keys: int
    keys_per_s: float


def bench_index(policy: str = "lru", num_blocks: int = 65536, batch_keys: int = 64,
                min_duration_s: float = 2.0) -> IndexResult:
    manager = OffloadingManager(num_blocks, policy)
    keys = _keys(num_blocks)
    _fill(manager, keys)
    order = np.random.default_rng(1).permutation(num_blocks // batch_keys)
    batches = [keys[b * batch_keys:(b + 1) * batch_keys] for b in order]
    done_keys = 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_duration_s:
        for batch in batches:
            if manager.lookup(batch) != batch_keys:
                raise RuntimeError("benchmark batch did not hit")
            manager.touch(batch)
        done_keys += len(batches) * batch_keys
    return IndexResult(policy, batch_keys, done_keys / elapsed)


@dataclass(frozen=True)
class ControlResult:
    num_clients: int
    batch_keys: int
    interval_s: float | None
    num_calls: int
    calls_per_s: float
    p50_s: float
    p99_s: float
    p999_s: float
    max_s: float


def _client_main(path: str, keys: list[bytes], num_calls: int, interval_s: float | None,
                 seed: int, barrier, results) -> None:
    """Child: warm up, wait for the others, then time ``num_calls`` lookups."""
    # Paced calls arrive as a Poisson process (exponential gaps, mean interval_s), so
    # clients are not phase-locked into bursts as a fixed shared schedule would make them.
    gaps_ns = np.random.default_rng(seed).exponential((interval_s or 0) * 1e9, num_calls)
    due_ns = np.cumsum(gaps_ns).astype(np.int64)
    with Client(path) as client:
        for _ in range(200):
            client.lookup(keys)
        latencies_ns = np.empty(num_calls, dtype=np.int64)
        barrier.wait(START_TIMEOUT_S)
        start_ns = time.perf_counter_ns()
        for i in range(num_calls):
            if interval_s is not None:
                delay_s = (start_ns + due_ns[i] - time.perf_counter_ns()) / 1e9
                if delay_s > 0:
                    time.sleep(delay_s)
            t0 = time.perf_counter_ns()
            hits = client.lookup(keys)
            latencies_ns[i] = time.perf_counter_ns() - t0
            if hits != len(keys):
                raise RuntimeError(f"benchmark lookup hit {hits} of {len(keys)} keys")
        results.put((latencies_ns.tobytes(), time.perf_counter_ns() - start_ns))


def bench_control_plane(num_clients: int = 8, batch_keys: int = 64, num_calls: int = 3000,
                        interval_s: float | None = None, policy: str = "lru") -> ControlResult:
    workdir = tempfile.mkdtemp(prefix="tiercache-bench-")
    path = os.path.join(workdir, "ctl.sock")
    ready = SPAWN.Event()
    server = SPAWN.Process(target=serve_forever, args=(path, 65536, policy, ready), daemon=True)
    server.start()
    clients: list = []
    try:
        if not ready.wait(START_TIMEOUT_S):
            raise TimeoutError(f"benchmark server did not start in {START_TIMEOUT_S} s")
        keys = _keys(num_clients * batch_keys)
        with Client(path) as loader:
            _fill(loader, keys)
        barrier = SPAWN.Barrier(num_clients)
        results = SPAWN.Queue()
        clients = [
            SPAWN.Process(target=_client_main, daemon=True, args=(
                path, keys[c * batch_keys:(c + 1) * batch_keys], num_calls, interval_s, c,
                barrier, results))
            for c in range(num_clients)
        ]
        for client in clients:
            client.start()
        gathered = [results.get(timeout=START_TIMEOUT_S + 600) for _ in clients]
        for client in clients:
            client.join(START_TIMEOUT_S)
            if client.exitcode != 0:
                raise RuntimeError(f"benchmark client exited with {client.exitcode}")
    finally:
        for proc in [*clients, server]:
            if proc.is_alive():
                proc.terminate()
            proc.join(START_TIMEOUT_S)
        shutil.rmtree(workdir, ignore_errors=True)
    latencies_s = np.concatenate([np.frombuffer(raw, dtype=np.int64) for raw, _ in gathered]) / 1e9
    wall_s = max(elapsed_ns for _, elapsed_ns in gathered) / 1e9
    p50, p99, p999 = np.percentile(latencies_s, [50, 99, 99.9])
    return ControlResult(num_clients, batch_keys, interval_s, int(latencies_s.size),
                         latencies_s.size / wall_s, float(p50), float(p99), float(p999),
                         float(latencies_s.max()))


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} µs"


def _capacities(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated slot counts") from None
    if any(v < 2 * BATCH_KEYS for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: each capacity must be >= 128 slots")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tiercache.tools.index_bench",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--calls", type=int, default=3000, help="timed lookups per client")
    parser.add_argument("--interval-ms", type=float, default=1.0,
                        help="schedule of the paced run, per client (default 1 ms)")
    parser.add_argument("--slots", type=_capacities, default=None,
                        help="scale mode: comma-separated capacities (e.g. 100000,2000000), "
                             f"each beside the {BASE_SLOTS}-slot reference")
    parser.add_argument("--policy", choices=("lru", "arc"), default="lru",
                        help="the index policy of the scale mode")
    args = parser.parse_args(argv)
    if args.slots is not None:
        return scale_main(args.slots, args.clients, args.calls, args.policy)

    print(f"machine: {os.cpu_count()} CPUs\n")
    print("| in-process | policy | keys/s |\n|---|---|---|")
    for policy in ("lru", "arc"):
        r = bench_index(policy)
        print(f"| lookup + touch, {r.batch_keys}-key batches | {policy} "
              f"| {r.keys_per_s / 1e6:.2f} M |")
    print("\n| control plane, 64-key lookup | clients | calls/s | p50 | p99 | p99.9 | max |")
    print("|---|---|---|---|---|---|---|")
    runs = [(1, None), (args.clients, args.interval_ms / 1e3), (args.clients, None)]
    for num_clients, interval_s in runs:
        c = bench_control_plane(num_clients, num_calls=args.calls, interval_s=interval_s)
        mode = ("closed loop" if interval_s is None
                else f"paced: Poisson, mean 1 call / {interval_s * 1e3:g} ms per client")
        print(f"| {mode} | {num_clients} | {c.calls_per_s:,.0f} | {_us(c.p50_s)} | {_us(c.p99_s)} "
              f"| {_us(c.p999_s)} | {_us(c.max_s)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

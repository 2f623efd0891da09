"""``tiercache demo --bench``: aggregate bandwidth of all ranks against one rank alone.

The scheduler reserves ``blocks`` slots through the index (``prepare_store`` of fresh
keys), then per direction: one warm-up transfer on every rank, ``repetitions``
back-to-back transfers of all blocks on rank 0 alone, then the same on every rank at
once. A rank's rate is its bytes over its own wall time (first submit to last finish);
the aggregate is all ranks' bytes over the union of their windows (CLOCK_MONOTONIC is
one clock for every process of the host). ``scaling`` = aggregate / (ranks x rank 0
alone), measured in the same run. Stored blocks are published with ``complete_store``
and then loaded back; every loaded block is checked on every rank.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from tiercache.errors import JobError, WorkerError
from tiercache.specs import Direction
from tiercache.tools.demo.content import key_seeds
from tiercache.tools.demo.engine import DemoEngine
from tiercache.tools.demo.wire import Command, Op, Report
from tiercache.tools.demo.workload import chain_key

BENCH_TIMEOUT_S = 600.0
GB = 1e9


def _rates(reports: list[Report]) -> dict[str, Any]:
    per_rank = [{"rank": r.rank, "bytes": r.transfer_bytes,
                 "gbps": r.transfer_bytes / ((r.ended_ns - r.started_ns) / 1e9) / GB,
                 "busy_gbps": r.transfer_bytes / r.transfer_s / GB if r.transfer_s else 0.0}
                for r in sorted(reports, key=lambda r: r.rank)]
    window_s = (max(r.ended_ns for r in reports) - min(r.started_ns for r in reports)) / 1e9
    total = sum(r.transfer_bytes for r in reports)
    return {"ranks": len(reports), "bytes": total, "seconds": window_s,
            "gbps": total / window_s / GB, "per_rank": per_rank}


def _phase(engine: DemoEngine, ranks: list[int], direction: Direction, cpu_ids: np.ndarray,
           seeds: np.ndarray, repetitions: int) -> list[Report]:
    """``repetitions`` transfers of every block on each of ``ranks`` at once."""
    factor = engine.factor
    gpu_ids = (np.arange(len(cpu_ids), dtype=np.int64)[:, None] * factor
               + np.arange(factor, dtype=np.int64)).reshape(-1)
    command = Command(Op.BENCH, engine.allocate_job_ids(repetitions),
                      np.asarray(cpu_ids, np.int64), gpu_ids, seeds, direction, repetitions)
    gone = engine.pool.send(ranks, command)
    if gone:
        raise WorkerError(f"bench: the worker(s) of rank(s) {gone} are gone")
    engine.wait_for(lambda: len(engine.bench_reports) >= len(ranks), BENCH_TIMEOUT_S,
                    f"bench reports of {len(ranks)} rank(s)")
    reports = engine.take_bench_reports()
    t = engine.totals
    for r in reports:
        if not r.success:
            raise WorkerError(f"bench: rank {r.rank} {direction.label} transfers failed")
        totals = t.ranks[r.rank][direction]
        totals.bytes += r.transfer_bytes
        totals.transfers_ok += repetitions
        totals.busy_s += r.transfer_s
        if direction.loads:
            t.checked_blocks += r.num_blocks
            t.mismatched_blocks += r.mismatched_blocks
    return reports


def run_bench(engine: DemoEngine, blocks: int, repetitions: int) -> dict[str, Any]:
    """Measure; returns the ``bench`` part of the summary."""
    if blocks < 1 or repetitions < 1:
        raise JobError(f"bench: blocks = {blocks}, repetitions = {repetitions}; both must be >= 1")
    if blocks * engine.factor > engine.options.num_gpu_blocks:
        raise JobError(f"bench: {blocks} blocks need {blocks * engine.factor} GPU blocks per "
                       f"rank; the workers have {engine.options.num_gpu_blocks}")
    engine.wait_idle(BENCH_TIMEOUT_S)
    nonce = os.urandom(8)
    keys = [chain_key(nonce, b"bench-%d" % i) for i in range(blocks)]
    client = engine.client
    out = client.prepare_store(keys)
    if out is None or len(out.keys_to_store) != blocks:
        raise JobError(f"bench: the index cannot take {blocks} blocks now "
                       f"({client.stats().free_blocks} free); pass a smaller --bench-blocks")
    seeds = key_seeds(keys)
    everyone = list(range(engine.world_size))
    result: dict[str, Any] = {"blocks": blocks, "repetitions": repetitions,
                              "transfer_bytes": blocks * engine.config.kv.cpu_block_bytes,
                              "directions": {}}
    stored = loading = False
    try:
        for direction in Direction:
            cpu_ids = out.store_spec.block_ids
            if direction.loads:
                client.complete_store(keys)
                stored = True
                cpu_ids = client.prepare_load(keys).block_ids
                loading = True
            _phase(engine, everyone, direction, cpu_ids, seeds, 1)  # warm-up
            solo = _rates(_phase(engine, [0], direction, cpu_ids, seeds, repetitions))
            together = _rates(_phase(engine, everyone, direction, cpu_ids, seeds, repetitions))
            result["directions"][direction.label] = {
                "solo": solo, "all": together,
                "scaling": together["gbps"] / (len(everyone) * solo["gbps"]),
            }
    finally:
        if loading:
            client.complete_load(keys)
        elif not stored:
            client.complete_store(keys, success=False)
    return result

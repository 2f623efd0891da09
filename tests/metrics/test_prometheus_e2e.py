"""End to end: a real Prometheus scrapes a running ``tiercache serve`` while spawned
workers (cpu backend) store and load blocks that a scheduler drives through the control
socket. Every dashboard query must return data, the counters must equal what the test
moved, and a worker SIGKILLed mid-transfer must read as down at the first scrape after
its death while the exporter keeps answering."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import time

import numpy as np
import psutil
import pytest
import torch

from tiercache.link.client import Client
from tiercache.config import BackendKind, DiskConfig, EventsConfig
from tiercache.specs import CPULoadStoreSpec, GPULoadStoreSpec
from tiercache.service.process import CoordinatorProcess
from tiercache.transfer.worker import attach

import dashboard_queries as dq
from prometheus_server import JOB, PrometheusServer

pytestmark = pytest.mark.slow

NUM_GPU_BLOCKS = 32
WAIT_S = 60
RANKS = (0, 1)
DIRECTIONS = ("gpu_to_cpu", "cpu_to_gpu")


def gpu_pattern(rank: int, tensor: int, page_bytes: int) -> np.ndarray:
    return np.random.default_rng(7000 + 100 * rank + tensor).integers(
        0, 256, (NUM_GPU_BLOCKS, page_bytes), dtype=np.uint8)


# ---------------------------------------------------------------- the worker process

def worker_main(config, rank: int, conn) -> None:
    """Attach ``rank`` with host-memory "GPU" caches; run transfers on command."""
    gpu = [torch.from_numpy(gpu_pattern(rank, t, p)) for t, p in enumerate(config.kv.page_bytes)]
    worker = attach(config, rank, gpu, ready_timeout_s=WAIT_S)
    conn.send(("attached", os.getpid()))
    job = 0
    while True:
        command, *args = conn.recv()
        if command == "close":
            worker.close()
            conn.send(("closed",))
            return
        if command == "read":
            (blocks,) = args
            conn.send(("read", [t[blocks].numpy().copy() for t in gpu]))
            continue
        gpu_blocks, cpu_blocks = args
        gpu_spec, cpu_spec = GPULoadStoreSpec(gpu_blocks), CPULoadStoreSpec(cpu_blocks)
        transfer = (gpu_spec, cpu_spec) if command in ("store", "spin") else (cpu_spec, gpu_spec)
        spins = 0
        while True:  # "spin": store until killed
            job += 1
            worker.transfer_async(job, transfer)
            worker.wait([job])
            results = [(r.success, r.transfer_size) for r in worker.get_finished()]
            if command != "spin":
                conn.send(("done", results))
                break
            spins += 1
            if spins == 1:
                conn.send(("spinning",))


class Rank:
    """The test's handle on one worker process."""

    def __init__(self, ctx, config, rank: int):
        self.rank = rank
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(config, rank, child), daemon=True)
        self.proc.start()
        child.close()
        self.pid = self.expect("attached")[0]
        self.moved = {d: 0 for d in DIRECTIONS}
        self.transfers = {d: 0 for d in DIRECTIONS}

    def expect(self, tag: str) -> list:
        assert self.conn.poll(WAIT_S), f"rank {self.rank}: no {tag!r} within {WAIT_S} s"
        message = self.conn.recv()
        assert message[0] == tag, message
        return message[1:]

    def run(self, command: str, gpu_blocks, cpu_blocks) -> None:
        self.conn.send((command, list(gpu_blocks), [int(b) for b in cpu_blocks]))
        (results,) = self.expect("done")
        assert all(ok for ok, _ in results), results
        direction = "gpu_to_cpu" if command == "store" else "cpu_to_gpu"
        self.moved[direction] += sum(size for _, size in results)
        self.transfers[direction] += len(results)

    def read(self, blocks) -> list[np.ndarray]:
        self.conn.send(("read", list(blocks)))
        return self.expect("read")[0]

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("close",))
            self.expect("closed")
        self.proc.join(WAIT_S)


def keys(first: int, count: int) -> list[bytes]:
    return [f"block-{i}".encode() for i in range(first, first + count)]


# ---------------------------------------------------------------- the test

@pytest.fixture
def cluster(make_config, tmp_path):
    """Coordinator + Prometheus scraping it + one worker per rank; torn down in reverse."""
    (tmp_path / "disk").mkdir()  # a disk tier and an event stream too: the dashboard's
    config = make_config(backend=BackendKind.CPU,  # tier and node events rows have data
                         disk=DiskConfig(path=str(tmp_path / "disk"), capacity_bytes=1 << 20),
                         events=EventsConfig(endpoint="tcp://127.0.0.1:0"))
    ctx = mp.get_context("spawn")
    with CoordinatorProcess(config, workdir=tmp_path / "coordinator") as coordinator:
        url = re.search(r"metrics: http://(\S+)/metrics", coordinator.output())
        assert url, f"the coordinator printed no metrics address:\n{coordinator.output()}"
        prom_dir = tmp_path / "prometheus"
        prom_dir.mkdir()
        with PrometheusServer(url.group(1), prom_dir) as prom:
            ranks: list[Rank] = []
            try:
                ranks.extend(Rank(ctx, config, r) for r in RANKS)
                yield config, prom, ranks
            finally:
                for rank in ranks:
                    rank.close()
                    if rank.proc.is_alive():
                        rank.proc.kill()
                        rank.proc.join(WAIT_S)


def test_dashboards_counters_and_liveness_against_real_prometheus(cluster, tmp_path):
    config, prom, ranks = cluster
    block_bytes = sum(config.kv.page_bytes)  # block_size_factor 1: one GPU page per tensor

    # Prometheus has scraped both live workers before anything moves, so every rate
    # window below starts from zero-valued samples.
    prom.wait_until(lambda: prom.value(f'count(tiercache_worker_up{{job="{JOB}"}} == 1)') == 2,
                    WAIT_S, "a scrape showing both workers up")

    with Client(config) as client:
        stored = client.prepare_store(keys(0, 12))
        slots = stored.store_spec.block_ids
        for rank in ranks:  # two transfers per rank
            rank.run("store", range(0, 6), slots[:6])
            rank.run("store", range(6, 12), slots[6:])
        client.complete_store(keys(0, 12))

        assert client.lookup(keys(0, 12) + keys(100, 1)) == 12
        assert client.lookup(keys(200, 1)) == 0

        load_spec = client.prepare_load(keys(0, 4))
        for rank in ranks:
            rank.run("load", range(20, 24), load_spec.block_ids)
        client.complete_load(keys(0, 4))
        for rank in ranks:  # the bytes made the round trip
            for t, page in enumerate(config.kv.page_bytes):
                assert np.array_equal(rank.read(range(20, 24))[t],
                                      gpu_pattern(rank.rank, t, page)[0:4])

        writing = client.prepare_store(keys(12, 4))  # the last 4 free slots, left WRITING
        assert len(writing.keys_to_store) == 4
        assert client.prepare_store(keys(16, 16)) is None  # only 12 evictable: rejected
        client.complete_store(keys(12, 4), success=False)  # 4 failed stores free their slots

        evicting = client.prepare_store(keys(40, 6))  # 4 free + 2 evicted
        assert len(evicting.evicted_keys) == 2
        for rank in ranks:
            rank.run("store", range(12, 18), evicting.store_spec.block_ids)
        client.complete_store(keys(40, 6))
        index = client.stats()

    # ---- the counters Prometheus holds equal what the test moved
    for rank in ranks:
        assert rank.moved == {"gpu_to_cpu": 18 * block_bytes, "cpu_to_gpu": 4 * block_bytes}
        assert rank.transfers == {"gpu_to_cpu": 3, "cpu_to_gpu": 1}

    def selector(rank: Rank, direction: str) -> str:
        return f'{{job="{JOB}", rank="{rank.rank}", direction="{direction}"}}'

    last = ranks[-1]
    expected_last = f"tiercache_transfer_bytes_total{selector(last, 'gpu_to_cpu')}"
    prom.wait_until(lambda: prom.value(expected_last) == last.moved["gpu_to_cpu"], WAIT_S,
                    "a scrape after the last transfer")
    prom.wait_until(lambda: prom.value(f'tiercache_index_evicted_blocks_total{{job="{JOB}"}}')
                    == index.evicted_blocks, WAIT_S, "a scrape after the last index call")
    for rank in ranks:
        for direction in DIRECTIONS:
            sel = selector(rank, direction)
            assert prom.value(f"tiercache_transfer_bytes_total{sel}") == rank.moved[direction]
            ok = sel.replace("}", ', outcome="ok"}')
            failed = sel.replace("}", ', outcome="failed"}')
            assert prom.value(f"tiercache_transfers_total{ok}") == rank.transfers[direction]
            assert prom.value(f"tiercache_transfers_total{failed}") == 0
            assert prom.value(f"tiercache_transfer_duration_seconds_count{sel}") == \
                rank.transfers[direction]
            assert prom.value(f"tiercache_transfer_size_bytes_sum{sel}") == rank.moved[direction]
            assert prom.value(f"tiercache_transfer_seconds_total{sel}") > 0
    expected_index = {
        "lookups": 2, "hit_blocks": 12, "miss_blocks": 2, "stored_blocks": 18,
        "loaded_blocks": 4, "store_rejections": 1, "evicted_blocks": 2, "failed_store_blocks": 4,
    }
    for name, value in expected_index.items():
        assert getattr(index, name) == value, name
        assert prom.value(f'tiercache_index_{name}_total{{job="{JOB}"}}') == value, name
    assert prom.value(f'tiercache_index_capacity_blocks{{job="{JOB}"}}') == 16
    # all 16 are READY, or for a moment pinned by the disk tier writing them ahead of eviction
    assert prom.value(f'sum(tiercache_index_blocks{{job="{JOB}", state=~"ready|loading"}})') \
        == 16
    assert prom.value(f'tiercache_index_occupancy_ratio{{job="{JOB}"}}') == 1.0
    for rank in ranks:
        labels = f'{{job="{JOB}", rank="{rank.rank}"}}'
        assert prom.value(f'tiercache_pin_state{{job="{JOB}", rank="{rank.rank}", '
                          'state="unpinned"}') == 1
        assert prom.value(f"tiercache_pinned_bytes{labels}") == 0
        for direction in DIRECTIONS:
            assert prom.value(f'tiercache_transfer_backend_info{{job="{JOB}", '
                              f'rank="{rank.rank}", direction="{direction}", '
                              'backend="cpu"}') == 1

    # ---- every query of every dashboard panel returns data (Grafana's "All" values)
    for path in dq.dashboard_files():
        model = dq.load(path)
        values = dq.default_values(model)
        for q in dq.queries(model):
            expr = dq.substitute(q.expr, values, rate_interval="2m", range_="10m")
            assert prom.query(expr), f"no data for {q}\n(sent: {expr})"
        for var in model["templating"]["list"]:
            if var["type"] == "query":
                metric = re.match(r"label_values\((\w+)", var["definition"]).group(1)
                assert prom.query(metric), f"variable {var['name']}: no {metric} series"

    # ---- a worker SIGKILLed mid-transfer reads as down at the next scrape
    victim, survivor = ranks[1], ranks[0]
    victim.conn.send(("spin", list(range(0, 8)), list(range(0, 8))))
    victim.expect("spinning")
    victim.proc.kill()
    prom.wait_until(lambda: _dead(victim.pid), WAIT_S, "the killed worker to die")
    died_at = time.time()  # Prometheus runs on this host: scrape timestamps share the clock
    up_series = f'tiercache_worker_up{{job="{JOB}", rank="{victim.rank}"}}'
    prom.wait_until(lambda: any(t > died_at for t, _ in prom.samples(up_series, 60)),
                    WAIT_S, "a scrape after the kill")
    after = [v for t, v in prom.samples(up_series, 60) if t > died_at]
    assert after[0] == 0, "the first scrape after the worker died must show it down"
    survivor_up = f'tiercache_worker_up{{job="{JOB}", rank="{survivor.rank}"}}'
    assert prom.value(survivor_up) == 1
    exporter_up = [v for t, v in prom.samples(f'up{{job="{JOB}"}}', 60) if t > died_at]
    assert exporter_up and all(v == 1 for v in exporter_up), "the exporter failed a scrape"
    assert prom.target_health()["health"] == "up"
    assert prom.target_health()["lastError"] == ""
    victim.proc.join(WAIT_S)


def _dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


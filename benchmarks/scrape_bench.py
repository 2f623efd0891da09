"""Scrape time of the coordinator's /metrics with 8 ranks (issue 5's target: <= 20 ms).

Starts ``tiercache serve`` with world_size 8 and 8 spawned cpu-backend workers that
fill their histograms, then measures, idle and while every worker copies in a loop:

  * client side: GET /metrics as Prometheus sends it (gzip), N times;
  * Prometheus side: ``scrape_duration_seconds`` of a real Prometheus scraping at 1 s.

    .venv/bin/python benchmarks/scrape_bench.py [--gets 300] [--scrapes 30]

Not a test: the numbers go to docs/benchmarks.md ("Observability (issue 5)").
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing as mp
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from prometheus_server import JOB, PrometheusServer  # noqa: E402  (the tests' helper)

from tiercache.backend_kind import BackendKind  # noqa: E402
from tiercache.config import (  # noqa: E402
    Config, ExporterConfig, KVGeometry, RegionConfig,
)
from tiercache.service.process import CoordinatorProcess  # noqa: E402

WORLD_SIZE = 8
NUM_BLOCKS = 64
GPU_BLOCKS = 64
PAGE_BYTES = (16 << 10,) * 4


def worker_main(config: Config, rank: int, conn) -> None:
    import torch

    from tiercache.specs import CPULoadStoreSpec, GPULoadStoreSpec
    from tiercache.transfer.worker import attach

    gpu = [torch.zeros((GPU_BLOCKS, p), dtype=torch.uint8) for p in config.kv.page_bytes]
    worker = attach(config, rank, gpu, ready_timeout_s=60)
    job = 0

    def transfer(n: int, store: bool) -> None:
        nonlocal job
        job += 1
        g, c = GPULoadStoreSpec(range(n)), CPULoadStoreSpec(range(n))
        worker.transfer_async(job, (g, c) if store else (c, g))
        worker.wait([job])
        worker.get_finished()

    for n in (1, 2, 4, 8, 16, 32, 64):  # several size and duration buckets per direction
        transfer(n, store=True)
        transfer(n, store=False)
    conn.send("ready")
    while (command := conn.recv()) != "close":
        if command == "spin":
            while not conn.poll():  # copy until the next command ("stop")
                transfer(16, store=True)
                transfer(16, store=False)
    worker.close()
    conn.send("closed")


def summary(values_s: list[float]) -> str:
    ms = sorted(v * 1e3 for v in values_s)
    pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
    return (f"n={len(ms)} median {statistics.median(ms):.1f} ms, p90 {pick(0.9):.1f}, "
            f"p99 {pick(0.99):.1f}, max {ms[-1]:.1f}")


def client_gets(url: str, count: int) -> tuple[list[float], int]:
    """GETs over one kept-alive connection, gzip accepted: what Prometheus does."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    times, size = [], 0
    try:
        for _ in range(count):
            start = time.perf_counter()
            conn.request("GET", parts.path, headers={"Accept-Encoding": "gzip"})
            with conn.getresponse() as resp:
                size = len(resp.read())
            times.append(time.perf_counter() - start)
    finally:
        conn.close()
    return times, size


def prometheus_durations(prom: PrometheusServer, seconds: int) -> list[float]:
    time.sleep(seconds)  # a benchmark, not a test: let Prometheus scrape for a while
    result = prom.api("query", query=f'scrape_duration_seconds{{job="{JOB}"}}[{seconds}s]')
    return [float(v) for _, v in result["result"][0]["values"]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gets", type=int, default=300)
    parser.add_argument("--scrapes", type=int, default=30, help="seconds of 1 s scrapes")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tiercache-scrape-bench-") as tmp:
        config = Config(
            name=f"scrape-bench-{os.getpid()}", world_size=WORLD_SIZE,
            kv=KVGeometry(page_bytes=PAGE_BYTES),
            region=RegionConfig(capacity_bytes=None, num_blocks=NUM_BLOCKS, prefault_threads=2),
            backend=BackendKind.CPU, exporter=ExporterConfig(port=0),
            control_socket=os.path.join(tmp, "control.sock"))
        ctx = mp.get_context("spawn")
        with CoordinatorProcess(config, workdir=tmp) as coordinator:
            url = "http://" + re.search(r"metrics: http://(\S+/metrics)",
                                        coordinator.output()).group(1)
            pipes, procs = [], []
            for rank in range(WORLD_SIZE):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=worker_main, args=(config, rank, child), daemon=True)
                proc.start()
                pipes.append(parent)
                procs.append(proc)
            for pipe in pipes:
                assert pipe.poll(120) and pipe.recv() == "ready"
            prom_dir = Path(tmp) / "prometheus"
            prom_dir.mkdir()
            with PrometheusServer(url.removeprefix("http://").removesuffix("/metrics"),
                                  prom_dir) as prom:
                prom.wait_until(lambda: prom.query(f'up{{job="{JOB}"}} == 1'), 60, "first scrape")
                body = urllib.request.urlopen(url, timeout=10).read()
                samples = sum(1 for line in body.splitlines() if not line.startswith(b"#"))
                print(f"{WORLD_SIZE} ranks, {samples} samples, {len(body)} bytes "
                      f"(text), {os.cpu_count()} CPUs, load average before the workers "
                      f"spin {os.getloadavg()[0]:.1f}")
                for phase in ("idle", "8 workers copying"):
                    if phase != "idle":
                        for pipe in pipes:
                            pipe.send("spin")
                        time.sleep(1)
                    gets, size = client_gets(url, args.gets)
                    print(f"[{phase}] client GET (gzip, {size} bytes): {summary(gets)}")
                    durations = prometheus_durations(prom, args.scrapes)
                    print(f"[{phase}] Prometheus scrape_duration_seconds: {summary(durations)}")
            for pipe in pipes:
                pipe.send("stop")  # leaves the spin loop
                pipe.send("close")
            for pipe, proc in zip(pipes, procs):
                assert pipe.poll(60) and pipe.recv() == "closed"
                proc.join(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())

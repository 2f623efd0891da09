"""Helpers of the end-to-end and fault tests: configs, a started engine, /metrics scrapes."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client.parser import text_string_to_metric_families

from tiercache.config import Config, RegionConfig
from tiercache.tools.demo.engine import DemoEngine
from tiercache.tools.demo.rank import RankOptions
from tiercache.tools.demo.workload import Request, WorkloadSpec, chain_key
from tiercache.specs import Direction
from tiercache.service.process import CoordinatorProcess

# Small requests over a region that fills: evictions (slot reuse) happen within a few
# dozen requests, and every reused slot is checked again when loaded.
SPEC = WorkloadSpec(num_prefixes=8, zipf_s=1.0, min_prefix_blocks=2, max_prefix_blocks=10,
                    min_suffix_blocks=1, max_suffix_blocks=4, continue_p=0.4,
                    max_request_blocks=20, seed=11)
NUM_BLOCKS = 96
WAIT_S = 60.0
DOWN_WITHIN_S = 5.0  # the bound for reporting a SIGKILLed worker down
_METRICS_RE = re.compile(r"metrics: (http://\S+/metrics)")


def e2e_config(make_config, world_size: int) -> Config:
    return make_config(world_size=world_size,
                       region=RegionConfig(capacity_bytes=None, num_blocks=NUM_BLOCKS,
                                           prefault_threads=2))


@contextmanager
def running_engine(config: Config) -> Iterator[DemoEngine]:
    engine = DemoEngine(config, RankOptions("cpu", SPEC.max_request_blocks))
    try:
        engine.start()
        yield engine
    finally:
        engine.close()


def metrics_url(coordinator: CoordinatorProcess) -> str:
    match = _METRICS_RE.search(coordinator.output())
    assert match, f"no metrics line in the serve log:\n{coordinator.output()}"
    return match.group(1)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of one scrape, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"{name}{labels} not exported"
    return samples[key]


def await_sample(url: str, name: str, value: float, timeout_s: float, **labels: str) -> float:
    """Scrape until ``name{labels} == value``; returns the seconds it took."""
    start = time.monotonic()
    while True:
        got = sample(scrape(url), name, **labels)
        if got == value:
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{name}{labels} = {got}, not {value}, after {timeout_s} s")
        time.sleep(0.05)


def assert_metrics_match_workers(samples: dict, engine: DemoEngine) -> None:
    """Bytes and transfer counts per rank and direction, exactly as the workers reported."""
    for rank, dirs in enumerate(engine.totals.ranks):
        for d in Direction:
            labels = dict(rank=str(rank), direction=d.label)
            assert sample(samples, "tiercache_transfer_bytes_total", **labels) == dirs[d].bytes
            assert sample(samples, "tiercache_transfers_total", outcome="ok",
                          **labels) == dirs[d].transfers_ok
            assert sample(samples, "tiercache_transfers_total", outcome="failed",
                          **labels) == dirs[d].transfers_failed


def request_over(keys: tuple[bytes, ...], tag: bytes, index: int = 10_000) -> Request:
    """A request that reuses ``keys`` (cached: a load) and adds two fresh blocks (a store)."""
    fresh = chain_key(keys[-1], tag)
    return Request(index, 0, keys + (fresh, chain_key(fresh, tag)), len(keys))


def cached_request(engine: DemoEngine, submissions, tag: bytes) -> Request:
    """``request_over`` the latest request whose keys are all still cached."""
    for done in reversed(submissions):
        keys = done.request.keys
        if engine.client.lookup(keys) == len(keys):
            return request_over(keys, tag)
    raise AssertionError("no fully cached request to reuse")

"""End to end: a real coordinator, one spawned worker per rank, the demo's scheduler, the
prefix-reuse workload; every loaded block checked at every rank; /metrics agrees exactly."""

from __future__ import annotations

import pytest

from tiercache.tools.demo.workload import PrefixWorkload
from tiercache.service.process import CoordinatorProcess

from e2e_support import (
    SPEC, assert_metrics_match_workers, e2e_config, metrics_url, running_engine, sample, scrape,
)

NUM_REQUESTS = 60


@pytest.mark.parametrize("world_size", [2, 4])
def test_workload_at_every_rank_without_a_wrong_block_and_metrics_agree(make_config, tmp_path,
                                                                       world_size):
    config = e2e_config(make_config, world_size)
    with CoordinatorProcess(config, tmp_path) as coordinator:
        url = metrics_url(coordinator)
        with running_engine(config) as engine:
            for request in PrefixWorkload(SPEC).requests(NUM_REQUESTS):
                engine.run(request)
            t = engine.totals
            assert t.requests == NUM_REQUESTS
            assert t.hit_blocks > 0 and t.stored_blocks > 0
            assert t.checked_blocks == world_size * t.loaded_blocks > 0  # every rank checked
            assert t.mismatched_blocks == 0
            assert (t.failed_jobs, t.orphaned_jobs, t.store_rejections) == (0, 0, 0)
            samples = scrape(url)
            assert_metrics_match_workers(samples, engine)
            for rank in range(world_size):
                assert sample(samples, "tiercache_worker_up", rank=str(rank)) == 1
                assert sample(samples, "tiercache_transfer_backend_info", rank=str(rank),
                              direction="gpu_to_cpu", backend="cpu") == 1
            index = {name: sample(samples, f"tiercache_index_{name}_total") for name in
                     ("lookups", "hit_blocks", "miss_blocks", "leased_blocks", "stored_blocks",
                      "evicted_blocks")}
            assert index["lookups"] == t.requests
            assert index["hit_blocks"] == t.hit_blocks
            assert index["miss_blocks"] == t.lookup_blocks - t.hit_blocks
            assert index["leased_blocks"] == t.loaded_blocks  # each load is its lease's hits
            assert index["stored_blocks"] == t.stored_blocks
            assert index["evicted_blocks"] > 0  # slots were reused, and loads still checked out
            assert engine.stats_agree()
        samples = scrape(url)  # the workers detached
        assert all(sample(samples, "tiercache_worker_up", rank=str(r)) == 0
                   for r in range(world_size))
        assert_metrics_match_workers(samples, engine)  # counters outlive the workers

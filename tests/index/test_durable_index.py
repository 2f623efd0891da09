"""The index survives a coordinator SIGKILL: real workload processes store and load real
bytes through the region while the coordinator is killed at a random moment; the
restarted coordinator re-adopts the region, rebuilds its index from the region's ledger,
and every key it then answers HIT for holds exactly the bytes stored under it."""

from __future__ import annotations

import random

import pytest

from control_children import check_every_hit, store_and_load_forever
from control_support import SPAWN, kill_all, wait_for
from tiercache.config import KVGeometry, RegionConfig, config_to_toml
from tiercache.link.client import Client
from tiercache.service.process import CoordinatorProcess

ITERATIONS = 6
NUM_BLOCKS = 48
KEY_SPACE = 120  # more keys than slots: blocks are evicted and slots reused all along
WORKLOADS = 2
STORES_BEFORE_KILL = 100  # each iteration's workload stores this many blocks at least


def _start_workloads(config, stored, wrong, iteration: int) -> list:
    procs = [SPAWN.Process(target=store_and_load_forever, daemon=True,
                           args=(config_to_toml(config), 1000 * iteration + w, KEY_SPACE,
                                 stored, wrong))
             for w in range(WORKLOADS)]
    for proc in procs:
        proc.start()
    return procs


@pytest.mark.slow
def test_every_hit_after_a_coordinator_sigkill_holds_its_bytes(make_config, tmp_path):
    config = make_config(
        kv=KVGeometry(page_bytes=(4096, 2048)),
        region=RegionConfig(capacity_bytes=None, num_blocks=NUM_BLOCKS, prefault_threads=1),
        index_session_grace_s=0.5)
    rng = random.Random(20251123)
    stored, wrong = SPAWN.Value("q", 0), SPAWN.Value("q", 0)
    coordinator = CoordinatorProcess(config, tmp_path / "c0")
    workloads: list = []
    recovered_total = 0
    try:
        for iteration in range(1, ITERATIONS + 1):
            goal = stored.value + STORES_BEFORE_KILL
            workloads = _start_workloads(config, stored, wrong, iteration)
            wait_for(lambda: stored.value >= goal, f"iteration {iteration}: blocks stored")
            threshold = stored.value + rng.randrange(0, 200)  # a random point of the workload
            wait_for(lambda: stored.value >= threshold, "the workload goes on")
            coordinator.kill()  # SIGKILL, mid-workload
            kill_all(workloads)  # their half-written blocks stay WRITING in the ledger
            assert wrong.value == 0, "a workload loaded wrong bytes before the kill"

            coordinator = CoordinatorProcess(config, tmp_path / f"c{iteration}")
            out = coordinator.output()
            assert "re-adopted stale region" in out and "recovered from the region's ledger" in out
            with Client(config) as client:
                s = client.stats()
            assert (s.writing_blocks, s.loading_blocks) == (0, 0)  # dropped and cleared
            assert s.recovered_blocks == s.ready_blocks
            hits, wrong_hits = check_every_hit(config, KEY_SPACE)
            assert wrong_hits == 0, f"iteration {iteration}: {wrong_hits} of {hits} hits hold " \
                                    "other bytes"
            assert hits == s.recovered_blocks
            recovered_total += hits
        assert recovered_total > 0  # the cache did survive (not merely came back empty)
        assert coordinator.stop() == 0
    finally:
        kill_all(workloads)
        coordinator.kill()
        coordinator.cleanup()

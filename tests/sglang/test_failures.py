"""The coordinator restarting or gone under a running SGLang rank, a page coming back from the
disk tier through SGLang's retries, and SGLang's own failure injection. Every loaded page is
checked byte for byte; nothing may raise into SGLang's threads."""

from __future__ import annotations

from sglang_env import require_sglang

require_sglang()

import os  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

from control_support import stop_process, wait_for  # noqa: E402
from sglang_harness import tokens_of  # noqa: E402
from tiercache.config import DiskConfig, load_config  # noqa: E402
from tiercache.link.client import Client  # noqa: E402
from tiercache.service.process import CoordinatorProcess  # noqa: E402

FAST = {"tiercache_retry_s": 0.05, "tiercache_call_timeout_s": 1.0}
RETRIES = 8  # SGLang's --hicache-storage-prefetch-retry-max-attempts default


def _backup_until_stored(rank, tokens, attempts: int = 200) -> int:
    """SGLang's next backups, until one is stored whole (the breaker and the reconnect
    take a few calls after a restart)."""
    for _ in range(attempts):
        done = rank.backup(tokens)
        if done == len(tokens):
            return done
        time.sleep(0.02)
    return done


@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
def test_a_coordinator_restart_keeps_the_cache_warm_and_backups_resume(coordinator, make_rank,
                                                                       tmp_path, stop):
    rank = make_rank(coordinator, extra=FAST)
    tokens = tokens_of(31, 4)
    assert rank.backup(tokens) == len(tokens)
    if stop == "sigterm":
        coordinator.stop()  # the region is kept: this rank is still attached
    else:
        coordinator.kill()
    assert rank.prefetch(tokens) == (0, [])  # gone: a miss, at once
    again = CoordinatorProcess(coordinator.config, workdir=tmp_path / "again")
    try:
        assert "re-adopted" in again.output()
        assert wait_for(lambda: rank.query(tokens) == len(tokens), "hits after the restart",
                        timeout_s=30)
        assert rank.prefetch(tokens) == (len(tokens), [])
        more = tokens_of(32, 3)
        assert _backup_until_stored(rank, more) == len(more)
        assert rank.prefetch(more) == (len(more), [])
    finally:
        again.cleanup()
    counters = rank.counters()
    assert counters["coordinator_down_calls"] >= 1 and counters["errors"] == 0


def test_a_coordinator_that_is_gone_or_frozen_costs_sglang_misses_not_waits(coordinator,
                                                                          make_rank):
    rank = make_rank(coordinator, extra={"tiercache_retry_s": 60.0,
                                         "tiercache_call_timeout_s": 1.0})
    tokens = tokens_of(33, 3)
    assert rank.backup(tokens) == len(tokens)
    stop_process(coordinator.pid)  # frozen: its socket accepts, nothing answers
    try:
        assert rank.prefetch(tokens) == (0, [])  # the call's timeout bounds the wait
        down = rank.counters()["coordinator_down_calls"]
        # the breaker is open now: every call answers at once, without the coordinator
        for _ in range(5):
            assert rank.backup(tokens_of(34, 2)) == 0
            assert rank.prefetch(tokens) == (0, [])
        assert rank.counters()["coordinator_down_calls"] == down + 10
    finally:
        os.kill(coordinator.pid, signal.SIGCONT)
    assert rank.counters()["errors"] == 0


def test_sglang_starts_while_the_coordinator_is_down_and_hits_once_it_is_up(
        model, instance_name, tmp_path, make_rank):
    config = model.coordinator_config(instance_name, str(tmp_path / "c.sock"))
    config_path = tmp_path / "node.toml"
    from tiercache.config import config_to_toml

    config_path.write_text(config_to_toml(config))
    rank = make_rank(config_path, extra=FAST)  # nothing there: no raise
    tokens = tokens_of(35, 2)
    assert rank.backup(tokens) == 0 and rank.prefetch(tokens) == (0, [])
    coordinator = CoordinatorProcess(config, workdir=tmp_path / "coord")
    try:
        assert _backup_until_stored(rank, tokens) == len(tokens)
        assert rank.prefetch(tokens) == (len(tokens), [])
    finally:
        coordinator.cleanup()


def test_a_page_demoted_to_disk_comes_back_through_sglang_retries(start_coordinator, make_rank,
                                                                  tmp_path):
    disk_dir = tmp_path / "disk"
    disk_dir.mkdir()
    coordinator = start_coordinator(num_blocks=16, disk=DiskConfig(
        path=str(disk_dir), capacity_bytes=64 << 20, low_watermark=0.9))
    rank = make_rank(coordinator, extra=FAST)
    first = tokens_of(36, 3)
    with Client(load_config(coordinator.config_path)) as index:
        def disk_idle():
            disk = index.tier_stats()["disk"]
            return disk.queued_blocks == 0 and disk.calls_in_flight == 0

        assert rank.backup(first) == len(first)  # below the watermark: demoted at once
        assert wait_for(lambda: disk_idle() and index.tier_stats()["disk"].used_blocks >= 3,
                        "the first prefix on disk", timeout_s=30)
        for seed in range(37, 43):  # 18 more pages evict the first prefix from host memory
            assert _backup_until_stored(rank, tokens_of(seed, 3)) == 3 * 16
        # SGLang's first attempt: a miss (not in host memory), which starts the promotion
        assert rank.query(first) == 0
    loaded, attempts = 0, 1
    while loaded < len(first) and attempts < RETRIES:  # the scheduler re-issues a miss
        loaded, wrong = rank.prefetch(first, rid=f"retry-{attempts}")
        assert wrong == []
        attempts += 1
        if loaded < len(first):
            time.sleep(0.25)  # SGLang's poll interval: a few scheduling passes
    assert loaded == len(first)
    with Client(load_config(coordinator.config_path)) as index:
        assert index.tier_stats()["disk"].promotions >= 3  # they came up from the disk


def test_sglang_failure_injection_runs_clean(coordinator, make_rank, monkeypatch):
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    rank = make_rank(coordinator)
    assert type(rank.controller.storage_backend).__name__ == "HiCacheStorageFailureInjector"
    loaded_pages = 0
    for seed in range(50, 62):
        tokens = tokens_of(seed, 3)
        rank.backup(tokens)
        loaded, wrong = rank.prefetch(tokens, rid=f"inject-{seed}")
        assert wrong == []
        loaded_pages += loaded // 16
    assert loaded_pages > 0
    assert rank.counters()["errors"] == 0
    with Client(load_config(coordinator.config_path)) as index:
        stats = index.stats()
    assert stats.loading_blocks == 0 and stats.writing_blocks == 0  # nothing left held


def test_a_region_replaced_under_a_running_rank_is_followed(coordinator, make_rank, tmp_path):
    from tiercache.region.stale import remove_stale

    rank = make_rank(coordinator, extra=FAST)
    old = tokens_of(70, 2)
    assert rank.backup(old) == len(old)
    coordinator.kill()
    remove_stale(name_prefix=coordinator.config.name)  # `tiercache clean`: the region is gone
    fresh = CoordinatorProcess(coordinator.config, workdir=tmp_path / "fresh")
    try:
        assert "re-adopted" not in fresh.output()
        new = tokens_of(71, 3)
        assert _backup_until_stored(rank, new) == len(new)  # into the new region
        assert rank.prefetch(new) == (len(new), [])
        assert rank.query(old) == 0  # the old region's pages went with it
        assert rank.backend.region.attach_count == 2
    finally:
        fresh.cleanup()


def test_a_model_with_host_pools_besides_kv_is_refused_naming_the_pool(coordinator, make_rank):
    from tiercache.errors import ConfigError

    rank = make_rank(coordinator)
    with pytest.raises(ConfigError, match="'mamba'.*v2"):
        rank.backend.register_mem_host_pool_v2(rank.host, "mamba")
    rank.backend.register_mem_host_pool_v2(rank.host, "kv")  # the anchor pool itself: fine


@pytest.fixture
def other_user():
    import users

    yield from users.other_user()


def test_a_region_another_user_owns_is_never_mapped_and_never_stops_sglang(
        start_coordinator, make_rank, other_user, model):
    from tiercache.region.shm import SHM_DIR

    # another user's file under our instance name, claiming another geometry in its header
    planted = start_coordinator(spec=type(model)(layers=4))
    planted.kill()  # its region stays: a READY header, another geometry
    path = f"{SHM_DIR}/{planted.config.shm_name}"
    other_user.own(path)
    try:
        rank = make_rank(planted.config_path, extra=FAST)  # a mismatch would raise: trust first
        tokens = tokens_of(72, 2)
        assert rank.backup(tokens) == 0 and rank.prefetch(tokens) == (0, [])
        assert rank.backend.region.transfer() is None
        assert rank.counters()["errors"] == 0
    finally:
        os.chown(path, os.geteuid(), os.getegid())  # ours again, for the fixture's clean-up

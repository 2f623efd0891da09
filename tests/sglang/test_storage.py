"""SGLang's real ``HiCacheController`` with tiercache as its ``dynamic`` storage backend,
against a real ``tiercache serve``: backup -> prefetch -> ACKs, bytes exact."""

from __future__ import annotations

from sglang_env import require_sglang

require_sglang()

import ctypes  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from sglang_harness import tokens_of  # noqa: E402
from tiercache.link.client import Client  # noqa: E402
from tiercache.config import load_config  # noqa: E402
from tiercache.region.shared import SharedOffloadRegion  # noqa: E402
from tiercache.region.stats import EngineKind, PinState  # noqa: E402
from e2e_support import metrics_url, sample, scrape  # noqa: E402
from tiercache.specs import Direction  # noqa: E402


def test_sglang_loads_tiercache_through_its_dynamic_factory_with_zero_copy(coordinator, make_rank):
    from tiercache.sglang import TierCacheHiCacheStorage

    rank = make_rank(coordinator)
    assert isinstance(rank.backend, TierCacheHiCacheStorage)
    assert rank.controller.page_get_func.__name__ == "_page_get_zero_copy"
    assert rank.controller.page_set_func.__name__ == "_page_set_zero_copy"


def test_a_backup_is_prefetched_byte_for_byte_and_acked(coordinator, make_rank, model):
    rank = make_rank(coordinator)
    tokens = tokens_of(1, 6)
    assert rank.backup(tokens) == len(tokens)
    # 2 pages nobody stored after the 6: the prefetch stops at the stored run
    query = tokens + tokens_of(2, 2)
    loaded, wrong = rank.prefetch(query)
    assert loaded == len(tokens)
    assert wrong == []
    counters = rank.backend.counters.snapshot()
    assert counters["stored_pages"] == 6 and counters["loaded_pages"] == 6
    assert counters["hit_pages"] == 6 and counters["errors"] == 0
    with Client(load_config(coordinator.config_path)) as index:
        stats = index.stats()
    assert stats.ready_blocks == 6
    assert stats.loading_blocks == 0  # no pin left behind: the lease was released


def test_a_second_backup_of_stored_pages_writes_nothing_and_reports_them_done(coordinator,
                                                                              make_rank):
    rank = make_rank(coordinator)
    tokens = tokens_of(3, 4)
    assert rank.backup(tokens) == len(tokens)
    assert rank.backup(tokens) == len(tokens)
    counters = rank.backend.counters.snapshot()
    assert counters["stored_pages"] == 4 and counters["already_stored_pages"] == 4


def test_the_rank_is_a_named_attachment_whose_pin_state_says_not_needed(coordinator, make_rank):
    rank = make_rank(coordinator)
    rank.backup(tokens_of(4, 2))
    with SharedOffloadRegion.attach(coordinator.config.name) as region:
        snap = region.stats(0, slot=0).snapshot()
    assert snap.pin_state is PinState.NOT_NEEDED
    assert (snap.engine, snap.engine_rank, snap.engine_ranks) == (EngineKind.SGLANG, 0, 1)
    status = subprocess.run([sys.executable, "-m", "tiercache", "status", "--config",
                             str(coordinator.config_path)], capture_output=True, text=True)
    assert "SGLang TP rank 0/1, host copies" in status.stdout, status.stdout
    assert "pin not_needed" in status.stdout
    samples = scrape(metrics_url(coordinator))
    assert sample(samples, "tiercache_attachment_engine", rank="0", attachment="0",
                  engine="sglang") == 1
    assert snap.directions[Direction.GPU_TO_CPU].transfers_ok == 1
    assert snap.directions[Direction.GPU_TO_CPU].bytes_total == 2 * sum(
        rank.model.blob_bytes())


def test_storage_metrics_report_pages_and_bandwidth(coordinator, make_rank):
    rank = make_rank(coordinator)
    tokens = tokens_of(5, 3)
    rank.backup(tokens)
    rank.prefetch(tokens)
    metrics = rank.backend.get_stats()
    assert metrics.backup_pgs == [3] and metrics.prefetch_pgs == [3]
    assert all(bw > 0 for bw in metrics.backup_bandwidth + metrics.prefetch_bandwidth)
    assert rank.backend.get_stats().backup_pgs == []  # drained


def test_a_page_evicted_between_query_and_load_is_a_miss_from_there_on(start_coordinator,
                                                                       make_rank):
    coordinator = start_coordinator(num_blocks=8)
    rank = make_rank(coordinator)
    tokens = tokens_of(6, 4)
    rank.backup(tokens)
    other = make_rank(coordinator)

    def evict() -> None:  # another engine stores 6 pages: the 2 oldest of ours go
        assert other.backup(tokens_of(7, 3)) == 3 * 16
        assert other.backup(tokens_of(9, 3)) == 3 * 16

    loaded, wrong = rank.prefetch(tokens, before_load=evict)  # the query pinned nothing
    assert loaded < len(tokens) and wrong == []  # the leading run still there, exact
    assert rank.backend.counters.snapshot()["load_failed_pages"] > 0


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_other_host_layouts_round_trip(coordinator, make_rank, layout):
    rank = make_rank(coordinator, layout=layout)
    tokens = tokens_of(8, 3)
    assert rank.backup(tokens) == len(tokens)
    assert rank.prefetch(tokens) == (len(tokens), [])


def test_a_key_twice_in_one_backup_is_stored_once_and_every_place_answered(coordinator,
                                                                          make_rank, model):
    """As SGLang's file backend answers a key it holds already: True. The distinct pages are
    stored (a duplicate key failed the whole call: every page answered False)."""
    rank = make_rank(coordinator)
    ps = model.page_size
    hashes = get_storage_hash_str(tokens_of(41, 3), None, page_size=ps)
    keys = [hashes[0], hashes[1], hashes[0], hashes[2]]
    src = rank.host.alloc(4 * ps)
    dst = rank.host.alloc(3 * ps)
    try:
        rank.fill(src, tokens_of(42, 4))  # four different pages
        assert rank.backend.batch_set_v1(keys, src) == [True] * 4
        counters = rank.counters()
        assert counters["stored_pages"] == 3 and counters["already_stored_pages"] == 1
        assert rank.backend.batch_get_v1(hashes, dst) == [True] * 3
        pages = rank._pages(src)
        for loaded, first_place in zip(rank._pages(dst), (0, 1, 3)):  # a key: its first page
            for (ptr, n), (want_ptr, want_n) in zip(zip(*loaded), zip(*pages[first_place])):
                assert n == want_n
                assert ctypes.string_at(ptr, n) == ctypes.string_at(want_ptr, n)
    finally:
        rank.host.free(src)
        rank.host.free(dst)

"""vLLM's own Scheduler and OffloadingConnector (both roles) with TierCacheOffloadingSpec,
a real `tiercache serve`, CPU KV tensors and the cpu backend."""

from __future__ import annotations

from vllm_env import require_vllm

require_vllm()

import numpy as np  # noqa: E402

from tiercache.region.shared import SharedOffloadRegion  # noqa: E402
from control_support import wait_for  # noqa: E402
from vllm_harness import BLOCK_TOKENS  # noqa: E402

PROMPT = list(range(100))  # 6 full blocks and a partial one
OTHER = [200 + (i % 50) for i in range(230)]  # takes every GPU block of a 16-block engine


def region_rows(coordinator, slots):
    """Each slot's row of rank 0, as the coordinator's region holds it now."""
    with SharedOffloadRegion.attach(coordinator.config.name) as region:
        rows = region.rank_array(0)
        return [rows[s].copy() for s in slots]


def test_a_stored_prefix_is_loaded_by_the_next_request_byte_for_byte(coordinator, make_engine):
    # 16 GPU blocks: the request in between evicts the first prompt's blocks from the GPU,
    # so the second request can only get its prefix from tiercache.
    engine = make_engine(coordinator, num_gpu_blocks=16)
    engine.add_request("r1", PROMPT)
    engine.run()
    stats = engine.manager.book
    assert not stats.writing, "request 1's stores completed"
    engine.add_request("between", OTHER)
    engine.run()
    engine.add_request("r2", PROMPT + [1, 2, 3])
    engine.run()

    assert engine.loaded_tokens("r2") == 6 * BLOCK_TOKENS
    (load,) = [r for r in engine.finished_loads if r.req_id == "r2"]
    rows = region_rows(coordinator, load.slots)
    page = engine.model.page_bytes
    for row, gpu_block in zip(rows, load.gpu_blocks):
        for layer in range(engine.model.num_layers):
            region_page = row[layer * page:(layer + 1) * page]  # page offsets: 256-aligned
            assert np.array_equal(engine.block_bytes(gpu_block, layer), region_page)
    assert engine.finished == {"r1", "between", "r2"}


def prompt(seed: int, length: int = 96) -> list[int]:
    return [(seed * 31 + i) % 250 for i in range(length)]


def test_eviction_under_pressure_drops_old_prefixes_and_reports_them(start_coordinator,
                                                                     make_engine):
    small = start_coordinator(num_chunks=8)
    engine = make_engine(small, num_gpu_blocks=16, kv_events=True)
    engine.add_request("old", prompt(1))  # 6 chunks
    engine.run()
    engine.add_request("new", prompt(2))  # 6 more: 4 of the old ones must go
    engine.run()
    removed = [e for e in engine.kv_events.events if type(e).__name__ == "BlockRemoved"
               and e.medium == "CPU"]
    assert sum(len(e.block_hashes) for e in removed) == 4
    engine.add_request("filler", OTHER)  # clears the GPU prefix cache
    engine.run()
    engine.add_request("old-again", prompt(1) + [9])
    engine.add_request("new-again", prompt(2) + [9])
    engine.run()
    assert engine.loaded_tokens("new-again") == 6 * BLOCK_TOKENS
    assert engine.loaded_tokens("old-again") == 2 * BLOCK_TOKENS, "4 of its 6 chunks were evicted"


def test_a_lone_engines_long_prompt_is_stored_whole_with_the_default_share(start_coordinator,
                                                                          make_engine):
    """Issue 33: with index.max_session_share at its default (0.5, what config-for-vllm
    prints), one engine alone on the node stored nothing of a 16-chunk prompt in a
    24-chunk cache. The share bites only under contention now: it is stored whole."""
    from tiercache.link.client import Client

    small = start_coordinator(num_chunks=24)
    assert small.config.index_max_session_share == 0.5
    engine = make_engine(small, num_gpu_blocks=40)
    engine.add_request("long", prompt(5, 16 * BLOCK_TOKENS + 4))
    engine.run()
    with Client(small.config) as client:
        stats = client.stats()
    assert (stats.stored_blocks, stats.session_limit_rejections) == (16, 0)


def test_a_store_refused_for_want_of_room_lands_in_the_step_after_its_request_finished(
        start_coordinator, make_engine):
    """vLLM retries a store that found no room (``prepare_store`` None: "cannot store
    chunks") in every later step, the one after its request finished included, which
    schedules nothing. Room appears only then here: the finished request's chunks are
    stored by a step without a forward pass, and the engine goes idle."""
    from tiercache.link.client import Client

    small = start_coordinator(num_chunks=8)
    engine = make_engine(small, num_gpu_blocks=16)
    with Client(small.config) as other:  # another engine fills the cache and pins all of it
        keys = [b"other-%d" % i for i in range(8)]
        other.complete_store(list(other.prepare_store(keys).keys_to_store))
        other.prepare_load(keys)
        engine.add_request("r", prompt(8))
        while "r" not in engine.finished:
            engine.step()
        with Client(small.config) as client:
            assert client.stats().stored_blocks == 8, "nothing of r found room"
        other.complete_load(keys)  # room, from the next step on
    engine.run()
    with Client(small.config) as client:
        stats = client.stats()
    assert stats.writing_blocks == 0
    assert stats.stored_blocks > 8, "r's chunks were stored after it finished"
    fresh = make_engine(small, num_gpu_blocks=16)  # nothing in its GPU prefix cache
    fresh.add_request("again", prompt(8) + [1])
    fresh.run()
    assert fresh.loaded_tokens("again") > 0  # checked byte for byte


def test_a_preempted_request_resumes_from_tiercache(coordinator, make_engine):
    # 15 usable GPU blocks; two requests of 6 prompt blocks decoding 90 tokens each need
    # 12 blocks apiece: the later one is preempted, and its prompt comes back from tiercache.
    engine = make_engine(coordinator, num_gpu_blocks=16)
    engine.add_request("a", prompt(3), max_tokens=90)
    engine.add_request("b", prompt(4), max_tokens=90)
    engine.run(max_steps=400)
    assert engine.preempted, "the engine preempted a request"
    assert engine.finished == {"a", "b"}
    (victim,) = engine.preempted
    # Part of its prompt may still be in the GPU prefix cache; the rest comes from tiercache,
    # and every block it reads was checked (the content rule).
    assert engine.loaded_tokens(victim) > 0


def test_a_request_finishing_with_stores_in_flight_keeps_its_bytes(coordinator, make_engine):
    # The store of a request's last blocks is submitted only at the next step, after the
    # request finished and its blocks went back to the pool; the next request reuses them
    # at once. vLLM fences the reuse on the store (jobs_to_flush): what lands in the region
    # must be the finished request's KV, not the new request's.
    engine = make_engine(coordinator, num_gpu_blocks=8)
    engine.add_request("first", prompt(5))
    engine.run()
    engine.add_request("second", prompt(6))
    engine.run()
    engine.add_request("first-again", prompt(5) + [1])
    engine.run()
    assert engine.loaded_tokens("first-again") == 6 * BLOCK_TOKENS  # checked byte for byte


def test_a_lookup_takes_nothing_an_aborted_request_evicts_no_stored_block(start_coordinator,
                                                                          make_engine):
    # Issue 21, item 2: A stores 16 chunks in a 24-chunk cache; X (A's first chunk, then 15
    # new ones: a cached chunk, so X is probed, not a cold miss) is looked up once and
    # aborted before it computes anything; B asks for A's prompt again. X's lookup may
    # reserve the 8 free slots, never evict one of A's chunks for a store that does not
    # happen.
    cache = start_coordinator(num_chunks=24)
    first = make_engine(cache)
    a_prompt = prompt(7, 16 * BLOCK_TOKENS + 4)
    first.add_request("A", a_prompt)
    first.run()
    second = make_engine(cache)  # an empty GPU prefix cache: B's hits can only be loaded
    second.add_request("X", a_prompt[:BLOCK_TOKENS] + prompt(8, 16 * BLOCK_TOKENS + 4)[BLOCK_TOKENS:])
    out = second.step()  # X's admission step: looked up, probed, deferred
    assert "X" not in out.num_scheduled_tokens, "X computed nothing"
    second.abort("X")
    second.add_request("B", a_prompt + [1, 2, 3])
    second.run()
    assert "B" in second.finished
    assert second.loaded_tokens("B") == 16 * BLOCK_TOKENS


def on_disk(coordinator) -> int:
    """Blocks the coordinator's disk tier holds (its file is locked by the coordinator:
    asked over the control socket, not read beside it)."""
    from tiercache.link.client import Client

    with Client(coordinator.config) as client:
        return client.tier_stats()["disk"].used_blocks


def test_a_prefix_evicted_to_the_disk_tier_is_promoted_and_loaded_exact(start_coordinator,
                                                                       make_engine, tmp_path):
    """A host tier of 8 chunks with a disk tier below: the first prompt's chunks are demoted
    ahead of their eviction while other prompts fill host memory; the prompt's next request
    finds them on disk, waits (HIT_PENDING) while they are promoted, and loads all 6 chunks
    exact (the harness checks every loaded block)."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from tiercache.config import DiskConfig
    from tiercache.link.client import Client

    (tmp_path / "disk").mkdir()
    small = start_coordinator(num_chunks=8, disk=DiskConfig(
        path=str(tmp_path / "disk"), capacity_bytes=64 << 20, low_watermark=0.5))
    engine = make_engine(small, num_gpu_blocks=16)
    engine.add_request("first", prompt(1))  # 6 chunks
    engine.run()
    wait_for(lambda: on_disk(small) >= 6, "the first prompt's chunks are demoted")
    for seed in (2, 3, 4):  # 18 more chunks: the first prompt's leave host memory
        engine.add_request(f"other {seed}", prompt(seed))
        engine.run()
    engine.add_request("filler", OTHER)  # every GPU block: the prefix is in tiercache only
    engine.run()
    with Client(small.config) as client:
        promoted_before = client.tier_stats()["disk"].promotions
    assert CacheHitSource.DISK not in engine.hits_by_source
    engine.add_request("again", prompt(1) + [7])
    engine.run()
    assert engine.loaded_tokens("again") == 6 * BLOCK_TOKENS
    # vLLM counts them as disk hits (prompt_tokens_cached_by_source{source="disk"})
    assert engine.hits_by_source.get(CacheHitSource.DISK) == 6 * BLOCK_TOKENS, \
        engine.hits_by_source
    with Client(small.config) as client:  # they came up from disk, not from host memory
        assert client.tier_stats()["disk"].promotions - promoted_before >= 6

"""TierCacheManager against a real coordinator: vLLM's OffloadingManager contract, one
scenario per method, built through TierCacheOffloadingSpec from an OffloadingConfig as
vLLM's connector builds it. Keys are vLLM OffloadKeys (block hash + group index)."""

from __future__ import annotations

from vllm_env import require_vllm

require_vllm()

import threading  # noqa: E402
from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult, ReqContext, ScheduleEndContext, make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig, OffloadingModelConfig, OffloadingParallelConfig,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from control_support import drained_stats, wait_for  # noqa: E402
from vllm_harness import offloading_config  # noqa: E402
from tiercache.link.client import Client  # noqa: E402
from tiercache.vllm.spec import TierCacheOffloadingSpec  # noqa: E402

HIT, MISS, PENDING, RETRY = (LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING,
                             LookupResult.RETRY)
END = ScheduleEndContext((), ())


def key(i: int):
    return make_offload_key(i.to_bytes(32, "big"), 0)


class Scheduler:
    """What vLLM's connector does around the manager, reduced to its calls."""

    def __init__(self, manager):
        self.manager = manager
        self.contexts: dict[str, ReqContext] = {}

    def request(self, req_id: str) -> ReqContext:
        ctx = self.contexts[req_id] = ReqContext(req_id)
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        return ctx

    def lookup(self, ctx: ReqContext, keys) -> list:
        with self.manager.lock:
            return [self.manager.lookup(k, ctx) for k in keys]

    def end_step(self) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(END)
        assert self.manager.wait_flushed()

    def store(self, ctx: ReqContext, keys, success=True):
        with self.manager.lock:
            out = self.manager.prepare_store(keys, ctx)
        if out is not None and out.keys_to_store:
            with self.manager.lock:
                self.manager.complete_store(out.keys_to_store, ctx, success)
        return out


@pytest.fixture
def spec_for(tiny_model):
    made = []

    def build(coordinator, **kw):
        spec = TierCacheOffloadingSpec(offloading_config(coordinator, tiny_model, **kw))
        made.append(spec)
        return spec

    yield build
    for spec in made:
        if spec._manager is not None:
            spec._manager.shutdown()


@pytest.fixture
def sched(spec_for, coordinator):
    scheduler = Scheduler(spec_for(coordinator).get_manager())
    return scheduler


def coordinator_stats(coordinator):
    with Client(coordinator.config) as client:
        return client.stats()


def test_lookup_is_retry_then_answered_by_one_probe_per_step(sched, coordinator):
    ctx = sched.request("r1")
    sched.store(ctx, [key(1), key(2)])
    sched.end_step()  # publishes the stores
    with sched.manager.lock:
        sched.manager.get_stats()  # drains the flush timings so far
    assert sched.lookup(ctx, [key(1), key(2), key(3)]) == [RETRY] * 3
    sched.end_step()
    assert sched.lookup(ctx, [key(1), key(2), key(3)]) == [HIT, HIT, MISS]
    with sched.manager.lock:
        values = sched.manager.get_stats().metric_sections()[1]
    assert values["vllm:kv_offload_tiercache_probed_keys"] == {(): 3}, "each key probed once"
    assert len(values["vllm:kv_offload_tiercache_flush_seconds"][()]) == 1


def test_a_hit_is_a_lease_that_no_store_can_evict_until_released(spec_for, start_coordinator):
    small = start_coordinator(num_chunks=2)
    sched = Scheduler(spec_for(small).get_manager())
    writer, reader = sched.request("w"), sched.request("r")
    sched.store(writer, [key(1), key(2)])
    sched.end_step()
    sched.lookup(reader, [key(1), key(2)])
    sched.end_step()
    assert sched.lookup(reader, [key(1), key(2)]) == [HIT, HIT]
    assert sched.store(writer, [key(3)]) is None, "both chunks are leased: no room"
    with sched.manager.lock:
        spec = sched.manager.prepare_load([key(1), key(2)], reader)
        sched.manager.on_request_finished(reader)
    assert sorted(spec.slot_ids) == [0, 1]
    with sched.manager.lock:
        sched.manager.complete_load([key(1), key(2)], reader)
    sched.end_step()  # the releases go out
    out = sched.store(writer, [key(3)])
    assert out is not None and out.keys_to_store == [key(3)] and len(out.evicted_keys) == 1


def test_prepare_store_skips_held_keys_and_complete_store_tolerates_stale_keys(sched):
    ctx = sched.request("r")
    with sched.manager.lock:
        first = sched.manager.prepare_store([key(1), key(2)], ctx)
        again = sched.manager.prepare_store([key(1), key(2), key(3)], ctx)
        assert first.keys_to_store == [key(1), key(2)]
        assert again.keys_to_store == [key(3)], "keys being written are not stored twice"
        sched.manager.complete_store([key(1), key(2), key(3)], ctx)
        sched.manager.complete_store([key(1), key(9)], ctx)  # repeated and unknown: ignored
    sched.end_step()
    other = sched.request("o")
    sched.lookup(other, [key(1), key(2), key(3)])
    sched.end_step()
    assert sched.lookup(other, [key(1), key(2), key(3)]) == [HIT, HIT, HIT]


def test_own_stores_in_flight_are_hit_pending(sched):
    ctx = sched.request("r")
    with sched.manager.lock:
        sched.manager.prepare_store([key(1)], ctx)
    assert sched.lookup(ctx, [key(1)]) == [PENDING]


def test_another_engines_store_in_flight_is_hit_pending(spec_for, coordinator):
    a = Scheduler(spec_for(coordinator).get_manager())
    b = Scheduler(spec_for(coordinator).get_manager())
    writer = a.request("w")
    with a.manager.lock:
        a.manager.prepare_store([key(1)], writer)
    ctx = b.request("r")
    b.lookup(ctx, [key(1)])
    b.end_step()
    assert b.lookup(ctx, [key(1)]) == [PENDING]


def test_a_failed_store_frees_its_slots(sched, coordinator):
    ctx = sched.request("r")
    sched.store(ctx, [key(1), key(2)], success=False)
    sched.end_step()
    assert coordinator_stats(coordinator).writing_blocks == 0
    sched.lookup(ctx, [key(1)])
    sched.end_step()
    assert sched.lookup(ctx, [key(1)]) == [MISS]


def test_events_report_this_engines_stores_and_evictions(spec_for, start_coordinator):
    small = start_coordinator(num_chunks=2)
    sched = Scheduler(spec_for(small, events=True).get_manager())
    ctx = sched.request("r")
    sched.store(ctx, [key(1), key(2)])
    sched.end_step()
    sched.store(ctx, [key(3)])
    with sched.manager.lock:
        events = list(sched.manager.take_events())
    assert [(e.removed, len(e.keys)) for e in events] == [(False, 2), (True, 1), (False, 1)]
    assert events[0].keys == [key(1), key(2)] and events[2].keys == [key(3)]
    assert events[1].keys[0] in (key(1), key(2))
    with sched.manager.lock:
        assert list(sched.manager.take_events()) == []


def test_reset_moves_to_a_fresh_namespace_and_keeps_fenced_pins_until_flushed(sched, coordinator):
    ctx = sched.request("r")
    sched.store(ctx, [key(1)])
    sched.end_step()
    sched.lookup(ctx, [key(1)])
    sched.end_step()
    with sched.manager.lock:
        sched.manager.prepare_load([key(1)], ctx)  # a load in flight at the reset
        before = sched.manager.namespace.digest
        sched.manager.reset_cache()
    assert sched.manager.namespace.digest != before
    sched.end_step()
    assert coordinator_stats(coordinator).loading_blocks == 1, "fenced until flushed"
    fresh = sched.request("after")
    sched.lookup(fresh, [key(1)])
    sched.end_step()
    assert sched.lookup(fresh, [key(1)]) == [MISS], "blocks from before the reset are not loaded"
    with sched.manager.lock:
        sched.manager.on_reset_flushed()
    sched.end_step()
    assert coordinator_stats(coordinator).loading_blocks == 0


def test_the_lock_is_real_and_shutdown_ends_the_sessions(sched, coordinator):
    ctx = sched.request("r")
    sched.store(ctx, [key(1)])
    sched.end_step()
    sched.lookup(ctx, [key(1)])
    with sched.manager.lock:
        sched.manager.on_schedule_end(END)
        # the flusher cannot file its answers while the scheduler holds the lock
        assert not sched.manager.wait_flushed(0.3)
    assert sched.manager.wait_flushed()
    with sched.manager.lock:
        sched.manager.prepare_store([key(2)], ctx)  # a reservation left open
    assert coordinator_stats(coordinator).loading_blocks == 1
    sched.manager.shutdown()
    wait_for(lambda: drained_stats(coordinator.config),
             "the shut-down manager's pins and reservations released", 30)


def test_load_source_stats_and_config_info(spec_for, coordinator):
    manager = spec_for(coordinator).get_manager()
    ctx = ReqContext("r")
    with manager.lock:
        manager.on_new_request(ctx)
        assert manager.get_load_source(key(1), ctx) is CacheHitSource.HOST
        stats = manager.get_stats()
        (info,) = manager.config_info()
    sections = stats.metric_sections()[1]
    assert sections["vllm:kv_offload_tiercache_coordinator_up"] == {(): 1.0}
    assert info["tiercache_instance"] == coordinator.config.name
    assert info["tiercache_namespace"] == manager.namespace.digest.hex()
    assert isinstance(manager.lock, type(threading.Lock()))


def test_the_namespace_names_everything_that_shapes_the_bytes(tiny_model, coordinator):
    base = offloading_config(coordinator, tiny_model)
    digests = {TierCacheOffloadingSpec(base).namespace.digest}
    for changed in (
        replace(base, model=OffloadingModelConfig("other-model", "float16", 4096)),
        replace(base, model=OffloadingModelConfig("tiny-llama", "bfloat16", 4096)),
        replace(base, kv_cache_layout="BLHNC"),
        replace(base, parallel=OffloadingParallelConfig(0, 2, 2, 1, 1, 1, 0, 1, None, True)),
        replace(base, parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 2, 0, 1, None, True)),
        replace(base, cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2)),
        replace(base, extra_config={**base.extra_config, "tiercache_namespace_salt": "rev2"}),
    ):
        digests.add(TierCacheOffloadingSpec(changed).namespace.digest)
    assert len(digests) == 8
    same = TierCacheOffloadingSpec(replace(base, engine_id="another-engine")).namespace.digest
    assert same in digests, "the engine's identity is not part of the namespace"


def test_a_lease_answers_the_fenced_slots_its_load_reads_in_one_round_trip(sched, coordinator):
    writer, reader = sched.request("w"), sched.request("r")
    sched.store(writer, [key(1), key(2)])
    sched.end_step()
    sched.lookup(reader, [key(1), key(2)])
    sched.end_step()
    assert sched.lookup(reader, [key(1), key(2)]) == [HIT, HIT]
    with sched.manager.lock:
        spec = sched.manager.prepare_load([key(1), key(2)], reader).to_cpu_spec()
    prefix = sched.manager.namespace.digest
    with Client(coordinator.config) as other:  # what a prepare_load of the keys answers
        want = other.prepare_load([prefix + key(1), prefix + key(2)])
        other.complete_load([prefix + key(1), prefix + key(2)])
    assert spec.fenced and spec.region_id == want.region_id
    assert spec.block_ids.tolist() == want.block_ids.tolist()
    assert spec.slot_gens.tolist() == want.slot_gens.tolist()
    stats = coordinator_stats(coordinator)
    # The flush sent one lease_batch and no prepare_load: the coordinator counts 2 leases
    # and only the other session's load; the load holds the lease's pins.
    assert (stats.leased_blocks, stats.loaded_blocks, stats.loading_blocks) == (2, 2, 2)
    with sched.manager.lock:
        sched.manager.on_request_finished(reader)
    sched.end_step()
    assert coordinator_stats(coordinator).loading_blocks == 2, "the load in flight keeps its pins"
    with sched.manager.lock:
        sched.manager.complete_load([key(1), key(2)], reader)
    sched.end_step()
    assert coordinator_stats(coordinator).loading_blocks == 0, "released with the load"
    with sched.manager.lock:
        values = sched.manager.get_stats().metric_sections()[1]
    assert values["vllm:kv_offload_tiercache_loaded_chunks"] == {(): 2}


def test_a_lookup_takes_nothing_a_miss_evicts_no_stored_block(spec_for, start_coordinator):
    # vLLM's manager contract: lookup is a query. A probe reserves the chunks a request is
    # about to compute from free slots only; the store itself may evict. (The probed
    # request starts with a cached chunk: a wholly new one is a cold miss, never probed.)
    small = start_coordinator(num_chunks=2)
    sched = Scheduler(spec_for(small).get_manager())
    writer, probe = sched.request("w"), sched.request("p")
    sched.store(writer, [key(1), key(2)])
    sched.end_step()
    assert sched.lookup(probe, [key(1), key(3)]) == [RETRY, RETRY]
    sched.end_step()
    assert sched.lookup(probe, [key(1), key(3)]) == [HIT, MISS]
    assert coordinator_stats(small).evicted_blocks == 0
    reader = sched.request("r")
    sched.lookup(reader, [key(1), key(2)])
    sched.end_step()
    assert sched.lookup(reader, [key(1), key(2)]) == [HIT, HIT], "the miss took neither"
    with sched.manager.lock:
        sched.manager.on_request_finished(reader)
    sched.end_step()
    out = sched.store(probe, [key(3)])
    assert out.keys_to_store == [key(3)] and len(out.evicted_keys) == 1


def test_a_cold_request_is_a_miss_at_its_first_lookup_with_no_round_trip(sched, coordinator):
    # Issue 21, item 1: no tier holds the request's first chunk (the coordinator's key
    # presence map says so), so it is admitted in this step; nothing is probed.
    ctx = sched.request("cold")
    lookups = coordinator_stats(coordinator).lookups
    assert sched.lookup(ctx, [key(7)]) == [MISS]
    sched.end_step()
    assert coordinator_stats(coordinator).lookups == lookups, "no lease RPC for it"
    with sched.manager.lock:
        values = sched.manager.get_stats().metric_sections()[1]
    assert values["vllm:kv_offload_tiercache_cold_misses"] == {(): 1}
    assert "vllm:kv_offload_tiercache_probed_keys" not in values
    other = sched.request("warm")  # once stored, the same first chunk is probed, then a HIT
    sched.store(other, [key(7)])
    sched.end_step()
    again = sched.request("again")
    assert sched.lookup(again, [key(7)]) == [RETRY]
    sched.end_step()
    assert sched.lookup(again, [key(7)]) == [HIT]


def test_reservations_evict_no_more_than_the_step_stored_and_retry_what_found_no_room(
        spec_for, start_coordinator):
    small = start_coordinator(num_chunks=5)
    sched = Scheduler(spec_for(small).get_manager())
    prefix = sched.manager.book.prefix
    with Client(small.config) as other:  # a full cache: this engine's first chunk (so the
        keys = [prefix + key(0)] + [b"other-%d" % i for i in range(4)]  # request is probed,
        out = other.prepare_store(keys)  # not a cold miss) and 4 blocks of another engine
        other.complete_store(list(out.keys_to_store))
    waiting, writer = sched.request("waiting"), sched.request("w")
    assert sched.lookup(waiting, [key(0), key(1), key(2)]) == [RETRY] * 3
    sched.end_step()
    assert sched.lookup(waiting, [key(0), key(1), key(2)]) == [HIT, MISS, MISS]
    assert coordinator_stats(small).evicted_blocks == 0, "a step that stored nothing"
    sched.end_step()
    assert sched.lookup(waiting, [key(1)]) == [MISS], "no room is still a miss, not a retry"
    sched.store(writer, [key(9)])  # a real store in this step: asked on the spot, evicts one
    sched.end_step()  # the step stored one: its flush may evict one for the waiting request
    stats = coordinator_stats(small)
    assert (stats.evicted_blocks, stats.writing_blocks) == (2, 1)
    with sched.manager.lock:
        out = sched.manager.prepare_store([key(1)], waiting)
    assert out.keys_to_store == [key(1)], "answered from the retried reservation"
    assert coordinator_stats(small).evicted_blocks == 2

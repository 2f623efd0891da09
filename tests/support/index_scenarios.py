"""Narrated cache-index scenarios, run against an ``OffloadingManager`` in-process
(tests/index/test_manager.py) and against a ``Client`` of a server in another process
(tests/control/test_control.py); the contract they narrate is ``OffloadingManager``'s
docstring (tiercache/index/manager.py). Every scenario starts from an empty index of
``CAPACITY_BLOCKS`` slots with events on; keys are integer-like (``b"7"``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tiercache.errors import InvalidKeyError, StateError, UnknownKeyError
from tiercache.index.manager import LeaseResult, OffloadingEvent, PrepareStoreOutput

CAPACITY_BLOCKS = 4


def k(*ints: int) -> list[bytes]:
    return [b"%d" % i for i in ints]


def store(cache, *ints: int) -> PrepareStoreOutput:
    """prepare_store + successful complete_store; returns the prepare output."""
    out = cache.prepare_store(k(*ints))
    assert out is not None, f"no room to store {ints}"
    cache.complete_store(list(out.keys_to_store))
    return out


def ids(out_or_spec) -> list[int]:
    spec = getattr(out_or_spec, "store_spec", out_or_spec)
    return spec.block_ids.tolist()


def stored(*ints: int) -> OffloadingEvent:
    return OffloadingEvent(tuple(k(*ints)), removed=False)


def removed(*ints: int) -> OffloadingEvent:
    return OffloadingEvent(tuple(k(*ints)), removed=True)


# ---------------------------------------------------------------- both policies

def store_then_hit(cache, policy: str) -> None:
    # Two blocks are reserved in the first free slots, but are not hits until written.
    out = cache.prepare_store(k(1, 2))
    assert out.keys_to_store == tuple(k(1, 2)) and ids(out) == [0, 1] and out.evicted_keys == ()
    assert cache.lookup(k(1, 2)) == 0
    with pytest.raises(StateError, match="still being written"):
        cache.prepare_load(k(1))
    s = cache.stats()
    assert (s.writing_blocks, s.free_blocks, s.occupancy) == (2, 2, 0.5)
    # Once written they are hits; lookup counts only the leading run.
    cache.complete_store(k(1, 2))
    assert cache.lookup(k(1, 2, 3)) == 2
    assert cache.lookup(k(3, 1)) == 0
    s = cache.stats()
    assert (s.lookups, s.hit_blocks, s.miss_blocks, s.stored_blocks) == (3, 2, 5, 2)
    assert (s.capacity_blocks, s.free_blocks, s.ready_blocks, s.writing_blocks) == (4, 2, 2, 0)
    # Loads get slot ids co-indexed with the keys, in the order asked.
    assert ids(cache.prepare_load(k(2, 1))) == [1, 0]
    cache.complete_load(k(2, 1))
    # Keys already held are skipped; nothing to store is not a refusal.
    out = cache.prepare_store(k(1, 2))
    assert out is not None and out.keys_to_store == () and ids(out) == []


def least_recent_goes_first(cache, policy: str) -> None:
    for i in (1, 2, 3, 4):
        store(cache, i)
    cache.touch(k(1))  # 1 is now the most recent (for ARC: promoted to T2)
    assert store(cache, 5).evicted_keys == tuple(k(2))
    assert store(cache, 6, 7).evicted_keys == tuple(k(3, 4))
    assert cache.lookup(k(1)) == 1 and cache.lookup(k(5, 6, 7)) == 3
    assert cache.stats().evicted_blocks == 3


def prefix_tail_goes_first(cache, policy: str) -> None:
    # Within one call keys[0] ends most recent: a prefix loses its tail before its head.
    store(cache, 1, 2, 3, 4)
    assert store(cache, 5).evicted_keys == tuple(k(4))
    assert store(cache, 6).evicted_keys == tuple(k(3))
    cache.touch(k(7, 2, 1))  # 7 is not held and is ignored; 1 and 2 are now the most recent
    assert store(cache, 8).evicted_keys == tuple(k(5))
    assert store(cache, 9).evicted_keys == tuple(k(6))


def same_call_keys_protected(cache, policy: str) -> None:
    store(cache, 1, 2)  # 2 is older than 1
    cache.touch(k(1))
    # 2 is the oldest, but it belongs to this very call: 1 goes instead.
    out = cache.prepare_store(k(2, 3, 4, 5))
    assert out.keys_to_store == tuple(k(3, 4, 5)) and out.evicted_keys == tuple(k(1))
    cache.complete_store(list(out.keys_to_store))
    assert cache.lookup(k(2, 3, 4, 5)) == 4


def loading_and_pending_blocks_protected(cache, policy: str) -> None:
    for i in (1, 2, 3, 4):
        store(cache, i)
    assert ids(cache.prepare_load(k(1, 2))) == [0, 1]
    cache.prepare_load(k(1))  # a second reader of 1
    s = cache.stats()
    assert (s.loading_blocks, s.ready_blocks, s.loaded_blocks) == (2, 2, 3)
    # Three new blocks need three victims; only 3 and 4 may go: refused, nothing changed.
    before = cache.stats()
    assert cache.prepare_store(k(5, 6, 7)) is None
    after = cache.stats()
    assert after.store_rejections == before.store_rejections + 1
    assert (after.free_blocks, after.ready_blocks, after.loading_blocks) == (0, 2, 2)
    assert cache.lookup(k(1, 2, 3, 4)) == 4
    # Two fit, and the blocks being written are protected in turn.
    out = cache.prepare_store(k(5, 6))
    assert out.evicted_keys == tuple(k(3, 4))
    assert cache.prepare_store(k(7)) is None
    # One load of 2 ends: 2 may go; 1 still has a reader.
    cache.complete_load(k(1, 2))
    assert cache.prepare_store(k(7)).evicted_keys == tuple(k(2))
    cache.complete_load(k(1))
    cache.complete_store(list(out.keys_to_store))
    cache.complete_store(k(7))
    assert store(cache, 8).evicted_keys == tuple(k(1))
    s = cache.stats()
    assert (s.loading_blocks, s.writing_blocks, s.ready_blocks, s.store_rejections) == (0, 0, 4, 2)


def more_than_capacity_refused(cache, policy: str) -> None:
    assert cache.prepare_store(k(1, 2, 3, 4, 5)) is None
    s = cache.stats()
    assert (s.free_blocks, s.store_rejections, s.writing_blocks) == (4, 1, 0)
    assert cache.prepare_store(k(1, 2, 3, 4)) is not None


def failed_store_frees_slots(cache, policy: str) -> None:
    for i in (1, 2, 3, 4):
        store(cache, i)
    out = cache.prepare_store(k(5))
    assert out.evicted_keys == tuple(k(1)) and ids(out) == [0]
    cache.complete_store(k(5), success=False)
    s = cache.stats()
    assert (s.free_blocks, s.failed_store_blocks, s.stored_blocks) == (1, 1, 4)
    assert cache.lookup(k(5)) == 0 and cache.lookup(k(1)) == 0  # the victim stays gone
    cache.complete_store(k(5))  # no longer reserved: ignored, 5 does not appear
    assert cache.lookup(k(5)) == 0 and cache.stats().stored_blocks == 4
    # The freed slot is reused without evicting anyone.
    out = cache.prepare_store(k(5))
    assert out.evicted_keys == () and ids(out) == [0]
    # A failure reaches only the caller's reservations: READY 2 is not "failed".
    cache.complete_store(k(5, 2), success=False)
    s = cache.stats()
    assert (s.writing_blocks, s.free_blocks, s.failed_store_blocks) == (0, 1, 2)
    assert cache.lookup(k(2, 3, 4)) == 3


def events(cache, policy: str) -> None:
    store(cache, 1, 2)
    store(cache, 3, 4)
    assert store(cache, 5).evicted_keys == tuple(k(2))
    out = cache.prepare_store(k(6))
    cache.complete_store(list(out.keys_to_store), success=False)  # failed: never reported
    assert cache.take_events() == [stored(1, 2), stored(3, 4), removed(2), stored(5), removed(1)]
    assert cache.take_events() == []


def misuse_is_refused(cache, policy: str) -> None:
    store(cache, 1, 2)
    # complete_store ignores what the caller did not reserve (engines repeat keys).
    cache.complete_store(k(9))
    cache.complete_store(k(1), success=False)  # a double complete, as a failure
    assert cache.lookup(k(1, 2, 9)) == 2 and cache.stats().failed_store_blocks == 0
    with pytest.raises(StateError, match="0 load"):
        cache.complete_load(k(1))  # would underflow
    with pytest.raises(UnknownKeyError, match="b'9'"):
        cache.prepare_load(k(1, 9))
    assert cache.stats().loading_blocks == 0  # the refused call pinned nothing
    cache.prepare_load(k(1))
    with pytest.raises(StateError):
        cache.complete_load(k(1, 1))  # one load in flight, two completes
    assert cache.stats().loading_blocks == 1
    cache.complete_load(k(1))
    with pytest.raises(InvalidKeyError, match="more than once"):
        cache.prepare_store(k(3, 3))
    with pytest.raises(InvalidKeyError, match="int"):
        cache.lookup([b"1", 2])
    with pytest.raises(InvalidKeyError, match="str"):
        cache.prepare_store(["3"])
    s = cache.stats()
    assert (s.ready_blocks, s.free_blocks, s.writing_blocks) == (2, 2, 0)


def reset_forgets_everything(cache, policy: str) -> None:
    """A reset forgets every key at once; a slot a copy still touches (3 being written, 1
    being loaded) is handed out again only once that copy's owner completes it, and a
    write completed into it after the reset is not served."""
    store(cache, 1, 2)
    writing = ids(cache.prepare_store(k(3)))
    loading = cache.prepare_load(k(1)).block_ids.tolist()
    cache.reset()
    s = cache.stats()
    assert (s.free_blocks, s.ready_blocks, s.writing_blocks, s.loading_blocks) == (2, 0, 1, 1)
    assert s.stored_blocks == 2  # counters are lifetime totals
    assert cache.lookup(k(1, 2)) == 0 and cache.lookup(k(3)) == 0
    assert not set(ids(store(cache, 4, 5))) & set(writing + loading)  # never a busy slot
    cache.complete_store(k(3))  # its copy landed in a slot the reset doomed: not served
    assert cache.lookup(k(3)) == 0
    cache.complete_load(k(1))  # the load ends: its slot is free again
    s = cache.stats()
    assert (s.free_blocks, s.ready_blocks, s.writing_blocks, s.loading_blocks) == (2, 2, 0, 0)
    assert set(ids(store(cache, 6, 7))) == set(writing + loading)
    assert cache.take_events()[:3] == [stored(1, 2), removed(1, 2), stored(4, 5)]


def scan_vs_reuse(cache, policy: str) -> None:
    # 1 and 2 are used twice, then a scan of one-time blocks passes through.
    store(cache, 1)
    store(cache, 2)
    cache.touch(k(1))
    cache.touch(k(2))
    store(cache, 3)
    store(cache, 4)
    first_victim = {"lru": k(1), "arc": k(3)}[policy]  # ARC keeps the reused blocks
    assert store(cache, 5).evicted_keys == tuple(first_victim)


def leases_pin_until_released(cache, policy: str) -> None:
    for i in (1, 2, 3, 4):
        store(cache, i)
    # A lease answers the leading hit run and pins it: 1 and 2 cannot be evicted now.
    lease = cache.lease(k(1, 2, 9, 3))
    assert lease == LeaseResult(2, pending=False)
    # Its spec is the run's slots, fenced as a prepare_load answer is: a load reads them
    # under the lease's pins, no prepare_load needed (and none counted).
    load = cache.prepare_load(k(1, 2))
    assert ids(lease.spec) == ids(load) == [0, 1]
    assert lease.spec.region_id == load.region_id
    if load.slot_gens is not None:
        assert lease.spec.slot_gens.tolist() == load.slot_gens.tolist()
    cache.complete_load(k(1, 2))
    assert cache.stats().loaded_blocks == 2, "the lease was not counted as a load"
    assert cache.prepare_store(k(5, 6, 7)) is None  # only 3 and 4 could go
    out = cache.prepare_store(k(5))
    assert out.evicted_keys == tuple(k(3))  # 1 and 2 were older, but leased
    # 5 is being written: a lease that reaches it says "pending" (ask again soon).
    assert cache.lease(k(4, 5)) == LeaseResult(1, pending=True)
    nothing = cache.lease(k(5))
    assert nothing == LeaseResult(0, pending=True) and len(nothing.spec) == 0
    s = cache.stats()
    assert (s.loading_blocks, s.leased_blocks, s.lookups, s.loaded_blocks) == (3, 3, 3, 2)
    # A lease and a load share one pin counter: the load ends, the lease still holds 1.
    cache.prepare_load(k(1))
    cache.complete_load(k(1))
    assert cache.stats().loading_blocks == 3
    # release drops every pin the caller holds on the keys; unknown keys are ignored.
    assert cache.release(k(1, 2, 4, 9)) == 3
    assert cache.release(k(1)) == 0
    cache.complete_store(list(out.keys_to_store))
    s = cache.stats()
    assert (s.loading_blocks, s.ready_blocks, s.free_blocks) == (0, 4, 0)
    # Nothing is pinned any more: a store finds a victim (which one is the policy's: a
    # lease counts as an access, so the leased blocks are recent; ARC drops 5, seen once).
    evicted = store(cache, 6).evicted_keys
    assert len(evicted) == 1 and evicted[0] in k(1, 2, 4, 5)


def reserving_ahead_evicts_at_most_its_limit(cache, policy: str) -> None:
    for i in (1, 2, 3):
        store(cache, i)
    # A reservation ahead of a store that may never happen (a scheduler's probe), free
    # slots only: one is free, so 4 is reserved, 5 gets nothing, 1 is held already.
    out = cache.prepare_store(k(4, 5, 1), max_evictions=0)
    assert (out.keys_to_store, out.no_room_keys, out.evicted_keys) == (tuple(k(4)), tuple(k(5)), ())
    assert ids(out) == [3]
    # No free slot left: nothing reserved, and still not None ("no room" is per key).
    out = cache.prepare_store(k(6, 7), max_evictions=0)
    assert (out.keys_to_store, out.no_room_keys, ids(out)) == ((), tuple(k(6, 7)), [])
    assert cache.lookup(k(1, 2, 3)) == 3, "no stored block was evicted"
    s = cache.stats()
    assert (s.evicted_blocks, s.store_rejections, s.writing_blocks) == (0, 0, 1)
    # One eviction allowed: 6 evicts the least recent of 2 and 3 (1 is a key of the call,
    # never evicted for it), 7 gets nothing.
    out = cache.prepare_store(k(1, 6, 7), max_evictions=1)
    assert (out.keys_to_store, out.no_room_keys) == (tuple(k(6)), tuple(k(7)))
    assert out.evicted_keys in (tuple(k(2)), tuple(k(3)))
    # The store itself (the request really computes 5) may evict, as ever.
    out = cache.prepare_store(k(5))
    assert out.keys_to_store == tuple(k(5)) and out.no_room_keys == ()
    assert len(out.evicted_keys) == 1


# ---------------------------------------------------------------- ARC only

def arc_ghost_hits_adapt_target(cache, policy: str) -> None:
    store(cache, 1)
    store(cache, 2)
    cache.touch(k(1))
    cache.touch(k(2))  # T2 = [1, 2]
    store(cache, 3)
    store(cache, 4)  # T1 = [3, 4]
    assert store(cache, 5).evicted_keys == tuple(k(3))  # p = 0: T1 gives way; B1 = [3]
    # 3 comes back: T1 was too small, p grows to 1, T1 (2 > 1) still gives way.
    assert store(cache, 3).evicted_keys == tuple(k(4))
    # 4 comes back: p = 2 > |T1| = 1, so now T2's least recent block goes.
    assert store(cache, 4).evicted_keys == tuple(k(1))
    assert store(cache, 6).evicted_keys == tuple(k(2))
    # 1 comes back from B2: T2 was too small, p drops to 1 and T1 gives way again.
    assert store(cache, 1).evicted_keys == tuple(k(5))
    assert cache.lookup(k(3)) == cache.lookup(k(4)) == cache.lookup(k(1)) == 1


Scenario = Callable[[object, str], None]

BOTH: dict[str, Scenario] = {f.__name__: f for f in (
    store_then_hit, least_recent_goes_first, prefix_tail_goes_first, same_call_keys_protected,
    loading_and_pending_blocks_protected, more_than_capacity_refused, failed_store_frees_slots,
    events, misuse_is_refused, reset_forgets_everything, scan_vs_reuse, leases_pin_until_released,
    reserving_ahead_evicts_at_most_its_limit,
)}
ARC_ONLY: dict[str, Scenario] = {arc_ghost_hits_adapt_target.__name__: arc_ghost_hits_adapt_target}
USES_EVENTS = {"events", "reset_forgets_everything"}

CASES = [(policy, name) for name in BOTH for policy in ("lru", "arc")] + [
    ("arc", name) for name in ARC_ONLY]


def run(cache, policy: str, name: str) -> None:
    (BOTH.get(name) or ARC_ONLY[name])(cache, policy)

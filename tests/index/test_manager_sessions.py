"""Owners in the index: every reservation and pin belongs to the session that made it, and
ending a session gives back exactly what it held. Narrated scenarios on four slots with
integer keys; owners 1 and 2 stand for two engines' sessions."""

from __future__ import annotations

import pytest

from index_scenarios import k, store
from tiercache.errors import ManagerError, StateError
from tiercache.index.manager import LOCAL_OWNER, LeaseResult, OffloadingManager, SessionRelease

ENGINE_A, ENGINE_B = 1, 2


@pytest.fixture(params=["lru", "arc"])
def cache(request) -> OffloadingManager:
    return OffloadingManager(4, request.param)


def test_a_dead_engine_gives_back_its_reservations_and_pins(cache):
    store(cache, 1, 2)
    # Engine A reserves the two free slots, leases 1 and loads 2, then dies.
    assert cache.prepare_store(k(3, 4), owner=ENGINE_A) is not None
    assert cache.lease(k(1), owner=ENGINE_A) == LeaseResult(1, pending=False)
    cache.prepare_load(k(2), owner=ENGINE_A)
    s = cache.stats()
    assert (s.free_blocks, s.writing_blocks, s.loading_blocks) == (0, 2, 2)
    assert cache.prepare_store(k(5)) is None  # nothing may go: the cache is stuck
    # Its session ends: both slots are free again and 1, 2 are evictable.
    assert cache.end_session(ENGINE_A) == SessionRelease(freed_writing=2, dropped_pins=2)
    s = cache.stats()
    assert (s.free_blocks, s.writing_blocks, s.loading_blocks, s.ready_blocks) == (2, 0, 0, 2)
    assert (s.sessions_ended, s.released_writing_blocks, s.released_pins) == (1, 2, 2)
    assert cache.lookup(k(3)) == 0  # never written, never readable
    assert cache.prepare_store(k(5, 6, 7, 8)) is not None  # full capacity is back
    # Ending it again gives back nothing (but counts: each end is one session ended).
    assert cache.end_session(ENGINE_A) == SessionRelease(0, 0)
    assert cache.stats().sessions_ended == 2


def test_another_engine_keeps_what_it_holds(cache):
    store(cache, 1)
    cache.prepare_store(k(2), owner=ENGINE_A)
    cache.prepare_store(k(3), owner=ENGINE_B)
    cache.lease(k(1), owner=ENGINE_A)
    cache.lease(k(1), owner=ENGINE_B)
    cache.end_session(ENGINE_A)
    # B's reservation and B's pin on 1 survive A's end.
    s = cache.stats()
    assert (s.writing_blocks, s.loading_blocks) == (1, 1)
    assert cache.release(k(1), owner=ENGINE_B) == 1
    cache.complete_store(k(3), owner=ENGINE_B)
    assert cache.lookup(k(1, 3)) == 2


def test_completing_someone_elses_store_is_ignored(cache):
    out = cache.prepare_store(k(1, 2), owner=ENGINE_A)
    cache.complete_store(k(1, 2), owner=ENGINE_B)  # a stale or confused caller
    cache.complete_store(k(1), success=False, owner=ENGINE_B)
    assert cache.stats().writing_blocks == 2 and cache.lookup(k(1)) == 0
    cache.complete_store(list(out.keys_to_store), owner=ENGINE_A)
    assert cache.lookup(k(1, 2)) == 2


def test_a_load_is_completed_by_the_session_that_prepared_it(cache):
    store(cache, 1)
    cache.prepare_load(k(1), owner=ENGINE_A)
    with pytest.raises(StateError, match="0 load.*owner 2"):
        cache.complete_load(k(1), owner=ENGINE_B)  # B has no load of 1 to complete
    assert cache.stats().loading_blocks == 1  # refused as a whole, nothing changed
    cache.complete_load(k(1), owner=ENGINE_A)
    assert cache.stats().loading_blocks == 0


def test_release_drops_all_of_the_callers_pins_and_only_those(cache):
    store(cache, 1, 2)
    cache.lease(k(1, 2), owner=ENGINE_A)
    cache.lease(k(1), owner=ENGINE_A)  # a second lease of 1 by the same request
    cache.prepare_load(k(1), owner=ENGINE_A)
    cache.lease(k(1), owner=ENGINE_B)
    assert cache.release(k(1, 1, 7), owner=ENGINE_A) == 3  # repeated and unknown keys: once
    assert cache.stats().loading_blocks == 2  # 2 (A's lease) and 1 (B's lease)
    with pytest.raises(StateError):
        cache.complete_load(k(1), owner=ENGINE_A)  # its load pin went with the release
    assert cache.release(k(1, 2), owner=ENGINE_B) == 1
    assert cache.release(k(2), owner=ENGINE_A) == 1
    assert cache.stats().loading_blocks == 0


def test_in_process_callers_are_the_local_owner(cache):
    store(cache, 1)
    cache.prepare_load(k(1))
    assert cache.end_session(LOCAL_OWNER) == SessionRelease(0, 1)
    with pytest.raises(ManagerError, match="owner = -1"):
        cache.lease(k(1), owner=-1)
    with pytest.raises(ManagerError, match="owner = True"):
        cache.end_session(True)


def test_a_reset_keeps_a_sessions_slots_out_of_use_until_it_lets_go(cache):
    """A reset forgets the keys, but the session's reservation and lease are copies that may
    still run: their slots stay in use (never handed out) until the session ends."""
    store(cache, 1)
    cache.prepare_store(k(2), owner=ENGINE_A)
    cache.lease(k(1), owner=ENGINE_A)
    cache.reset()
    assert cache.lookup(k(1, 2)) == 0 and cache.holds(ENGINE_A)
    assert cache.stats().free_blocks == 2
    assert cache.end_session(ENGINE_A) == SessionRelease(1, 1)
    assert cache.stats().free_blocks == 4 and not cache.holds(ENGINE_A)


def test_holds_says_whether_an_owner_has_anything_to_give_back(cache):
    """What the control server asks before closing an idle connection."""
    store(cache, 1)
    assert not cache.holds(ENGINE_A)
    assert cache.prepare_store(k(2), owner=ENGINE_A) is not None
    assert cache.holds(ENGINE_A) and not cache.holds(ENGINE_B)
    cache.complete_store(k(2), owner=ENGINE_A)
    assert not cache.holds(ENGINE_A)
    cache.lease(k(1), owner=ENGINE_A)
    assert cache.holds(ENGINE_A)
    cache.release(k(1), owner=ENGINE_A)
    assert not cache.holds(ENGINE_A)
    cache.prepare_load(k(1, 2), owner=ENGINE_B)
    assert cache.holds(ENGINE_B)
    cache.complete_load(k(1, 2), owner=ENGINE_B)
    assert not cache.holds(ENGINE_B)
    cache.lease(k(1), owner=ENGINE_B)
    cache.end_session(ENGINE_B)
    assert not cache.holds(ENGINE_B)

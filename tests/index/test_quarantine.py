"""Slots held out of use after a write that may still land (a lower tier's read that gave
up while its transfer may still run): the key is forgotten at once, the slot is never
handed out again by this index (a reset included), a restart frees it; a lower tier's
reservation that outlives the reservation timeout is held out, not freed; a lookup does
not wait on a promotion longer than PROMOTION_WAIT_S. The cluster tier's use of it, with
a real frozen node, is in tests/tiers/test_cluster_tier.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

import tiercache.index.tiering as tiering_module
from index_scenarios import ids, k, store
from tiercache.index.manager import TIER_OWNER, OffloadingManager
from tiercache.region.ledger import RECORD_BYTES, IndexLedger

CAPACITY = 6


def accounted(m: OffloadingManager) -> int:
    s = m.stats()
    return (s.free_blocks + s.writing_blocks + s.ready_blocks + s.loading_blocks
            + s.quarantined_blocks)


def test_a_quarantined_slot_is_never_handed_out_again_until_a_restart():
    buf = np.zeros(CAPACITY * RECORD_BYTES, np.uint8)
    m = OffloadingManager(CAPACITY, ledger=IndexLedger(buf))
    out = m.prepare_store(k(1, 2), owner=TIER_OWNER)
    held = ids(out)[0]
    assert m.quarantine(k(1), owner=TIER_OWNER) == 1
    m.complete_store(k(1, 2), owner=TIER_OWNER)  # the late completion of 1 is ignored
    assert m.lookup(k(1)) == 0 and m.lookup(k(2)) == 1
    lease = m.lease(k(1))
    assert (lease.num_hit, lease.pending) == (0, False)  # a miss, not "being written"
    s = m.stats()
    assert (s.quarantined_blocks, s.free_blocks) == (1, CAPACITY - 2)
    assert accounted(m) == CAPACITY
    for rounds in range(2):  # fill and churn the cache twice, a reset between
        for i in range(3 * CAPACITY):
            out = store(m, 100 * rounds + 10 + i)
            assert held not in ids(out)
        assert m.stats().quarantined_blocks == 1 and accounted(m) == CAPACITY
        m.reset()
    again = OffloadingManager(CAPACITY, ledger=IndexLedger(buf))  # a coordinator restart
    assert again.stats().quarantined_blocks == 0
    slots = ids(again.prepare_store([b"x%d" % i for i in range(CAPACITY)]))
    assert held in slots


def test_only_the_owners_writing_keys_are_quarantined():
    m = OffloadingManager(CAPACITY)
    store(m, 1)  # READY
    m.prepare_store(k(2), owner=3)  # another owner's reservation
    m.prepare_store(k(4), owner=TIER_OWNER)
    assert m.quarantine(k(1, 2, 5), owner=TIER_OWNER) == 0
    assert m.lookup(k(1)) == 1 and m.holds(3)
    assert m.quarantine(k(4, 4), owner=TIER_OWNER) == 1
    assert not m.holds(TIER_OWNER)
    assert m.stats().quarantined_blocks == 1 and accounted(m) == CAPACITY


def test_an_expired_tier_reservation_is_held_out_and_an_engines_freed():
    m = OffloadingManager(CAPACITY)
    m.prepare_store(k(1), owner=2)
    m.prepare_store(k(3), owner=TIER_OWNER)
    now = time.monotonic()
    assert m.expire_reservations(50, now=now + 60) == 2
    s = m.stats()
    assert (s.expired_reservations, s.quarantined_blocks, s.free_blocks) == (1, 1, CAPACITY - 1)
    assert not m.holds(2) and not m.holds(TIER_OWNER)
    assert m.lookup(k(1, 3)) == 0


@pytest.mark.parametrize("waited", [False, True])
def test_a_lookup_waits_on_a_promotion_at_most_promotion_wait_s(monkeypatch, waited):
    monkeypatch.setattr(tiering_module, "PROMOTION_WAIT_S", 0.05)
    m = OffloadingManager(CAPACITY)
    store(m, 1)
    m.prepare_store(k(2), owner=TIER_OWNER)  # a lower tier's read of 2 under way
    m.prepare_store(k(3), owner=4)  # an engine's store of 3 under way
    if waited:
        time.sleep(0.1)
    assert m.lease(k(1, 2), owner=5).pending is not waited
    assert m.lease(k(3), owner=5).pending  # an engine's store is waited for, however long

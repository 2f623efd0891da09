"""Eviction policies on their own: ordering, atomic admission, ARC's lists and target,
and the registry (a new policy is one class)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from tiercache.errors import ConfigError
from tiercache.index.manager import OffloadingManager
from tiercache.eviction import POLICIES, ARCPolicy, EvictionPolicy, LRUPolicy, make_policy


def k(*ints: int) -> list[bytes]:
    return [b"%d" % i for i in ints]


def anything(key: bytes) -> bool:
    return True


def except_(*ints: int):
    blocked = set(k(*ints))
    return lambda key: key not in blocked


def test_registry_lists_lru_and_arc():
    assert POLICIES["lru"] is LRUPolicy and POLICIES["arc"] is ARCPolicy
    assert isinstance(make_policy("arc", 4), ARCPolicy)
    with pytest.raises(ConfigError, match="policy = 'nope': allowed 'arc', 'lru'"):
        make_policy("nope", 4)
    with pytest.raises(ConfigError, match="capacity_blocks = 0"):
        make_policy("lru", 0)


def test_a_new_policy_is_one_class():
    class FIFO(EvictionPolicy):
        """First in, first out: touches change nothing."""

        name = "test-fifo"

        def __init__(self, capacity_blocks: int):
            super().__init__(capacity_blocks)
            self.order: list[bytes] = []

        def admit(self, keys: Sequence[bytes], num_evictions, can_evict):
            victims = [key for key in self.order if can_evict(key)][:num_evictions]
            if len(victims) < num_evictions:
                return None
            self.order = [key for key in self.order if key not in victims] + list(keys)
            return victims

        def remove(self, key: bytes) -> None:
            self.order.remove(key)

        def touch(self, keys: Sequence[bytes]) -> None:
            pass

        def clear(self) -> None:
            self.order.clear()

        def peek(self, num_keys: int, can_evict) -> list[bytes]:
            return [key for key in self.order if can_evict(key)][:num_keys]

    POLICIES[FIFO.name] = FIFO  # what @register_policy does, undone below
    try:
        m = OffloadingManager(2, policy="test-fifo")
        for i in (1, 2):
            m.complete_store(list(m.prepare_store(k(i)).keys_to_store))
        m.touch(k(1))
        assert m.prepare_store(k(3)).evicted_keys == tuple(k(1))
    finally:
        del POLICIES[FIFO.name]


def test_lru_evicts_least_recent_and_skips_what_cannot_go():
    lru = LRUPolicy(8)
    assert lru.admit(k(1, 2, 3), 0, anything) == []  # keys[0] ends most recent
    assert lru.keys_lru_first() == tuple(k(3, 2, 1))
    lru.touch(k(3))
    assert lru.keys_lru_first() == tuple(k(2, 1, 3))
    assert lru.admit(k(4), 1, except_(2)) == k(1)  # 2 is pinned: skipped, keeps its place
    assert lru.keys_lru_first() == tuple(k(2, 3, 4))


def test_lru_admit_is_all_or_nothing():
    lru = LRUPolicy(8)
    lru.admit(k(1, 2, 3), 0, anything)
    assert lru.admit(k(4, 5), 2, except_(1, 2)) is None
    assert lru.keys_lru_first() == tuple(k(3, 2, 1))  # nothing evicted, 4 and 5 not admitted
    lru.remove(k(2)[0])
    assert lru.keys_lru_first() == tuple(k(3, 1))
    lru.clear()
    assert lru.keys_lru_first() == ()


def test_arc_first_use_in_t1_second_in_t2():
    arc = ARCPolicy(4)
    arc.admit(k(1, 2), 0, anything)
    assert arc.lists() == {"t1": tuple(k(2, 1)), "t2": (), "b1": (), "b2": ()}
    arc.touch(k(2))
    arc.touch(k(1))
    arc.touch(k(2))
    assert arc.lists()["t1"] == () and arc.lists()["t2"] == tuple(k(1, 2))


def test_arc_prefers_t1_while_it_exceeds_the_target():
    arc = ARCPolicy(4)
    arc.admit(k(1), 0, anything)
    arc.admit(k(2), 0, anything)
    arc.touch(k(1))  # T1 = [2], T2 = [1]
    arc.admit(k(3), 0, anything)  # T1 = [2, 3]
    assert arc.admit(k(4), 1, anything) == k(2)
    assert arc.lists()["b1"] == tuple(k(2))
    # T1's only evictable block is pinned: T2 gives instead of refusing.
    assert arc.admit(k(5), 1, except_(3, 4)) == k(1)
    assert arc.lists()["b2"] == tuple(k(1))


def test_arc_ghost_hits_move_the_target_both_ways():
    arc = ARCPolicy(4)
    for i in (1, 2, 3, 4):
        arc.admit(k(i), 0, anything)
    arc.touch(k(3, 4))  # T1 = [1, 2], T2 = [4, 3]
    assert arc.admit(k(5, 6), 2, anything) == k(1, 2)  # to B1
    assert arc.target_t1_blocks == 0
    # 1 returns from B1: p grows by max(1, |B2|/|B1|) = 1 before choosing the victim;
    # then |T1| = 2 > p = 1, so T1 gives way; the returning key goes straight to T2.
    assert arc.admit(k(1), 1, anything) == k(6)
    assert arc.target_t1_blocks == 1
    assert arc.lists()["t2"][-1] == k(1)[0]
    # 2 returns too: p = 2 >= |T1| = 1, so now T2's least recent (4) goes.
    assert arc.admit(k(2), 1, anything) == k(4)
    assert arc.target_t1_blocks == 2
    # 4 returns from B2: p shrinks by max(1, |B1|/|B2|) = max(1, 1/1) = 1.
    assert arc.lists()["b1"] == tuple(k(6)) and arc.lists()["b2"] == tuple(k(4))
    arc.admit(k(4), 1, anything)
    assert arc.target_t1_blocks == 1


def test_arc_refusal_changes_neither_lists_nor_target():
    arc = ARCPolicy(2)
    arc.admit(k(1), 0, anything)
    arc.admit(k(2), 0, anything)
    arc.admit(k(3), 1, anything)  # 1 -> B1
    before = arc.lists(), arc.target_t1_blocks
    assert arc.admit(k(1), 1, except_(2, 3)) is None  # a ghost hit, but no room
    assert (arc.lists(), arc.target_t1_blocks) == before


def test_arc_clear_forgets_ghosts_and_target():
    arc = ARCPolicy(2)
    arc.admit(k(1), 0, anything)
    arc.admit(k(2), 1, anything)
    arc.admit(k(1), 1, anything)
    assert arc.target_t1_blocks > 0
    arc.clear()
    assert arc.lists() == {"t1": (), "t2": (), "b1": (), "b2": ()}
    assert arc.target_t1_blocks == 0


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_peek_names_the_next_victims_in_order_and_changes_nothing(policy):
    m = OffloadingManager(4, policy=policy)
    for i in (1, 2, 3, 4):
        m.complete_store(list(m.prepare_store(k(i)).keys_to_store))
    m.touch(k(1))
    peeked = m.policy.peek(2, lambda key: True)
    assert m.policy.peek(2, lambda key: True) == peeked  # nothing changed
    out = m.prepare_store(k(5, 6))
    assert list(out.evicted_keys) == peeked
    every = m.policy.peek(9, lambda key: True)
    skipping = m.policy.peek(9, lambda key: key != every[0])
    assert every[0] not in skipping and set(skipping) == set(every[1:])

"""Eviction policies on their own: ordering, atomic eviction, ARC's lists and target,
and the registry (a new policy is one class). A policy orders slots; ARC keeps the keys
of its ghosts."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from tiercache.errors import ConfigError
from tiercache.index.manager import OffloadingManager
from tiercache.eviction import POLICIES, ARCPolicy, EvictionPolicy, LRUPolicy, make_policy


def k(*ints: int) -> list[bytes]:
    return [b"%d" % i for i in ints]


def anything(slot: int) -> bool:
    return True


def except_(*slots: int):
    return lambda slot: slot not in slots


def add(policy: EvictionPolicy, *ints: int) -> None:
    """Block i is stored in slot i - 1 under key k(i); ``ints[0]`` ends most recent."""
    policy.insert([i - 1 for i in ints], k(*ints))


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
            self.order: list[int] = []

        def evict(self, num_evictions, can_evict, incoming=()):
            victims = [slot for slot in self.order if can_evict(slot)][:num_evictions]
            if len(victims) < num_evictions:
                return None
            self.order = [slot for slot in self.order if slot not in victims]
            return victims

        def insert(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
            self.order += list(slots)

        def remove(self, slot: int) -> None:
            self.order.remove(slot)

        def touch(self, slots: Sequence[int]) -> None:
            pass

        def clear(self) -> None:
            self.order.clear()

        def peek(self, num_slots: int, can_evict) -> list[int]:
            return [slot for slot in self.order if can_evict(slot)][:num_slots]

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
    lru.insert([1, 2, 3], k(1, 2, 3))  # slots[0] ends most recent
    assert lru.slots_lru_first() == (3, 2, 1)
    lru.touch([3])
    assert lru.slots_lru_first() == (2, 1, 3)
    assert lru.evict(1, except_(2)) == [1]  # 2 is pinned: skipped, keeps its place
    lru.insert([4], k(4))
    assert lru.slots_lru_first() == (2, 3, 4)


def test_lru_evict_is_all_or_nothing():
    lru = LRUPolicy(8)
    lru.insert([1, 2, 3], k(1, 2, 3))
    assert lru.evict(2, except_(1, 2)) is None
    assert lru.slots_lru_first() == (3, 2, 1)  # nothing evicted
    lru.remove(2)
    assert lru.slots_lru_first() == (3, 1)
    lru.clear()
    assert lru.slots_lru_first() == ()


def test_lru_walks_past_its_cached_head_and_sees_every_touch():
    """The order's head is found a chunk at a time (``RecencyOrder``); the walk must
    still meet every member once, oldest first, whatever was touched or removed since."""
    n = 3 * 1024 + 5  # more than one chunk of the smallest capacity
    lru = LRUPolicy(n)
    lru.insert(list(range(n - 1, -1, -1)), [b""] * n)  # slot 0 least recent
    assert lru.evict(3, anything) == [0, 1, 2]
    lru.touch([3, 1500])  # 3 ends most recent, 1500 just before it
    lru.remove(4)
    expected = [s for s in range(5, n) if s != 1500] + [1500, 3]
    assert list(lru.slots_lru_first()) == expected
    assert lru.peek(2, except_(5)) == [6, 7]
    assert lru.evict(n - 3 - 1, anything) == expected


def test_arc_first_use_in_t1_second_in_t2():
    arc = ARCPolicy(4)
    add(arc, 1, 2)
    assert arc.lists() == {"t1": tuple(k(2, 1)), "t2": (), "b1": (), "b2": ()}
    arc.touch([1])  # key 2
    arc.touch([0])
    arc.touch([1])
    assert arc.lists()["t1"] == () and arc.lists()["t2"] == tuple(k(1, 2))


def test_arc_prefers_t1_while_it_exceeds_the_target():
    arc = ARCPolicy(4)
    add(arc, 1)
    add(arc, 2)
    arc.touch([0])  # T1 = [2], T2 = [1]
    add(arc, 3)  # T1 = [2, 3]
    assert arc.evict(1, anything, k(4)) == [1]  # key 2's slot
    arc.insert([1], k(4))
    assert arc.lists()["b1"] == tuple(k(2))
    # T1's only evictable block is pinned: T2 gives instead of refusing.
    assert arc.evict(1, except_(2, 1), k(5)) == [0]  # keys 3 and 4 pinned; key 1 goes
    assert arc.lists()["b2"] == tuple(k(1))


def test_arc_ghost_hits_move_the_target_both_ways():
    arc = ARCPolicy(4)
    for i in (1, 2, 3, 4):
        add(arc, i)
    arc.touch([2, 3])  # T1 = [1, 2], T2 = [4, 3]
    assert arc.evict(2, anything, k(5, 6)) == [0, 1]  # keys 1 and 2 to B1
    arc.insert([0, 1], k(5, 6))  # T1 = [6, 5]
    assert arc.target_t1_blocks == 0
    # 1 returns from B1: p grows by max(1, |B2|/|B1|) = 1 before choosing the victim;
    # then |T1| = 2 > p = 1, so T1 gives way; the returning key goes straight to T2.
    assert arc.evict(1, anything, k(1)) == [1]  # key 6
    arc.insert([1], k(1))
    assert arc.target_t1_blocks == 1
    assert arc.lists()["t2"][-1] == k(1)[0]
    # 2 returns too: p = 2 >= |T1| = 1, so now T2's least recent (4) goes.
    assert arc.evict(1, anything, k(2)) == [3]
    arc.insert([3], k(2))
    assert arc.target_t1_blocks == 2
    # 4 returns from B2: p shrinks by max(1, |B1|/|B2|) = max(1, 1/1) = 1.
    assert arc.lists()["b1"] == tuple(k(6)) and arc.lists()["b2"] == tuple(k(4))
    arc.evict(1, anything, k(4))
    assert arc.target_t1_blocks == 1


def test_arc_refusal_changes_neither_lists_nor_target():
    arc = ARCPolicy(2)
    add(arc, 1)
    add(arc, 2)
    assert arc.evict(1, anything, k(3)) == [0]  # 1 -> B1
    arc.insert([0], k(3))
    before = arc.lists(), arc.target_t1_blocks
    assert arc.evict(1, except_(0, 1), k(1)) is None  # a ghost hit, but no room
    assert (arc.lists(), arc.target_t1_blocks) == before


def test_arc_clear_forgets_ghosts_and_target():
    arc = ARCPolicy(2)
    add(arc, 1)
    assert arc.evict(1, anything, k(2)) == [0]
    arc.insert([0], k(2))
    assert arc.evict(1, anything, k(1)) == [0]  # 1 returns from B1
    arc.insert([0], k(1))
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
    peeked = m.policy.peek(2, anything)
    assert m.policy.peek(2, anything) == peeked  # nothing changed
    keys_of = [m._table.key_of[slot] for slot in peeked]
    out = m.prepare_store(k(5, 6))
    assert list(out.evicted_keys) == keys_of
    every = m.policy.peek(9, anything)
    skipping = m.policy.peek(9, except_(every[0]))
    assert every[0] not in skipping and set(skipping) == set(every[1:])

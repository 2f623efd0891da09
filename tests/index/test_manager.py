"""The cache index in-process: the shared narrated scenarios, then what only the
manager itself can show (policy internals, invariants under random use, threads)."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import index_scenarios as sc
from index_scenarios import k, store
from tiercache.errors import ConfigError, ManagerError, StateError, UnknownKeyError
from tiercache.index.manager import OffloadingEvent, OffloadingManager, SlotState
from tiercache.index.slots import SlotFlag


@pytest.mark.parametrize(("policy", "name"), sc.CASES)
def test_scenario(policy, name):
    sc.run(OffloadingManager(sc.CAPACITY_BLOCKS, policy, enable_events=True), policy, name)


def test_arc_lists_follow_promotion_and_ghosts():
    m = OffloadingManager(2, "arc")
    arc = m.policy
    store(m, 1)
    store(m, 2)
    assert arc.lists() == {"t1": tuple(k(1, 2)), "t2": (), "b1": (), "b2": ()}
    m.touch(k(1))  # a second use promotes to T2
    assert arc.lists()["t1"] == tuple(k(2)) and arc.lists()["t2"] == tuple(k(1))
    store(m, 3)  # T1 (1 block) > p (0): its least recent block becomes a ghost
    assert arc.lists() == {"t1": tuple(k(3)), "t2": tuple(k(1)), "b1": tuple(k(2)), "b2": ()}
    assert arc.target_t1_blocks == 0
    store(m, 2)  # a B1 ghost comes back: p grows, and 2 goes straight to T2
    assert arc.target_t1_blocks == 1
    assert arc.lists()["t2"][-1] == k(2)[0]


def test_arc_touch_skips_blocks_being_written():
    m = OffloadingManager(4, "arc")
    m.prepare_store(k(1))
    m.touch(k(1))  # the storing request itself: not a second use
    m.complete_store(k(1))
    assert m.policy.lists()["t1"] == tuple(k(1))
    m.touch(k(1))
    assert m.policy.lists()["t2"] == tuple(k(1))


def test_arc_ghost_lists_stay_within_the_directory_bound():
    m = OffloadingManager(2, "arc")
    for i in range(3, 40):
        store(m, i)
        if i % 3 == 0:
            m.touch(k(i))
        lists = m.policy.lists()
        assert len(lists["t1"]) + len(lists["b1"]) <= 2
        assert sum(len(v) for v in lists.values()) <= 4


def test_failed_store_leaves_no_ghost():
    m = OffloadingManager(2, "arc")
    out = m.prepare_store(k(1))
    m.complete_store(list(out.keys_to_store), success=False)
    assert m.policy.lists() == {"t1": (), "t2": (), "b1": (), "b2": ()}


def test_take_events_bounded_batches_split_events_in_order():
    m = OffloadingManager(8, enable_events=True)
    store(m, 1, 2, 3)
    store(m, 4)
    assert m.take_events(max_keys=2) == [OffloadingEvent(tuple(k(1, 2)), removed=False)]
    assert m.take_events(max_keys=2) == [OffloadingEvent(tuple(k(3)), removed=False),
                                         OffloadingEvent(tuple(k(4)), removed=False)]
    assert m.take_events(max_keys=2) == []
    with pytest.raises(ManagerError, match="max_keys = 0"):
        m.take_events(max_keys=0)


def test_events_off_is_an_error_not_an_empty_list():
    m = OffloadingManager(2)
    store(m, 1)
    with pytest.raises(StateError, match="enable_events=True"):
        m.take_events()


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_num_blocks_must_be_a_positive_int(bad):
    with pytest.raises(ConfigError, match=f"num_blocks = {bad!r}"):
        OffloadingManager(bad)


def test_unknown_policy_names_the_allowed_ones():
    with pytest.raises(ConfigError, match=r"policy = 'mru': allowed 'arc', 'lru'"):
        OffloadingManager(4, policy="mru")


def test_threads_share_one_manager_consistently():
    m = OffloadingManager(64, "arc")
    errors: list[BaseException] = []

    def worker(base: int) -> None:
        try:
            for i in range(300):
                keys = k(*(base + 1000 * i + j for j in range(4)))
                out = m.prepare_store(keys)
                if out is not None:
                    m.complete_store(list(out.keys_to_store))
                hits = m.lookup(keys)
                m.touch(keys)
                try:
                    m.prepare_load(keys[:hits])
                except UnknownKeyError:  # another thread evicted them in between: allowed
                    continue
                m.complete_load(keys[:hits])
        except BaseException as e:  # reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t * 10**6,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    s = m.stats()
    assert s.free_blocks + s.writing_blocks + s.ready_blocks + s.loading_blocks == 64
    assert s.stored_blocks == s.evicted_blocks + s.ready_blocks


# ---------------------------------------------------------------- random use keeps invariants

OWNERS = (1, 2)


class ManagerMachine(RuleBasedStateMachine):
    """Random calls by two owners; a model of which keys each owner is writing, which are
    ready and how many pins each owner holds must match the index. A reset dooms what a
    copy still touches (a reservation, a pinned block): not readable, its slot in use until
    its last writer or pin ends."""

    policy = "lru"

    def __init__(self):
        super().__init__()
        self.m = OffloadingManager(5, self.policy, enable_events=True)
        self.writing: dict[bytes, int] = {}  # key -> owner that reserved it
        self.ready: set[bytes] = set()
        self.pins: Counter[tuple[int, bytes]] = Counter()
        self.doomed: set[bytes] = set()  # forgotten by a reset while a copy touched them
        self.stored_minus_removed: set[bytes] = set()

    def settle(self, key: bytes) -> None:
        """A doomed key nobody writes or pins any more is gone."""
        if key in self.doomed and key not in self.writing and not self.pinned(key):
            self.doomed.discard(key)

    keys = st.lists(st.integers(0, 9).map(lambda i: b"%d" % i), min_size=0, max_size=4,
                    unique=True)
    owners = st.sampled_from(OWNERS)

    def pinned(self, key: bytes) -> bool:
        return any(n for (_, k), n in self.pins.items() if k == key)

    @rule(keys=keys, owner=owners)
    def prepare_store(self, keys, owner):
        held = set(self.writing) | self.ready | self.doomed
        out = self.m.prepare_store(keys, owner=owner)
        new = [key for key in keys if key not in held]
        if out is None:
            evictable = {key for key in self.ready if not self.pinned(key) and key not in keys}
            assert len(new) - (5 - len(held)) > len(evictable)
            return
        assert list(out.keys_to_store) == new
        assert set(out.evicted_keys) <= self.ready - set(keys)
        assert not any(self.pinned(key) for key in out.evicted_keys)
        self.ready -= set(out.evicted_keys)
        self.writing.update(dict.fromkeys(new, owner))

    @rule(keys=keys, owner=owners, success=st.booleans())
    def complete_store(self, keys, owner, success):
        self.m.complete_store(keys, success, owner=owner)  # others' and unknown keys: ignored
        mine = [key for key in keys if self.writing.get(key) == owner]
        for key in mine:
            del self.writing[key]
        if success:
            self.ready |= set(mine) - self.doomed
        for key in mine:
            self.settle(key)

    @precondition(lambda self: self.ready)
    @rule(data=st.data(), owner=owners)
    def prepare_load(self, data, owner):
        keys = data.draw(st.lists(st.sampled_from(sorted(self.ready)), min_size=1, max_size=3))
        self.m.prepare_load(keys, owner=owner)
        for key in keys:
            self.pins[owner, key] += 1

    @precondition(lambda self: +self.pins)
    @rule(data=st.data())
    def complete_load(self, data):
        owner, key = data.draw(st.sampled_from(sorted(k for k, n in self.pins.items() if n)))
        self.m.complete_load([key], owner=owner)
        self.pins[owner, key] -= 1
        if not self.pins[owner, key]:  # an unpinned block may be evicted: the model forgets it
            del self.pins[owner, key]
        self.settle(key)

    @rule(keys=keys, owner=owners)
    def lease(self, keys, owner):
        result = self.m.lease(keys, owner=owner)
        hits = 0
        for key in keys:
            if key not in self.ready:
                break
            hits += 1
        assert result.num_hit == hits
        assert result.pending == (hits < len(keys) and keys[hits] in self.writing
                                  and keys[hits] not in self.doomed)
        for key in keys[:hits]:
            self.pins[owner, key] += 1

    @rule(keys=keys, owner=owners)
    def release(self, keys, owner):
        expected = sum(self.pins.pop((owner, key), 0) for key in set(keys))
        assert self.m.release(keys, owner=owner) == expected
        for key in keys:
            self.settle(key)

    @rule(owner=owners)
    def end_session(self, owner):
        writing = [key for key, o in self.writing.items() if o == owner]
        pins = sum(n for (o, _), n in self.pins.items() if o == owner)
        released = self.m.end_session(owner)
        assert (released.freed_writing, released.dropped_pins) == (len(writing), pins)
        for key in writing:
            del self.writing[key]
        self.pins = Counter({(o, k): n for (o, k), n in self.pins.items() if o != owner})
        for key in list(self.doomed):
            self.settle(key)

    @rule(keys=keys)
    def touch_and_lookup(self, keys):
        self.m.touch(keys)
        expected = 0
        for key in keys:
            if key not in self.ready:
                break
            expected += 1
        assert self.m.lookup(keys) == expected

    @rule()
    def reset(self):
        self.m.reset()
        self.doomed |= set(self.writing) | {key for key in self.ready if self.pinned(key)}
        self.ready.clear()

    @invariant()
    def gauges_match_the_model(self):
        s = self.m.stats()
        loading = {key for key in self.ready | self.doomed
                   if self.pinned(key) and key not in self.writing}
        assert s.writing_blocks == len(self.writing)
        assert s.loading_blocks == len(loading)
        assert s.ready_blocks == len(self.ready - loading)
        assert s.free_blocks == 5 - len(self.writing) - len(self.ready | loading)
        table = self.m._table  # the index's own records: one slot per key, none shared
        slots = {key: table.slot_id(key) for key in table.slot_of}
        assert len(set(slots.values())) == len(slots)
        assert all(0 <= slot < 5 and table.key_of[slot] == key for key, slot in slots.items())
        assert sum(key is not None for key in table.key_of) == len(slots)
        assert all((table.state[slot] == SlotState.LOADING) == (slot in table.pins)
                   for slot in slots.values())
        assert all(table.pins.values())  # an entry only while pinned
        assert {key for key, slot in slots.items()
                if table.flags[slot] & SlotFlag.DOOMED} == self.doomed
        assert set(table.readable_keys()) == {
            key for key, slot in slots.items()
            if table.state[slot] != SlotState.WRITING and not table.flags[slot] & SlotFlag.DOOMED}
        for (owner, key), n in self.pins.items():
            assert table.pins_of(slots[key], owner) == n

    @invariant()
    def events_replay_to_the_readable_set(self):
        for event in self.m.take_events():
            if event.removed:
                self.stored_minus_removed -= set(event.keys)
            else:
                self.stored_minus_removed |= set(event.keys)
        assert self.stored_minus_removed == self.ready


class ARCMachine(ManagerMachine):
    policy = "arc"


TestLRUMachine = ManagerMachine.TestCase
TestLRUMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestARCMachine = ARCMachine.TestCase
TestARCMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_lease_is_an_access_its_blocks_outlive_older_unleased_ones(policy):
    """vLLM 0.33 never calls touch: without the lease counting as an access, a popular
    prefix aged out like a one-off one (eviction was first in, first out)."""
    m = OffloadingManager(3, policy=policy)
    for i in (1, 2, 3):
        m.complete_store(list(m.prepare_store(k(i)).keys_to_store))
    assert m.lease(k(1)).num_hit == 1  # the oldest block, reused
    m.release(k(1))
    out = m.prepare_store(k(4))
    assert list(out.evicted_keys) == k(2)  # not 1: its lease made it the most recent

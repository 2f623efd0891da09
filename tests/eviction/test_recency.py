"""``RecencyOrder``: slots in order of last use, found a chunk at a time. Checked against
an ``OrderedDict`` doing the same moves, with chunks small enough that every walk crosses
several and meets entries made stale since its head was found."""

from __future__ import annotations

import random
from collections import OrderedDict
from itertools import islice

import pytest

from tiercache.eviction import recency
from tiercache.eviction.recency import RecencyOrder


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(recency, "MIN_CHUNK", 3)
    monkeypatch.setattr(recency, "WALK_STEP", 2)


def test_a_batch_ends_head_first_and_the_walk_is_oldest_first():
    order = RecencyOrder(8)
    order.add([1, 2, 3])  # 1 ends most recent
    order.add([5])
    assert list(order.oldest()) == [3, 2, 1, 5] and len(order) == 4
    order.touch([2, 3])
    assert list(order.oldest()) == [1, 5, 3, 2]
    order.remove([5, 7])  # 7 is not a member: ignored
    assert list(order.oldest()) == [1, 3, 2] and len(order) == 3
    assert 1 in order and 5 not in order
    order.clear()
    assert list(order.oldest()) == [] and len(order) == 0


def test_touch_counts_new_members_once_and_a_repeat_ends_at_its_first_place():
    order = RecencyOrder(8)
    order.add([0])
    order.touch([4, 0, 4, 6])  # 4 twice: its first place (most recent) wins
    assert len(order) == 3
    assert list(order.oldest()) == [6, 0, 4]


def test_a_walk_crosses_chunks_and_skips_what_changed_since_its_head_was_found(small_chunks):
    order = RecencyOrder(20)
    order.add(list(range(19, -1, -1)))  # 0 least recent
    assert list(islice(order.oldest(), 4)) == [0, 1, 2, 3]  # the head holds 0..2, then 3..5
    order.touch([1])  # stale in the head: walked past, met again as the newest
    order.remove([2, 4])
    order.add([2])
    assert list(order.oldest()) == [0, 3] + list(range(5, 20)) + [1, 2]


def test_random_moves_keep_the_order_of_an_ordered_dict(small_chunks):
    rng = random.Random(41)
    capacity = 40
    order, model = RecencyOrder(capacity), OrderedDict[int, None]()
    for _ in range(3000):
        move = rng.random()
        members = list(model)
        if move < 0.3:
            new = rng.sample([s for s in range(capacity) if s not in model], rng.randint(0, 3)) \
                if len(model) < capacity - 3 else []
            order.add(new)
            for slot in reversed(new):
                model[slot] = None
        elif move < 0.55 and members:
            slots = [rng.choice(members) for _ in range(rng.randint(1, 4))]
            order.touch(slots)
            for slot in reversed(slots):
                model.pop(slot, None)
                model[slot] = None
        elif move < 0.75 and members:
            gone = rng.sample(members, rng.randint(1, min(3, len(members))))
            order.remove(gone)
            for slot in gone:
                del model[slot]
        elif move < 0.995:
            n = rng.randint(0, len(model) + 1)  # a partial walk, as an eviction's
            assert list(islice(order.oldest(), n)) == members[:n]
        else:
            order.clear()
            model.clear()
        assert len(order) == len(model)
    assert list(order.oldest()) == list(model)

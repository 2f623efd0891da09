"""The index hands out only slots whose memory is reserved (``usable_blocks``, grown by the
region's background reservation): a narrated scenario on 4 slots, 2 reserved at first."""

import pytest

from tiercache.errors import ConfigError, StateError
from tiercache.index.manager import OffloadingManager


def _slots(out) -> list[int]:
    return out.store_spec.block_ids.tolist()


def test_only_reserved_slots_are_handed_out_and_eviction_stays_among_them():
    m = OffloadingManager(4, usable_blocks=2)
    assert m.num_blocks == 4 and m.stats().capacity_blocks == 2
    # three new keys cannot fit two reserved slots: refused, nothing changed
    assert m.prepare_store([b"a", b"b", b"c"]) is None
    assert m.stats().free_blocks == 2
    first = m.prepare_store([b"a", b"b"])
    assert sorted(_slots(first)) == [0, 1]
    slot_of = dict(zip(first.keys_to_store, _slots(first)))
    m.complete_store([b"a", b"b"])
    # full: a new key evicts a reserved block rather than take an unreserved slot
    out = m.prepare_store([b"c"])
    assert len(out.evicted_keys) == 1 and _slots(out) == [slot_of[out.evicted_keys[0]]]
    m.complete_store([b"c"])
    ahead = m.prepare_store([b"d"], max_evictions=0)  # no free slot, no eviction allowed
    assert ahead.no_room_keys == (b"d",)
    # the reservation goes on: the next slots are the newly reserved ones, no eviction
    m.set_usable_blocks(4)
    out = m.prepare_store([b"d", b"e"])
    assert sorted(_slots(out)) == [2, 3] and out.evicted_keys == ()
    s = m.stats()
    assert (s.capacity_blocks, s.free_blocks, s.writing_blocks, s.ready_blocks) == (4, 0, 2, 2)


def test_usable_blocks_only_grow_within_the_index():
    m = OffloadingManager(4, usable_blocks=3)
    with pytest.raises(ConfigError, match="usable slots 2: allowed 3..4"):
        m.set_usable_blocks(2)
    with pytest.raises(ConfigError, match="usable slots 5: allowed 3..4"):
        m.set_usable_blocks(5)
    with pytest.raises(StateError, match="only slots below 5"):
        OffloadingManager(4, usable_blocks=5)


def test_a_reset_hands_out_reserved_slots_only():
    m = OffloadingManager(8, usable_blocks=3)
    m.prepare_store([b"a", b"b", b"c"])
    m.complete_store([b"a", b"b", b"c"])
    m.reset()
    assert sorted(_slots(m.prepare_store([b"x", b"y", b"z"]))) == [0, 1, 2]
    assert m.prepare_store([b"w"]) is None  # the three are WRITING, nothing else reserved

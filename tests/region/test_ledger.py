"""The index ledger: what a restarted index gets back, and that a rewrite cut short at any
store never yields a READY record whose slot holds other bytes.

The manager scenarios run over a ledger in a plain numpy buffer (the table does not care
where its bytes live); the region tests check where the table sits and that a region of
the old format is replaced rather than misread."""

from __future__ import annotations

import os
import struct
import time

import numpy as np
import pytest

from index_scenarios import k, store
from tiercache.errors import ConfigError, InvalidKeyError
from tiercache.index.manager import OffloadingManager
from tiercache.region.layout import RegionLayout
from tiercache.region.ledger import KEY_BYTES, RECORD_BYTES, IndexLedger, LedgerState
from tiercache.region.shared import SharedOffloadRegion
from tiercache.region.stats import STATS_BLOCK_BYTES


def table(num_records: int) -> np.ndarray:
    return np.zeros(num_records * RECORD_BYTES, np.uint8)


def restart(buffer: np.ndarray, policy: str = "lru") -> OffloadingManager:
    """A new index over the same bytes: what a re-adopting coordinator builds."""
    return OffloadingManager(buffer.size // RECORD_BYTES, policy, ledger=IndexLedger(buffer))


# ---------------------------------------------------------------- through the manager

@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_ready_blocks_come_back_and_dead_owners_pins_and_writes_do_not(policy):
    buf = table(4)
    m = restart(buf, policy)
    assert m.stats().recovered_blocks == 0  # a zeroed table is an empty index
    store(m, 1, 2)
    writing = m.prepare_store(k(3))  # the writer dies before complete_store
    m.lease(k(1), owner=7)  # owner 7 and the local owner do not survive the restart
    m.prepare_load(k(2))
    again = restart(buf, policy)
    s = again.stats()
    assert (s.recovered_blocks, s.ready_blocks, s.writing_blocks, s.loading_blocks,
            s.free_blocks) == (2, 2, 0, 0, 2)
    assert again.lookup(k(1, 2)) == 2 and again.lookup(k(3)) == 0
    assert again.prepare_load(k(2, 1)).block_ids.tolist() == [1, 0]  # same slots as before
    again.complete_load(k(2, 1))
    # The slot 3 was being written in is handed out after every other free slot.
    abandoned = writing.store_spec.block_ids.tolist()
    assert store(again, 4).store_spec.block_ids.tolist() == [3]
    assert store(again, 5).store_spec.block_ids.tolist() == abandoned


def test_store_order_is_the_recency_after_a_restart():
    buf = table(3)
    m = restart(buf)
    store(m, 1)
    store(m, 3, 2)  # in one call keys[0] counts as more recent: 2 is older than 3
    again = restart(buf)
    assert store(again, 4).evicted_keys == tuple(k(1))
    assert store(again, 5).evicted_keys == tuple(k(2))
    assert store(again, 6).evicted_keys == tuple(k(3))


def test_evicted_failed_ended_and_reset_blocks_do_not_come_back():
    buf = table(2)
    m = restart(buf)
    store(m, 1, 2)
    assert store(m, 3).evicted_keys == tuple(k(2))  # evicted
    assert {key for key in k(1, 2, 3) if restart(buf).lookup([key])} == set(k(1, 3))
    out = m.prepare_store(k(4))  # evicts 1 for a store that then fails
    m.complete_store(list(out.keys_to_store), success=False)
    assert restart(buf).lookup(k(3)) == 1 and restart(buf).lookup(k(1)) == 0
    m.prepare_store(k(5), owner=9)
    m.end_session(9)
    assert restart(buf).stats().ready_blocks == 1
    m.reset()
    assert restart(buf).stats().ready_blocks == 0


def test_keys_longer_than_a_record_are_refused_before_anything_changes():
    m = restart(table(2))
    with pytest.raises(InvalidKeyError, match=f"at most {KEY_BYTES} bytes"):
        m.prepare_store([b"a", b"x" * (KEY_BYTES + 1)])
    assert m.stats().free_blocks == 2
    store(m, 1)
    m.prepare_store([b"y" * KEY_BYTES])  # the longest key fits


def test_a_ledger_of_another_size_is_refused():
    with pytest.raises(ConfigError, match="ledger has 3 records; num_blocks = 4"):
        OffloadingManager(4, ledger=IndexLedger(table(3)))
    with pytest.raises(ValueError, match=f"multiple of {RECORD_BYTES}"):
        IndexLedger(np.zeros(RECORD_BYTES + 1, np.uint8))


# ---------------------------------------------------------------- a rewrite cut short

class _Crash(Exception):
    pass


class CrashingLedger(IndexLedger):
    """Stops (as SIGKILL would) after ``stores_left`` field stores of its rewrites."""

    def __init__(self, buffer: np.ndarray, stores_left: int):
        super().__init__(buffer)
        self.stores_left = stores_left

    def _store(self, field, ids, values):
        if self.stores_left == 0:
            raise _Crash
        self.stores_left -= 1
        super()._store(field, ids, values)


def _ready_record(buf: np.ndarray, slot: int) -> tuple[bytes, int] | None:
    found = [(key, s) for key, s, _ in IndexLedger(buf.copy()).recover().ready if s == slot]
    return found[0] if found else None


@pytest.mark.parametrize("transition", ["reuse", "publish", "free"])
def test_a_rewrite_cut_at_any_store_leaves_the_old_record_or_none(transition):
    """Slot 0 holds READY ``a``, then is handed to ``b`` (reuse) or freed (free); or it
    holds ``b`` being written, which is published (publish). Cut after each store in
    turn: recovery finds the record as before, as after, or not at all."""
    before = table(1)
    ledger = IndexLedger(before)
    ledger.writing([0], [b"a"], 1, [1])
    ledger.ready([0])
    if transition == "publish":
        ledger.writing([0], [b"b"], 1, [2])
    old = _ready_record(before, 0)
    apply = {"reuse": lambda led: led.writing([0], [b"b"], 1, [3]),
             "publish": lambda led: led.ready([0]),
             "free": lambda led: led.free([0])}[transition]
    after = before.copy()
    apply(IndexLedger(after))
    new = _ready_record(after, 0)
    cuts = 0
    while True:
        buf = before.copy()
        try:
            apply(CrashingLedger(buf, cuts))
        except _Crash:
            assert _ready_record(buf, 0) in (old, None), f"cut after {cuts} stores"
            cuts += 1
            continue
        assert _ready_record(buf, 0) == new
        break
    assert cuts >= 4  # seq, the body, seq_end, seq: every cut point was tried
    expected = {"reuse": ((b"a", 0), None), "publish": (None, (b"b", 0)),
                "free": ((b"a", 0), None)}
    assert (old, new) == expected[transition]


def test_torn_records_are_reported_abandoned_and_rewritten_free():
    buf = table(3)
    ledger = IndexLedger(buf)
    ledger.writing([0, 1, 2], [b"x", b"y", b"z"], 1, [1, 2, 3])
    ledger.ready([0, 1, 2])
    records = buf.view(np.dtype([("seq", "<u8"), ("rest", "u1", (RECORD_BYTES - 8,))]))
    records["seq"][1] += 1  # torn: seq moved on, seq_end did not
    recovery = IndexLedger(buf).recover()
    assert [slot for _, slot, _ in recovery.ready] == [2, 0]  # ready([0,1,2]): slot 0 is newest
    assert recovery.abandoned == (1,)
    assert IndexLedger(buf).recover().abandoned == ()  # rewritten FREE, whole again


# ---------------------------------------------------------------- in the region

def test_the_ledger_sits_in_the_header_between_the_stats_blocks_and_the_slices(make_config):
    layout = RegionLayout.from_config(make_config())
    assert layout.ledger_offset >= 4096 + layout.world_size * STATS_BLOCK_BYTES
    assert layout.ledger_offset % 8 == 0
    assert layout.ledger_offset + layout.ledger_bytes <= layout.header_bytes
    assert layout.ledger_bytes == layout.num_blocks * RECORD_BYTES
    region = SharedOffloadRegion.create(make_config())
    try:
        ledger = IndexLedger(region.ledger_array())
        assert ledger.num_records == layout.num_blocks
        ledger.writing([layout.num_blocks - 1], [b"last"], 1, [7])
        ledger.ready([layout.num_blocks - 1])
        assert not region.rank_array(0).any()  # the table ends before rank 0's slice
        assert IndexLedger(region.ledger_array()).recover().ready == ((b"last", 15, 7),)
    finally:
        region.close()


def test_a_region_of_the_previous_format_is_replaced_not_misread(make_config, tmp_path):
    """A stale region whose header says format 1 (no ledger) is not re-adopted."""
    cfg = make_config()
    region = SharedOffloadRegion.create(cfg)
    struct.pack_into("<I", region._bytes, 8, 1)  # format_version of the old layout
    path = region.path
    region.close(unlink=False)  # a dead coordinator's region, lock released
    old = time.time() - 3600  # written long ago (a young headerless file is one mid-creation)
    os.utime(path, (old, old))
    messages: list[str] = []
    again = SharedOffloadRegion.create(cfg, log_step=messages.append)
    try:
        assert "replacing stale region" in messages[0]
        assert "region format version 1; this tiercache reads" in messages[0]  # one line
        assert not again.setup_times.adopted
    finally:
        again.close()


def test_record_states_are_the_documented_values():
    assert [s.value for s in LedgerState] == [0, 1, 2]


def test_a_key_ready_in_two_records_keeps_the_newer_one():
    """Impossible through the index (a key holds one slot); a damaged table must still give
    an index with one slot per key."""
    buf = table(3)
    ledger = IndexLedger(buf)
    ledger.writing([0, 1, 2], [b"dup", b"other", b"dup"], 1, [1, 2, 3])
    ledger.ready([0])
    ledger.ready([1])
    ledger.ready([2])  # the newest record of b"dup"
    recovery = IndexLedger(buf).recover()
    assert recovery.ready == ((b"other", 1, 2), (b"dup", 2, 3))
    assert IndexLedger(buf).recover().ready == ((b"other", 1, 2), (b"dup", 2, 3))  # 0 freed
    m = restart(buf)
    assert m.stats().free_blocks == 1 and m.lookup([b"dup", b"other"]) == 2


# ---------------------------------------------------------------- damage

def _structured_keys(n: int) -> list[bytes]:
    """Keys like a namespaced engine's: a shared prefix, a short distinct tail (the shape
    whose single bit flips used to turn one key into another)."""
    return [b"ns:model=tiny|dtype=bf16|tp=1|" + bytes([48 + i]) for i in range(n)]


def test_no_single_bit_flip_anywhere_in_the_ledger_makes_a_key_hit_another_block():
    """Exhaustive: every bit of a 4-record table holding READY, WRITING and pinned records
    is flipped in turn and the index rebuilt (the pinning and writing owners survive). A
    key that still hits must name the slot it was stored in; a record that no longer
    checks is dropped and counted (was: 92 and 128 of 16,128 flips gave a wrong HIT)."""
    keys = _structured_keys(4)
    buf = table(4)
    m = OffloadingManager(4, ledger=IndexLedger(buf))
    where = {}
    for key in keys[:3]:
        out = m.prepare_store([key], owner=1)
        m.complete_store([key], owner=1)
        where[key] = int(out.store_spec.block_ids[0])
    m.lease(keys[:2], owner=2)
    m.prepare_store(keys[3:], owner=1)  # WRITING
    clean = buf.copy()
    wrong, damaged = [], 0
    for bit in range(buf.size * 8):
        flipped = clean.copy()
        flipped[bit // 8] ^= 1 << (bit % 8)
        again = OffloadingManager(4, ledger=IndexLedger(flipped), surviving_owners={1, 2})
        damaged += again.stats().damaged_records > 0
        for key, slot in where.items():
            if again.lookup([key]) and int(again.prepare_load([key]).block_ids[0]) != slot:
                wrong.append((bit, key))
    assert not wrong, f"{len(wrong)} flips made a key hit another slot: {wrong[:5]}"
    assert damaged > buf.size * 8 // 2  # most flips land in checked words, and are seen


def test_a_damaged_record_is_dropped_counted_and_its_slot_reused_last():
    buf = table(3)
    m = OffloadingManager(3, ledger=IndexLedger(buf))
    store(m, 1, 2)
    slot_of_1 = int(m.prepare_load(k(1)).block_ids[0])
    m.complete_load(k(1))
    record = buf[slot_of_1 * RECORD_BYTES:(slot_of_1 + 1) * RECORD_BYTES]
    record[40] ^= 0x10  # a bit of the key
    again = OffloadingManager(3, ledger=IndexLedger(buf))
    assert again.stats().damaged_records == 1 and again.lookup(k(1)) == 0
    assert again.lookup(k(2)) == 1
    assert store(again, 3).store_spec.block_ids.tolist() != [slot_of_1]  # reused last
    assert OffloadingManager(3, ledger=IndexLedger(buf)).stats().damaged_records == 0


def test_pins_and_reservations_of_surviving_owners_come_back_with_their_generations():
    buf = table(4)
    m = restart(buf)
    store(m, 1, 2)
    m.lease(k(1), owner=3)
    load = m.prepare_load(k(1, 2), owner=3)
    write = m.prepare_store(k(5), owner=4)
    again = OffloadingManager(4, ledger=IndexLedger(buf), surviving_owners={3, 4})
    s = again.stats()
    assert (s.loading_blocks, s.writing_blocks, s.recovered_pins, s.recovered_writing_blocks) \
        == (2, 1, 3, 1)
    again.complete_load(k(1, 2), owner=3)  # the restored pins are the same counts
    assert again.release(k(1), owner=3) == 1
    again.complete_store(k(5), owner=4)
    assert again.lookup(k(5)) == 1
    spec = again.prepare_load(k(1, 5))
    assert spec.slot_gens.tolist()[0] == load.slot_gens.tolist()[0]  # the same block
    assert spec.slot_gens.tolist()[1] == write.store_spec.slot_gens.tolist()[0]
    new = store(again, 6).store_spec.slot_gens.tolist()[0]
    assert new > max(load.slot_gens.tolist() + write.store_spec.slot_gens.tolist())


def test_a_slot_is_pinned_by_at_most_eight_sessions_and_the_ninth_lease_stops_short():
    m = restart(table(2))
    store(m, 1, 2)
    for owner in range(1, 9):
        assert m.lease(k(1, 2), owner=owner).num_hit == 2
    assert m.lease(k(1, 2), owner=9).num_hit == 0  # a miss, never an unrecorded pin
    m.release(k(1, 2), owner=1)
    assert m.lease(k(1, 2), owner=9).num_hit == 2


# ---------------------------------------------------------------- the session table

def test_session_records_come_back_and_damaged_ones_are_dropped():
    from tiercache.region.sessions import MAX_SESSIONS, RECORD_BYTES as SESSION_BYTES
    from tiercache.region.sessions import SessionLedger

    buf = np.zeros(MAX_SESSIONS * SESSION_BYTES, np.uint8)
    table_ = SessionLedger(buf)
    a = table_.open(b"A" * 16, 111, 5)
    b = table_.open(b"B" * 16, 222, 6)
    c = table_.open(b"C" * 16, 333, 7)
    table_.close(b)
    buf[(c - 1) * SESSION_BYTES + 20] ^= 1  # a bit of c's token
    records, damaged = SessionLedger(buf).recover()
    assert [(r.owner, r.token, r.pid, r.pid_start_ns) for r in records] == [(a, b"A" * 16, 111, 5)]
    assert damaged == 1
    again = SessionLedger(buf)
    again.recover()
    assert again.open(b"D" * 16, 1, 1) not in (a,)  # a live record's owner is never reused

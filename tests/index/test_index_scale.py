"""The index at scale, in-process: what it keeps per slot, and a recovery whose bulk paths
(chunks of the ledger, keys of one length or of many, a key held twice) give back exactly
the index the records describe. No timings: docs/benchmarks.md has those."""

from __future__ import annotations

import gc
import sys
import tracemalloc
from collections.abc import Callable

import numpy as np

from tiercache.index.manager import OffloadingManager
from tiercache.index.table import REBUILD_SHARE
from tiercache.region.ledger import CHUNK_RECORDS, RECORD_BYTES, IndexLedger

MEMORY_SLOTS = 200_000
# Bytes a slot the index may allocate for a READY block beyond its key (tracemalloc counts
# what was asked: a dict entry of ~42-52 B, an int of 28 B, 8 B of key_of, 3 B of state,
# flags and source, 8 B of recency stamp; the generation is the ledger's). An object per
# block (the index before issue 41: a slot object, its pins dict, two ints, an OrderedDict
# node) costs ~300 B more.
MAX_INDEX_BYTES_PER_SLOT = 120


def keys_of(first: int, count: int, width: int = 32) -> list[bytes]:
    return [i.to_bytes(8, "little").rjust(width, b"k") for i in range(first, first + count)]


def filled_ledger(keys: list[bytes]) -> np.ndarray:
    """A ledger whose slot i is READY with keys[i], stored oldest first."""
    buf = np.zeros(len(keys) * RECORD_BYTES, np.uint8)
    ledger = IndexLedger(buf)
    for lo in range(0, len(keys), 8192):
        ids = list(range(lo, min(len(keys), lo + 8192)))
        ledger.writing(ids, keys[lo:lo + 8192], 1, [i + 1 for i in ids])
        ledger.ready(ids[::-1])  # ready() stamps its first slot newest: slot 0 oldest
    return buf


def traced_bytes(build: Callable[[], OffloadingManager]) -> tuple[OffloadingManager, int]:
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        built = build()
        gc.collect()
        return built, tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_a_recovered_index_keeps_no_object_per_block_but_its_key_and_slot():
    keys = keys_of(0, MEMORY_SLOTS)
    buf = filled_ledger(keys)
    del keys
    index, traced = traced_bytes(lambda: OffloadingManager(MEMORY_SLOTS,
                                                           ledger=IndexLedger(buf)))
    key_bytes = MEMORY_SLOTS * (32 + 33)  # the recovered keys themselves: bytes objects
    assert (traced - key_bytes) / MEMORY_SLOTS <= MAX_INDEX_BYTES_PER_SLOT
    assert index.stats().ready_blocks == MEMORY_SLOTS


def test_a_filled_index_keeps_no_object_per_block_but_its_key_and_slot():
    num_slots = MEMORY_SLOTS // 4  # stores are slower than a recovery under tracemalloc
    keys = keys_of(0, num_slots)  # made outside: the engine's keys, not the index's

    def fill() -> OffloadingManager:
        m = OffloadingManager(num_slots, ledger=IndexLedger(np.zeros(num_slots * RECORD_BYTES,
                                                                     np.uint8)))
        for lo in range(0, num_slots, 4096):
            m.complete_store(list(m.prepare_store(keys[lo:lo + 4096]).keys_to_store))
        return m

    ledger_bytes = num_slots * RECORD_BYTES  # the region's, in shared memory in a coordinator
    index, traced = traced_bytes(fill)
    assert (traced - ledger_bytes) / num_slots <= MAX_INDEX_BYTES_PER_SLOT
    assert index.lookup(keys) == num_slots


def test_churn_rebuilds_the_key_dict_before_cpython_doubles_it():
    # 16,384 keys: a copy's table (32,768) has room for 5,461 more entries, beyond the
    # 4,096 deletes between rebuilds; without them the dict doubles after 5,461 churns.
    capacity, batch = 16_384, 256
    m = OffloadingManager(capacity)
    table = m._table
    live = keys_of(0, capacity)
    for lo in range(0, capacity, batch):
        m.complete_store(list(m.prepare_store(live[lo:lo + batch]).keys_to_store))
    built = table.slot_of
    gone: list[bytes] = []
    for lo in range(capacity, 4 * capacity, batch):  # each store evicts the oldest block
        new = keys_of(lo, batch)
        out = m.prepare_store(new)
        assert out is not None and len(out.evicted_keys) == batch
        m.complete_store(new)
        gone += out.evicted_keys
        live = live[batch:] + new
        assert sys.getsizeof(table.slot_of) <= sys.getsizeof(dict(table.slot_of)), lo
    assert table.slot_of is not built  # rebuilt (3 x 16,384 deletes: 12 times)
    assert table.num_deleted < capacity * REBUILD_SHARE
    assert set(gone) == set(keys_of(0, 3 * capacity))
    assert m.lookup(live) == capacity and list(table.slot_of) and set(table.slot_of) == set(live)
    assert all(table.key_of[table.slot_id(key)] == key for key in live)
    assert not any(m.lookup([key]) for key in gone)


def test_recovery_over_many_chunks_with_keys_of_every_length_and_a_key_held_twice():
    n = 3 * CHUNK_RECORDS + 5
    keys = keys_of(0, n)
    for i in range(CHUNK_RECORDS, 2 * CHUNK_RECORDS, 7):  # a chunk of mixed lengths
        keys[i] = keys[i][: 1 + i % 256]
    keys[CHUNK_RECORDS + 1] = b""  # an empty key is a key
    buf = filled_ledger(keys)
    # A damaged table: slot 5's key written again in the last chunk, READY and newer.
    ledger = IndexLedger(buf)
    ledger.recover()  # what a coordinator does first: its next store order follows on
    twice = n - 2
    ledger.writing([twice], [keys[5]], 1, [n + 10])
    ledger.ready([twice])
    m = OffloadingManager(n, ledger=IndexLedger(buf))
    held = {key: slot for slot, key in enumerate(keys) if slot != twice}
    held[keys[5]] = twice  # the newer record wins; the older one is freed
    assert m.stats().ready_blocks == len(held) and m.stats().recovered_blocks == len(held)
    for key, slot in held.items():
        assert m.prepare_load([key]).block_ids.tolist() == [slot], key
        m.complete_load([key])
    # Store order is the recency: the oldest (slot 0) goes first, then on in slot order.
    assert m.policy.peek(4, lambda slot: True) == [0, 1, 2, 3]
    assert store_slot(m, b"new") == 5  # the freed older record of keys[5]: the one free slot


def store_slot(m: OffloadingManager, key: bytes) -> int:
    out = m.prepare_store([key])
    assert out is not None
    m.complete_store([key])
    return int(out.store_spec.block_ids[0])

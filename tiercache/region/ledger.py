"""The index ledger: the durable part of the cache index (key → slot, READY), kept in the
region itself so that a coordinator restarted after SIGKILL rebuilds its index from it.

One fixed-size record per slot, in a table between the stats blocks and the first rank
slice (``RegionLayout.ledger_offset``), little-endian::

    offset  size  field
    0       8     seq       u64: made odd before the record is rewritten, even once it is whole
    8       4     state     u32: FREE 0, WRITING 1, READY 2 (``LedgerState``)
    12      2     key_len   u16: bytes of ``key`` that are the key (<= KEY_BYTES)
    14      2     reserved  0
    16      8     stamp     u64: store order of READY records (1, 2, ...; larger = newer)
    24      256   key       the block hash, zero-padded
    280     8     seq_end   u64: written equal to ``seq`` last but one; a whole record has
                            ``seq == seq_end`` and both even

Decisions and reasons:

* **Single writer, crash = process death.** Only the coordinator holding the region's
  lock writes the table, and only its successor reads it (after the lock said the writer
  is dead). A process killed at any instruction leaves every store it made before that
  instruction in shared memory (the mapping is the page cache), so the only question
  is which prefix of a rewrite landed. A rewrite stores, in this order: ``seq`` (odd),
  the body, ``seq_end`` (new even value), ``seq`` (the same value). Every proper prefix
  leaves ``seq`` odd or ``seq != seq_end``, and such a record is recovered as FREE.
* **FREE is always a safe answer.** Losing a record only loses a cached block; what
  must never happen is a READY record whose slot holds other bytes. A slot's record is
  rewritten (to WRITING with the new key, or to FREE) *before* the index hands the slot
  to a writer, so the old READY record is gone before any byte of the new block can land;
  and it becomes READY only in ``complete_store``, after every rank wrote the block.
* **WRITING comes back as free, but last.** A writer of the dead coordinator's time may
  still be finishing its copy into such a slot, so ``recover`` reports those slots
  separately and the index hands them out after every other free slot.
* **No checksum.** The seq bracket is what makes a torn rewrite visible; a checksum would
  cost a Python loop per record on the control path and guard only against scribbles
  that the region's 0600 mode already excludes.
* Stamps give the recovered blocks their store order for the eviction policy; touches
  are not recorded (they are the hot path), so recency after a restart is store order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

KEY_BYTES = 256  # the control plane carries keys of at most this many bytes
RECORD = np.dtype([
    ("seq", "<u8"), ("state", "<u4"), ("key_len", "<u2"), ("reserved", "<u2"),
    ("stamp", "<u8"), ("key", "u1", (KEY_BYTES,)), ("seq_end", "<u8"),
])
RECORD_BYTES = RECORD.itemsize
assert RECORD_BYTES == 288 and RECORD_BYTES % 8 == 0


class LedgerState(IntEnum):
    FREE = 0
    WRITING = 1
    READY = 2


@dataclass(frozen=True)
class Recovery:
    """What a ledger held: ``ready`` as (key, slot) oldest stored first; ``abandoned``:
    slots that were being written (or whose record was torn), to be reused last."""

    ready: tuple[tuple[bytes, int], ...]
    abandoned: tuple[int, ...]


class IndexLedger:
    """The record table over ``buffer`` (a writable uint8 array of ``num_records *
    RECORD_BYTES`` bytes, 8-byte aligned). Not thread-safe: the index calls it under its
    own lock. Raises ``ValueError`` for a buffer of the wrong size."""

    max_key_bytes = KEY_BYTES

    def __init__(self, buffer: np.ndarray):
        if buffer.dtype != np.uint8 or buffer.ndim != 1 or buffer.size % RECORD_BYTES:
            raise ValueError(f"ledger buffer of {buffer.size} {buffer.dtype} bytes; needs a 1-d "
                             f"uint8 array of a multiple of {RECORD_BYTES} bytes")
        if buffer.ctypes.data % 8:
            raise ValueError(f"ledger buffer at {buffer.ctypes.data:#x} is not 8-byte aligned")
        self._table = buffer.view(RECORD)
        self._next_stamp = 1

    @property
    def num_records(self) -> int:
        return self._table.size

    # ------------------------------------------------------------------ writes
    def writing(self, slot_ids: Sequence[int], keys: Sequence[bytes]) -> None:
        """These slots now belong to these keys, not readable yet (invalidates what they held)."""
        if not len(slot_ids):
            return
        lengths = np.fromiter(map(len, keys), np.uint16, len(keys))
        packed = b"".join(key.ljust(KEY_BYTES, b"\0") for key in keys)
        key_rows = np.frombuffer(packed, np.uint8).reshape(len(keys), KEY_BYTES)
        self._rewrite(slot_ids, (("state", LedgerState.WRITING), ("key_len", lengths),
                                 ("key", key_rows), ("stamp", 0)))

    def ready(self, slot_ids: Sequence[int]) -> None:
        """The blocks in these slots are whole: READY. ``slot_ids[0]`` gets the newest stamp
        (the index's convention: the first key of a batch is the most recent)."""
        n = len(slot_ids)
        if not n:
            return
        stamps = np.arange(self._next_stamp + n - 1, self._next_stamp - 1, -1, dtype=np.uint64)
        self._next_stamp += n
        self._rewrite(slot_ids, (("state", LedgerState.READY), ("stamp", stamps)))

    def free(self, slot_ids: Sequence[int]) -> None:
        if len(slot_ids):
            self._rewrite(slot_ids, (("state", LedgerState.FREE), ("key_len", 0), ("stamp", 0)))

    def clear(self) -> None:
        self.free(np.arange(self._table.size))

    def _rewrite(self, slot_ids: Sequence[int], body: tuple[tuple[str, object], ...]) -> None:
        """The one way a record changes; the store order is the crash-safety argument
        (module docstring)."""
        ids = np.asarray(slot_ids, dtype=np.int64)
        seq = self._table["seq"][ids]
        odd = (seq | 1).astype(np.uint64)
        self._store("seq", ids, odd)
        for field, values in body:
            self._store(field, ids, values)
        self._store("seq_end", ids, odd + 1)
        self._store("seq", ids, odd + 1)

    def _store(self, field: str, ids: np.ndarray, values: object) -> None:
        self._table[field][ids] = values

    # ------------------------------------------------------------------ recovery
    def recover(self) -> Recovery:
        """Read what a dead coordinator left: READY records come back (oldest stamp first);
        WRITING and torn records are rewritten FREE and reported as abandoned; a key READY
        in two records (impossible unless the table was damaged) keeps its newest one."""
        t = self._table
        whole = (t["seq"] == t["seq_end"]) & (t["seq"] % 2 == 0) & (t["key_len"] <= KEY_BYTES)
        state = t["state"]
        ready_ids = np.flatnonzero(whole & (state == LedgerState.READY))
        abandoned = np.flatnonzero(~whole | (state == LedgerState.WRITING)
                                   | (state > LedgerState.READY))
        ready_ids = ready_ids[np.argsort(t["stamp"][ready_ids], kind="stable")]
        blob = t["key"][ready_ids].tobytes()  # one copy; slicing bytes beats per-record numpy
        lengths = t["key_len"][ready_ids].tolist()
        by_key: dict[bytes, int] = {}
        for i, (slot, length) in enumerate(zip(ready_ids.tolist(), lengths)):
            key = blob[i * KEY_BYTES:i * KEY_BYTES + length]
            by_key.pop(key, None)  # the newer record wins, in its place in stamp order
            by_key[key] = slot
        kept = set(by_key.values())
        duplicates = [s for s in ready_ids.tolist() if s not in kept]
        self._normalise_seq(abandoned)
        self.free(np.concatenate([abandoned, np.asarray(duplicates, np.int64)]))
        self._next_stamp = int(t["stamp"].max(initial=0)) + 1
        return Recovery(tuple(by_key.items()), tuple(abandoned.tolist()))

    def _normalise_seq(self, ids: np.ndarray) -> None:
        """A torn record gets an even seq at least as large as both halves, so the next
        rewrite starts from a consistent bracket."""
        if ids.size:
            t = self._table
            top = np.maximum(t["seq"][ids], t["seq_end"][ids])
            even = top + (top % 2)
            t["seq_end"][ids] = even
            t["seq"][ids] = even

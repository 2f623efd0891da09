"""The index ledger: the durable part of the cache index, kept in the region itself so that
a restarted coordinator (after SIGKILL or a clean stop) rebuilds its index from it — which
key each slot holds, in what state, who is writing it and who has it pinned.

One fixed-size record per slot, in a table between the stats blocks and the session table
(``RegionLayout.ledger_offset``), little-endian::

    offset  size  field
    0       8     seq        u64: made odd before the record is rewritten, even once whole
    8       4     state      u32: FREE 0, WRITING 1, READY 2 (``LedgerState``)
    12      2     key_len    u16: bytes of ``key`` that are the key (<= KEY_BYTES)
    14      2     writer     u16: the session (owner) that reserved a WRITING slot
    16      8     stamp      u64: store order of READY records (1, 2, ...; larger = newer)
    24      8     gen        u64: the slot's generation: new (ledger-wide increasing) each
                             time the slot is handed to a key; specs carry it (see below)
    32      256   key        the block hash, zero-padded (a namespaced key names its namespace)
    288     16    pin_owner  8 x u16: sessions holding pins on the slot
    304     16    pin_count  8 x u16: their pin counts (0: the entry is empty)
    320     8     checksum   u64: ``record_checksums`` of bytes 8..320 salted by the slot index
    328     8     seq_end    u64: written equal to ``seq`` last but one; a whole record has
                             ``seq == seq_end`` and both even

Decisions and reasons:

* **Single writer, crash = process death.** Only the coordinator holding the region's
  lock writes the table, and only its successor rebuilds from it. A rewrite stores, in this
  order: ``seq`` (odd), the body and its checksum, ``seq_end`` (new even value), ``seq``
  (the same value). Every proper prefix leaves ``seq`` odd or ``seq != seq_end``: such a
  record is torn and recovered as FREE.
* **A checksum over what names a block.** State, key, writer, stamp, generation and pins,
  salted by the slot index, so damage (a bit flip, a stray write) that the seq bracket
  cannot see makes the record fail its check; it is dropped on rebuild and counted
  (``Recovery.damaged``), never served. ``region.checksum`` says why a single flipped bit
  is always caught.
* **FREE is always a safe answer.** Losing a record only loses a cached block; what must
  never happen is a READY record whose slot holds other bytes. A slot's record is rewritten
  (to WRITING with the new key and a new generation, or to FREE) *before* the index hands
  the slot to a writer, and it becomes READY only in ``complete_store``.
* **Reservations and pins are durable.** A load or a store in flight when the coordinator
  died must not find its slot handed to someone else by the next one. So the writer of a
  WRITING record and the owners of its pins are recorded with the record; the rebuilt index
  keeps them for the sessions that survive (``tiercache.region.sessions`` keeps the session
  table) and gives back only those of sessions proven gone.
* **Eight pinning sessions per slot.** A fixed record cannot list every session; one block
  pinned by more than ``PIN_OWNERS`` sessions at once is refused to the ninth (its lease
  stops short of it: a miss, never an unrecorded pin).
* **Generations let a worker check what it copies.** A spec carries each slot's generation;
  before it copies, a worker reads the record in its own mapping and refuses a slot whose
  generation (or state) is not the one it was given: a slot handed to another key since.
* Stamps give the recovered blocks their store order for the eviction policy; touches are
  not recorded (they are the hot path), so recency after a restart is store order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from tiercache.region.checksum import record_checksums

KEY_BYTES = 256  # the control plane carries keys of at most this many bytes
PIN_OWNERS = 8  # sessions that may pin one slot at once (see the module docstring)
MAX_OWNER = 0xFFFF  # owners are stored as u16
RECORD = np.dtype([
    ("seq", "<u8"), ("state", "<u4"), ("key_len", "<u2"), ("writer", "<u2"),
    ("stamp", "<u8"), ("gen", "<u8"), ("key", "u1", (KEY_BYTES,)),
    ("pin_owner", "<u2", (PIN_OWNERS,)), ("pin_count", "<u2", (PIN_OWNERS,)),
    ("checksum", "<u8"), ("seq_end", "<u8"),
])
RECORD_BYTES = RECORD.itemsize
_FIELDS = RECORD.fields
assert RECORD_BYTES == 336 and RECORD_BYTES % 8 == 0 and _FIELDS is not None
_WORDS = RECORD_BYTES // 8
_BODY = slice(1, _FIELDS["checksum"][1] // 8)  # the words the checksum covers


class LedgerState(IntEnum):
    FREE = 0
    WRITING = 1
    READY = 2


@dataclass(frozen=True)
class Recovery:
    """What a ledger held. ``ready``: (key, slot, gen), oldest stored first; ``writing``:
    (key, slot, writer, gen); ``pins``: slot -> {owner: count} for ready slots;
    ``abandoned``: slots whose record was torn or damaged (rewritten FREE, to be reused
    last); ``damaged``: how many of those failed their checksum; ``next_gen``: the first
    generation not used yet."""

    ready: tuple[tuple[bytes, int, int], ...]
    writing: tuple[tuple[bytes, int, int, int], ...] = ()
    pins: Mapping[int, Mapping[int, int]] = field(default_factory=dict)
    abandoned: tuple[int, ...] = ()
    damaged: int = 0
    next_gen: int = 1


class IndexLedger:
    """The record table over ``buffer`` (a writable uint8 array of ``num_records *
    RECORD_BYTES`` bytes, 8-byte aligned). Not thread-safe: the index calls it under its
    own lock. Raises ``ValueError`` for a buffer of the wrong size."""

    max_key_bytes = KEY_BYTES
    max_pin_owners = PIN_OWNERS

    def __init__(self, buffer: np.ndarray):
        if buffer.dtype != np.uint8 or buffer.ndim != 1 or buffer.size % RECORD_BYTES:
            raise ValueError(f"ledger buffer of {buffer.size} {buffer.dtype} bytes; needs a 1-d "
                             f"uint8 array of a multiple of {RECORD_BYTES} bytes")
        if buffer.ctypes.data % 8:
            raise ValueError(f"ledger buffer at {buffer.ctypes.data:#x} is not 8-byte aligned")
        self._table = buffer.view(RECORD)
        self._words = buffer.view(np.uint64).reshape(-1, _WORDS)
        self._next_stamp = 1

    @property
    def num_records(self) -> int:
        return self._table.size

    @property
    def table(self) -> np.ndarray:
        """The records as a structured array (read-only use: workers check generations)."""
        return self._table

    # ------------------------------------------------------------------ writes
    def writing(self, slot_ids: Sequence[int], keys: Sequence[bytes], writer: int,
                gens: Sequence[int]) -> None:
        """These slots now belong to these keys, reserved by ``writer``, with these new
        generations; not readable yet (invalidates what they held)."""
        if not len(slot_ids):
            return
        lengths = np.fromiter(map(len, keys), np.uint16, len(keys))
        packed = b"".join(key.ljust(KEY_BYTES, b"\0") for key in keys)
        key_rows = np.frombuffer(packed, np.uint8).reshape(len(keys), KEY_BYTES)
        self._rewrite(slot_ids, (("state", LedgerState.WRITING), ("key_len", lengths),
                                 ("key", key_rows), ("stamp", 0), ("writer", writer),
                                 ("gen", np.asarray(gens, np.uint64)), ("pin_owner", 0),
                                 ("pin_count", 0)))

    def ready(self, slot_ids: Sequence[int]) -> None:
        """The blocks in these slots are whole: READY. ``slot_ids[0]`` gets the newest stamp
        (the index's convention: the first key of a batch is the most recent)."""
        n = len(slot_ids)
        if not n:
            return
        stamps = np.arange(self._next_stamp + n - 1, self._next_stamp - 1, -1, dtype=np.uint64)
        self._next_stamp += n
        self._rewrite(slot_ids, (("state", LedgerState.READY), ("stamp", stamps),
                                 ("writer", 0)))

    def pins(self, slot_ids: Sequence[int], holders: Sequence[Mapping[int, int]]) -> None:
        """Record who pins each slot now (``holders[i]``: owner -> count, at most
        ``PIN_OWNERS`` owners; the index refuses a pin that would pass it)."""
        n = len(slot_ids)
        if not n:
            return
        owners = np.zeros((n, PIN_OWNERS), np.uint16)
        counts = np.zeros((n, PIN_OWNERS), np.uint16)
        for row, held in enumerate(holders):
            if len(held) > PIN_OWNERS:
                raise ValueError(f"slot {slot_ids[row]} pinned by {len(held)} sessions; the "
                                 f"ledger records at most {PIN_OWNERS}")
            for col, (owner, count) in enumerate(held.items()):
                owners[row, col] = owner
                counts[row, col] = min(count, 0xFFFF)
        self._rewrite(slot_ids, (("pin_owner", owners), ("pin_count", counts)))

    def free(self, slot_ids: Sequence[int] | np.ndarray) -> None:
        if len(slot_ids):
            self._rewrite(slot_ids, (("state", LedgerState.FREE), ("key_len", 0), ("stamp", 0),
                                     ("writer", 0), ("pin_owner", 0), ("pin_count", 0)))

    def clear(self) -> None:
        self.free(np.arange(self._table.size))

    def _rewrite(self, slot_ids: Sequence[int] | np.ndarray,
                 body: tuple[tuple[str, object], ...]) -> None:
        """The one way a record changes; the store order is the crash-safety argument
        (module docstring)."""
        ids = np.asarray(slot_ids, dtype=np.int64)
        odd = (self._table["seq"][ids] | 1).astype(np.uint64)
        self._store("seq", ids, odd)
        for name, values in body:
            self._store(name, ids, values)
        self._store("checksum", ids, record_checksums(self._words[ids, _BODY], ids))
        self._store("seq_end", ids, odd + 1)
        self._store("seq", ids, odd + 1)

    def _store(self, name: str, ids: np.ndarray, values: object) -> None:
        self._table[name][ids] = values

    # ------------------------------------------------------------------ recovery
    def check(self, ids: np.ndarray | None = None) -> np.ndarray:
        """Which records (all, or ``ids``) are whole and pass their checksum."""
        t = self._table if ids is None else self._table[ids]
        ids = np.arange(self._table.size) if ids is None else ids
        sums = record_checksums(self._words[ids, _BODY], ids)
        whole: np.ndarray = ((t["seq"] == t["seq_end"]) & (t["seq"] % 2 == 0)
                             & (t["checksum"] == sums) & (t["key_len"] <= KEY_BYTES)
                             & (t["state"] <= LedgerState.READY))
        return whole

    def recover(self) -> Recovery:
        """Read what a previous coordinator left. Torn and damaged records are rewritten
        FREE and reported as abandoned; a key held by two records (impossible unless the
        table was damaged) keeps its newest READY one. WRITING records and pins are
        reported as they are: the index decides which of their sessions survive."""
        t = self._table
        fresh = (t["seq"] == 0) & (t["seq_end"] == 0)  # never written: FREE
        whole_seq = (t["seq"] == t["seq_end"]) & (t["seq"] % 2 == 0)
        good = self.check() & ~fresh
        damaged = int(np.count_nonzero(whole_seq & ~good & ~fresh))
        state = t["state"]
        ready_ids = np.flatnonzero(good & (state == LedgerState.READY))
        writing_ids = np.flatnonzero(good & (state == LedgerState.WRITING))
        abandoned = np.flatnonzero(~good & ~fresh)
        next_gen = int(t["gen"][np.flatnonzero(good)].max(initial=0)) + 1
        ready_ids = ready_ids[np.argsort(t["stamp"][ready_ids], kind="stable")]
        by_key: dict[bytes, int] = {}
        for slot in ready_ids.tolist():
            key = self._key(slot)
            by_key.pop(key, None)  # the newer record wins, in its place in stamp order
            by_key[key] = slot
        kept = set(by_key.values())
        writing = []
        dropped = [s for s in ready_ids.tolist() if s not in kept]
        for slot in writing_ids.tolist():
            key = self._key(slot)
            if key in by_key:
                dropped.append(slot)
            else:
                writing.append((key, slot, int(t["writer"][slot]), int(t["gen"][slot])))
        pins = {}
        for slot in kept:
            count = t["pin_count"][slot]
            if count.any():
                owners = t["pin_owner"][slot]
                pins[slot] = {int(o): int(c) for o, c in zip(owners, count) if c}
        self._normalise_seq(abandoned)
        lost = np.concatenate([abandoned, np.asarray(dropped, np.int64)])
        t["gen"][lost] = np.arange(next_gen, next_gen + lost.size, dtype=np.uint64)
        next_gen += lost.size
        self.free(lost)
        self._next_stamp = int(t["stamp"][np.flatnonzero(good)].max(initial=0)) + 1
        return Recovery(tuple((k, s, int(t["gen"][s])) for k, s in by_key.items()),
                        tuple(writing), pins, tuple(abandoned.tolist()), damaged, next_gen)

    def _key(self, slot: int) -> bytes:
        t = self._table
        return t["key"][slot, :t["key_len"][slot]].tobytes()

    def _normalise_seq(self, ids: np.ndarray) -> None:
        """A torn record gets an even seq at least as large as both halves, so the next
        rewrite starts from a consistent bracket."""
        if ids.size:
            t = self._table
            top = np.maximum(t["seq"][ids], t["seq_end"][ids])
            even = top + (top % 2)
            t["seq_end"][ids] = even
            t["seq"][ids] = even

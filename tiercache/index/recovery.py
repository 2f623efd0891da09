"""A restarted index: the slot table rebuilt from the durable ledger in the region.

READY blocks come back (oldest first: the policy's recency), with the reservations and
pins of ``surviving`` owners (sessions whose processes live). Other owners' pins are
dropped; their reservations' slots, where a copy of that time may still land, are reused
last."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, cast, overload

import numpy as np

from tiercache.index.slots import SlotState
from tiercache.index.table import SlotTable

if TYPE_CHECKING:
    from tiercache.region.ledger import Recovery


def restore(table: SlotTable, recovery: Recovery, surviving: set[int],
            counters: dict[str, int]) -> None:
    """Fill the empty ``table`` from ``recovery`` (``IndexLedger.recover()``); the counts
    go to ``counters``. The READY blocks in bulk (arrays, the recovery's own dict), the
    few reservations and pins one by one."""
    ready = recovery.ready_slots
    if ready.size:
        table.check_slot_id(int(ready.min()))
        table.check_slot_id(int(ready.max()))
    table.slot_of = recovery.slot_of
    table.key_of = recovery.key_of
    table.view(table.state)[ready] = SlotState.READY  # generations: the ledger's own
    table.num_by_state[SlotState.READY] = ready.size
    newest_first = ready[::-1]
    table.policy.insert(newest_first, _Keys(table.key_of, newest_first))
    repinned = []
    for slot, holders in recovery.pins.items():
        key = keys_of(table, slot)
        for owner, count in holders.items():
            if owner in surviving:
                if slot not in table.pins:
                    table.pins[slot] = {}
                    table.move(slot, SlotState.LOADING)
                table.pins[slot][owner] = count
                table.holdings_of(owner).pinned.add(key)
                counters["recovered_pins"] += count
        if len(table.pins.get(slot, ())) != len(holders):
            repinned.append(slot)
    abandoned = set(recovery.abandoned)
    now = time.monotonic()
    for key, slot, writer, _gen in recovery.writing:
        table.check_slot_id(slot)
        if writer in surviving and key not in table.slot_of:
            table.slot_of[key] = ~slot
            table.key_of[slot] = key
            table.state[slot] = SlotState.WRITING
            table.num_by_state[SlotState.WRITING] += 1
            table.holdings_of(writer).writing[key] = now
            table.policy.insert([slot], [key])
            counters["recovered_writing_blocks"] += 1
        else:
            abandoned.add(slot)
    in_use = table.view(table.state) != SlotState.FREE
    last = sorted(s for s in abandoned if not in_use[s])
    table.set_free(last)
    table.next_gen = recovery.next_gen
    counters["recovered_blocks"] = int(ready.size)
    counters["damaged_records"] = recovery.damaged
    if table.ledger is not None:
        table.ledger.free(sorted(set(last) - set(recovery.abandoned)))
        table.mirror_pins(repinned)


def keys_of(table: SlotTable, slot: int) -> bytes:
    key = table.key_of[slot]
    assert key is not None, "a recovered READY slot holds its key"
    return key


class _Keys(Sequence[bytes]):
    """The keys of ``slots``, read when asked (LRU never asks)."""

    def __init__(self, key_of: list[bytes | None], slots: np.ndarray):
        self._key_of, self._slots = key_of, slots

    def __len__(self) -> int:
        return self._slots.size

    @overload
    def __getitem__(self, i: int) -> bytes: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[bytes]: ...

    def __getitem__(self, i: int | slice) -> bytes | Sequence[bytes]:
        if isinstance(i, slice):
            return _Keys(self._key_of, self._slots[i])
        key = self._key_of[int(self._slots[i])]
        assert key is not None, "a recovered READY slot holds its key"
        return key

    def __iter__(self) -> Iterator[bytes]:
        return cast(Iterator[bytes], map(self._key_of.__getitem__, self._slots.tolist()))

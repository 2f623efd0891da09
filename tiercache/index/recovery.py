"""A restarted index: the slot table rebuilt from the durable ledger in the region.

READY blocks come back (oldest first: the policy's recency), with the reservations and
pins of ``surviving`` owners (sessions whose processes live). Other owners' pins are
dropped; their reservations' slots, where a copy of that time may still land, are reused
last."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tiercache.index.slots import Slot, SlotState
from tiercache.index.table import SlotTable

if TYPE_CHECKING:
    from tiercache.region.ledger import Recovery


def restore(table: SlotTable, recovery: Recovery, surviving: set[int],
            counters: dict[str, int]) -> None:
    """Fill the empty ``table`` from ``recovery`` (``IndexLedger.recover()``); the counts
    go to ``counters``."""
    by_slot: dict[int, bytes] = {}
    for key, slot_id, gen in recovery.ready:
        table.check_slot_id(slot_id)
        table.slots[key] = Slot(slot_id, SlotState.READY, gen, key)
        by_slot[slot_id] = key
    table.readable = set(table.slots)
    table.num_by_state[SlotState.READY] = len(table.slots)
    table.policy.admit([key for key, _, _ in reversed(recovery.ready)], 0, lambda key: False)
    repinned = []
    for slot_id, holders in recovery.pins.items():
        key = by_slot[slot_id]
        slot = table.slots[key]
        for owner, count in holders.items():
            if owner in surviving:
                if not slot.pins:
                    table.move(slot, SlotState.LOADING)
                slot.pins[owner] = count
                table.holdings_of(owner).pinned.add(key)
                counters["recovered_pins"] += count
        if len(slot.pins) != len(holders):
            repinned.append(slot)
    abandoned = set(recovery.abandoned)
    now = time.monotonic()
    for key, slot_id, writer, gen in recovery.writing:
        table.check_slot_id(slot_id)
        if writer in surviving and key not in table.slots:
            table.slots[key] = Slot(slot_id, SlotState.WRITING, gen, key)
            table.num_by_state[SlotState.WRITING] += 1
            table.holdings_of(writer).writing[key] = now
            table.policy.admit([key], 0, lambda key: False)
            counters["recovered_writing_blocks"] += 1
        else:
            abandoned.add(slot_id)
    used = {slot.slot_id for slot in table.slots.values()}
    abandoned -= used
    rest = [s for s in range(table.capacity - 1, -1, -1) if s not in used and s not in abandoned]
    table.free = sorted(abandoned, reverse=True) + rest
    table.next_fresh = table.capacity
    table.next_gen = recovery.next_gen
    counters["recovered_blocks"] = len(by_slot)
    counters["damaged_records"] = recovery.damaged
    if table.ledger is not None:
        table.ledger.free(sorted(abandoned - set(recovery.abandoned)))
        table.mirror_pins(repinned)

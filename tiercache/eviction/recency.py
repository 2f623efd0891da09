"""``RecencyOrder``: slots (ids ``0 .. capacity - 1``) in order of last use, in flat arrays.

Decision: one stamp per slot from one increasing counter (8 bytes a slot, no object per
member; an ``OrderedDict`` of keys cost about 90 bytes a member, docs/benchmarks.md
"The index at scale"). Adding or touching a batch stamps it anew, ``slots[0]`` last, so
it ends most recent. The least recent members are those with the smallest stamps.

``oldest()`` walks them from a cached sorted *head*: the members with the smallest stamps
when it was found. The head needs no upkeep, because stamps only grow: every member
outside it is newer than all of it, and an entry whose slot's stamp changed since (touched,
removed, added again) is stale and skipped. Past the head's end the next ``chunk`` members
are found in one O(capacity) pass (``argpartition``), so a walk costs one pass per
``chunk`` members it reaches: with ``chunk`` a fixed share of the capacity, amortised O(1)
per eviction. Not thread-safe (the index calls it under its lock).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

MIN_CHUNK = 1024  # members found per pass, at least ...
CHUNK_SHARE = 64  # ... or 1/64 of the capacity: a pass per 1/64 of the cache evicted
WALK_STEP = 256  # head entries checked for staleness at once


class RecencyOrder:
    """Members in order of last use; see the module docstring."""

    def __init__(self, capacity: int):
        self._stamps = np.zeros(capacity, np.uint64)  # 0: not a member
        self._next = 1
        self._size = 0
        self._chunk = max(MIN_CHUNK, capacity // CHUNK_SHARE)
        self._reset_head()

    def _reset_head(self) -> None:
        self._head_slots = np.zeros(0, np.int64)  # the oldest members when found, in order
        self._head_stamps = np.zeros(0, np.uint64)  # their stamps then
        self._head_at = 0  # every head entry before this one is stale

    def __len__(self) -> int:
        return self._size

    def __contains__(self, slot: int) -> bool:
        return bool(self._stamps[slot])

    def add(self, slots: Sequence[int] | np.ndarray) -> None:
        """Make these slots (not members, distinct) members; ``slots[0]`` ends most recent."""
        ids = np.asarray(slots, np.int64)
        self._size += ids.size
        self._stamp(ids)

    def touch(self, slots: Sequence[int] | np.ndarray) -> None:
        """Members, or not yet: all end most recent, ``slots[0]`` last (a slot given twice
        ends where its first place puts it)."""
        ids = np.asarray(slots, np.int64)
        new = ids[self._stamps[ids] == 0]
        if new.size:
            self._size += np.unique(new).size
        self._stamp(ids)

    def _stamp(self, ids: np.ndarray) -> None:
        n = ids.size
        # Assigned in reverse: for a repeated slot the last write (its first place) wins.
        self._stamps[ids[::-1]] = np.arange(self._next, self._next + n, dtype=np.uint64)
        self._next += n

    def remove(self, slots: Sequence[int] | np.ndarray) -> None:
        """Forget these slots; those that are not members are ignored."""
        ids = np.asarray(slots, np.int64)
        members = ids[self._stamps[ids] != 0]
        if members.size:
            self._size -= np.unique(members).size
            self._stamps[members] = 0

    def clear(self) -> None:
        self._stamps.fill(0)
        self._size = 0
        self._reset_head()

    def oldest(self) -> Iterator[int]:
        """Members, least recent first. Nothing may change the order during the walk."""
        at = self._head_at
        leading = True  # every entry before ``at`` is stale
        while True:
            if at == self._head_slots.size:
                dropped = self._extend()
                if dropped < 0:
                    return
                at -= dropped
                continue
            end = min(at + WALK_STEP, self._head_slots.size)
            segment = self._head_slots[at:end]
            live = np.flatnonzero(self._stamps[segment] == self._head_stamps[at:end])
            for offset in live.tolist():
                if leading:
                    self._head_at = at + offset
                    leading = False
                yield int(segment[offset])
            if leading:
                self._head_at = end
            at = end

    def _extend(self) -> int:
        """Append the next ``chunk`` members to the head, keeping its live entries only;
        how many entries before ``_head_at`` were dropped, or -1 when none is newer."""
        bound = int(self._head_stamps[-1]) if self._head_stamps.size else 0
        newer = np.flatnonzero(self._stamps > bound)
        if not newer.size:
            return -1
        if newer.size > self._chunk:
            newer = newer[np.argpartition(self._stamps[newer], self._chunk - 1)[:self._chunk]]
        newer = newer[np.argsort(self._stamps[newer])]
        dropped = self._head_at
        kept_slots = self._head_slots[dropped:]
        kept_stamps = self._head_stamps[dropped:]
        live = self._stamps[kept_slots] == kept_stamps
        self._head_slots = np.concatenate([kept_slots[live], newer])
        self._head_stamps = np.concatenate([kept_stamps[live], self._stamps[newer]])
        self._head_at = 0
        return dropped + int(np.count_nonzero(~live))

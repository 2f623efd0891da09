"""LRU: least recently used first."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from tiercache.eviction.base import CanEvict, EvictionPolicy, candidates, register_policy
from tiercache.eviction.recency import RecencyOrder


@register_policy
class LRUPolicy(EvictionPolicy):
    """Least recently used first; blocks that cannot go are skipped, not reordered. One
    ``RecencyOrder`` (8 bytes a slot)."""

    name = "lru"

    def __init__(self, capacity_blocks: int):
        super().__init__(capacity_blocks)
        self._order = RecencyOrder(capacity_blocks)

    def evict(self, num_evictions: int, can_evict: CanEvict,
              incoming: Sequence[bytes] = ()) -> list[int] | None:
        if num_evictions <= 0:
            return []
        victims = list(itertools.islice(candidates(self._order, can_evict), num_evictions))
        if len(victims) < num_evictions:
            return None
        self._order.remove(victims)
        return victims

    def insert(self, slots: Sequence[int] | np.ndarray, keys: Sequence[bytes]) -> None:
        self._order.add(slots)

    def remove(self, slot: int) -> None:
        self._order.remove([slot])

    def touch(self, slots: Sequence[int]) -> None:
        self._order.touch(slots)

    def clear(self) -> None:
        self._order.clear()

    def peek(self, num_slots: int, can_evict: CanEvict) -> list[int]:
        return list(itertools.islice(candidates(self._order, can_evict), num_slots))

    def slots_lru_first(self) -> tuple[int, ...]:
        """Held slots, least recent first (for tests and debugging)."""
        return tuple(self._order.oldest())

"""LRU: least recently used first."""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Sequence

from tiercache.eviction.base import CanEvict, EvictionPolicy, candidates, register_policy


@register_policy
class LRUPolicy(EvictionPolicy):
    """Least recently used first; blocks that cannot go are skipped, not reordered."""

    name = "lru"

    def __init__(self, capacity_blocks: int):
        super().__init__(capacity_blocks)
        self._order: OrderedDict[bytes, None] = OrderedDict()  # least recent first

    def admit(self, keys: Sequence[bytes], num_evictions: int,
              can_evict: CanEvict) -> list[bytes] | None:
        victims: list[bytes] = []
        if num_evictions > 0:
            for key in candidates(self._order, can_evict):
                victims.append(key)
                if len(victims) == num_evictions:
                    break
            if len(victims) < num_evictions:
                return None
        order = self._order
        for key in victims:
            del order[key]
        for key in reversed(keys):
            order[key] = None
        return victims

    def remove(self, key: bytes) -> None:
        del self._order[key]

    def touch(self, keys: Sequence[bytes]) -> None:
        # The hot path of every scheduler step: consume the map in C, no Python loop.
        deque(map(self._order.move_to_end, reversed(keys)), maxlen=0)

    def clear(self) -> None:
        self._order.clear()

    def peek(self, num_keys: int, can_evict: CanEvict) -> list[bytes]:
        return list(itertools.islice(candidates(self._order, can_evict), num_keys))

    def keys_lru_first(self) -> tuple[bytes, ...]:
        """Held keys, least recent first (for tests and debugging)."""
        return tuple(self._order)

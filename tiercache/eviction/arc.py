"""ARC: the Adaptive Replacement Cache, adapted to pinned blocks."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import cast

import numpy as np

from tiercache.eviction.base import CanEvict, EvictionPolicy, candidates, register_policy
from tiercache.eviction.recency import RecencyOrder


@register_policy
class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST '03), adapted to pinned blocks.

    T1 holds keys seen once since admission, T2 keys touched again; B1 and B2
    remember keys recently evicted from T1 and T2 (ghosts, no slot). ``target_t1_blocks``
    (ARC's p) is how large T1 may grow before eviction prefers it: a re-admitted B1
    ghost means T1 was too small (p grows by max(1, |B2|/|B1|)), a B2 ghost means T2
    was (p shrinks by max(1, |B1|/|B2|)). Re-admitted ghosts go straight to T2. As in
    ARC, p adapts before the victims are chosen; a batch applies all its ghost hits first.

    Eviction takes T1's least recent evictable key while the simulated |T1| exceeds p,
    else T2's; when the preferred list has no evictable key left the other one is
    used, so a store is refused only when nothing at all can go. Ghost lists are kept
    within ARC's directory bounds: |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c.

    T1 and T2 are ``RecencyOrder``s of slots (8 bytes a slot each) with the held slots'
    keys (one reference a slot); ghosts are keys, which outlive their slots: up to ``c``
    of them, each a key and an ``OrderedDict`` entry (ARC's price for its memory).
    """

    name = "arc"

    def __init__(self, capacity_blocks: int):
        super().__init__(capacity_blocks)
        self._t1 = RecencyOrder(capacity_blocks)
        self._t2 = RecencyOrder(capacity_blocks)
        self._keys: list[bytes | None] = [None] * capacity_blocks  # a held slot's key
        self._b1: OrderedDict[bytes, None] = OrderedDict()  # ghosts, least recent first
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._target_t1_blocks = 0.0

    @property
    def target_t1_blocks(self) -> float:
        return self._target_t1_blocks

    def lists(self) -> dict[str, tuple[bytes, ...]]:
        """The keys of ``t1``, ``t2``, ``b1``, ``b2``, each least recent first (tests and
        debugging)."""
        keys = self._keys
        return {"t1": cast(tuple[bytes, ...], tuple(keys[s] for s in self._t1.oldest())),
                "t2": cast(tuple[bytes, ...], tuple(keys[s] for s in self._t2.oldest())),
                "b1": tuple(self._b1), "b2": tuple(self._b2)}

    def evict(self, num_evictions: int, can_evict: CanEvict,
              incoming: Sequence[bytes] = ()) -> list[int] | None:
        # ARC adapts p on a ghost hit before it replaces; a batch adapts for all its keys first.
        target = self._target_t1_blocks
        num_b1, num_b2 = len(self._b1), len(self._b2)
        for key in incoming:
            if key in self._b1:
                target = min(float(self.capacity_blocks), target + max(1.0, num_b2 / num_b1))
            elif key in self._b2:
                target = max(0.0, target - max(1.0, num_b1 / num_b2))
        victims = self._choose_victims(num_evictions, can_evict, target)
        if victims is None:
            return None
        self._target_t1_blocks = target
        for slot, in_t1 in victims:
            ghost = self._keys[slot]
            assert ghost is not None, "a held slot has its key"
            self._keys[slot] = None
            (self._t1 if in_t1 else self._t2).remove([slot])
            (self._b1 if in_t1 else self._b2)[ghost] = None
        return [slot for slot, _ in victims]

    def insert(self, slots: Sequence[int] | np.ndarray, keys: Sequence[bytes]) -> None:
        to_t1: list[int] = []
        to_t2: list[int] = []
        b1, b2, held = self._b1, self._b2, self._keys
        for slot, key in zip(np.asarray(slots).tolist(), keys):
            if b1 and key in b1:  # a returning ghost goes straight to T2
                del b1[key]
                to_t2.append(slot)
            elif b2 and key in b2:
                del b2[key]
                to_t2.append(slot)
            else:
                to_t1.append(slot)
            held[slot] = key
        self._t1.add(to_t1)
        self._t2.add(to_t2)
        self._trim_ghosts()

    def peek(self, num_slots: int, can_evict: CanEvict) -> list[int]:
        for n in range(num_slots, 0, -1):  # as many as there are, in ARC's eviction order
            victims = self._choose_victims(n, can_evict, self._target_t1_blocks)
            if victims is not None:
                return [slot for slot, _ in victims]
        return []

    def _choose_victims(self, num_evictions: int, can_evict: CanEvict,
                        target: float) -> list[tuple[int, bool]] | None:
        """(slot, taken from T1) in eviction order, or None when too few can go."""
        victims: list[tuple[int, bool]] = []
        next_t1 = candidates(self._t1, can_evict)
        next_t2 = candidates(self._t2, can_evict)
        head_t1 = next(next_t1, None) if num_evictions else None
        head_t2 = next(next_t2, None) if num_evictions else None
        simulated_t1 = len(self._t1)
        while len(victims) < num_evictions:
            if head_t1 is not None and (simulated_t1 > target or head_t2 is None):
                victims.append((head_t1, True))
                simulated_t1 -= 1
                head_t1 = next(next_t1, None)
            elif head_t2 is not None:
                victims.append((head_t2, False))
                head_t2 = next(next_t2, None)
            else:
                return None
        return victims

    def remove(self, slot: int) -> None:
        (self._t1 if slot in self._t1 else self._t2).remove([slot])
        self._keys[slot] = None

    def touch(self, slots: Sequence[int]) -> None:
        self._t1.remove(slots)  # a second use: T1's members move to T2
        self._t2.touch(slots)

    def _trim_ghosts(self) -> None:
        c = self.capacity_blocks
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while self._b2 and len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * c:
            self._b2.popitem(last=False)

    def clear(self) -> None:
        self._t1.clear()
        self._t2.clear()
        self._keys = [None] * self.capacity_blocks
        self._b1.clear()
        self._b2.clear()
        self._target_t1_blocks = 0.0

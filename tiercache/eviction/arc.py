"""ARC: the Adaptive Replacement Cache, adapted to pinned blocks."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tiercache.eviction.base import CanEvict, EvictionPolicy, candidates, register_policy


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
    """

    name = "arc"

    def __init__(self, capacity_blocks: int):
        super().__init__(capacity_blocks)
        self._t1: OrderedDict[bytes, None] = OrderedDict()  # least recent first
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._target_t1_blocks = 0.0

    @property
    def target_t1_blocks(self) -> float:
        return self._target_t1_blocks

    def lists(self) -> dict[str, tuple[bytes, ...]]:
        """``t1``, ``t2``, ``b1``, ``b2``, each least recent first (tests and debugging)."""
        return {"t1": tuple(self._t1), "t2": tuple(self._t2),
                "b1": tuple(self._b1), "b2": tuple(self._b2)}

    def admit(self, keys: Sequence[bytes], num_evictions: int,
              can_evict: CanEvict) -> list[bytes] | None:
        # ARC adapts p on a ghost hit before it replaces; a batch adapts for all its keys first.
        target = self._target_t1_blocks
        num_b1, num_b2 = len(self._b1), len(self._b2)
        for key in keys:
            if key in self._b1:
                target = min(float(self.capacity_blocks), target + max(1.0, num_b2 / num_b1))
            elif key in self._b2:
                target = max(0.0, target - max(1.0, num_b1 / num_b2))
        victims = self._choose_victims(num_evictions, can_evict, target)
        if victims is None:
            return None
        self._target_t1_blocks = target
        for key, in_t1 in victims:
            if in_t1:
                del self._t1[key]
                self._b1[key] = None
            else:
                del self._t2[key]
                self._b2[key] = None
        for key in reversed(keys):
            if key in self._b1:
                del self._b1[key]
                self._t2[key] = None
            elif key in self._b2:
                del self._b2[key]
                self._t2[key] = None
            else:
                self._t1[key] = None
        self._trim_ghosts()
        return [key for key, _ in victims]

    def peek(self, num_keys: int, can_evict: CanEvict) -> list[bytes]:
        for n in range(num_keys, 0, -1):  # as many as there are, in ARC's eviction order
            victims = self._choose_victims(n, can_evict, self._target_t1_blocks)
            if victims is not None:
                return [key for key, _ in victims]
        return []

    def _choose_victims(self, num_evictions: int, can_evict: CanEvict,
                        target: float) -> list[tuple[bytes, bool]] | None:
        """(key, taken from T1) in eviction order, or None when too few can go."""
        victims: list[tuple[bytes, bool]] = []
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

    def remove(self, key: bytes) -> None:
        if key in self._t1:
            del self._t1[key]
        else:
            del self._t2[key]

    def touch(self, keys: Sequence[bytes]) -> None:
        t1, t2 = self._t1, self._t2
        for key in reversed(keys):
            if key in t2:
                t2.move_to_end(key)
            else:
                del t1[key]
                t2[key] = None

    def _trim_ghosts(self) -> None:
        c = self.capacity_blocks
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while self._b2 and len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * c:
            self._b2.popitem(last=False)

    def clear(self) -> None:
        for order in (self._t1, self._t2, self._b1, self._b2):
            order.clear()
        self._target_t1_blocks = 0.0

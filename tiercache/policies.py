"""Eviction policies: which cached blocks to give up when the index needs room.

A policy only orders keys; the manager owns slots, states and ref counts and tells
the policy, per eviction, which keys may go. ``POLICIES`` maps a name to a class;
a new policy is one class decorated with ``@register_policy``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar

from tiercache.errors import ConfigError

CanEvict = Callable[[bytes], bool]


class EvictionPolicy(ABC):
    """Recency (and, for ARC, frequency) bookkeeping over the keys the index holds.

    Contract between the manager and a policy:

    * The manager calls ``insert`` once for every key it admits and then exactly one
      of ``remove`` (the store failed) or an ``evict`` that returns the key; ``clear``
      forgets everything. A policy never sees a key twice without one of these between.
    * ``insert`` and ``touch`` take batches; within a batch ``keys[0]`` ends most
      recent, so the head of a prompt prefix outlives its tail (a tail block is
      useless without the blocks before it).
    * ``touch`` receives only keys the policy holds.
    * ``evict(num_blocks, can_evict)`` is atomic: it returns exactly ``num_blocks``
      keys for which ``can_evict(key)`` is true and has forgotten them, or returns
      ``None`` and has changed nothing. ``can_evict`` is a pure predicate supplied by
      the manager (block readable, no load in flight, not part of the calling store).
    * A policy raises nothing on valid use; it never decides what is evictable.
    """

    name: ClassVar[str]

    def __init__(self, capacity_blocks: int):
        if capacity_blocks < 1:
            raise ConfigError(f"capacity_blocks = {capacity_blocks}: must be >= 1")
        self.capacity_blocks = capacity_blocks

    @abstractmethod
    def insert(self, keys: Sequence[bytes]) -> None:
        """Admit new keys (their blocks are about to be written)."""

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """Forget a held key without keeping any history of it."""

    @abstractmethod
    def touch(self, keys: Sequence[bytes]) -> None:
        """Record an access to held keys."""

    @abstractmethod
    def evict(self, num_blocks: int, can_evict: CanEvict) -> list[bytes] | None:
        """Choose and forget ``num_blocks`` evictable keys, or change nothing and return None."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every key and all history."""


POLICIES: dict[str, type[EvictionPolicy]] = {}


def register_policy(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Class decorator: make a policy available by its ``name``."""
    if cls.name in POLICIES:
        raise ValueError(f"eviction policy {cls.name!r} is already registered by {POLICIES[cls.name]}")
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, capacity_blocks: int) -> EvictionPolicy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ConfigError(
            f"policy = {name!r}: allowed {', '.join(repr(n) for n in sorted(POLICIES))}"
        ) from None
    return cls(capacity_blocks)


def _candidates(order: OrderedDict[bytes, None], can_evict: CanEvict) -> Iterator[bytes]:
    return (key for key in order if can_evict(key))


@register_policy
class LRUPolicy(EvictionPolicy):
    """Least recently used first; blocks that cannot go are skipped, not reordered."""

    name = "lru"

    def __init__(self, capacity_blocks: int):
        super().__init__(capacity_blocks)
        self._order: OrderedDict[bytes, None] = OrderedDict()  # least recent first

    def insert(self, keys: Sequence[bytes]) -> None:
        order = self._order
        for key in reversed(keys):
            order[key] = None

    def remove(self, key: bytes) -> None:
        del self._order[key]

    def touch(self, keys: Sequence[bytes]) -> None:
        move = self._order.move_to_end
        for key in reversed(keys):
            move(key)

    def evict(self, num_blocks: int, can_evict: CanEvict) -> list[bytes] | None:
        victims: list[bytes] = []
        if num_blocks > 0:
            for key in _candidates(self._order, can_evict):
                victims.append(key)
                if len(victims) == num_blocks:
                    break
        if len(victims) < num_blocks:
            return None
        for key in victims:
            del self._order[key]
        return victims

    def clear(self) -> None:
        self._order.clear()

    def keys_lru_first(self) -> tuple[bytes, ...]:
        """Held keys, least recent first (for tests and debugging)."""
        return tuple(self._order)


@register_policy
class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST '03), adapted to pinned blocks.

    T1 holds keys seen once since admission, T2 keys touched again; B1 and B2
    remember keys recently evicted from T1 and T2 (ghosts, no slot). ``target_t1_blocks``
    (ARC's p) is how large T1 may grow before eviction prefers it: a re-admitted B1
    ghost means T1 was too small (p grows by max(1, |B2|/|B1|)), a B2 ghost means T2
    was (p shrinks by max(1, |B1|/|B2|)). Re-admitted ghosts go straight to T2.

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

    def insert(self, keys: Sequence[bytes]) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        for key in reversed(keys):
            if key in b1:
                step = max(1.0, len(b2) / len(b1))
                self._target_t1_blocks = min(float(self.capacity_blocks), self._target_t1_blocks + step)
                del b1[key]
                t2[key] = None
            elif key in b2:
                step = max(1.0, len(b1) / len(b2))
                self._target_t1_blocks = max(0.0, self._target_t1_blocks - step)
                del b2[key]
                t2[key] = None
            else:
                t1[key] = None
        self._trim_ghosts()

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

    def evict(self, num_blocks: int, can_evict: CanEvict) -> list[bytes] | None:
        victims: list[tuple[bytes, bool]] = []  # (key, taken from T1), in eviction order
        next_t1 = _candidates(self._t1, can_evict)
        next_t2 = _candidates(self._t2, can_evict)
        head_t1 = next(next_t1, None)
        head_t2 = next(next_t2, None)
        simulated_t1 = len(self._t1)
        while len(victims) < num_blocks:
            prefer_t1 = simulated_t1 > self._target_t1_blocks
            if head_t1 is not None and (prefer_t1 or head_t2 is None):
                victims.append((head_t1, True))
                simulated_t1 -= 1
                head_t1 = next(next_t1, None)
            elif head_t2 is not None:
                victims.append((head_t2, False))
                head_t2 = next(next_t2, None)
            else:
                return None
        for key, in_t1 in victims:
            if in_t1:
                del self._t1[key]
                self._b1[key] = None
            else:
                del self._t2[key]
                self._b2[key] = None
        self._trim_ghosts()
        return [key for key, _ in victims]

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

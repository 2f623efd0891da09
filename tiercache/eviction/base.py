"""The eviction policy contract and its registry: which cached blocks to give up when the
index needs room.

A policy only orders slots; the index owns keys, states and ref counts and tells the
policy, per eviction, which slots may go. ``POLICIES`` maps a name to a class; a new policy
is one class decorated with ``@register_policy`` in a module of this room, imported by
``tiercache.eviction``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar

import numpy as np

from tiercache.errors import ConfigError
from tiercache.eviction.recency import RecencyOrder

CanEvict = Callable[[int], bool]


class EvictionPolicy(ABC):
    """Recency (and, for ARC, frequency) bookkeeping over the slots the index holds.

    A policy orders *slots* (ids ``0 .. capacity_blocks - 1``), so it keeps no object per
    block: the index maps keys to slots. Contract between the manager and a policy:

    * Every slot enters through ``insert`` and leaves through exactly one of ``remove``
      (its store failed), being returned by ``evict``, or ``clear``.
    * ``evict(num_evictions, can_evict, incoming)`` is atomic: it either forgets exactly
      ``num_evictions`` held slots for which ``can_evict(slot)`` is true and returns them
      (in eviction order), or returns ``None`` and has changed nothing. ``incoming``: the
      keys the caller inserts next (ARC adapts to those it remembers evicting);
      ``can_evict`` is a pure predicate from the manager (block readable, no load in
      flight, not part of the calling store), so a policy never decides what *may* go,
      only what goes first.
    * ``insert(slots, keys)``: hold these slots (not held), ``keys[i]`` stored in
      ``slots[i]``; ``touch`` receives only held slots.
    * In a batch (``insert`` or ``touch``) ``slots[0]`` ends most recent, so the head of
      a prompt prefix outlives its tail (a tail block is useless without its head).
    * A policy raises nothing on valid use.
    """

    name: ClassVar[str]

    def __init__(self, capacity_blocks: int):
        if capacity_blocks < 1:
            raise ConfigError(f"capacity_blocks = {capacity_blocks}: must be >= 1")
        self.capacity_blocks = capacity_blocks

    @abstractmethod
    def evict(self, num_evictions: int, can_evict: CanEvict,
              incoming: Sequence[bytes] = ()) -> list[int] | None:
        """Forget ``num_evictions`` slots that may go and return them; or change nothing."""

    @abstractmethod
    def insert(self, slots: Sequence[int] | np.ndarray, keys: Sequence[bytes]) -> None:
        """Hold these slots, ``slots[0]`` most recent."""

    @abstractmethod
    def remove(self, slot: int) -> None:
        """Forget a held slot without keeping any history of it."""

    @abstractmethod
    def touch(self, slots: Sequence[int]) -> None:
        """Record an access to held slots."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every slot and all history."""

    @abstractmethod
    def peek(self, num_slots: int, can_evict: CanEvict) -> list[int]:
        """Up to ``num_slots`` slots that ``evict`` would give up next, in that order;
        changes nothing (the disk tier demotes them ahead of their eviction)."""


POLICIES: dict[str, type[EvictionPolicy]] = {}


def register_policy(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Class decorator: make a policy available by its ``name``."""
    if cls.name in POLICIES:
        raise ValueError(
            f"eviction policy {cls.name!r} is already registered by {POLICIES[cls.name]}")
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


def candidates(order: RecencyOrder, can_evict: CanEvict) -> Iterator[int]:
    """``order``'s members that may go, least recent first."""
    return filter(can_evict, order.oldest())

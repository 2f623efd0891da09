"""The eviction policy contract and its registry: which cached blocks to give up when the
index needs room.

A policy only orders keys; the index owns slots, states and ref counts and tells the
policy, per eviction, which keys may go. ``POLICIES`` maps a name to a class; a new policy
is one class decorated with ``@register_policy`` in a module of this room, imported by
``tiercache.eviction``.
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

    * Every key enters through ``admit`` and leaves through exactly one of ``remove``
      (its store failed), being returned by a later ``admit`` (evicted), or ``clear``.
    * ``admit(keys, num_evictions, can_evict)`` is atomic: it either forgets exactly
      ``num_evictions`` held keys for which ``can_evict(key)`` is true, returns them
      (in eviction order) and holds ``keys`` from then on, or returns ``None`` and has
      changed nothing. ``keys`` are not held by the policy; ``can_evict`` is a pure
      predicate from the manager (block readable, no load in flight, not part of the
      calling store), so a policy never decides what *may* go, only what goes first.
    * ``touch`` receives only held keys.
    * In a batch (``admit`` or ``touch``) ``keys[0]`` ends most recent, so the head of
      a prompt prefix outlives its tail (a tail block is useless without its head).
    * A policy raises nothing on valid use.
    """

    name: ClassVar[str]

    def __init__(self, capacity_blocks: int):
        if capacity_blocks < 1:
            raise ConfigError(f"capacity_blocks = {capacity_blocks}: must be >= 1")
        self.capacity_blocks = capacity_blocks

    @abstractmethod
    def admit(self, keys: Sequence[bytes], num_evictions: int,
              can_evict: CanEvict) -> list[bytes] | None:
        """Make room (evict ``num_evictions`` keys) and hold ``keys``; or change nothing."""

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """Forget a held key without keeping any history of it."""

    @abstractmethod
    def touch(self, keys: Sequence[bytes]) -> None:
        """Record an access to held keys."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every key and all history."""

    @abstractmethod
    def peek(self, num_keys: int, can_evict: CanEvict) -> list[bytes]:
        """Up to ``num_keys`` keys that ``admit`` would evict next, in that order; changes
        nothing (the disk tier demotes them ahead of their eviction)."""


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


def candidates(order: OrderedDict[bytes, None], can_evict: CanEvict) -> Iterator[bytes]:
    return (key for key in order if can_evict(key))

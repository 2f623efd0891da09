"""The index's vocabulary: a slot's state and flags, an owner's holdings, the ledger the
index writes through, what its key listeners are called with, and the key checks every
verb shares. Used inside the index (under its lock); nothing here locks or does I/O."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from enum import IntEnum, IntFlag
from typing import TYPE_CHECKING, Protocol

import numpy as np

from tiercache.errors import InvalidKeyError, ManagerError

if TYPE_CHECKING:
    from tiercache.region.ledger import Recovery

KeyListener = Callable[[Sequence[bytes], bool], None]  # (keys, removed)


class SlotState(IntEnum):
    """A slot's state; the value is its code in ``SlotTable.state`` (one byte a slot)."""

    FREE = 0  # no key: on the free list, held out, or never handed out yet
    WRITING = 1  # allocated by prepare_store; bytes not there yet; not readable
    READY = 2  # readable and evictable
    LOADING = 3  # readable and pinned (loads or leases); not evictable


class SlotFlag(IntFlag):
    """A slot's flags (``SlotTable.flags``, one byte a slot)."""

    DOOMED = 1  # a reset forgot its key; freed when its last writer or pin ends
    REUSED = 2  # pinned since it was stored (a lease or a load): reuse, for the tiers


class Holdings:
    """Which keys one owner reserved (with when, monotonic seconds) or pinned (the counts
    live on the slots)."""

    __slots__ = ("writing", "pinned")

    def __init__(self) -> None:
        self.writing: dict[bytes, float] = {}
        self.pinned: set[bytes] = set()

    @property
    def num_blocks(self) -> int:
        return len(self.writing) + len(self.pinned)

    def take_writing(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys of ``keys`` this owner reserved (each once, in order), no longer
        reserved by it: what a completion, a quarantine or an expiry acts on."""
        mine = [k for k in dict.fromkeys(keys) if k in self.writing]
        for key in mine:
            del self.writing[key]
        return mine


class Ledger(Protocol):
    """The durable mirror the index writes through (``tiercache.region.ledger.IndexLedger``)."""

    max_key_bytes: int
    max_pin_owners: int

    @property
    def num_records(self) -> int: ...

    @property
    def gens(self) -> np.ndarray:
        """Each slot's generation as last recorded (read-only)."""

    def recover(self) -> Recovery: ...

    def writing(self, slot_ids: Sequence[int], keys: Sequence[bytes], writer: int,
                gens: Sequence[int] | np.ndarray) -> None: ...

    def ready(self, slot_ids: Sequence[int]) -> None: ...

    def pins(self, slot_ids: Sequence[int], holders: Sequence[Mapping[int, int]]) -> None: ...

    def free(self, slot_ids: Sequence[int] | np.ndarray) -> None: ...

    def clear(self) -> None: ...


def check_keys(keys: Sequence[bytes], verb: str) -> None:
    """Raise ``InvalidKeyError`` unless every key is ``bytes``."""
    if set(map(type, keys)) <= {bytes}:
        return
    for key in keys:
        if type(key) is not bytes:
            raise InvalidKeyError(
                f"{verb}: key {key!r} is {type(key).__name__}; keys must be bytes")


def require_unique(keys: Sequence[bytes], verb: str) -> None:
    if len(set(keys)) != len(keys):
        repeated = [k for k, n in Counter(keys).items() if n > 1]
        raise InvalidKeyError(f"{verb}: key {repeated[0]!r} appears more than once in one call")


def check_owner(owner: int) -> None:
    if type(owner) is not int or owner < 0:
        raise ManagerError(f"owner = {owner!r}: must be an int >= 0 (LOCAL_OWNER is 0)")

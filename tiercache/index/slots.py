"""The index's records: a slot's state and pins, an owner's holdings, the ledger the index
writes through, and the key checks every verb shares. Used by the manager only (under its
lock); nothing here locks or does I/O."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from tiercache.errors import InvalidKeyError, ManagerError
from tiercache.index.lower_tier import BlockSource

if TYPE_CHECKING:
    from tiercache.region.ledger import Recovery


class SlotState(Enum):
    WRITING = "writing"  # allocated by prepare_store; bytes not there yet; not readable
    READY = "ready"  # readable and evictable
    LOADING = "loading"  # readable and pinned (loads or leases); not evictable


class Slot:
    __slots__ = ("slot_id", "state", "pins", "gen", "hits", "source", "key", "doomed")

    def __init__(self, slot_id: int, state: SlotState = SlotState.WRITING, gen: int = 0,
                 key: bytes = b""):
        self.slot_id = slot_id
        self.key = key
        self.state = state  # while WRITING, the writer is the owner whose holdings name the key
        self.pins: dict[int, int] = {}  # owner -> pins; non-empty exactly when LOADING
        self.gen = gen  # the slot's generation for this key (what specs carry)
        self.hits = 0  # pins taken since it was stored (leases and loads): reuse, for tiers
        self.source = BlockSource.HOST  # or the lower tier whose promotion stored it
        self.doomed = False  # a reset forgot its key; freed when its last writer or pin ends

    @property
    def loads(self) -> int:
        return sum(self.pins.values())


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

    def recover(self) -> Recovery: ...

    def writing(self, slot_ids: Sequence[int], keys: Sequence[bytes], writer: int,
                gens: Sequence[int]) -> None: ...

    def ready(self, slot_ids: Sequence[int]) -> None: ...

    def pins(self, slot_ids: Sequence[int], holders: Sequence[dict[int, int]]) -> None: ...

    def free(self, slot_ids: Sequence[int]) -> None: ...

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

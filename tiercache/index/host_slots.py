"""``HostSlots``: what the tier chain (``tiercache.index.tiering``, with its
``tiercache.index.feeds``) may do to host memory's index and read of it, and nothing more.
``OffloadingManager`` implements it over its ``SlotTable``; the chain holds it, not the
manager or the table, so the chain cannot reach an engine's verbs (``prepare_store``,
``lease``, ...) nor the table's arrays.

Locking: ``lock`` is the index's own. The reads and the two locked verbs,
``reserve_promotion`` and ``pin_for_tier``, are called with it held (the chain calls them
from a lookup's miss or its own refill, both already under it, so a promotion's
reservation is atomic with the lookup that asked, and what a refill reads is still so
when it pins); ``complete_write``, ``complete_read``, ``quarantine_slots`` and
``release_quarantine`` take it themselves and are called without it (from the chain's
thread, booking a tier's results). Every verb acts as ``TIER_OWNER``: no session, no cap.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Protocol

from tiercache.index.slots import SlotState
from tiercache.results import BlockSource, PrepareStoreOutput
from tiercache.specs import CPULoadStoreSpec


class HostSlots(Protocol):
    @property
    def lock(self) -> threading.Lock:
        """The index's lock: held around the reads and the two locked verbs."""

    @property
    def num_blocks(self) -> int:
        """Host memory's slots (fixed)."""

    # ------------------------------------------------------------------ reads (locked)
    def state_of(self, key: bytes) -> SlotState | None:
        """Locked. ``key``'s state in host memory, or None: the index does not hold it."""

    def readable_keys(self) -> list[bytes]:
        """Locked. Every key readable in host memory now (READY or LOADING)."""

    def promotion_since(self, key: bytes) -> float | None:
        """Locked. When (``time.monotonic``) the chain reserved ``key``'s slot for a
        promotion still being written, or None: it holds no such reservation."""

    def keys_fit(self, keys: Sequence[bytes]) -> bool:
        """Whether the index can hold every one of ``keys`` (its ledger's key size)."""

    def num_free(self) -> int:
        """Locked. Slots free now (neither held by a key nor held out)."""

    def num_held_out(self) -> int:
        """Locked. Slots held out of use now (``quarantine_slots``, expired promotions)."""

    def held_out(self, slot_ids: Iterable[int]) -> list[int]:
        """Locked. Those of ``slot_ids`` held out of use now, in order."""

    def pinnable(self, keys: Sequence[bytes]) -> list[bytes]:
        """Locked. Those of ``keys`` that ``pin_for_tier`` would pin now, in order: readable,
        and on a slot not pinned by as many owners as the ledger records."""

    def peek_evictions(self, count: int, admissible: Callable[[bytes], bool]
                       ) -> list[tuple[bytes, bool]]:
        """Locked. Up to ``count`` READY keys that ``admissible`` accepts, in the order
        eviction would give them up, each with whether it was reused (leased or loaded
        since it was stored); changes nothing."""

    # ------------------------------------------------------------------ verbs
    def reserve_promotion(self, keys: Sequence[bytes]) -> PrepareStoreOutput:
        """Locked. Reserve host slots (WRITING) for those of ``keys`` not held yet, in order,
        from free slots then by evicting at most ``len(keys)`` READY blocks (never one of
        ``keys``); the rest are ``no_room_keys``. Never refused as a whole."""

    def pin_for_tier(self, keys: Sequence[bytes], why: str) -> CPULoadStoreSpec:
        """Locked. Pin readable ``keys`` while a tier reads them (a demotion, a publish);
        each must be readable, else nothing changes (``why`` names the job in the
        error)."""

    def complete_write(self, keys: Sequence[bytes], success: bool, source: BlockSource) -> None:
        """A promotion's blocks are READY (came up from ``source``), or their slots free."""

    def complete_read(self, keys: Sequence[bytes]) -> None:
        """One ``pin_for_tier`` pin of each key ends."""

    def quarantine_slots(self, keys: Sequence[bytes]) -> list[int]:
        """Hold the reserved slots of ``keys`` out of use (a read into them may still land);
        returns the slots held out."""

    def release_quarantine(self, slot_ids: Collection[int]) -> int:
        """The reads into ``slot_ids`` provably ended: they return to use."""

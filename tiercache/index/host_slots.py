"""``HostSlots``: what the tier chain (``tiercache.index.tiering``) may do to host memory's
index, and nothing more. ``OffloadingManager`` implements it; the chain holds it, not the
manager, so the chain cannot reach an engine's verbs (``prepare_store``, ``lease``, ...).

Locking: ``lock`` is the index's own. ``reserve_promotion`` and ``pin_for_tier`` are
called with it held (the chain calls them from a lookup's miss or its own refill, both
already under it, so a promotion's reservation is atomic with the lookup that asked);
``complete_write``, ``complete_read``, ``quarantine_slots`` and ``release_quarantine``
take it themselves and are called without it (from the chain's thread, booking a tier's
results). Every verb acts as ``TIER_OWNER``: no session, no cap.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from typing import Protocol

from tiercache.results import BlockSource, PrepareStoreOutput
from tiercache.specs import CPULoadStoreSpec


class HostSlots(Protocol):
    @property
    def lock(self) -> threading.Lock:
        """The index's lock: held around the two locked verbs."""

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

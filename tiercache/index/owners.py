"""The index's verbs about owners rather than blocks (mixed into ``OffloadingManager``,
whose lock, table and counters they use): what an owner holds goes back when it ends
(``end_session``) or never completes a reservation (``expire_reservations``); a write that
may still land is held out (``quarantine``) until it provably ended (``release_quarantine``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Sequence

from tiercache.index.caps import SessionCaps
from tiercache.results import SessionRelease
from tiercache.index.slots import check_keys, check_owner
from tiercache.index.table import SlotTable
from tiercache.index.tiering import TIER_OWNER


class OwnerVerbs:
    _lock: threading.Lock
    _table: SlotTable
    _caps: SessionCaps
    _counters: dict[str, int]

    def quarantine(self, keys: Sequence[bytes], *, owner: int = TIER_OWNER) -> int:
        """``quarantine_slots``, counted: how many slots this call held out."""
        return len(self.quarantine_slots(keys, owner=owner))

    def quarantine_slots(self, keys: Sequence[bytes], *, owner: int = TIER_OWNER
                         ) -> list[int]:
        """A write that failed but may still land (a lower tier's read that gave up while its
        transfer may still run): forget the keys that ``owner`` reserved and that are still
        WRITING (lookups miss them at once) and hold their slots out of use, ``reset``
        included, until ``release_quarantine`` (the read provably ended) or a new index (a
        coordinator restart: the process whose transfer it was is gone). Returns the slots
        this call held out."""
        check_owner(owner)
        check_keys(keys, "quarantine")
        table = self._table
        with self._lock:
            holdings = table.holdings.get(owner)
            if holdings is None:
                return []
            mine = holdings.take_writing(keys)
            held = table.free_writing(mine, hold_out=True)
            self._counters["failed_store_blocks"] += len(mine)
            table.tidy(owner, holdings)
            return held

    def release_quarantine(self, slot_ids: Collection[int]) -> int:
        """Slots held out whose transfers provably ended go back to the free list; returns
        how many did (slots not held out are ignored)."""
        table = self._table
        with self._lock:
            back = [s for s in dict.fromkeys(slot_ids) if s in table.quarantined]
            table.quarantined.difference_update(back)
            table.free.extend(back)
            return len(back)

    def end_session(self, owner: int) -> SessionRelease:
        """``owner`` is gone: free every slot it was writing and drop every pin it holds."""
        check_owner(owner)
        table = self._table
        with self._lock:
            holdings = table.holdings.pop(owner, None)
            freed = dropped = 0
            if holdings is not None:
                freed = len(holdings.writing)
                table.free_writing(list(holdings.writing))
                keys = list(holdings.pinned)
                pinned = table.slots(keys)
                dropped = table.unpin(pinned, keys, owner, None, None)
                table.mirror_pins(pinned)
            self._caps.forget(owner)
            counters = self._counters
            counters["sessions_ended"] += 1
            counters["released_writing_blocks"] += freed
            counters["released_pins"] += dropped
            return SessionRelease(freed, dropped)

    def expire_reservations(self, max_age_s: float, now: float | None = None) -> int:
        """Free every reservation older than ``max_age_s`` (its writer never completed it:
        its ``complete_store`` is then ignored); returns how many. The tier chain's are
        quarantined instead of freed: its read may still land (they come back when its job
        settles)."""
        now = time.monotonic() if now is None else now
        table = self._table
        with self._lock:
            expired = held_out = 0
            for owner, holdings in list(table.holdings.items()):
                old = holdings.take_writing([k for k, since in holdings.writing.items()
                                             if now - since > max_age_s])
                if not old:
                    continue
                tier_read = owner == TIER_OWNER  # a tier's read still under way may land
                table.free_writing(old, hold_out=tier_read)
                if tier_read:
                    held_out += len(old)
                else:
                    expired += len(old)
                table.tidy(owner, holdings)
            self._counters["expired_reservations"] += expired
            self._counters["failed_store_blocks"] += held_out
            return expired + held_out

    def set_owner_process(self, owner: int, pid: int) -> None:
        """``owner`` (a session) serves process ``pid``: sessions of one process (an
        engine's scheduler and flusher) do not contend with each other for the cache."""
        with self._lock:
            self._caps.set_process(owner, pid)

    def holds(self, owner: int) -> bool:
        """Whether ``owner`` holds any reservation or pin."""
        with self._lock:
            return owner in self._table.holdings

    def owners(self) -> set[int]:
        """The owners that hold something now."""
        with self._lock:
            return set(self._table.holdings)

"""``SessionCaps``: how much of the cache one session may hold at once, and when.

``max_session_blocks`` (from ``index.max_session_share``) caps the keys one owner holds at
once (reservations plus pinned keys) **under contention only**: while another session
holds something, or was refused room within ``CONTENTION_S``. One engine alone on the node
is never capped (a long prompt may fill the whole cache); once another engine wants room,
neither may hold more than its share, so one cannot crowd out the others. The tier chain
(``TIER_OWNER``) is never capped. Called under the manager's lock.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from tiercache.errors import SessionLimitError, StateError
from tiercache.index.slots import Holdings
from tiercache.index.table import SlotTable

CONTENTION_S = 10.0  # a session refused room makes every other session's cap bite this long
MAX_REFUSALS_KEPT = 4096  # refusals remembered (the oldest forgotten first)


class SessionCaps:
    def __init__(self, table: SlotTable, max_session_blocks: int | None, tier_owner: int):
        self._table = table
        self.max_session_blocks = max_session_blocks
        self._tier_owner = tier_owner
        self._refused_at: dict[int, float] = {}  # owner -> when it was last refused room

    def cap(self, owner: int) -> int | None:
        """``owner``'s cap now, or None (no cap: the tier chain, an unbounded index, or no
        other session contending)."""
        cap = self.max_session_blocks
        if cap is None or owner == self._tier_owner:
            return None
        now = time.monotonic()
        tier = self._tier_owner
        others = any(o != owner and o != tier for o in self._table.holdings) or any(
            o != owner and now - at < CONTENTION_S for o, at in self._refused_at.items())
        return cap if others else None

    def refused(self, owner: int) -> None:
        """``owner`` was refused room: the others contend with it for ``CONTENTION_S``."""
        if owner == self._tier_owner:
            return
        self._refused_at[owner] = time.monotonic()
        if len(self._refused_at) > MAX_REFUSALS_KEPT:
            del self._refused_at[min(self._refused_at, key=self._refused_at.__getitem__)]

    def forget(self, owner: int) -> None:
        self._refused_at.pop(owner, None)

    def pinnable_run(self, keys: Sequence[bytes], owner: int, holdings: Holdings) -> int:
        """How many of ``keys`` (all readable) ``owner`` may pin, in order: the run stops
        at the session cap or at a slot already pinned by ``PIN_OWNERS`` other owners."""
        cap = self.cap(owner)
        room = None if cap is None else cap - holdings.num_blocks
        for i, key in enumerate(keys):
            if key in holdings.pinned:
                continue
            if not self._table.can_pin(self._table.slots[key], owner):
                return i
            if room is not None:
                if room <= 0:
                    return i
                room -= 1
        return len(keys)

    def check_can_load(self, keys: Sequence[bytes], owner: int, holdings: Holdings,
                       verb: str) -> None:
        """Raise unless ``owner`` may pin every one of ``keys`` (readable) now:
        ``StateError`` at a slot pinned by as many owners as the ledger records,
        ``SessionLimitError`` past the cap (counted by the caller)."""
        new = {key for key in keys if key not in holdings.pinned}
        table = self._table
        for key in new:
            if not table.can_pin(table.slots[key], owner):
                table.tidy(owner, holdings)
                raise StateError(f"{verb}: key {key!r} is pinned by {table.max_pin_owners} "
                                 "other sessions, the most the index ledger records per block")
        cap = self.cap(owner)
        if cap is not None and holdings.num_blocks + len(new) > cap:
            self.refused(owner)
            table.tidy(owner, holdings)
            raise SessionLimitError(
                f"{verb}: {len(new)} more block(s) would make this session hold "
                f"{holdings.num_blocks + len(new)}; while other sessions use the cache a "
                f"session holds at most {cap} (index.max_session_share)")

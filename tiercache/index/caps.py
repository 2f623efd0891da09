"""``SessionCaps``: how much of the cache one session may hold at once, and when.

``max_session_blocks`` (``index.max_session_share``) caps what one owner holds at once
(reservations plus pinned keys) **under contention only**: while a session of another
process holds something or was refused room within ``CONTENTION_S``. An engine alone on the
node, whatever sessions its process opens, may fill the cache; beside another, neither holds
more than its share. The tier chain is never capped; an owner of unknown process counts as
a process of its own. Called under the manager's lock.
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
        self._process: dict[int, int] = {}  # owner -> the pid of the process it serves

    def cap(self, owner: int) -> int | None:
        """``owner``'s cap now, or None (no cap: the tier chain, an unbounded index, or no
        other session contending)."""
        cap = self.max_session_blocks
        if cap is None or owner == self._tier_owner:
            return None
        now = time.monotonic()
        tier, mine, process = self._tier_owner, self._process.get(owner), self._process.get

        def another(o: int) -> bool:  # an owner of another process (not the chain)
            return o != owner and o != tier and (mine is None or process(o) != mine)

        others = any(another(o) for o in self._table.holdings) or any(
            another(o) and now - at < CONTENTION_S for o, at in self._refused_at.items())
        return cap if others else None

    def set_process(self, owner: int, pid: int) -> None:
        """``owner`` serves process ``pid`` (0: unknown)."""
        if pid:
            self._process[owner] = pid
        else:
            self._process.pop(owner, None)

    def refused(self, owner: int) -> None:
        """``owner`` was refused room: the others contend with it for ``CONTENTION_S``."""
        if owner == self._tier_owner:
            return
        self._refused_at[owner] = time.monotonic()
        if len(self._refused_at) > MAX_REFUSALS_KEPT:
            del self._refused_at[min(self._refused_at, key=self._refused_at.__getitem__)]

    def forget(self, owner: int) -> None:
        self._refused_at.pop(owner, None)
        self._process.pop(owner, None)

    def pinnable_run(self, keys: Sequence[bytes], slots: Sequence[int], owner: int,
                     holdings: Holdings) -> int:
        """How many of ``slots`` (readable, holding the first ``keys``) ``owner`` may pin, in
        order (see ``cap``)."""
        cap = self.cap(owner)
        room = None if cap is None else cap - holdings.num_blocks
        can_pin, pinned = self._table.can_pin, holdings.pinned
        for i, (key, slot) in enumerate(zip(keys, slots)):
            if key in pinned:
                continue
            if not can_pin(slot, owner):
                return i
            if room is not None:
                if room <= 0:
                    return i
                room -= 1
        return len(slots)

    def check_can_load(self, keys: Sequence[bytes], slots: Sequence[int], owner: int,
                       holdings: Holdings, verb: str) -> None:
        """``StateError`` at a slot pinned by as many owners as the ledger records,
        ``SessionLimitError`` past the cap (counted by the caller); else nothing."""
        new = {key: slot for key, slot in zip(keys, slots) if key not in holdings.pinned}
        table = self._table
        for key, slot in new.items():
            if not table.can_pin(slot, owner):
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

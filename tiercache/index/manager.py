"""The cache index: which key lives in which slot of the region, in what state, held by
whom. Python over a dict and per-slot arrays (``tiercache.index.table``)::

    FREE ──prepare_store──► WRITING ──complete_store(ok)──► READY ◄──► LOADING (pinned)
      ▲                        │                              │
      └─complete_store(fail)───┤                              └──evicted (policy)──► FREE
        or end_session(writer) ┘

The state is a ``SlotTable`` (``tiercache.index.table``); this module is the verbs over
it, under one lock (the control server, the tier chain and the exporter call from their
threads).

**Owners.** Every reservation (WRITING) and pin belongs to an *owner*: a client session
(the control server numbers them), ``LOCAL_OWNER`` in-process, or the tier chain
(``TIER_OWNER``). A pin comes from ``prepare_load`` (one per key, until
``complete_load``) or ``lease`` (one per hit: the lease answers the run's fenced slots,
so its holder loads under it with no ``prepare_load``), one per-owner counter on the
slot; ``release`` drops an owner's pins on some keys, ``end_session`` everything it holds,
``expire_reservations`` the reservations whose writer never completed them. An underflow
raises; nothing is ever repaired. The tier chain sees the index only as ``HostSlots``
(``tiercache.index.host_slots``), which this class implements: ``reserve_promotion``/
``complete_write`` (a promotion writes reserved slots), ``pin_for_tier``/``complete_read``
(a demotion or a publish reads pinned slots), ``quarantine_slots``/``release_quarantine``
(a write that may still land is held out until it provably ended), and the few reads of
the table the chain decides by (``state_of``, ``num_free``, ``peek_evictions``, ...).

Only READY blocks outside the calling ``prepare_store`` are evicted. Every method is
atomic (the whole batch validated first) and raises ``ManagerError`` subclasses on misuse.
With a ``ledger`` (``tiercache.region.ledger``) every slot's key, state, generation,
writer and pins are in the region before a call returns, and a new manager over it starts
from them (``tiercache.index.recovery``). Every spec carries ``region_id`` and each slot's
generation (``tiercache.transfer.fence``). ``max_session_blocks`` caps what one owner
holds at once, under contention only (``tiercache.index.caps``).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from itertools import islice

from tiercache.errors import (
    ConfigError, InvalidKeyError, ManagerError, SessionLimitError, StateError,
)
from tiercache.index.caps import SessionCaps
from tiercache.index.events import EventLog, NodeEvents
from tiercache.tiers.base import LowerTier
from tiercache.eviction import EvictionPolicy, make_policy
from tiercache.index.heap import give_back_freed_heap, map_large_blocks
from tiercache.index.recovery import restore
from tiercache.results import (
    BlockSource, LeaseResult, ManagerStats, OffloadingEvent, PrepareStoreOutput, SessionRelease,
    TierStats,
)
from tiercache.index.slots import (
    KeyListener, Ledger, SlotFlag, SlotState, check_keys, check_owner, require_unique,
)
from tiercache.index.table import SlotTable
from tiercache.index.tiering import TIER_OWNER, TierChain
from tiercache.specs import CPULoadStoreSpec

__all__ = ["LOCAL_OWNER", "TIER_OWNER", "LeaseResult", "ManagerStats", "OffloadingEvent",
           "OffloadingManager", "PrepareStoreOutput", "SessionRelease", "SlotState",
           "check_keys"]

LOCAL_OWNER = 0  # the owner of in-process calls; the control server numbers sessions from 1
LISTENER_BATCH = 1 << 16  # keys a key listener is first told at once

_COUNTERS = ("lookups", "hit_blocks", "miss_blocks", "stored_blocks", "loaded_blocks",
             "store_rejections", "evicted_blocks", "failed_store_blocks", "leased_blocks",
             "recovered_blocks", "sessions_ended", "released_writing_blocks", "released_pins",
             "recovered_pins", "recovered_writing_blocks", "damaged_records",
             "expired_reservations", "session_limit_rejections")


class OffloadingManager:
    """Index over ``num_blocks`` slots of the region, of which the first
    ``usable_blocks`` (all by default) may be handed out now; see the module docstring."""

    def __init__(self, num_blocks: int, policy: str = "lru", enable_events: bool = False,
                 *, ledger: Ledger | None = None, region_id: int = 0,
                 surviving_owners: Collection[int] = (),
                 max_session_blocks: int | None = None, usable_blocks: int | None = None):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(f"num_blocks = {num_blocks!r}: must be an integer >= 1")
        if ledger is not None and ledger.num_records != num_blocks:
            raise ConfigError(f"the index ledger has {ledger.num_records} records; "
                              f"num_blocks = {num_blocks}")
        if max_session_blocks is not None and not 1 <= max_session_blocks:
            raise ConfigError(f"max_session_blocks = {max_session_blocks!r}: must be >= 1 "
                              "(or None: no cap)")
        map_large_blocks()  # the tables it frees go back (tiercache.index.heap)
        self._policy: EvictionPolicy = make_policy(policy, num_blocks)
        self._events_enabled = enable_events
        self._events = EventLog()
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._table = SlotTable(num_blocks, self._policy, ledger, region_id)
        self._table.on_readable.append(self._emit)
        self._caps = SessionCaps(self._table, max_session_blocks, TIER_OWNER)
        self._table.usable = num_blocks if usable_blocks is None else usable_blocks
        if ledger is not None:
            restore(self._table, ledger.recover(), set(surviving_owners), self._counters)
            give_back_freed_heap()  # the recovery is gone: what it freed goes back
        if not self._table.next_fresh <= self._table.usable <= num_blocks:
            raise StateError(f"the index ledger names slot {self._table.next_fresh - 1}; only "
                             f"slots below {self._table.usable} are reserved (usable_blocks)")
        self._chain = TierChain(self)
        self._table.on_readable.append(self._chain.host_changed)

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    @property
    def chain(self) -> TierChain:
        """The tiers below host memory and what moves blocks between them and the index."""
        return self._chain

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    @property
    def num_blocks(self) -> int:
        return self._table.capacity

    def set_usable_blocks(self, usable: int) -> None:
        """Slots below ``usable`` may be handed out (their memory is reserved: the
        region's reservation, ``tiercache.region.reservation``, calls this as it goes);
        it only grows. ``stats().capacity_blocks`` counts these."""
        with self._lock:
            self._table.set_usable(usable)

    def set_key_listener(self, listener: KeyListener | None) -> None:
        """Call ``listener(keys, removed)`` (under the index's lock: it must be quick) when
        keys enter the index (``removed=False``: a reservation, which a lookup answers
        pending and then READY) or leave it (evicted, a failed or abandoned store, reset); it
        is first called with every key held now, ``LISTENER_BATCH`` at a time (not one list
        of millions). The coordinator's key presence map (``tiercache.region.presence``)
        counts them."""
        with self._lock:
            self._table.on_keys = listener
            held = iter(self._table.slot_of)
            while listener is not None and (batch := list(islice(held, LISTENER_BATCH))):
                listener(batch, False)

    def set_node_events(self, sink: NodeEvents | None) -> None:
        """Tell ``sink`` every change to what the node holds (host memory and the tiers'
        own holdings; ``tiercache.index.events``), first everything held now."""
        self._chain.set_node_events(sink)

    def set_lower_tiers(self, tiers: Sequence[LowerTier]) -> None:
        """The tiers below host memory, fastest first (see ``TierChain``)."""
        self._chain.set_tiers(tiers)

    def tier_stats(self) -> dict[str, TierStats]:
        """Each lower tier's figures by its name (empty without one)."""
        return self._chain.stats()

    # ------------------------------------------------------------------ HostSlots' reads
    # What the tier chain reads of the table (``HostSlots``), the lock held.
    def state_of(self, key: bytes) -> SlotState | None:
        return self._table.state_of(key)

    def readable_keys(self) -> list[bytes]:
        return self._table.readable_keys()

    def promotion_since(self, key: bytes) -> float | None:
        return self._table.writing_since(TIER_OWNER, key)

    def keys_fit(self, keys: Sequence[bytes]) -> bool:
        try:
            self._table.check_key_bytes(keys)
        except InvalidKeyError:
            return False
        return True

    def num_free(self) -> int:
        return self._table.num_free()

    def num_held_out(self) -> int:
        return len(self._table.quarantined)

    def held_out(self, slot_ids: Iterable[int]) -> list[int]:
        quarantined = self._table.quarantined
        return [s for s in slot_ids if s in quarantined]

    def pinnable(self, keys: Sequence[bytes]) -> list[bytes]:
        table = self._table  # evicted since, or pinned by as many owners as a slot records
        return [k for k in keys
                if table.is_readable(k) and table.can_pin(table.held(k, "refill"), TIER_OWNER)]

    def peek_evictions(self, count: int, admissible: Callable[[bytes], bool]
                       ) -> list[tuple[bytes, bool]]:
        table = self._table
        state, key_of, ready = table.state, table.key_of, SlotState.READY

        def can_go(slot: int) -> bool:
            key = key_of[slot]
            return key is not None and state[slot] == ready and admissible(key)

        slots = self._policy.peek(count, can_go)
        flags = table.flags
        return [(key, bool(flags[slot] & SlotFlag.REUSED))
                for slot, key in zip(slots, table.keys(slots))]

    # ------------------------------------------------------------------ queries
    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the leading run of keys that are readable (READY or LOADING)."""
        with self._lock:
            hits = len(self._hit_run(keys, "lookup"))
            self._chain.after_miss(keys, hits, LOCAL_OWNER)
            return hits

    def _hit_run(self, keys: Sequence[bytes], verb: str) -> list[int]:
        """The slots of the leading run of readable keys, counted as a lookup."""
        try:
            run = self._table.readable_run(keys)
        except TypeError:  # an unhashable key
            check_keys(keys, verb)
            raise
        hits = len(run)
        if hits < len(keys):  # only bytes are ever held, so only a miss can hide a bad key
            check_keys(keys[hits:], verb)
        counters = self._counters
        counters["lookups"] += 1
        counters["hit_blocks"] += hits
        counters["miss_blocks"] += len(keys) - hits
        return run

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark readable keys as just used (``keys[0]`` most recent). Keys not held, and
        blocks still being written (they entered as most recent; for ARC the storing
        request must not count as a second access), are ignored."""
        with self._lock:
            try:
                held = self._table.readable_slots(keys)
            except TypeError:  # an unhashable key
                check_keys(keys, "touch")
                raise
            if len(held) < len(keys):
                check_keys(keys, "touch")
            if held:
                self._policy.touch(held)

    # ------------------------------------------------------------------ leases and loads
    def lease(self, keys: Sequence[bytes], *, owner: int = LOCAL_OWNER) -> LeaseResult:
        """A lookup whose hits are pinned for ``owner`` (one pin each) until released, and
        touched (a lease is the access: engines such as vLLM 0.33 never call ``touch``).

        Counted as a lookup (and the hits in ``leased_blocks``, not ``loaded_blocks``).
        ``pending``: the key after the hit run is being written, or a lower tier is
        bringing it up or finding out whether it has it (for at most ``PROMOTION_WAIT_S``
        of a promotion's read, then a miss)."""
        check_owner(owner)
        table = self._table
        with self._lock:
            run = self._hit_run(keys, "lease")
            readable = hits = len(run)
            if hits:
                holdings = table.holdings_of(owner)
                hits = self._caps.pinnable_run(keys, run, owner, holdings)
                del run[hits:]
                table.pin(run, keys[:hits], owner, holdings, reuse=True)
                table.mirror_pins(run)
                table.tidy(owner, holdings)
                if hits:  # a lease is an access (vLLM never touches)
                    self._policy.touch(run)
                self._counters["hit_blocks"] -= readable - hits  # refused: a miss
                self._counters["miss_blocks"] += readable - hits
            self._counters["leased_blocks"] += hits
            promoting = self._chain.after_miss(keys, hits, owner)
            pending = promoting or (hits < len(keys) and table.being_written(keys[hits])
                                    and not self._chain.overdue(keys[hits]))
            source = table.source
            promoted = [(i, BlockSource(source[slot])) for i, slot in enumerate(run)
                        if source[slot] != BlockSource.HOST]
            for i, _ in promoted:  # reported once: later leases read it from host memory
                source[run[i]] = BlockSource.HOST
            return LeaseResult(hits, pending, table.spec(run), tuple(i for i, _ in promoted),
                               tuple(source for _, source in promoted))

    def release(self, keys: Sequence[bytes], *, owner: int = LOCAL_OWNER) -> int:
        """Drop every pin ``owner`` holds on these keys; returns how many were dropped.
        Keys not held, or not pinned by ``owner``, are ignored."""
        check_owner(owner)
        check_keys(keys, "release")
        table = self._table
        with self._lock:
            holdings = table.holdings.get(owner)
            if holdings is None:
                return 0
            mine = list(set(keys) & holdings.pinned)
            unpinned = table.slots(mine)
            dropped = table.unpin(unpinned, mine, owner, holdings, None)
            table.mirror_pins(unpinned)
            table.tidy(owner, holdings)
            return dropped

    def prepare_load(self, keys: Sequence[bytes], *, owner: int = LOCAL_OWNER
                     ) -> CPULoadStoreSpec:
        """Slot ids co-indexed with ``keys``; each key gets one pin of ``owner`` until
        ``complete_load``. Every key must be readable, else nothing changes."""
        check_owner(owner)
        with self._lock:
            spec = self._pin(keys, owner, "prepare_load")
            self._counters["loaded_blocks"] += len(keys)
            return spec

    def pin_for_tier(self, keys: Sequence[bytes], why: str) -> CPULoadStoreSpec:
        """``HostSlots``' (the lock held): a tier's read of readable blocks (a demotion, a
        publish); not a load, no session cap."""
        return self._pin(keys, TIER_OWNER, why)

    def _pin(self, keys: Sequence[bytes], owner: int, verb: str) -> CPULoadStoreSpec:
        table = self._table
        slots = [table.readable_slot(key, verb) for key in keys]
        if slots:
            holdings = table.holdings_of(owner)
            try:
                self._caps.check_can_load(keys, slots, owner, holdings, verb)
            except SessionLimitError:
                self._counters["session_limit_rejections"] += 1
                raise
            table.pin(slots, keys, owner, holdings, reuse=owner != TIER_OWNER)
            table.mirror_pins(slots)
        return table.spec(slots)

    def complete_load(self, keys: Sequence[bytes], *, owner: int = LOCAL_OWNER) -> None:
        """End one load of each key by ``owner`` (a key given twice ends two)."""
        check_owner(owner)
        table = self._table
        with self._lock:
            slots = [table.held(key, "complete_load") for key in keys]
            for key, times in Counter(keys).items():
                pins = table.pins_of(table.held(key, "complete_load"), owner)
                if pins < times:
                    raise StateError(
                        f"complete_load: key {key!r} has {pins} load(s) in flight for this "
                        f"session (owner {owner}), asked to complete {times}; every "
                        "complete_load needs a prepare_load of the same session")
            if slots:
                holdings = table.holdings[owner]
                table.unpin(slots, keys, owner, holdings, 1)
                table.mirror_pins(slots)
                table.tidy(owner, holdings)

    def complete_read(self, keys: Sequence[bytes]) -> None:
        """``HostSlots``': a ``pin_for_tier`` read ended (the chain's ``complete_load``)."""
        self.complete_load(keys, owner=TIER_OWNER)

    # ------------------------------------------------------------------ stores
    def prepare_store(self, keys: Sequence[bytes], *, owner: int = LOCAL_OWNER,
                      max_evictions: int | None = None) -> PrepareStoreOutput | None:
        """Reserve slots (for ``owner``) for the keys not held yet, evicting READY blocks
        if needed. Returns ``None`` (and changes nothing) when not enough blocks can be
        evicted; keys of this call are never evicted to make room for each other.

        With ``max_evictions`` (an int) it reserves ahead of a store that may never happen
        (a scheduler's probe): the new keys are reserved in order from free slots, then by
        evicting at most ``max_evictions`` READY blocks (0: free slots only), while the
        session's room lasts; the rest are ``no_room_keys`` (nothing reserved for them,
        not counted as a rejection). Never ``None``."""
        check_owner(owner)
        check_keys(keys, "prepare_store")
        require_unique(keys, "prepare_store")
        self._table.check_key_bytes(keys)
        with self._lock:
            return self._reserve(keys, owner, max_evictions)

    def reserve_promotion(self, keys: Sequence[bytes]) -> PrepareStoreOutput:
        """``HostSlots``' (the lock held): host slots a promotion writes, evicting at most
        ``len(keys)`` READY blocks; what finds no room is ``no_room_keys``."""
        out = self._reserve(keys, TIER_OWNER, len(keys))
        assert out is not None, "a reservation with max_evictions is never refused"
        return out

    def _reserve(self, keys: Sequence[bytes], owner: int, max_evictions: int | None
                 ) -> PrepareStoreOutput | None:
        """``prepare_store`` with the lock held."""
        table = self._table
        new_keys = [k for k in keys if k not in table.slot_of]
        cap = self._caps.cap(owner)
        held = table.holdings.get(owner)
        owned = held.num_blocks if held else 0
        no_room: list[bytes] = []
        if max_evictions is not None:
            room = table.num_free() + min(max_evictions, table.num_evictable(keys))
            if cap is not None:
                room = min(room, max(0, cap - owned))
            new_keys, no_room = new_keys[:room], new_keys[room:]
        elif new_keys and cap is not None and owned + len(new_keys) > cap:
            self._counters["store_rejections"] += 1
            self._counters["session_limit_rejections"] += 1
            self._caps.refused(owner)
            return None
        need = max(0, len(new_keys) - table.num_free())
        victims = None
        if need <= table.num_by_state[SlotState.READY]:  # else no policy could find room
            victims = self._policy.evict(need, table.evictable_except(keys), new_keys)
        if victims is None:
            self._counters["store_rejections"] += 1
            self._caps.refused(owner)
            return None
        evicted = table.evict(victims)
        self._counters["evicted_blocks"] += len(victims)
        slots, gens = table.allocate(new_keys)
        self._policy.insert(slots, new_keys)
        table.keys_changed(new_keys, False)
        if new_keys:
            table.holdings_of(owner).writing.update(dict.fromkeys(new_keys, time.monotonic()))
        if table.ledger is not None:
            table.ledger.free(sorted(set(victims) - set(slots)))
            table.ledger.writing(slots, new_keys, owner, gens)
        return PrepareStoreOutput(tuple(new_keys), table.spec(slots), tuple(evicted),
                                  tuple(no_room))

    def complete_store(self, keys: Sequence[bytes], success: bool = True, *,
                       owner: int = LOCAL_OWNER,
                       source: BlockSource = BlockSource.HOST) -> None:
        """Publish written blocks (READY), or free their slots when the write failed.

        Acts on the keys that ``owner`` reserved and that are still WRITING; every other
        key (READY, absent, or reserved by another session) is ignored, because engines
        complete with every key of a request, sometimes twice. ``source``: the tier whose
        promotion wrote them. The tier chain hears of every block that became READY
        (to publish it to the tiers it did not come from)."""
        check_owner(owner)
        check_keys(keys, "complete_store")
        table = self._table
        with self._lock:
            holdings = table.holdings.get(owner)
            if holdings is None:
                return
            mine = holdings.take_writing(keys)
            if not mine:
                return
            slots = [table.held(k, "complete_store") for k in mine]
            if success:
                ready = table.make_ready(slots, source)
                self._chain.became_ready(ready, source)
                self._counters["stored_blocks"] += len(ready)
            else:
                table.free_writing(mine)
                self._counters["failed_store_blocks"] += len(slots)
            table.tidy(owner, holdings)

    def complete_write(self, keys: Sequence[bytes], success: bool, source: BlockSource) -> None:
        """``HostSlots``': a promotion's write ended (the chain's ``complete_store``)."""
        self.complete_store(keys, success, owner=TIER_OWNER, source=source)

    # ------------------------------------------------------------------ the rest
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

    def take_events(self, max_keys: int | None = None) -> list[OffloadingEvent]:
        """Events since the last call, oldest first; with ``max_keys``, at most that many
        keys in all (a larger event is split), the rest stay for the next call."""
        if not self._events_enabled:
            raise StateError(
                "take_events: events are off; build the manager with enable_events=True")
        if max_keys is not None and max_keys < 1:
            raise ManagerError(f"take_events: max_keys = {max_keys}; must be >= 1 or None")
        with self._lock:
            return self._events.take(max_keys)

    def reset(self) -> None:
        """Forget every block (a removed event for the readable ones), every reservation
        and every pin of every owner; counters are kept.

        A slot that a copy still touches (a reservation being written, a pin being read,
        by an engine or a lower tier) is not handed out again until that copy's owner
        completes or releases it (``tiercache.index.table``). It empties host memory only:
        blocks a lower tier holds stay there and are promoted again when looked up."""
        with self._lock:
            self._emit(self._table.reset(), True)
            self._chain.host_cleared()

    def stats(self) -> ManagerStats:
        table = self._table
        with self._lock:
            by_state = table.num_by_state
            return ManagerStats(
                **self._counters,
                capacity_blocks=table.usable,  # reserved: all, once the region is
                free_blocks=table.num_free(),
                writing_blocks=by_state[SlotState.WRITING],
                ready_blocks=by_state[SlotState.READY],
                loading_blocks=by_state[SlotState.LOADING],
                quarantined_blocks=len(table.quarantined),
            )

    def _emit(self, keys: Sequence[bytes], removed: bool) -> None:
        if self._events_enabled:
            self._events.emit(keys, removed)


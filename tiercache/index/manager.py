"""The cache index: which block hash lives in which slot of the region, in what state, and
which client session holds it.

Pure Python (numpy for the spec only; never torch or mmap). One ``Slot`` record per
held key is the single owner of that block's state, its writer and its pins::

    FREE ──prepare_store──► WRITING ──complete_store(ok)──► READY ◄──► LOADING (pinned)
      ▲                        │                              │
      └─complete_store(fail)───┤                              └──evicted (policy)──► FREE
        or end_session(writer) ┘

**Owners.** Every reservation (WRITING) and every pin belongs to an *owner*, an int the
caller names (the control server gives each client session its own; in-process users
get ``LOCAL_OWNER``). A pin comes from ``prepare_load`` (one per key, dropped by
``complete_load``) or from ``lease`` (one per hit, for a scheduler that must find its
HIT still there when it loads: the lease answers the run's slots, so its holder loads
under the lease's pin, with no ``prepare_load``); both count in the slot's one per-owner
pin counter.
``release`` drops every pin an owner holds on some keys; ``end_session`` frees every
reservation and drops every pin of an owner (its client is gone). An underflow raises;
nothing is ever repaired.

Only READY blocks that are not part of the calling ``prepare_store`` are evicted;
WRITING and pinned blocks never are. Every method is atomic: it validates the whole
batch before changing anything, and raises ``ManagerError`` subclasses
(``UnknownKeyError``, ``StateError``, ``InvalidKeyError``) on misuse. One lock guards
the index, so the control server and the exporter may call it from different threads.

**Durability.** With a ``ledger`` (``tiercache.region.ledger.IndexLedger`` over the
region), every slot's key, state, generation, writer and pins are mirrored into the region
before the call returns, and a new manager over the same ledger starts with the READY
blocks it holds, plus the reservations and pins of the owners named ``surviving_owners``
(sessions a restarted coordinator found alive); those of other owners are given back
(their WRITING slots are reused last: a copy of that time may still be landing). A
coordinator restarted after SIGKILL keeps its cache, and a load or store in flight keeps
its slot. Without a ledger the index lives in memory only.

**Fencing.** Every spec handed out carries ``region_id`` (the region the index belongs to)
and each slot's generation, new each time the slot is given to a key, so a worker can
refuse a copy for another region or into a slot given away since
(``tiercache.transfer.fence``).

**Bounds.** ``max_session_blocks`` caps the keys one owner may hold at once (reservations
plus pinned keys): a lease stops short of it, a ``prepare_store`` past it is refused like a
full cache, a ``prepare_load`` past it raises ``SessionLimitError``. With a ledger, one
slot can be pinned by at most ``PIN_OWNERS`` owners at once (a lease stops short of a
slot pinned by that many others). ``expire_reservations`` frees reservations older than a
deadline (a writer that never completes).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Collection, Sequence
from itertools import takewhile
from typing import Protocol

from tiercache.errors import (
    ConfigError, InvalidKeyError, ManagerError, SessionLimitError, StateError, UnknownKeyError,
)
from tiercache.index.events import EventLog
from tiercache.index.policies import EvictionPolicy, make_policy
from tiercache.index.results import (
    BlockSource, LeaseResult, ManagerStats, OffloadingEvent, PrepareStoreOutput, SessionRelease,
    TierStats,
)
from tiercache.index.slots import (
    Holdings, Ledger, Slot, SlotState, check_keys, check_owner, require_unique,
)
from tiercache.specs import CPULoadStoreSpec

__all__ = ["LOCAL_OWNER", "LeaseResult", "ManagerStats", "OffloadingEvent", "OffloadingManager",
           "PrepareStoreOutput", "SessionRelease", "SlotState", "check_keys"]

LOCAL_OWNER = 0  # the owner of in-process calls; the control server numbers sessions from 1
TIER_OWNER = 0xFFFF  # the coordinator's own tiers (promotions, demotions): no session, no cap
PROMOTION_WAIT_S = 1.0  # a lower tier's promotion pending longer: lookups miss it (_overdue)


class LowerTier(Protocol):
    """A tier below host memory, as the index asks it. ``holds``, ``promote`` and ``stored``
    are called under the index's lock: they must be quick (no I/O: queue the work) and must
    not call back into the index.

    * ``holds(key, owner)``: whether the tier may have ``key`` (True starts its promotion;
      the lookup answers "not yet"). ``owner``: who asks (a tier may answer each asker
      differently while it finds out, see ``tiercache.tiers.cluster``).
    * ``promote(run, mine, owner)``: promote ``mine``, the keys of ``run`` this tier was
      chosen for; the rest of ``run`` is in host memory already (a promotion's reservation
      of the whole run protects them from its own evictions).
    * ``stored(keys)``: these keys just became READY in host memory, stored by an engine
      or promoted from another tier (never from this one: a tier is not told of its own
      promotions).
    """

    name: str
    source: BlockSource

    def holds(self, key: bytes, owner: int) -> bool: ...

    def promote(self, run: Sequence[bytes], mine: Collection[bytes], owner: int) -> None: ...

    def stored(self, keys: Sequence[bytes]) -> None: ...

    def snapshot(self) -> TierStats: ...


_COUNTERS = ("lookups", "hit_blocks", "miss_blocks", "stored_blocks", "loaded_blocks",
             "store_rejections", "evicted_blocks", "failed_store_blocks", "leased_blocks",
             "recovered_blocks", "sessions_ended", "released_writing_blocks", "released_pins",
             "recovered_pins", "recovered_writing_blocks", "damaged_records",
             "expired_reservations", "session_limit_rejections")


class OffloadingManager:
    """Index over ``num_blocks`` slots of the region; see the module docstring."""

    def __init__(self, num_blocks: int, policy: str = "lru", enable_events: bool = False,
                 *, ledger: Ledger | None = None, region_id: int = 0,
                 surviving_owners: Collection[int] = (),
                 max_session_blocks: int | None = None):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(f"num_blocks = {num_blocks!r}: must be an integer >= 1")
        if ledger is not None and ledger.num_records != num_blocks:
            raise ConfigError(f"the index ledger has {ledger.num_records} records; "
                              f"num_blocks = {num_blocks}")
        if max_session_blocks is not None and not 1 <= max_session_blocks:
            raise ConfigError(f"max_session_blocks = {max_session_blocks!r}: must be >= 1 "
                              "(or None: no cap)")
        self._capacity = num_blocks
        self._region_id = region_id
        self._max_session_blocks = max_session_blocks
        self._max_pin_owners = ledger.max_pin_owners if ledger is not None else None
        self._tiers: tuple[LowerTier, ...] = ()  # below host memory, fastest first
        self._key_listener = None  # (keys, removed): keys enter and leave the index
        self._next_gen = 1
        self._policy: EvictionPolicy = make_policy(policy, num_blocks)
        self._events_enabled = enable_events
        self._ledger = ledger
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._quarantined: set[int] = set()  # slots held out of use (see quarantine)
        self._clear_index()
        self._events = EventLog()
        if ledger is not None:
            self._restore(ledger.recover(), set(surviving_owners))

    def _clear_index(self) -> None:
        self._slots: dict[bytes, Slot] = {}
        # Keys whose state is READY or LOADING: lets lookup and touch run at C speed.
        self._readable_keys: set[bytes] = set()
        self._next_fresh = 0  # slots >= this were never handed out
        self._free: list[int] = []  # freed slots, reused last-in first-out
        self._num_by_state = dict.fromkeys(SlotState, 0)
        self._holdings: dict[int, Holdings] = {}

    def _restore(self, recovery, surviving: set[int]) -> None:
        """Start from a ledger's READY blocks (oldest first; their store order is the
        policy's recency), with the reservations and pins of ``surviving`` owners. Other
        owners' pins are dropped; their reservations' slots go to the bottom of the free
        stack with the abandoned ones: a copy of that time may still be landing in them."""
        by_slot: dict[int, bytes] = {}
        for key, slot_id, gen in recovery.ready:
            self._check_slot_id(slot_id)
            self._slots[key] = Slot(slot_id, SlotState.READY, gen)
            by_slot[slot_id] = key
        self._readable_keys = set(self._slots)
        self._num_by_state[SlotState.READY] = len(self._slots)
        self._policy.admit([key for key, _, _ in reversed(recovery.ready)], 0, lambda key: False)
        repinned = []
        for slot_id, holders in recovery.pins.items():
            key = by_slot[slot_id]
            slot = self._slots[key]
            for owner, count in holders.items():
                if owner in surviving:
                    if not slot.pins:
                        self._move(slot, SlotState.LOADING)
                    slot.pins[owner] = count
                    self._holdings_of(owner).pinned.add(key)
                    self._counters["recovered_pins"] += count
            if len(slot.pins) != len(holders):
                repinned.append(slot)
        abandoned = set(recovery.abandoned)
        now = time.monotonic()
        for key, slot_id, writer, gen in recovery.writing:
            self._check_slot_id(slot_id)
            if writer in surviving and key not in self._slots:
                self._slots[key] = Slot(slot_id, SlotState.WRITING, gen)
                self._num_by_state[SlotState.WRITING] += 1
                self._holdings_of(writer).writing[key] = now
                self._policy.admit([key], 0, lambda key: False)
                self._counters["recovered_writing_blocks"] += 1
            else:
                abandoned.add(slot_id)
        used = {slot.slot_id for slot in self._slots.values()}
        abandoned -= used
        rest = [s for s in range(self._capacity - 1, -1, -1) if s not in used and s not in abandoned]
        self._free = sorted(abandoned, reverse=True) + rest
        self._next_fresh = self._capacity
        self._next_gen = recovery.next_gen
        self._counters["recovered_blocks"] = len(by_slot)
        self._counters["damaged_records"] = recovery.damaged
        if self._ledger is not None:
            self._ledger.free(sorted(abandoned - set(recovery.abandoned)))
            self._ledger_pins(repinned)

    def _check_slot_id(self, slot_id: int) -> None:
        if not 0 <= slot_id < self._capacity:
            raise ConfigError(f"the index ledger names slot {slot_id}; allowed "
                              f"0..{self._capacity - 1}")

    def set_key_listener(self, listener) -> None:
        """Call ``listener(keys, removed)`` (under the index's lock: it must be quick) when
        keys enter the index (``removed=False``: a reservation, which a lookup answers
        pending and then READY) or leave it (evicted, a failed or abandoned store, reset); it
        is first called with every key held now. The coordinator's key presence map
        (``tiercache.region.presence``) counts them."""
        with self._lock:
            self._key_listener = listener
            if listener is not None and self._slots:
                listener(list(self._slots), False)

    def _keys_changed(self, keys: Sequence[bytes], removed: bool) -> None:
        if self._key_listener is not None and keys:
            self._key_listener(keys, removed)

    def set_lower_tiers(self, tiers: Sequence[LowerTier]) -> None:
        """Lookups and leases that miss host memory ask ``tiers`` in order (fastest first):
        a key one of them holds is promoted by the first that does (its lease answers
        ``pending``; ``lookup`` counts it not hit). Engine stores are told to every tier."""
        with self._lock:
            self._tiers = tuple(tiers)

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    @property
    def num_blocks(self) -> int:
        return self._capacity

    # ------------------------------------------------------------------ queries

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the leading run of keys that are readable (READY or LOADING)."""
        with self._lock:
            hits = self._count_hits(keys, "lookup")
            self._promote_after(keys, hits, LOCAL_OWNER)
            return hits

    def _count_hits(self, keys: Sequence[bytes], verb: str) -> int:
        try:
            hits = len(list(takewhile(self._readable_keys.__contains__, keys)))
        except TypeError:  # an unhashable key
            check_keys(keys, verb)
            raise
        if hits < len(keys):  # only bytes are ever held, so only a miss can hide a bad key
            check_keys(keys[hits:], verb)
        counters = self._counters
        counters["lookups"] += 1
        counters["hit_blocks"] += hits
        counters["miss_blocks"] += len(keys) - hits
        return hits

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark readable keys as just used (``keys[0]`` most recent).

        Engines touch a whole request's keys, so keys not held are ignored, and so are
        blocks still being written: they entered as most recent, and for ARC the
        storing request must not count as a second access.
        """
        with self._lock:
            try:
                held = list(filter(self._readable_keys.__contains__, keys))
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

        Counted as a lookup (and the hits in ``leased_blocks``, not ``loaded_blocks``: the
        caller may load from the answer's spec or never). ``pending``: the key after the
        hit run is being written (by a lower tier's promotion: for at most
        ``PROMOTION_WAIT_S``, then a miss).
        """
        check_owner(owner)
        with self._lock:
            readable = self._count_hits(keys, "lease")
            hits = readable
            if hits:
                holdings = self._holdings_of(owner)
                hits = self._pinnable_run(keys[:hits], owner, holdings)
                for key in keys[:hits]:
                    self._pin(key, self._slots[key], owner, holdings)
                self._ledger_pins([self._slots[key] for key in keys[:hits]])
                self._tidy(owner, holdings)
                if hits and owner != TIER_OWNER:  # a lease is an access (vLLM never touches)
                    self._policy.touch(keys[:hits])
                self._counters["hit_blocks"] -= readable - hits  # refused: a miss
                self._counters["miss_blocks"] += readable - hits
            self._counters["leased_blocks"] += hits
            promoting = self._promote_after(keys, hits, owner)
            after = self._slots.get(keys[hits]) if hits < len(keys) else None
            run = [self._slots[key] for key in keys[:hits]]
            promoted = [(i, slot.source) for i, slot in enumerate(run)
                        if slot.source is not BlockSource.HOST]
            return LeaseResult(hits, promoting or (after is not None
                                                   and after.state is SlotState.WRITING
                                                   and not self._overdue(keys[hits])),
                               self._spec(run), tuple(i for i, _ in promoted),
                               tuple(source for _, source in promoted))

    def _overdue(self, key: bytes) -> bool:
        """Whether ``key`` is being promoted by a lower tier for longer than
        ``PROMOTION_WAIT_S`` (a hung disk, a frozen node whose object is being read): a
        lookup then misses it instead of waiting (pending) until the read gives up."""
        tiers = self._holdings.get(TIER_OWNER)
        since = tiers.writing.get(key) if tiers is not None else None
        return since is not None and time.monotonic() - since > PROMOTION_WAIT_S

    def _promote_after(self, keys: Sequence[bytes], hits: int, owner: int) -> bool:
        """Start promoting the run of keys after the host hits that the lower tiers hold,
        each key by the first tier that holds it; whether there was one (the key after the
        hits is then 'pending'). The run goes on through keys READY in host memory, which
        each promotion's reservation then protects from eviction (a promotion must not
        evict the rest of its own prefix)."""
        tiers = self._tiers
        if not tiers or hits >= len(keys) or keys[hits] in self._slots:
            return False
        run: list[bytes] = []
        chosen: dict[bytes, LowerTier] = {}
        for key in keys[hits:]:
            slot = self._slots.get(key)
            if slot is None:
                tier = next((t for t in tiers if t.holds(key, owner)), None)
                if tier is None:
                    break
                chosen[key] = tier
            elif slot.state is SlotState.WRITING:
                break
            run.append(key)
        for tier in tiers:
            mine = {key for key, t in chosen.items() if t is tier}
            if mine:
                tier.promote([key for key in run if key in mine or key not in chosen], mine,
                             owner)
        return bool(run)

    def tier_stats(self) -> dict[str, TierStats]:
        """Each lower tier's figures by its name (empty without one)."""
        return {tier.name: tier.snapshot() for tier in self._tiers}

    def demotion_candidates(self, num_keys: int, skip) -> list[tuple[bytes, bool]]:
        """Up to ``num_keys`` READY, unpinned keys the policy would evict next, less those
        ``skip(key)`` is true for (on the lower tier already), each with whether it was
        reused (pinned by a lease or load since it was stored)."""
        with self._lock:
            slots = self._slots
            ready = SlotState.READY
            keys = self._policy.peek(num_keys, lambda key: slots[key].state is ready
                                     and not skip(key))
            return [(key, slots[key].hits > 0) for key in keys]

    def _pinnable_run(self, keys: Sequence[bytes], owner: int, holdings: Holdings) -> int:
        """How many of ``keys`` (all readable) ``owner`` may pin, in order: the run stops
        at the session cap or at a slot already pinned by ``PIN_OWNERS`` other owners."""
        room = (None if self._max_session_blocks is None or owner == TIER_OWNER
                else self._max_session_blocks - holdings.num_blocks)
        for i, key in enumerate(keys):
            if key in holdings.pinned:
                continue
            if not self._can_pin(self._slots[key], owner):
                return i
            if room is not None:
                if room <= 0:
                    return i
                room -= 1
        return len(keys)

    def _can_pin(self, slot: Slot, owner: int) -> bool:
        limit = self._max_pin_owners
        return limit is None or owner in slot.pins or len(slot.pins) < limit

    def release(self, keys: Sequence[bytes], *, owner: int = LOCAL_OWNER) -> int:
        """Drop every pin ``owner`` holds on these keys; returns how many were dropped.
        Keys not held, or not pinned by ``owner``, are ignored."""
        check_owner(owner)
        check_keys(keys, "release")
        with self._lock:
            holdings = self._holdings.get(owner)
            if holdings is None:
                return 0
            dropped = 0
            unpinned = set(keys) & holdings.pinned
            for key in unpinned:
                dropped += self._unpin(key, self._slots[key], owner, holdings, None)
            self._ledger_pins([self._slots[key] for key in unpinned])
            self._tidy(owner, holdings)
            return dropped

    def prepare_load(self, keys: Sequence[bytes], *, owner: int = LOCAL_OWNER
                     ) -> CPULoadStoreSpec:
        """Slot ids co-indexed with ``keys``; each key gets one pin of ``owner`` until
        ``complete_load``. Every key must be readable, else nothing changes."""
        check_owner(owner)
        with self._lock:
            slots = [self._readable_slot(key, "prepare_load") for key in keys]
            if slots:
                holdings = self._holdings_of(owner)
                self._check_can_load(keys, slots, owner, holdings)
                for key, slot in zip(keys, slots):
                    self._pin(key, slot, owner, holdings)
                self._ledger_pins(slots)
            if owner != TIER_OWNER:  # the tiers' own reads are not loads
                self._counters["loaded_blocks"] += len(slots)
            return self._spec(slots)

    def _check_can_load(self, keys: Sequence[bytes], slots: Sequence[Slot], owner: int,
                        holdings: Holdings) -> None:
        new = {key for key in keys if key not in holdings.pinned}
        for key in new:
            if not self._can_pin(self._slots[key], owner):
                self._tidy(owner, holdings)
                raise StateError(f"prepare_load: key {key!r} is pinned by {self._max_pin_owners} "
                                 "other sessions, the most the index ledger records per block")
        cap = self._max_session_blocks
        if cap is not None and owner != TIER_OWNER and holdings.num_blocks + len(new) > cap:
            self._counters["session_limit_rejections"] += 1
            self._tidy(owner, holdings)
            raise SessionLimitError(
                f"prepare_load: {len(new)} more block(s) would make this session hold "
                f"{holdings.num_blocks + len(new)}; a session holds at most {cap} "
                "(index.max_session_blocks)")

    def _spec(self, slots: Sequence[Slot]) -> CPULoadStoreSpec:
        return CPULoadStoreSpec([s.slot_id for s in slots], [s.gen for s in slots],
                                self._region_id)

    def complete_load(self, keys: Sequence[bytes], *, owner: int = LOCAL_OWNER) -> None:
        """End one load of each key by ``owner`` (a key given twice ends two)."""
        check_owner(owner)
        with self._lock:
            slots = [self._held(key, "complete_load") for key in keys]
            for key, times in Counter(keys).items():
                pins = self._slots[key].pins.get(owner, 0)
                if pins < times:
                    raise StateError(
                        f"complete_load: key {key!r} has {pins} load(s) in flight for this "
                        f"session (owner {owner}), asked to complete {times}; every "
                        "complete_load needs a prepare_load of the same session")
            if slots:
                holdings = self._holdings[owner]
                for key, slot in zip(keys, slots):
                    self._unpin(key, slot, owner, holdings, 1)
                self._ledger_pins(slots)
                self._tidy(owner, holdings)

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
        if self._ledger is not None:
            self._check_key_bytes(keys)
        with self._lock:
            new_keys = [k for k in keys if k not in self._slots]
            cap = self._max_session_blocks
            held = self._holdings.get(owner)
            no_room: list[bytes] = []
            if owner == TIER_OWNER:
                cap = None  # the coordinator's own tiers have no session share
            if max_evictions is not None:
                room = self._num_free() + min(max_evictions, self._num_evictable(keys))
                if cap is not None:
                    room = min(room, max(0, cap - (held.num_blocks if held else 0)))
                new_keys, no_room = new_keys[:room], new_keys[room:]
            elif new_keys and cap is not None:
                if (held.num_blocks if held else 0) + len(new_keys) > cap:
                    self._counters["store_rejections"] += 1
                    self._counters["session_limit_rejections"] += 1
                    return None
            need = max(0, len(new_keys) - self._num_free())
            victims = None
            if need <= self._num_by_state[SlotState.READY]:  # else no policy could find room
                victims = self._policy.admit(new_keys, need, self._evictable_except(keys))
            if victims is None:
                self._counters["store_rejections"] += 1
                return None
            victim_slots = [self._slots.pop(key).slot_id for key in victims]
            for slot_id in victim_slots:
                self._num_by_state[SlotState.READY] -= 1
                self._free.append(slot_id)
            self._readable_keys.difference_update(victims)
            self._counters["evicted_blocks"] += len(victims)
            self._emit(victims, removed=True)
            self._keys_changed(victims, True)
            slots = [self._allocate(key) for key in new_keys]
            self._keys_changed(new_keys, False)
            if new_keys:
                self._holdings_of(owner).writing.update(dict.fromkeys(new_keys, time.monotonic()))
            slot_ids = [s.slot_id for s in slots]
            if self._ledger is not None:
                self._ledger.free(sorted(set(victim_slots) - set(slot_ids)))
                self._ledger.writing(slot_ids, new_keys, owner, [s.gen for s in slots])
            return PrepareStoreOutput(tuple(new_keys), self._spec(slots), tuple(victims),
                                      tuple(no_room))

    def complete_store(self, keys: Sequence[bytes], success: bool = True, *,
                       owner: int = LOCAL_OWNER,
                       source: BlockSource = BlockSource.HOST) -> None:
        """Publish written blocks (READY), or free their slots when the write failed.

        Acts on the keys that ``owner`` reserved and that are still WRITING; every other
        key (READY, absent, or reserved by another session) is ignored, because engines
        complete with every key of a request, sometimes twice. ``source``: the tier whose
        promotion wrote them (its own owner ``TIER_OWNER`` completes them). The blocks are
        told to every lower tier but the one they came from (``LowerTier.stored``): a block
        promoted from disk is published to the cluster tier as an engine's is.
        """
        check_owner(owner)
        check_keys(keys, "complete_store")
        with self._lock:
            holdings = self._holdings.get(owner)
            if holdings is None:
                return
            mine = holdings.take_writing(keys)
            if not mine:
                return
            slots = [self._slots[k] for k in mine]
            if success:
                for slot in slots:
                    self._move(slot, SlotState.READY)
                    slot.source = source
                self._readable_keys.update(mine)
                for tier in self._tiers:  # all but the tier they came up from
                    if tier.source is not source:
                        tier.stored(mine)
                self._counters["stored_blocks"] += len(slots)
                self._emit(mine, removed=False)
                if self._ledger is not None:
                    self._ledger.ready([s.slot_id for s in slots])
            else:
                self._free_writing(mine)
                self._counters["failed_store_blocks"] += len(slots)
            self._tidy(owner, holdings)

    def quarantine(self, keys: Sequence[bytes], *, owner: int = LOCAL_OWNER) -> int:
        """A write that failed but may still land (a lower tier's read that gave up while its
        transfer may still run): forget the keys that ``owner`` reserved and that are still
        WRITING (lookups miss them at once) and hold their slots out of use for the life of
        this index, ``reset`` included: a late write then lands in a slot no block uses.
        A new index (a coordinator restart) frees them: the process whose transfer it was is
        gone. Returns how many slots this call held out."""
        check_owner(owner)
        check_keys(keys, "quarantine")
        with self._lock:
            holdings = self._holdings.get(owner)
            if holdings is None:
                return 0
            mine = holdings.take_writing(keys)
            self._free_writing(mine, hold_out=True)
            self._counters["failed_store_blocks"] += len(mine)
            self._tidy(owner, holdings)
            return len(mine)

    # ------------------------------------------------------------------ sessions

    def end_session(self, owner: int) -> SessionRelease:
        """``owner`` is gone: free every slot it was writing and drop every pin it holds."""
        check_owner(owner)
        with self._lock:
            holdings = self._holdings.pop(owner, None)
            freed = dropped = 0
            if holdings is not None:
                freed = len(holdings.writing)
                self._free_writing(list(holdings.writing))
                for key in holdings.pinned:
                    dropped += self._unpin(key, self._slots[key], owner, None, None)
                self._ledger_pins([self._slots[key] for key in holdings.pinned])
            counters = self._counters
            counters["sessions_ended"] += 1
            counters["released_writing_blocks"] += freed
            counters["released_pins"] += dropped
            return SessionRelease(freed, dropped)

    def expire_reservations(self, max_age_s: float, now: float | None = None) -> int:
        """Free every reservation older than ``max_age_s`` (its writer never completed it:
        its ``complete_store`` is then ignored); returns how many. A lower tier's
        (``TIER_OWNER``) are quarantined instead of freed: its read may still land."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = held_out = 0
            for owner, holdings in list(self._holdings.items()):
                old = holdings.take_writing([k for k, since in holdings.writing.items()
                                             if now - since > max_age_s])
                if not old:
                    continue
                tier_read = owner == TIER_OWNER  # a tier's read still under way may land
                self._free_writing(old, hold_out=tier_read)
                if tier_read:
                    held_out += len(old)
                else:
                    expired += len(old)
                self._tidy(owner, holdings)
            self._counters["expired_reservations"] += expired
            self._counters["failed_store_blocks"] += held_out
            return expired + held_out

    def holds(self, owner: int) -> bool:
        """Whether ``owner`` holds any reservation or pin."""
        with self._lock:
            return owner in self._holdings

    def owners(self) -> set[int]:
        """The owners that hold something now."""
        with self._lock:
            return set(self._holdings)

    # ------------------------------------------------------------------ the rest

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

        Loads and stores in flight become unknown keys: the caller must not let their
        transfers touch the region after this returns. It empties host memory only: blocks
        a lower tier holds stay there and are promoted again when looked up.
        """
        with self._lock:
            readable = [k for k, s in self._slots.items() if s.state is not SlotState.WRITING]
            self._emit(readable, removed=True)
            self._keys_changed(list(self._slots), True)
            self._policy.clear()
            self._clear_index()
            if self._ledger is not None:
                self._ledger.clear()

    def stats(self) -> ManagerStats:
        with self._lock:
            by_state = self._num_by_state
            return ManagerStats(
                **self._counters,
                capacity_blocks=self._capacity,
                free_blocks=self._num_free(),
                writing_blocks=by_state[SlotState.WRITING],
                ready_blocks=by_state[SlotState.READY],
                loading_blocks=by_state[SlotState.LOADING],
                quarantined_blocks=len(self._quarantined),
            )

    # ------------------------------------------------------------------ internals

    def _held(self, key: bytes, verb: str) -> Slot:
        if type(key) is not bytes:
            check_keys([key], verb)
        slot = self._slots.get(key)
        if slot is None:
            raise UnknownKeyError(f"{verb}: key {key!r} is not in the cache index")
        return slot

    def _readable_slot(self, key: bytes, verb: str) -> Slot:
        slot = self._held(key, verb)
        if slot.state is SlotState.WRITING:
            raise StateError(f"{verb}: key {key!r} is still being written; wait for complete_store")
        return slot

    def _check_key_bytes(self, keys: Sequence[bytes]) -> None:
        limit = self._ledger.max_key_bytes
        for key in keys:
            if len(key) > limit:
                raise InvalidKeyError(f"prepare_store: key of {len(key)} bytes ({key[:16]!r}...); "
                                      f"the index ledger holds keys of at most {limit} bytes")

    def _holdings_of(self, owner: int) -> Holdings:
        holdings = self._holdings.get(owner)
        if holdings is None:
            holdings = self._holdings[owner] = Holdings()
        return holdings

    def _tidy(self, owner: int, holdings: Holdings) -> None:
        if not holdings.writing and not holdings.pinned:
            self._holdings.pop(owner, None)

    def _pin(self, key: bytes, slot: Slot, owner: int, holdings: Holdings) -> None:
        if not slot.pins:
            self._move(slot, SlotState.LOADING)
        slot.pins[owner] = slot.pins.get(owner, 0) + 1
        if owner != TIER_OWNER:
            slot.hits += 1
        holdings.pinned.add(key)

    def _unpin(self, key: bytes, slot: Slot, owner: int, holdings: Holdings | None,
               times: int | None) -> int:
        """Drop ``times`` pins (None: all) of ``owner``; the caller checked there are enough."""
        held = slot.pins[owner]
        dropped = held if times is None else times
        if dropped == held:
            del slot.pins[owner]
            if holdings is not None:
                holdings.pinned.discard(key)
        else:
            slot.pins[owner] = held - dropped
        if not slot.pins:
            self._move(slot, SlotState.READY)
        return dropped

    def _free_writing(self, keys: Sequence[bytes], hold_out: bool = False) -> None:
        """Forget blocks that were being written (failed store, ended session); their
        slots go to the free list, or with ``hold_out`` out of use (see ``quarantine``).
        The ledger records them free either way: no block is there, and a restart may
        reuse them."""
        freed = []
        for key in keys:
            slot = self._slots.pop(key)
            assert slot.state is SlotState.WRITING, "freed a slot that is not being written"
            self._policy.remove(key)
            self._num_by_state[SlotState.WRITING] -= 1
            freed.append(slot.slot_id)
        if hold_out:
            self._quarantined.update(freed)
        else:
            self._free.extend(freed)
        self._keys_changed(keys, True)
        if self._ledger is not None:
            self._ledger.free(freed)

    def _evictable_except(self, protected_keys: Sequence[bytes]):
        protected = set(protected_keys)
        slots = self._slots
        ready = SlotState.READY
        return lambda key: slots[key].state is ready and key not in protected

    def _num_free(self) -> int:
        return self._capacity - len(self._slots) - len(self._quarantined)

    def _num_evictable(self, protected_keys: Sequence[bytes]) -> int:
        """READY blocks that are not among ``protected_keys``: what eviction can free."""
        ready = SlotState.READY
        protected = sum(1 for key in set(protected_keys)
                        if (slot := self._slots.get(key)) is not None and slot.state is ready)
        return self._num_by_state[ready] - protected

    def _allocate(self, key: bytes) -> Slot:
        slot_id = None
        while slot_id is None or slot_id in self._quarantined:  # (after a reset: see quarantine)
            if self._free:
                slot_id = self._free.pop()
            else:
                slot_id = self._next_fresh
                self._next_fresh += 1
        assert slot_id < self._capacity, "allocated past capacity: free-slot accounting is broken"
        slot = self._slots[key] = Slot(slot_id, SlotState.WRITING, self._next_gen)
        self._next_gen += 1
        self._num_by_state[SlotState.WRITING] += 1
        return slot

    def _ledger_pins(self, slots: Sequence[Slot]) -> None:
        """Mirror these slots' pins into the ledger (after a pin or unpin)."""
        if self._ledger is not None and slots:
            unique = {slot.slot_id: slot for slot in slots}.values()
            self._ledger.pins([s.slot_id for s in unique], [s.pins for s in unique])

    def _move(self, slot: Slot, state: SlotState) -> None:
        self._num_by_state[slot.state] -= 1
        self._num_by_state[state] += 1
        slot.state = state

    def _emit(self, keys: Sequence[bytes], removed: bool) -> None:
        if self._events_enabled:
            self._events.emit(keys, removed)

"""``SlotTable``: the index's state and the moves every verb is made of.

**Flat, per slot.** A million-block index cannot afford an object per block (a slot
object, its pins dict and two ints cost about 250 bytes; docs/benchmarks.md, "The index at
scale"). So the table is one dict and a few arrays indexed by slot id:

* ``slot_of``: key -> slot id while the key is readable (READY or LOADING, not doomed),
  ``~slot`` (negative) while it is not (being written, or doomed). A lookup is then
  ``takewhile`` over ``map(slot_of.get)``, at C speed, with the run's slot ids for free.
* ``key_of`` (a reference), ``state`` (``SlotState``, a byte), ``flags`` (``SlotFlag``,
  a byte), ``source`` (``BlockSource``, a byte) and ``gens`` (u64) per slot;
* ``pins``: slot -> {owner: count}, for the pinned (LOADING) slots only.

**``slot_of`` is rebuilt as keys churn.** A CPython dict never shrinks: a deleted key leaves
a dead entry, and when the dead and live entries fill the table it is resized for three
times the live keys. So a full index whose blocks are evicted and replaced doubles its dict
(2 M 32-byte keys: 42 B a key when built, 84 B after 2 M deletes and inserts). After
``REBUILD_SHARE`` of the capacity in deletes, ``forget`` replaces ``slot_of`` with a copy,
sized for the keys it holds and with no dead entries, so that the resize does not come: a
copy of 2 M keys has room for 0.8 M more entries, a copy of 0.5 M for 0.2 M, more than the
0.5 M and 0.125 M deletes between rebuilds (capacities just below two thirds of a power of
two leave a copy less room: there CPython's resize comes first, and the rebuild only undoes
it). A rebuild costs a copy of every key under the index's lock (0.3-0.6 s at 2 M keys on the
development VM; docs/benchmarks.md, "The index at scale"), and both tables while it runs,
at most once per ``REBUILD_SHARE`` of the capacity in deletes. It is a new dict object:
nothing may hold ``slot_of`` across a call that can forget a key.

One ``Holdings`` per owner names what it reserved and pinned. The table keeps the free
list, quarantine, the counts by state, the policy and the ledger in step, and tells its
listeners what entered or left the index and what became readable or stopped being. It
never locks (the manager does).

**A slot is handed out only when nothing touches it.** A reset forgets every key, but a
slot still being written (a reservation) or read (a pin) is *doomed*, not freed: its key is
not readable (a new store of it waits for it to go), and it is free again only when its
last reservation or pin ends (a completed write does not make it READY). So a copy in
flight across a reset never lands in, or reads from, a slot given to another block.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from itertools import repeat, takewhile
from typing import cast

import numpy as np

from tiercache.errors import ConfigError, InvalidKeyError, UnknownKeyError, StateError
from tiercache.results import BlockSource
from tiercache.eviction import EvictionPolicy
from tiercache.index.heap import give_back_freed_heap
from tiercache.index.slots import Holdings, KeyListener, Ledger, SlotFlag, SlotState, check_keys
from tiercache.specs import CPULoadStoreSpec

_FREE, _WRITING, _READY, _LOADING = (int(s) for s in SlotState)
_DOOMED, _REUSED = int(SlotFlag.DOOMED), int(SlotFlag.REUSED)
_HOST = int(BlockSource.HOST)
_HIT = (0).__le__  # a slot_of value that is a readable slot (not ~slot, not absent: -1)
REBUILD_SHARE = 0.25  # slot_of is copied after deletes of this share of the capacity


class SlotTable:
    """See the module docstring. ``on_keys(keys, removed)``: keys entered the index (a
    reservation) or left it; ``on_readable(keys, removed)``: keys became readable (READY
    in host memory) or stopped being (evicted, reset, a doomed block's end)."""

    def __init__(self, capacity: int, policy: EvictionPolicy, ledger: Ledger | None,
                 region_id: int):
        self.capacity = capacity
        self.policy = policy
        self.ledger = ledger
        self.region_id = region_id
        self.max_pin_owners = ledger.max_pin_owners if ledger is not None else None
        self.quarantined: set[int] = set()  # slots held out of use (see manager.quarantine)
        self.next_gen = 1
        self.on_keys: KeyListener | None = None
        self.on_readable: list[KeyListener] = []
        self.slot_of: dict[bytes, int] = {}
        self.num_deleted = 0  # keys deleted from slot_of since it was built
        self.rebuild_after = max(1, int(capacity * REBUILD_SHARE))  # deletes (see rebuild)
        self.key_of: list[bytes | None] = [None] * capacity
        self.state = bytearray(capacity)
        self.flags = bytearray(capacity)
        self.source = bytearray(capacity)
        # the slots' generations: the ledger's own (a read-only view), or an array here
        self.gens = ledger.gens if ledger is not None else np.zeros(capacity, np.uint64)
        self.pins: dict[int, dict[int, int]] = {}  # slot -> owner -> pins (LOADING slots)
        self.free = array("q")  # freed slots, reused last-in first-out
        self.next_fresh = 0  # then slots from here up (never handed out since a reset)
        self.usable = capacity  # fresh slots stop here: those past it are not reserved yet
        self.last: list[int] = []  # then these (popped from the end): see set_free
        self.num_by_state = [0] * len(SlotState)
        self.holdings: dict[int, Holdings] = {}

    def view(self, column: bytearray) -> np.ndarray:
        """A byte column as a numpy array over the same memory (bulk moves)."""
        return np.frombuffer(column, np.uint8)

    # ------------------------------------------------------------------ listeners
    def keys_changed(self, keys: Sequence[bytes], removed: bool) -> None:
        if self.on_keys is not None and keys:
            self.on_keys(keys, removed)

    def readable_changed(self, keys: Sequence[bytes], removed: bool) -> None:
        if keys:
            for listener in self.on_readable:
                listener(keys, removed)

    # ------------------------------------------------------------------ lookups
    def slot_id(self, key: bytes) -> int | None:
        """The slot holding ``key`` (readable or not), or None."""
        value = self.slot_of.get(key)
        return None if value is None else value if value >= 0 else ~value

    def keys(self, slots: Sequence[int]) -> list[bytes]:
        """The keys these slots hold (every one holds a key: not FREE)."""
        return cast(list[bytes], [self.key_of[s] for s in slots])

    def slots(self, keys: Sequence[bytes]) -> list[int]:
        """The slots of held keys (readable or not)."""
        return [v if v >= 0 else ~v for v in map(self.slot_of.__getitem__, keys)]

    def held(self, key: bytes, verb: str) -> int:
        if type(key) is not bytes:
            check_keys([key], verb)
        slot = self.slot_id(key)
        if slot is None:
            raise UnknownKeyError(f"{verb}: key {key!r} is not in the cache index")
        return slot

    def readable_slot(self, key: bytes, verb: str) -> int:
        slot = self.held(key, verb)
        if self.state[slot] == _WRITING:
            raise StateError(f"{verb}: key {key!r} is still being written; wait for complete_store")
        if self.flags[slot] & _DOOMED:
            raise UnknownKeyError(f"{verb}: key {key!r} was dropped by a reset")
        return slot

    def readable_run(self, keys: Sequence[bytes]) -> list[int]:
        """The slots of the leading run of readable keys (``TypeError``: an unhashable key)."""
        return list(takewhile(_HIT, map(self.slot_of.get, keys, repeat(-1))))

    def readable_slots(self, keys: Sequence[bytes]) -> list[int]:
        """The slots of the readable keys among ``keys``, in order."""
        return list(filter(_HIT, map(self.slot_of.get, keys, repeat(-1))))

    def is_readable(self, key: bytes) -> bool:
        return self.slot_of.get(key, -1) >= 0

    def readable_keys(self) -> list[bytes]:
        return [key for key, value in self.slot_of.items() if value >= 0]

    def state_of(self, key: bytes) -> SlotState | None:
        slot = self.slot_id(key)
        return None if slot is None else SlotState(self.state[slot])

    def being_written(self, key: bytes) -> bool:
        """Whether ``key`` is reserved and will be readable once written (not doomed)."""
        value = self.slot_of.get(key, 0)
        return value < 0 and self.state[~value] == _WRITING and not self.flags[~value] & _DOOMED

    def check_key_bytes(self, keys: Sequence[bytes]) -> None:
        if self.ledger is None:
            return
        limit = self.ledger.max_key_bytes
        for key in keys:
            if len(key) > limit:
                raise InvalidKeyError(f"prepare_store: key of {len(key)} bytes ({key[:16]!r}...); "
                                      f"the index ledger holds keys of at most {limit} bytes")

    def spec(self, slots: Sequence[int]) -> CPULoadStoreSpec:
        return CPULoadStoreSpec(slots, self.gens[np.asarray(slots, np.int64)], self.region_id)

    # ------------------------------------------------------------------ owners
    def holdings_of(self, owner: int) -> Holdings:
        holdings = self.holdings.get(owner)
        if holdings is None:
            holdings = self.holdings[owner] = Holdings()
        return holdings

    def tidy(self, owner: int, holdings: Holdings) -> None:
        if not holdings.writing and not holdings.pinned:
            self.holdings.pop(owner, None)

    def can_pin(self, slot: int, owner: int) -> bool:
        limit = self.max_pin_owners
        held = self.pins.get(slot)
        return limit is None or held is None or owner in held or len(held) < limit

    def pins_of(self, slot: int, owner: int) -> int:
        held = self.pins.get(slot)
        return 0 if held is None else held.get(owner, 0)

    def pin(self, slots: Sequence[int], keys: Sequence[bytes], owner: int, holdings: Holdings,
            reuse: bool) -> None:
        """One pin of ``owner`` on each slot (readable; holding ``keys``, co-indexed)."""
        pins, state, flags, counts = self.pins, self.state, self.flags, self.num_by_state
        for slot in slots:
            held = pins.get(slot)
            if held is None:
                pins[slot] = {owner: 1}
                counts[state[slot]] -= 1
                counts[_LOADING] += 1
                state[slot] = _LOADING
            else:
                held[owner] = held.get(owner, 0) + 1
            if reuse:
                flags[slot] |= _REUSED
        holdings.pinned.update(keys)

    def unpin(self, slots: Sequence[int], keys: Sequence[bytes], owner: int,
              holdings: Holdings | None, times: int | None) -> int:
        """Drop ``times`` pins (None: all) of ``owner`` from each slot (holding ``keys``,
        co-indexed); the caller checked there are enough. A doomed slot whose last pin
        goes is freed. How many pins were dropped."""
        pins, state, counts = self.pins, self.state, self.num_by_state
        dropped = 0
        for slot, key in zip(slots, keys):
            held = pins[slot]
            count = held[owner]
            drop = count if times is None else times
            dropped += drop
            if drop == count:
                del held[owner]
                if holdings is not None:
                    holdings.pinned.discard(key)
            else:
                held[owner] = count - drop
            if not held:
                del pins[slot]
                counts[_LOADING] -= 1
                counts[_READY] += 1
                state[slot] = _READY
                if self.flags[slot] & _DOOMED:
                    self.drop_doomed(slot)
        return dropped

    def mirror_pins(self, slots: Sequence[int]) -> None:
        """Mirror these slots' pins into the ledger (after a pin or unpin)."""
        if self.ledger is not None and slots:
            state = self.state  # a doomed one freed meanwhile: done
            unique = [s for s in dict.fromkeys(slots) if state[s] != _FREE]
            if unique:
                self.ledger.pins(unique, [self.pins.get(s, {}) for s in unique])

    # ------------------------------------------------------------------ slots
    def num_free(self) -> int:
        return self.usable - len(self.slot_of) - len(self.quarantined)

    def set_usable(self, usable: int) -> None:
        """Slots below ``usable`` may be handed out (their memory is reserved); it only
        grows. Every slot the free list, quarantine or a key holds is below it: slots are
        handed out lowest first from ``next_fresh``, which never passes it."""
        if not self.usable <= usable <= self.capacity:
            raise ConfigError(f"usable slots {usable}: allowed {self.usable}..{self.capacity}")
        self.usable = usable

    def evictable_except(self, protected_keys: Sequence[bytes]) -> Callable[[int], bool]:
        protected = {s for s in map(self.slot_id, protected_keys) if s is not None}
        state = self.state
        return lambda slot: state[slot] == _READY and slot not in protected

    def num_evictable(self, protected_keys: Sequence[bytes]) -> int:
        """READY blocks that are not among ``protected_keys``: what eviction can free."""
        state = self.state
        protected = sum(1 for slot in map(self.slot_id, set(protected_keys))
                        if slot is not None and state[slot] == _READY)
        return self.num_by_state[_READY] - protected

    def allocate(self, keys: Sequence[bytes]) -> tuple[list[int], np.ndarray]:
        """WRITING slots for new keys: from the free list, then fresh, then ``last``; and
        their new generations (the caller's ledger write records them; without a ledger
        they are recorded here)."""
        slots = []
        free, quarantined = self.free, self.quarantined
        for key in keys:
            slot = None
            while slot is None or slot in quarantined:
                if free:
                    slot = free.pop()
                elif self.next_fresh < self.usable:
                    slot = self.next_fresh
                    self.next_fresh += 1
                else:
                    assert self.last, "allocated past capacity: free-slot accounting is broken"
                    slot = self.last.pop()
            self.slot_of[key] = ~slot
            self.key_of[slot] = key
            self.state[slot] = _WRITING
            self.flags[slot] = 0
            self.source[slot] = _HOST
            slots.append(slot)
        if not free:
            self.free = array("q")  # an array never shrinks as it is popped
        gens = np.arange(self.next_gen, self.next_gen + len(slots), dtype=np.uint64)
        self.next_gen += len(slots)
        if self.ledger is None:
            self.gens[slots] = gens
        self.num_by_state[_WRITING] += len(slots)
        return slots, gens

    def evict(self, victims: Sequence[int]) -> list[bytes]:
        """Forget READY blocks the policy gave up (it forgot them already); their keys."""
        keys = [self.forget(slot) for slot in victims]
        self.num_by_state[_READY] -= len(victims)
        self.free.extend(victims)
        self.readable_changed(keys, True)
        self.keys_changed(keys, True)
        return keys

    def forget(self, slot: int) -> bytes:
        """The slot's key leaves the index; the slot is FREE (not on the free list yet)."""
        key = self.key_of[slot]
        assert key is not None, "forgot a slot that holds no key"
        del self.slot_of[key]
        self.key_of[slot] = None
        self.state[slot] = _FREE
        self.num_deleted += 1
        if self.num_deleted >= self.rebuild_after:
            self.rebuild()
        return key

    def rebuild(self) -> None:
        """Replace ``slot_of`` with a copy that has no dead entries (see the module
        docstring). ``dict(d)`` inserts each key into a table sized for ``len(d)``;
        ``d.copy()`` would clone a table that is still dense enough, dead entries and all.
        The old table, freed, goes back to the system."""
        self.slot_of = dict(self.slot_of)
        self.num_deleted = 0
        give_back_freed_heap()

    def free_writing(self, keys: Sequence[bytes], hold_out: bool = False) -> list[int]:
        """Forget blocks that were being written (failed store, ended session, a doomed
        write's end); their slots go to the free list, or with ``hold_out`` out of use.
        The ledger records them free either way: no block is there, and a restart may
        reuse them."""
        freed = []
        for key in keys:
            slot = self.slot_id(key)
            assert slot is not None and self.state[slot] == _WRITING, \
                "freed a slot that is not being written"
            if not self.flags[slot] & _DOOMED:
                self.policy.remove(slot)
            self.forget(slot)
            freed.append(slot)
        self.num_by_state[_WRITING] -= len(freed)
        if hold_out:
            self.quarantined.update(freed)
        else:
            self.free.extend(freed)
        self.keys_changed(keys, True)
        if self.ledger is not None:
            self.ledger.free(freed)
        return freed

    def drop_doomed(self, slot: int) -> None:
        """A doomed READY block's last pin went: its slot is free now."""
        key = self.forget(slot)
        self.num_by_state[_READY] -= 1
        self.free.append(slot)
        self.keys_changed([key], True)
        if self.ledger is not None:
            self.ledger.free([slot])

    def move(self, slot: int, state: int) -> None:
        counts = self.num_by_state
        counts[self.state[slot]] -= 1
        counts[state] += 1
        self.state[slot] = state

    def make_ready(self, slots: Sequence[int], source: BlockSource) -> list[bytes]:
        """Written blocks become READY (the doomed ones are freed instead); the keys that
        became readable."""
        flags, slot_of = self.flags, self.slot_of
        ready = [s for s in slots if not flags[s] & _DOOMED]
        keys = self.keys(ready)
        for slot, key in zip(ready, keys):
            self.state[slot] = _READY
            self.source[slot] = source
            slot_of[key] = slot
        self.num_by_state[_WRITING] -= len(ready)
        self.num_by_state[_READY] += len(ready)
        if self.ledger is not None and ready:
            self.ledger.ready(ready)
        if len(ready) < len(slots):
            self.free_writing(self.keys([s for s in slots if flags[s] & _DOOMED]))
        self.readable_changed(keys, False)
        return keys

    def reset(self) -> list[bytes]:
        """Forget every key (see the module docstring): READY blocks nobody pins are freed
        at once, the others are doomed. Returns the keys that were readable (the caller
        tells the readable listeners: a reset is one event, not one per key)."""
        was_readable = self.readable_keys()
        state = self.view(self.state)
        ready = np.flatnonzero(state == _READY)
        kept = np.flatnonzero((state == _WRITING) | (state == _LOADING))
        gone = self.keys(ready.tolist())
        kept_keys = self.keys(kept.tolist())
        self.view(self.flags)[kept] |= _DOOMED
        state[ready] = _FREE
        self.key_of = [None] * self.capacity
        for slot, key in zip(kept.tolist(), kept_keys):
            self.key_of[slot] = key
        self.slot_of = {key: ~slot for key, slot in zip(kept_keys, kept.tolist())}
        self.num_deleted = 0
        self.policy.clear()
        self.num_by_state[_READY] = 0
        self.set_free()
        if self.ledger is not None:
            self.ledger.free(ready)
        self.keys_changed(gone, True)
        return was_readable

    def set_free(self, last: Sequence[int] = ()) -> None:
        """After a reset or a restart: hand out every FREE slot lowest first, but those of
        ``last`` (FREE too), which go after all others, in their order. The free list holds
        the FREE slots below the highest one in use (or held out); those above are fresh."""
        held = self.view(self.state) != _FREE
        held[np.fromiter(self.quarantined, np.int64, len(self.quarantined))] = True
        held[np.asarray(last, np.int64)] = True
        in_use = np.flatnonzero(held)
        top = int(in_use[-1]) + 1 if in_use.size else 0
        self.free = array("q", np.flatnonzero(~held[:top])[::-1].astype(np.int64).tobytes())
        self.next_fresh = top
        self.last = list(reversed(last))

    def check_slot_id(self, slot_id: int) -> None:
        if not 0 <= slot_id < self.capacity:
            raise ConfigError(f"the index ledger names slot {slot_id}; allowed "
                              f"0..{self.capacity - 1}")

    def writing_since(self, owner: int, key: bytes) -> float | None:
        holdings = self.holdings.get(owner)
        return holdings.writing.get(key) if holdings is not None else None

"""``SlotTable``: the index's state and the moves every verb is made of.

One ``Slot`` per held key owns its state, writer and pins; one ``Holdings`` per owner names
what it reserved and pinned. The table keeps the free list, quarantine, the counts by
state, the policy and the ledger in step, and tells its listeners what entered or left
the index and what became readable or stopped being. It never locks (the manager does).

**A slot is handed out only when nothing touches it.** A reset forgets every key, but a
slot still being written (a reservation) or read (a pin) is *doomed*, not freed: its key is
not readable (a new store of it waits for it to go), and it is free again only when its
last reservation or pin ends (a completed write does not make it READY). So a copy in
flight across a reset never lands in, or reads from, a slot given to another block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tiercache.errors import ConfigError, InvalidKeyError, UnknownKeyError, StateError
from tiercache.index.lower_tier import BlockSource
from tiercache.eviction import EvictionPolicy
from tiercache.index.slots import Holdings, Ledger, Slot, SlotState, check_keys
from tiercache.specs import CPULoadStoreSpec

KeyListener = Callable[[Sequence[bytes], bool], None]  # (keys, removed)


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
        self.clear()

    def clear(self) -> None:
        self.slots: dict[bytes, Slot] = {}
        # Keys whose state is READY or LOADING and not doomed: lookup and touch at C speed.
        self.readable: set[bytes] = set()
        self.next_fresh = 0  # slots >= this were never handed out
        self.free: list[int] = []  # freed slots, reused last-in first-out
        self.num_by_state = dict.fromkeys(SlotState, 0)
        self.holdings: dict[int, Holdings] = {}

    # ------------------------------------------------------------------ listeners
    def keys_changed(self, keys: Sequence[bytes], removed: bool) -> None:
        if self.on_keys is not None and keys:
            self.on_keys(keys, removed)

    def readable_changed(self, keys: Sequence[bytes], removed: bool) -> None:
        if keys:
            for listener in self.on_readable:
                listener(keys, removed)

    # ------------------------------------------------------------------ lookups
    def held(self, key: bytes, verb: str) -> Slot:
        if type(key) is not bytes:
            check_keys([key], verb)
        slot = self.slots.get(key)
        if slot is None:
            raise UnknownKeyError(f"{verb}: key {key!r} is not in the cache index")
        return slot

    def readable_slot(self, key: bytes, verb: str) -> Slot:
        slot = self.held(key, verb)
        if slot.state is SlotState.WRITING:
            raise StateError(f"{verb}: key {key!r} is still being written; wait for complete_store")
        if slot.doomed:
            raise UnknownKeyError(f"{verb}: key {key!r} was dropped by a reset")
        return slot

    def check_key_bytes(self, keys: Sequence[bytes]) -> None:
        if self.ledger is None:
            return
        limit = self.ledger.max_key_bytes
        for key in keys:
            if len(key) > limit:
                raise InvalidKeyError(f"prepare_store: key of {len(key)} bytes ({key[:16]!r}...); "
                                      f"the index ledger holds keys of at most {limit} bytes")

    def spec(self, slots: Sequence[Slot]) -> CPULoadStoreSpec:
        return CPULoadStoreSpec([s.slot_id for s in slots], [s.gen for s in slots],
                                self.region_id)

    # ------------------------------------------------------------------ owners
    def holdings_of(self, owner: int) -> Holdings:
        holdings = self.holdings.get(owner)
        if holdings is None:
            holdings = self.holdings[owner] = Holdings()
        return holdings

    def tidy(self, owner: int, holdings: Holdings) -> None:
        if not holdings.writing and not holdings.pinned:
            self.holdings.pop(owner, None)

    def can_pin(self, slot: Slot, owner: int) -> bool:
        limit = self.max_pin_owners
        return limit is None or owner in slot.pins or len(slot.pins) < limit

    def pin(self, key: bytes, slot: Slot, owner: int, holdings: Holdings, reuse: bool) -> None:
        if not slot.pins:
            self.move(slot, SlotState.LOADING)
        slot.pins[owner] = slot.pins.get(owner, 0) + 1
        if reuse:
            slot.hits += 1
        holdings.pinned.add(key)

    def unpin(self, key: bytes, slot: Slot, owner: int, holdings: Holdings | None,
              times: int | None) -> int:
        """Drop ``times`` pins (None: all) of ``owner``; the caller checked there are enough.
        A doomed slot whose last pin goes is freed."""
        held = slot.pins[owner]
        dropped = held if times is None else times
        if dropped == held:
            del slot.pins[owner]
            if holdings is not None:
                holdings.pinned.discard(key)
        else:
            slot.pins[owner] = held - dropped
        if not slot.pins:
            self.move(slot, SlotState.READY)
            if slot.doomed:
                self.drop_doomed(key, slot)
        return dropped

    def mirror_pins(self, slots: Sequence[Slot]) -> None:
        """Mirror these slots' pins into the ledger (after a pin or unpin)."""
        if self.ledger is not None and slots:
            unique = [s for s in {slot.slot_id: slot for slot in slots}.values()
                      if self.slots.get(s.key) is s]  # a doomed one freed meanwhile: done
            if unique:
                self.ledger.pins([s.slot_id for s in unique], [s.pins for s in unique])

    # ------------------------------------------------------------------ slots
    def num_free(self) -> int:
        return self.capacity - len(self.slots) - len(self.quarantined)

    def evictable_except(self, protected_keys: Sequence[bytes]) -> Callable[[bytes], bool]:
        protected = set(protected_keys)
        slots = self.slots
        ready = SlotState.READY
        return lambda key: slots[key].state is ready and key not in protected

    def num_evictable(self, protected_keys: Sequence[bytes]) -> int:
        """READY blocks that are not among ``protected_keys``: what eviction can free."""
        ready = SlotState.READY
        protected = sum(1 for key in set(protected_keys)
                        if (slot := self.slots.get(key)) is not None and slot.state is ready)
        return self.num_by_state[ready] - protected

    def allocate(self, key: bytes) -> Slot:
        slot_id = None
        while slot_id is None or slot_id in self.quarantined:
            if self.free:
                slot_id = self.free.pop()
            else:
                slot_id = self.next_fresh
                self.next_fresh += 1
        assert slot_id < self.capacity, "allocated past capacity: free-slot accounting is broken"
        slot = self.slots[key] = Slot(slot_id, SlotState.WRITING, self.next_gen, key)
        self.next_gen += 1
        self.num_by_state[SlotState.WRITING] += 1
        return slot

    def evict(self, victims: Sequence[bytes]) -> list[int]:
        """Forget READY blocks the policy gave up (it forgot them already)."""
        victim_slots = [self.slots.pop(key).slot_id for key in victims]
        self.num_by_state[SlotState.READY] -= len(victims)
        self.free.extend(victim_slots)
        self.readable.difference_update(victims)
        self.readable_changed(victims, True)
        self.keys_changed(victims, True)
        return victim_slots

    def free_writing(self, keys: Sequence[bytes], hold_out: bool = False) -> list[int]:
        """Forget blocks that were being written (failed store, ended session, a doomed
        write's end); their slots go to the free list, or with ``hold_out`` out of use.
        The ledger records them free either way: no block is there, and a restart may
        reuse them."""
        freed = []
        for key in keys:
            slot = self.slots.pop(key)
            assert slot.state is SlotState.WRITING, "freed a slot that is not being written"
            if not slot.doomed:
                self.policy.remove(key)
            self.num_by_state[SlotState.WRITING] -= 1
            freed.append(slot.slot_id)
        if hold_out:
            self.quarantined.update(freed)
        else:
            self.free.extend(freed)
        self.keys_changed(keys, True)
        if self.ledger is not None:
            self.ledger.free(freed)
        return freed

    def drop_doomed(self, key: bytes, slot: Slot) -> None:
        """A doomed READY block's last pin went: its slot is free now."""
        del self.slots[key]
        self.num_by_state[SlotState.READY] -= 1
        self.free.append(slot.slot_id)
        self.keys_changed([key], True)
        if self.ledger is not None:
            self.ledger.free([slot.slot_id])

    def move(self, slot: Slot, state: SlotState) -> None:
        self.num_by_state[slot.state] -= 1
        self.num_by_state[state] += 1
        slot.state = state

    def make_ready(self, slots: Sequence[Slot], source: BlockSource) -> list[bytes]:
        """Written blocks become READY (the doomed ones are freed instead); the keys that
        became readable."""
        ready: list[Slot] = []
        doomed: list[Slot] = []
        for slot in slots:
            (doomed if slot.doomed else ready).append(slot)
        for slot in ready:
            self.move(slot, SlotState.READY)
            slot.source = source
        keys = [s.key for s in ready]
        self.readable.update(keys)
        if self.ledger is not None and ready:
            self.ledger.ready([s.slot_id for s in ready])
        if doomed:
            self.free_writing([s.key for s in doomed])
        self.readable_changed(keys, False)
        return keys

    def reset(self) -> list[bytes]:
        """Forget every key (see the module docstring): READY blocks nobody pins are freed
        at once, the others are doomed. Returns the keys that were readable (the caller
        tells the readable listeners: a reset is one event, not one per key)."""
        was_readable = [k for k in self.slots if k in self.readable]
        kept: dict[bytes, Slot] = {}
        freed: list[int] = []
        for key, slot in self.slots.items():
            if slot.state is SlotState.READY:
                freed.append(slot.slot_id)
            else:
                slot.doomed = True
                kept[key] = slot
        gone = [k for k in self.slots if k not in kept]
        self.policy.clear()
        self.slots = kept
        self.readable = set()
        self.num_by_state[SlotState.READY] = 0
        in_use = {s.slot_id for s in kept.values()} | self.quarantined
        self.free = [s for s in range(self.capacity - 1, -1, -1) if s not in in_use]
        self.next_fresh = self.capacity
        if self.ledger is not None:
            self.ledger.free(sorted(freed))
        self.keys_changed(gone, True)
        return was_readable

    def check_slot_id(self, slot_id: int) -> None:
        if not 0 <= slot_id < self.capacity:
            raise ConfigError(f"the index ledger names slot {slot_id}; allowed "
                              f"0..{self.capacity - 1}")

    def writing_since(self, owner: int, key: bytes) -> float | None:
        holdings = self.holdings.get(owner)
        return holdings.writing.get(key) if holdings is not None else None

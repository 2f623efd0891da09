"""The cache index: which block hash lives in which slot of the region, and in what state.

Pure Python (numpy for the spec only; never torch). One ``_Slot`` record per held
key is the single owner of that block's state and its one load counter::

    FREE ──prepare_store──► WRITING ──complete_store(ok)──► READY ◄──► LOADING (loads > 0)
      ▲                        │                              │
      └──complete_store(fail)──┘                              └──evicted (policy)──► FREE

Only READY blocks that are not part of the calling ``prepare_store`` are ever
evicted; WRITING and LOADING blocks never are. Every method is atomic: it validates
the whole batch before changing anything, and raises ``ManagerError`` subclasses
(``UnknownKeyError``, ``StateError``, ``InvalidKeyError``) on misuse. One lock guards
the index, so the coordinator's control server and its exporter may call it from
different threads.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from itertools import takewhile
from dataclasses import dataclass
from enum import Enum

from tiercache.errors import ConfigError, InvalidKeyError, ManagerError, StateError, UnknownKeyError
from tiercache.index.policies import EvictionPolicy, make_policy
from tiercache.specs import CPULoadStoreSpec, Medium


class SlotState(Enum):
    WRITING = "writing"  # allocated by prepare_store; bytes not there yet; not readable
    READY = "ready"  # readable and evictable
    LOADING = "loading"  # readable; ``loads`` transfers read it; not evictable


class _Slot:
    __slots__ = ("slot_id", "state", "loads")

    def __init__(self, slot_id: int):
        self.slot_id = slot_id
        self.state = SlotState.WRITING
        self.loads = 0  # in-flight loads; > 0 exactly when state is LOADING


@dataclass(frozen=True, eq=False)
class PrepareStoreOutput:
    """What to write: ``keys_to_store[i]`` goes to ``store_spec.block_ids[i]``.

    Keys of the call that were already held (ready or being written) are not in
    ``keys_to_store``; ``evicted_keys`` were dropped to make room.
    """

    keys_to_store: tuple[bytes, ...]
    store_spec: CPULoadStoreSpec
    evicted_keys: tuple[bytes, ...]


@dataclass(frozen=True)
class OffloadingEvent:
    """Blocks that became readable (``removed=False``) or left the cache (``removed=True``)."""

    keys: tuple[bytes, ...]
    removed: bool
    medium: str = Medium.CPU.value


@dataclass(frozen=True)
class ManagerStats:
    """A consistent snapshot: lifetime counters (never reset) and gauges in blocks.

    ``free + writing + ready + loading == capacity``.
    """

    lookups: int
    hit_blocks: int
    miss_blocks: int
    stored_blocks: int
    loaded_blocks: int
    store_rejections: int
    evicted_blocks: int
    failed_store_blocks: int
    capacity_blocks: int
    free_blocks: int
    writing_blocks: int
    ready_blocks: int
    loading_blocks: int

    @property
    def occupancy(self) -> float:
        """Fraction of slots not free (pending writes count as used)."""
        return (self.capacity_blocks - self.free_blocks) / self.capacity_blocks


def check_keys(keys: Sequence[bytes], verb: str) -> None:
    """Raise ``InvalidKeyError`` unless every key is ``bytes``."""
    if set(map(type, keys)) <= {bytes}:
        return
    for key in keys:
        if type(key) is not bytes:
            raise InvalidKeyError(
                f"{verb}: key {key!r} is {type(key).__name__}; keys must be bytes")


def _require_unique(keys: Sequence[bytes], verb: str) -> None:
    if len(set(keys)) != len(keys):
        repeated = [k for k, n in Counter(keys).items() if n > 1]
        raise InvalidKeyError(f"{verb}: key {repeated[0]!r} appears more than once in one call")


class OffloadingManager:
    """Index over ``num_blocks`` slots of the region; see the module docstring for states."""

    def __init__(self, num_blocks: int, policy: str = "lru", enable_events: bool = False):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(f"num_blocks = {num_blocks!r}: must be an integer >= 1")
        self._capacity = num_blocks
        self._policy: EvictionPolicy = make_policy(policy, num_blocks)
        self._events_enabled = enable_events
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(
            ("lookups", "hit_blocks", "miss_blocks", "stored_blocks", "loaded_blocks",
             "store_rejections", "evicted_blocks", "failed_store_blocks"), 0)
        self._clear_index()

    def _clear_index(self) -> None:
        self._slots: dict[bytes, _Slot] = {}
        # Keys whose state is READY or LOADING: lets lookup and touch run at C speed.
        self._readable_keys: set[bytes] = set()
        self._next_fresh = 0  # slots >= this were never handed out
        self._free: list[int] = []  # freed slots, reused last-in first-out
        self._num_by_state = dict.fromkeys(SlotState, 0)
        self._events: list[OffloadingEvent] = []

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
            try:
                hits = len(list(takewhile(self._readable_keys.__contains__, keys)))
            except TypeError:  # an unhashable key
                check_keys(keys, "lookup")
                raise
            if hits < len(keys):  # only bytes are ever held, so only a miss can hide a bad key
                check_keys(keys[hits:], "lookup")
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

    # ------------------------------------------------------------------ loads

    def prepare_load(self, keys: Sequence[bytes]) -> CPULoadStoreSpec:
        """Slot ids co-indexed with ``keys``; each block is pinned until ``complete_load``."""
        with self._lock:
            slots = [self._readable_slot(key, "prepare_load") for key in keys]
            for slot in slots:
                if slot.loads == 0:
                    self._move(slot, SlotState.LOADING)
                slot.loads += 1
            self._counters["loaded_blocks"] += len(slots)
            return CPULoadStoreSpec([s.slot_id for s in slots])

    def complete_load(self, keys: Sequence[bytes]) -> None:
        """End one load of each key (a key given twice ends two loads)."""
        with self._lock:
            slots = [self._held(key, "complete_load") for key in keys]
            for key, times in Counter(keys).items():
                loads = self._slots[key].loads
                if loads < times:
                    raise StateError(
                        f"complete_load: key {key!r} has {loads} load(s) in flight, "
                        f"asked to complete {times}; every complete_load needs a prepare_load"
                    )
            for slot in slots:
                slot.loads -= 1
                if slot.loads == 0:
                    self._move(slot, SlotState.READY)

    # ------------------------------------------------------------------ stores

    def prepare_store(self, keys: Sequence[bytes]) -> PrepareStoreOutput | None:
        """Reserve slots for the keys not held yet, evicting READY blocks if needed.

        Returns ``None`` (and changes nothing) when not enough blocks can be evicted;
        keys of this call are never evicted to make room for each other.
        """
        check_keys(keys, "prepare_store")
        _require_unique(keys, "prepare_store")
        with self._lock:
            new_keys = [k for k in keys if k not in self._slots]
            need = max(0, len(new_keys) - self._num_free())
            victims = None
            if need <= self._num_by_state[SlotState.READY]:  # else no policy could find room
                victims = self._policy.admit(new_keys, need, self._evictable_except(keys))
            if victims is None:
                self._counters["store_rejections"] += 1
                return None
            for key in victims:
                self._release(self._slots.pop(key))
            self._readable_keys.difference_update(victims)
            self._counters["evicted_blocks"] += len(victims)
            self._emit(victims, removed=True)
            slot_ids = [self._allocate(key) for key in new_keys]
            return PrepareStoreOutput(tuple(new_keys), CPULoadStoreSpec(slot_ids), tuple(victims))

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        """Publish written blocks (READY), or free their slots when the write failed.

        ``keys`` are the ``keys_to_store`` of a ``prepare_store``: each must be WRITING.
        """
        with self._lock:
            slots = [self._held(key, "complete_store") for key in keys]
            _require_unique(keys, "complete_store")
            for key, slot in zip(keys, slots):
                if slot.state is not SlotState.WRITING:
                    raise StateError(
                        f"complete_store: key {key!r} is {slot.state.value}, not writing; "
                        "a store completes once, with the keys_to_store of its prepare_store"
                    )
            if success:
                for slot in slots:
                    self._move(slot, SlotState.READY)
                self._readable_keys.update(keys)
                self._counters["stored_blocks"] += len(slots)
                self._emit(keys, removed=False)
            else:
                for key, slot in zip(keys, slots):
                    self._policy.remove(key)
                    self._release(self._slots.pop(key))
                self._counters["failed_store_blocks"] += len(slots)

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
            if max_keys is None:
                taken, self._events = self._events, []
                return taken
            taken = []
            budget = max_keys
            while self._events and budget > 0:
                event = self._events[0]
                if len(event.keys) <= budget:
                    taken.append(self._events.pop(0))
                    budget -= len(event.keys)
                else:
                    head, rest = event.keys[:budget], event.keys[budget:]
                    taken.append(OffloadingEvent(head, event.removed, event.medium))
                    self._events[0] = OffloadingEvent(rest, event.removed, event.medium)
                    budget = 0
            return taken

    def reset(self) -> None:
        """Forget every block (a removed event for the readable ones); counters are kept.

        Loads and stores in flight become unknown keys: the caller must not let their
        transfers touch the region after this returns.
        """
        with self._lock:
            readable = [k for k, s in self._slots.items() if s.state is not SlotState.WRITING]
            self._emit(readable, removed=True)
            events = self._events
            self._policy.clear()
            self._clear_index()
            self._events = events

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
            )

    # ------------------------------------------------------------------ internals

    def _held(self, key: bytes, verb: str) -> _Slot:
        if type(key) is not bytes:
            check_keys([key], verb)
        slot = self._slots.get(key)
        if slot is None:
            raise UnknownKeyError(f"{verb}: key {key!r} is not in the cache index")
        return slot

    def _readable_slot(self, key: bytes, verb: str) -> _Slot:
        slot = self._held(key, verb)
        if slot.state is SlotState.WRITING:
            raise StateError(f"{verb}: key {key!r} is still being written; wait for complete_store")
        return slot

    def _evictable_except(self, protected_keys: Sequence[bytes]):
        protected = set(protected_keys)
        slots = self._slots
        ready = SlotState.READY
        return lambda key: slots[key].state is ready and key not in protected

    def _num_free(self) -> int:
        return self._capacity - len(self._slots)

    def _allocate(self, key: bytes) -> int:
        if self._free:
            slot_id = self._free.pop()
        else:
            slot_id = self._next_fresh
            self._next_fresh += 1
        assert slot_id < self._capacity, "allocated past capacity: free-slot accounting is broken"
        self._slots[key] = _Slot(slot_id)
        self._num_by_state[SlotState.WRITING] += 1
        return slot_id

    def _release(self, slot: _Slot) -> None:
        assert slot.loads == 0 and slot.state is not SlotState.LOADING, "released a slot being read"
        self._num_by_state[slot.state] -= 1
        self._free.append(slot.slot_id)

    def _move(self, slot: _Slot, state: SlotState) -> None:
        self._num_by_state[slot.state] -= 1
        self._num_by_state[state] += 1
        slot.state = state

    def _emit(self, keys: Sequence[bytes], removed: bool) -> None:
        if self._events_enabled and keys:
            self._events.append(OffloadingEvent(tuple(keys), removed))

"""The values the cache index hands out: what to store, leases, session releases, events and
stats. Frozen dataclasses; the manager (``tiercache.index.manager``) re-exports them.
``BlockSource`` and ``TierStats`` belong to the lower tiers' contract
(``tiercache.index.lower_tier``) and are re-exported here."""

from __future__ import annotations

from dataclasses import dataclass, field

from tiercache.errors import SpecError
from tiercache.index.lower_tier import BlockSource, TierStats
from tiercache.specs import CPULoadStoreSpec, Medium

__all__ = ["BlockSource", "LeaseResult", "ManagerStats", "OffloadingEvent", "PrepareStoreOutput",
           "SessionRelease", "TierStats"]


@dataclass(frozen=True, eq=False)
class PrepareStoreOutput:
    """What to write: ``keys_to_store[i]`` goes to ``store_spec.block_ids[i]``.

    Keys of the call that were already held (ready or being written) are not in
    ``keys_to_store``; ``evicted_keys`` were dropped to make room. ``no_room_keys``: keys
    not held that got no slot in a reservation ahead (``max_evictions`` given: free slots
    and at most that many evictions); always empty for a store (all or nothing).
    """

    keys_to_store: tuple[bytes, ...]
    store_spec: CPULoadStoreSpec
    evicted_keys: tuple[bytes, ...]
    no_room_keys: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class LeaseResult:
    """``num_hit``: the leading run of readable keys, each now pinned once by the caller
    (release it with ``release``). ``pending``: the key right after that run is being
    written (vLLM's HIT_PENDING: worth asking again soon). ``spec``: the run's slots,
    co-indexed with it and fenced like a ``prepare_load`` answer (region id, generations):
    what a load of the run reads, under the lease's own pins, so no ``prepare_load`` is
    needed. Built by hand (tests) it may be left out; equality compares ``num_hit`` and
    ``pending`` only (a spec has no value equality). ``promoted``: positions in the run of
    blocks that came up from a tier below host memory, and ``sources`` (co-indexed) which
    tier each came from (vLLM reports them as DISK or P2P hits)."""

    num_hit: int
    pending: bool
    spec: CPULoadStoreSpec | None = field(default=None, compare=False)
    promoted: tuple[int, ...] = field(default=(), compare=False)
    sources: tuple[BlockSource, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if len(self.sources) != len(self.promoted):
            raise SpecError(f"{len(self.promoted)} promoted positions with "
                            f"{len(self.sources)} sources; one source per position")
        if self.spec is not None and len(self.spec) != self.num_hit:
            raise SpecError(f"a lease of {self.num_hit} hits with {len(self.spec)} slots; "
                             "one slot per hit")


@dataclass(frozen=True)
class SessionRelease:
    """What ``end_session`` gave back: reservations freed and pins dropped."""

    freed_writing: int
    dropped_pins: int


@dataclass(frozen=True)
class OffloadingEvent:
    """Blocks that became readable (``removed=False``) or left the cache (``removed=True``)."""

    keys: tuple[bytes, ...]
    removed: bool
    medium: str = Medium.CPU.value


@dataclass(frozen=True)
class ManagerStats:
    """A consistent snapshot: lifetime counters (never reset) and gauges in blocks.

    ``free + writing + ready + loading + quarantined == capacity``; ``loading`` counts every
    pinned block (a load's or a lease's); ``quarantined`` slots are held out after a write
    that may still land. ``recovered_blocks`` came back from the ledger, with
    ``recovered_pins`` and ``recovered_writing_blocks`` of surviving sessions, and
    ``damaged_records`` were dropped; ``sessions_ended``, ``released_writing_blocks`` and
    ``released_pins`` count what ended sessions gave back; ``expired_reservations``: never
    completed; ``session_limit_rejections``: calls refused at ``max_session_blocks``.
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
    leased_blocks: int = 0
    recovered_blocks: int = 0
    sessions_ended: int = 0
    released_writing_blocks: int = 0
    released_pins: int = 0
    recovered_pins: int = 0
    recovered_writing_blocks: int = 0
    damaged_records: int = 0
    expired_reservations: int = 0
    session_limit_rejections: int = 0
    quarantined_blocks: int = 0

    @property
    def occupancy(self) -> float:
        """Fraction of slots not free (pending writes count as used)."""
        return (self.capacity_blocks - self.free_blocks) / self.capacity_blocks

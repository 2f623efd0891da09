"""The values the cache index hands out and the control plane carries: what to store,
leases, session releases, events and stats, and where a block came from. Frozen
dataclasses and enums, plain Python: the coordinator's index makes them, and the engines'
side of the control plane (``tiercache.link.client``) decodes them, so they stand in
the foundation, under both (an engine process never loads the index to read an answer).
``BlockSource`` and ``TierStats`` are also the lower tiers' (``tiercache.tiers.base``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from tiercache.errors import SpecError
from tiercache.specs import CPULoadStoreSpec, Medium

__all__ = ["BlockSource", "LeaseResult", "ManagerStats", "OffloadingEvent", "PrepareStoreOutput",
           "SessionRelease", "TierStats"]


class BlockSource(IntEnum):
    """Where a block in host memory came from (its wire code is the value; ``label`` names
    the tier in metrics and status): an engine stored it, or a tier below promoted it."""

    HOST = 0
    DISK = 1
    CLUSTER = 2

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass
class TierStats:
    """Counters (lifetime) and gauges of a tier below host memory (disk or cluster)."""

    capacity_blocks: int = 0
    used_blocks: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    promotions: int = 0
    demotions: int = 0
    dropped_spills: int = 0
    queued_blocks: int = 0  # waiting to be written (disk: demotions; cluster: publishes)
    calls_in_flight: int = 0  # disk: promotion/demotion jobs; cluster: calls to the pool
    checksum_failures: int = 0
    errors: int = 0
    rebuilt_blocks: int = 0
    up: bool = True
    direct_io: bool = False
    promoting: bool = True  # False: promotions stopped (too many host slots held out)
    held_buffers: int = 0  # transfer buffers held out: a read into them may still land


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
    tier each came from (vLLM reports them as DISK or P2P hits): told to the first lease
    that holds the block after its promotion only; later leases of it read host memory."""

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

    ``free + writing + ready + loading + quarantined == capacity``, the slots whose memory
    is reserved (all of them once the region's reservation completes); ``loading`` counts every
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

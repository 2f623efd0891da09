"""Prometheus metrics: one collector that reads shared state at scrape time.

The coordinator builds a ``TiercacheCollector(region, manager_stats=control.stats)`` over
the region it owns and the index it hosts, serves it with ``start_exporter(config.exporter,
collector)`` (``tiercache.metrics.exporter``, re-exported here) and closes the exporter
before it unmaps the region. Each scrape reads, per rank, a consistent snapshot of each of
its attachment blocks (one per worker process attached to the rank, each its block's single
writer: ``region.stats``, ``region.attachments``), checks the recorded worker pids, and
reads the region header (its state and reservation) and the index counters. Nothing is
cached between scrapes but each block's last consistent snapshot: a worker SIGKILLed
mid-update leaves its block odd for good, and the rank is still reported (as down, with
its last counters) rather than fail the scrape.

Per-rank families aggregate the rank's attachments (``RankSummary``): counters and
histograms are sums over every block the rank ever used, live or not (a block keeps its
counters when its process dies and the next holder of the slot continues from them), so
they never go backwards; ``worker_up`` is 1 while any attachment is up. Where the
attachment is the point (up, pid, pin state, bytes moved) ``tiercache_attachment_*`` carry
an ``attachment`` label: the slot, bounded by ``region.attachments_per_rank`` (not a pid).

Metric names, types and labels are a contract users and dashboards rely on (README
"Metrics and dashboards", docs/observability.md). ``Family`` lists every family once, in
exposition order; ``METRIC_NAMES`` (their names on the wire) is derived from it, and the
dashboards' tests check their queries against it.
"""

from __future__ import annotations

import itertools
import logging
import platform
from collections.abc import Callable, Iterator, Mapping
from enum import Enum
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from tiercache import __version__
from tiercache.metrics.exporter import Exporter, start_exporter
from tiercache.numa.placement import NumaPlacement, NumaState
from tiercache.region.header import HeaderInfo, RegionState, Reservation
from tiercache.region.attachments import AttachmentReader, RankSummary
from tiercache.region.layout import FORMAT_VERSION, RegionLayout
from tiercache.region.stats import (
    DURATION_BUCKETS_S, SIZE_BUCKETS_BYTES, EngineKind, PinState, RankStats,
)
from tiercache.specs import Direction

if TYPE_CHECKING:
    from tiercache.index.manager import ManagerStats

log = logging.getLogger(__name__)

_DURATION_LE = tuple(floatToGoString(b) for b in DURATION_BUCKETS_S) + ("+Inf",)
_SIZE_LE = tuple(floatToGoString(b) for b in SIZE_BUCKETS_BYTES) + ("+Inf",)
INDEX_BLOCK_STATES = ("free", "writing", "ready", "loading", "quarantined")
_RANK, _RANK_DIR = ("rank",), ("rank", "direction")
_ATTACHMENT = ("rank", "attachment")
_TYPES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily,
          "histogram": HistogramMetricFamily}


class Family(Enum):
    """Every metric family, in exposition order: (type, name, help, labels), and for the
    index's lifetime counters the ``ManagerStats`` field they export. Counter names are
    given without ``_total`` (the client library adds it on the wire)."""

    BUILD_INFO = ("gauge", "tiercache_build_info", "tiercache build; the value is always 1.",
                  ("version", "region_format", "python_version"))
    REGION_BYTES = ("gauge", "tiercache_region_bytes",
                    "Size of the shared-memory region (header and all slices).")
    REGION_BLOCK_BYTES = ("gauge", "tiercache_region_block_bytes",
                          "Region bytes one cached block takes, all ranks together.")
    REGION_RANKS = ("gauge", "tiercache_region_ranks",
                    "Ranks (worker slices) the region is partitioned into.")
    REGION_STATE = ("gauge", "tiercache_region_state",
                    "1 for the region header's current lifecycle state, else 0.", ("state",))
    REGION_GENERATION = ("gauge", "tiercache_region_generation",
                         "How many times a coordinator has (re)adopted the region.")
    REGION_RESERVATION = ("gauge", "tiercache_region_reservation", "1 for the state of the "
                          "region's reservation (failed: /dev/shm ran out), else 0.", ("state",))
    RESERVED_BYTES = ("gauge", "tiercache_region_reserved_bytes",
                      "Bytes of the rank's slice reserved (fallocated) in /dev/shm so far.", _RANK)
    WORKER_UP = ("gauge", "tiercache_worker_up",
                 "1 while any worker process attached to the rank is alive, else 0.", _RANK)
    ATTACHES = ("counter", "tiercache_worker_attaches",
                "Times a worker attached this rank (all attachment slots).", _RANK)
    HEARTBEAT = ("gauge", "tiercache_worker_heartbeat_timestamp_seconds",
                 "Wall-clock time of the rank's last stats update (Unix seconds).", _RANK)
    READ_FAILURES = ("counter", "tiercache_stats_read_failures",
                     "Scrapes that found one of the rank's stats blocks mid-update and exported "
                     "its last snapshot.", _RANK)
    REGION_PINNED = ("gauge", "tiercache_region_pinned",
                     "1 when the rank's slice is pinned for its GPU (by every live attachment), "
                     "else 0.", _RANK)
    PIN_STATE = ("gauge", "tiercache_pin_state",
                 "1 for the rank's current pin state (the worst of its live attachments), else 0.",
                 _RANK + ("state",))
    PINNED_BYTES = ("gauge", "tiercache_pinned_bytes",
                    "Bytes of the rank's slice registered with the GPU driver, summed over its "
                    "live attachments (each process registers its own).", _RANK)
    PIN_SECONDS = ("gauge", "tiercache_pin_duration_seconds",
                   "Time the rank's pinning (registration) took (the slowest attachment).", _RANK)
    PREFAULT_SECONDS = ("gauge", "tiercache_prefault_duration_seconds",
                        "Time the rank's worker took to pre-fault its slice at attach (the "
                        "slowest attachment).", _RANK)
    NUMA_NODE = ("gauge", "tiercache_numa_node",
                 "NUMA node of the device the rank's worker copies to and from (its GPU's), "
                 "where its slice belongs; -1 when not known.", _RANK)
    NUMA_LOCAL_RATIO = ("gauge", "tiercache_numa_local_ratio",
                        "Fraction of the rank's slice pages on that node (0-1), counted by "
                        "the worker at attach; absent when not counted.", _RANK)
    NUMA_PLACEMENT = ("gauge", "tiercache_numa_placement",
                      "1 for the state of the rank's slice placement (the worst of its live "
                      "attachments'), else 0.", _RANK + ("state",))
    BACKEND = ("gauge", "tiercache_transfer_backend_info",
               "Copy backend of the rank's handlers per direction; the value is always 1.",
               _RANK_DIR + ("backend",))
    ATTACHMENT_UP = ("gauge", "tiercache_attachment_up",
                     "1 while the worker process holding this attachment slot is alive, else 0.",
                     _ATTACHMENT)
    ATTACHMENT_PID = ("gauge", "tiercache_attachment_pid",
                      "Process id of the attachment's worker (0 after it detached).", _ATTACHMENT)
    ATTACHMENT_PIN_STATE = ("gauge", "tiercache_attachment_pin_state",
                            "1 for the attachment's pin state, else 0.", _ATTACHMENT + ("state",))
    ATTACHMENT_ENGINE = ("gauge", "tiercache_attachment_engine", "1 for the kind of process "
                         "holding the slot (worker: a GPU worker, e.g. a vLLM rank; sglang: an "
                         "SGLang rank copying host to host), else 0.", _ATTACHMENT + ("engine",))
    ATTACHMENT_BYTES = ("counter", "tiercache_attachment_transfer_bytes",
                        "Bytes moved by successful transfers through this attachment slot (all "
                        "its holders); the rank's tiercache_transfer_bytes_total is the sum.",
                        _ATTACHMENT + ("direction",))
    TRANSFER_BYTES = ("counter", "tiercache_transfer_bytes",
                      "Bytes moved by successful transfers.", _RANK_DIR)
    TRANSFER_SECONDS = ("counter", "tiercache_transfer_seconds",
                        "Busy time of successful transfers (GPU-event timed; wall time on the "
                        "cpu backend).", _RANK_DIR)
    TRANSFERS = ("counter", "tiercache_transfers", "Finished transfers by outcome.",
                 _RANK_DIR + ("outcome",))
    DURATION = ("histogram", "tiercache_transfer_duration_seconds",
                "Duration of successful transfers.", _RANK_DIR)
    SIZE = ("histogram", "tiercache_transfer_size_bytes", "Bytes per successful transfer.",
            _RANK_DIR)
    INDEX_LOOKUPS = ("counter", "tiercache_index_lookups",
                     "Lookup calls answered by the cache index.", (), "lookups")
    INDEX_HIT_BLOCKS = ("counter", "tiercache_index_hit_blocks",
                        "Blocks that lookups found stored and READY.", (), "hit_blocks")
    INDEX_MISS_BLOCKS = ("counter", "tiercache_index_miss_blocks",
                         "Blocks that lookups asked for and did not find.", (), "miss_blocks")
    INDEX_STORED_BLOCKS = ("counter", "tiercache_index_stored_blocks",
                           "Blocks whose store completed successfully.", (), "stored_blocks")
    INDEX_LOADED_BLOCKS = ("counter", "tiercache_index_loaded_blocks",
                           "Blocks handed out by prepare_load (leases are counted as "
                           "leased blocks).", (), "loaded_blocks")
    INDEX_STORE_REJECTIONS = ("counter", "tiercache_index_store_rejections",
                              "prepare_store calls refused for lack of evictable room.", (),
                              "store_rejections")
    INDEX_EVICTED_BLOCKS = ("counter", "tiercache_index_evicted_blocks",
                            "Blocks evicted to make room.", (), "evicted_blocks")
    INDEX_FAILED_STORE_BLOCKS = ("counter", "tiercache_index_failed_store_blocks",
                                 "Blocks whose store completed with failure (slots freed).", (),
                                 "failed_store_blocks")
    INDEX_LEASED_BLOCKS = ("counter", "tiercache_index_leased_blocks",
                           "Blocks pinned by leases (lookups that hold their hits until released).",
                           (), "leased_blocks")
    INDEX_RECOVERED_BLOCKS = ("counter", "tiercache_index_recovered_blocks",
                              "READY blocks rebuilt from the region's ledger when the coordinator "
                              "started.", (), "recovered_blocks")
    INDEX_SESSIONS_ENDED = ("counter", "tiercache_index_sessions_ended",
                            "Client sessions ended (connection gone for longer than the grace "
                            "period).", (), "sessions_ended")
    INDEX_SESSION_RELEASED_BLOCKS = ("counter", "tiercache_index_session_released_blocks",
                                     "Reserved (writing) slots freed because the client session "
                                     "that reserved them ended.", (), "released_writing_blocks")
    INDEX_SESSION_RELEASED_PINS = ("counter", "tiercache_index_session_released_pins",
                                   "Pins (loads and leases) dropped because the client session "
                                   "that held them ended.", (), "released_pins")
    INDEX_RECOVERED_PINS = ("counter", "tiercache_index_recovered_pins",
                            "Pins of live sessions rebuilt from the region's ledger when the "
                            "coordinator started (loads in flight across a restart).", (),
                            "recovered_pins")
    INDEX_RECOVERED_WRITING = ("counter", "tiercache_index_recovered_writing_blocks",
                               "Reservations of live sessions rebuilt from the region's ledger "
                               "when the coordinator started.", (), "recovered_writing_blocks")
    INDEX_DAMAGED_RECORDS = ("counter", "tiercache_index_damaged_records",
                             "Ledger records that failed their checksum when the index was "
                             "rebuilt (dropped, never served).", (), "damaged_records")
    INDEX_EXPIRED_RESERVATIONS = ("counter", "tiercache_index_expired_reservations",
                                  "Reservations freed because they were not completed within "
                                  "index.reservation_timeout_s.", (), "expired_reservations")
    INDEX_SESSION_LIMIT_REJECTIONS = ("counter", "tiercache_index_session_limit_rejections",
                                      "Calls refused because a session would hold more than "
                                      "index.max_session_share of the cache.", (),
                                      "session_limit_rejections")
    TIER_UP = ("gauge", "tiercache_tier_up",
               "1 while the tier serves; 0 while it is marked down (disk: after I/O errors; "
               "cluster: the pool's master unreachable).",
               ("tier",), "up")
    TIER_PROMOTING = ("gauge", "tiercache_tier_promoting",
                      "1 while the tier promotes what lookups find in it; 0 once promotions "
                      "stopped (cluster: too many host slots held out after reads that may "
                      "still land).", ("tier",), "promoting")
    TIER_DIRECT_IO = ("gauge", "tiercache_tier_direct_io",
                      "1 when the tier reads and writes with O_DIRECT, 0 for buffered I/O.",
                      ("tier",), "direct_io")
    TIER_CAPACITY = ("gauge", "tiercache_tier_capacity_blocks", "Blocks the tier can hold.",
                     ("tier",), "capacity_blocks")
    TIER_BLOCKS = ("gauge", "tiercache_tier_blocks", "Blocks the tier holds.", ("tier",),
                   "used_blocks")
    TIER_READ_BYTES = ("counter", "tiercache_tier_read_bytes", "Bytes read from the tier.",
                       ("tier",), "read_bytes")
    TIER_WRITE_BYTES = ("counter", "tiercache_tier_write_bytes", "Bytes written to the tier.",
                        ("tier",), "write_bytes")
    TIER_READ_SECONDS = ("counter", "tiercache_tier_read_seconds",
                         "Seconds spent reading blocks from the tier.", ("tier",),
                         "read_seconds")
    TIER_WRITE_SECONDS = ("counter", "tiercache_tier_write_seconds",
                          "Seconds spent writing blocks to the tier.", ("tier",),
                          "write_seconds")
    TIER_PROMOTIONS = ("counter", "tiercache_tier_promotions",
                       "Blocks promoted from the tier into host memory.", ("tier",),
                       "promotions")
    TIER_DEMOTIONS = ("counter", "tiercache_tier_demotions",
                      "Blocks written to the tier (disk: ahead of their eviction from host "
                      "memory; cluster: published to the pool).", ("tier",), "demotions")
    TIER_DROPPED_SPILLS = ("counter", "tiercache_tier_dropped_spills",
                           "Blocks not written to the tier (not admitted under pressure, queue "
                           "full, evicted first, no slot free, the tier down or the write "
                           "failed).", ("tier",), "dropped_spills")
    TIER_QUEUED = ("gauge", "tiercache_tier_queued_blocks",
                   "Blocks waiting to be written to the tier (disk: demotions; cluster: the "
                   "publish queue).", ("tier",), "queued_blocks")
    TIER_CALLS_IN_FLIGHT = ("gauge", "tiercache_tier_calls_in_flight",
                            "Calls to the tier's medium under way (disk: promotion and "
                            "demotion jobs; cluster: exists, get and put calls to the pool and "
                            "the health probe). Stuck at the thread count: a hung disk or a "
                            "master that does not answer.", ("tier",), "calls_in_flight")
    TIER_HELD_BUFFERS = ("gauge", "tiercache_tier_held_buffers",
                         "Transfer buffers held out of use because a read the tier gave up "
                         "on may still land in them (cluster: staging areas; never a host "
                         "slot).", ("tier",), "held_buffers")
    TIER_CHECKSUM_FAILURES = ("counter", "tiercache_tier_checksum_failures",
                              "Blocks read from the tier whose checksum failed (dropped, "
                              "never served).", ("tier",), "checksum_failures")
    TIER_ERRORS = ("counter", "tiercache_tier_errors", "I/O errors of the tier.", ("tier",),
                   "errors")
    TIER_REBUILT_BLOCKS = ("counter", "tiercache_tier_rebuilt_blocks",
                           "Blocks found in the tier when the coordinator started.", ("tier",),
                           "rebuilt_blocks")
    INDEX_CAPACITY = ("gauge", "tiercache_index_capacity_blocks",
                      "Slots of the cache index (CPU blocks) whose memory is reserved.")
    INDEX_BLOCKS = ("gauge", "tiercache_index_blocks",
                    "Slots by state; the states sum to the capacity.", ("state",))
    OCCUPANCY = ("gauge", "tiercache_index_occupancy_ratio", "Fraction of slots not free (0-1).")

    def __init__(self, kind: str, metric: str, doc: str, labels: tuple[str, ...] = (),
                 index_stat: str | None = None):
        self.kind, self.metric, self.doc, self.labels = kind, metric, doc, labels
        self.read_stat = None if index_stat is None else attrgetter(index_stat)

    @property
    def wire_name(self) -> str:
        return self.metric + "_total" if self.kind == "counter" else self.metric

    @property
    def of_tiers(self) -> bool:
        """Exported only by a coordinator with a tier below host memory."""
        return self.metric.startswith("tiercache_tier_")

    @property
    def of_index(self) -> bool:
        """Exported only by a process that hosts the cache index."""
        return self.metric.startswith("tiercache_index_")

    def new(self) -> Metric:
        return _TYPES[self.kind](self.metric, self.doc, labels=list(self.labels))


METRIC_NAMES: tuple[str, ...] = tuple(f.wire_name for f in Family)
_INDEX_COUNTERS = tuple((f, f.read_stat) for f in Family if f.read_stat is not None and f.of_index)
_TIER_FAMILIES = tuple((f, f.read_stat) for f in Family if f.of_tiers and f.read_stat is not None)
# the client's counter, gauge and histogram families: add_metric's arguments differ by kind
Families = dict[Family, Any]


def _families(include_index: bool, include_tiers: bool = False) -> Families:
    """Fresh, empty families for one scrape (or for ``describe``), in ``Family`` order."""
    return {f: f.new() for f in Family
            if (include_index or not f.of_index) and (include_tiers or not f.of_tiers)}


class RegionView(Protocol):
    """What the collector reads from the region (``SharedOffloadRegion`` satisfies it)."""

    layout: RegionLayout

    def info(self) -> HeaderInfo:
        """The header as it is now."""

    def stats(self, rank: int, slot: int | None = None) -> RankStats:
        """The reader view of ``rank``'s stats block of attachment ``slot``."""

    def slot_held(self, rank: int, slot: int) -> bool:
        """Whether any process holds ``rank``'s attachment ``slot``."""


class TiercacheCollector(Collector):
    """Everything the region, its workers and the cache index know, read per scrape.

    ``region``: the coordinator's mapping (layout, header, one stats block per rank).
    ``manager_stats``: returns a consistent ``ManagerStats`` of the cache index, or
    ``None`` when this process hosts no index (the index families are then left out).
    ``collect`` may run in several scrape threads at once; it raises only what the
    region header or ``manager_stats`` raise.
    """

    def __init__(self, region: RegionView,
                 manager_stats: Callable[[], ManagerStats] | None = None,
                 tier_stats: Callable[[], Mapping[str, object]] | None = None):
        self._region = region
        self._layout = region.layout
        self._reader = AttachmentReader(region, self._layout)
        self._manager_stats = manager_stats
        self._tier_stats = tier_stats  # tier name -> its stats (``TierStats``)

    def describe(self) -> Iterator[Metric]:
        """Names only: registering must not read shared memory."""
        yield from _families(self._manager_stats is not None,
                             self._tier_stats is not None).values()

    def collect(self) -> Iterator[Metric]:
        f = _families(self._manager_stats is not None, self._tier_stats is not None)
        if self._tier_stats is not None:
            for tier, stats in self._tier_stats().items():
                for family, read_stat in _TIER_FAMILIES:
                    f[family].add_metric([tier], float(read_stat(stats)))
        self._collect_region(f, self._region.info())
        for rank in range(self._layout.world_size):
            self._collect_rank(f, self._reader.read(rank))
        for message in self._reader.take_errors():
            log.warning("%s; exporting the block's last consistent snapshot", message)
        if self._manager_stats is not None:
            self._collect_index(f, self._manager_stats())
        yield from f.values()

    # ------------------------------------------------------------ parts
    def _collect_region(self, f: Families, header: HeaderInfo) -> None:
        layout = self._layout
        f[Family.BUILD_INFO].add_metric(
            [__version__, str(FORMAT_VERSION), platform.python_version()], 1)
        f[Family.REGION_BYTES].add_metric([], layout.total_bytes)
        f[Family.REGION_BLOCK_BYTES].add_metric([], layout.row_stride * layout.world_size)
        f[Family.REGION_RANKS].add_metric([], layout.world_size)
        for state in RegionState:
            f[Family.REGION_STATE].add_metric([state.label], 1 if header.state == state else 0)
        f[Family.REGION_GENERATION].add_metric([], header.generation)
        for r in Reservation:
            f[Family.REGION_RESERVATION].add_metric([r.label], int(header.reservation == r))
        for rank in range(layout.world_size):
            f[Family.RESERVED_BYTES].add_metric([str(rank)], header.reserved_bytes(rank))

    def _collect_rank(self, f: Families, summary: RankSummary) -> None:
        rank = str(summary.rank)
        f[Family.READ_FAILURES].add_metric([rank], self._reader.read_failures[summary.rank])
        if not summary.readable:
            f[Family.WORKER_UP].add_metric([rank], 0)
            return
        current = summary.current
        pin_state = summary.pin_state
        for family, value in ((Family.WORKER_UP, 1 if summary.up else 0),
                              (Family.ATTACHES, summary.attach_count),
                              (Family.HEARTBEAT, summary.heartbeat_ns / 1e9),
                              (Family.REGION_PINNED, 1 if pin_state == PinState.PINNED else 0)):
            f[family].add_metric([rank], value)
        for state in PinState:
            f[Family.PIN_STATE].add_metric([rank, state.label], 1 if pin_state == state else 0)
        for family, value in ((Family.PINNED_BYTES, sum(s.pinned_bytes for s in current)),
                              (Family.PIN_SECONDS, max(s.pin_seconds for s in current)),
                              (Family.PREFAULT_SECONDS, max(s.prefault_seconds for s in current))):
            f[family].add_metric([rank], value)
        self._collect_numa(f, rank, summary.numa)
        directions = summary.directions
        for direction in Direction:
            d = directions[direction]
            labels = [rank, direction.label]
            for backend in sorted({s.backends[direction].label for s in current}):
                f[Family.BACKEND].add_metric(labels + [backend], 1)
            f[Family.TRANSFER_BYTES].add_metric(labels, d.bytes_total)
            f[Family.TRANSFER_SECONDS].add_metric(labels, d.busy_seconds_total)
            f[Family.TRANSFERS].add_metric(labels + ["ok"], d.transfers_ok)
            f[Family.TRANSFERS].add_metric(labels + ["failed"], d.transfers_failed)
            f[Family.DURATION].add_metric(labels, _cumulative(_DURATION_LE, d.duration_counts),
                                          d.busy_seconds_total)
            f[Family.SIZE].add_metric(labels, _cumulative(_SIZE_LE, d.size_counts),
                                      d.bytes_total)
        self._collect_attachments(f, summary)

    @staticmethod
    def _collect_numa(f: Families, rank: str, numa: NumaPlacement) -> None:
        f[Family.NUMA_NODE].add_metric([rank], -1 if numa.node is None else numa.node)
        if numa.local_ratio is not None:
            f[Family.NUMA_LOCAL_RATIO].add_metric([rank], numa.local_ratio)
        for state in NumaState:
            f[Family.NUMA_PLACEMENT].add_metric([rank, state.label],
                                                1 if numa.state == state else 0)

    @staticmethod
    def _collect_attachments(f: Families, summary: RankSummary) -> None:
        """One series set per slot ever claimed (``attachment`` = slot number)."""
        rank = str(summary.rank)
        for a in summary.attachments:
            labels = [rank, str(a.slot)]
            f[Family.ATTACHMENT_UP].add_metric(labels, 1 if a.up else 0)
            f[Family.ATTACHMENT_PID].add_metric(labels, a.snapshot.pid)
            for state in PinState:
                f[Family.ATTACHMENT_PIN_STATE].add_metric(
                    labels + [state.label], 1 if a.snapshot.pin_state == state else 0)
            for engine in EngineKind:
                f[Family.ATTACHMENT_ENGINE].add_metric(
                    labels + [engine.label], 1 if a.snapshot.engine == engine else 0)
            for direction in Direction:
                f[Family.ATTACHMENT_BYTES].add_metric(
                    labels + [direction.label], a.snapshot.directions[direction].bytes_total)

    def _collect_index(self, f: Families, stats: ManagerStats) -> None:
        for family, read_stat in _INDEX_COUNTERS:
            f[family].add_metric([], read_stat(stats))
        f[Family.INDEX_CAPACITY].add_metric([], stats.capacity_blocks)
        by_state = (stats.free_blocks, stats.writing_blocks, stats.ready_blocks,
                    stats.loading_blocks, stats.quarantined_blocks)
        for state, blocks in zip(INDEX_BLOCK_STATES, by_state, strict=True):
            f[Family.INDEX_BLOCKS].add_metric([state], blocks)
        f[Family.OCCUPANCY].add_metric([], stats.occupancy)


def _cumulative(les: tuple[str, ...], counts: tuple[int, ...]) -> list[tuple[str, int]]:
    """Per-bucket counts (as stored) to Prometheus' cumulative ``le`` buckets."""
    return list(zip(les, itertools.accumulate(counts), strict=True))


__all__ = ["Exporter", "Family", "METRIC_NAMES", "RegionView", "TiercacheCollector",
           "start_exporter"]

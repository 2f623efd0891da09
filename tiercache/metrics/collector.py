"""Prometheus metrics: one collector that reads shared state at scrape time.

The coordinator builds a ``TiercacheCollector`` over the region it owns and the cache
index it hosts, and serves it with ``start_exporter`` (``tiercache.metrics.exporter``,
re-exported here)::

    collector = TiercacheCollector(region, manager_stats=control.stats)
    exporter = start_exporter(config.exporter, collector)   # when config.exporter.enabled
    ...
    exporter.close()          # before the region is unmapped

Each scrape reads, per rank, a consistent snapshot of the stats block (the worker is
its single writer, see ``tiercache.region.stats``), checks the recorded worker pid, and reads
the region header and the index counters. Nothing is cached between scrapes except
each rank's last consistent snapshot: a worker SIGKILLed between the two sequence
bumps of a stats update leaves its block odd for good, and the rank must still be
reported (as down, with its last counters) rather than fail the scrape.

Metric names, types and labels are the contract of DESIGN §7. ``METRIC_NAMES`` lists
every family as it appears on the wire; the dashboards' tests check their queries
against it.
"""

from __future__ import annotations

import logging
import platform
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

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
from tiercache.region.header import HeaderInfo, RegionState
from tiercache.region.hostmem import process_alive
from tiercache.region.layout import FORMAT_VERSION, RegionLayout
from tiercache.region.stats import (
    DURATION_BUCKETS_S,
    SIZE_BUCKETS_BYTES,
    Direction,
    PinState,
    RankStats,
    RankStatsSnapshot,
)

if TYPE_CHECKING:
    from tiercache.index.manager import ManagerStats

log = logging.getLogger(__name__)

_DURATION_LE = tuple(floatToGoString(b) for b in DURATION_BUCKETS_S) + ("+Inf",)
_SIZE_LE = tuple(floatToGoString(b) for b in SIZE_BUCKETS_BYTES) + ("+Inf",)
INDEX_BLOCK_STATES = ("free", "writing", "ready", "loading")

# (reader, metric, help) of the index's lifetime counters.
_INDEX_COUNTERS: tuple[tuple[Callable[[ManagerStats], int], str, str], ...] = (
    (lambda s: s.lookups, "tiercache_index_lookups_total",
     "Lookup calls answered by the cache index."),
    (lambda s: s.hit_blocks, "tiercache_index_hit_blocks_total",
     "Blocks that lookups found stored and READY."),
    (lambda s: s.miss_blocks, "tiercache_index_miss_blocks_total",
     "Blocks that lookups asked for and did not find."),
    (lambda s: s.stored_blocks, "tiercache_index_stored_blocks_total",
     "Blocks whose store completed successfully."),
    (lambda s: s.loaded_blocks, "tiercache_index_loaded_blocks_total",
     "Blocks handed out for loading."),
    (lambda s: s.store_rejections, "tiercache_index_store_rejections_total",
     "prepare_store calls refused for lack of evictable room."),
    (lambda s: s.evicted_blocks, "tiercache_index_evicted_blocks_total",
     "Blocks evicted to make room."),
    (lambda s: s.failed_store_blocks, "tiercache_index_failed_store_blocks_total",
     "Blocks whose store completed with failure (slots freed)."),
    (lambda s: s.leased_blocks, "tiercache_index_leased_blocks_total",
     "Blocks pinned by leases (lookups that hold their hits until released)."),
    (lambda s: s.recovered_blocks, "tiercache_index_recovered_blocks_total",
     "READY blocks rebuilt from the region's ledger when the coordinator started."),
    (lambda s: s.sessions_ended, "tiercache_index_sessions_ended_total",
     "Client sessions ended (connection gone for longer than the grace period)."),
    (lambda s: s.released_writing_blocks, "tiercache_index_session_released_blocks_total",
     "Reserved (writing) slots freed because the client session that reserved them ended."),
    (lambda s: s.released_pins, "tiercache_index_session_released_pins_total",
     "Pins (loads and leases) dropped because the client session that held them ended."),
)

METRIC_NAMES: tuple[str, ...] = (
    "tiercache_build_info",
    "tiercache_region_bytes",
    "tiercache_region_block_bytes",
    "tiercache_region_ranks",
    "tiercache_region_state",
    "tiercache_region_generation",
    "tiercache_worker_up",
    "tiercache_worker_attaches_total",
    "tiercache_worker_heartbeat_timestamp_seconds",
    "tiercache_stats_read_failures_total",
    "tiercache_region_pinned",
    "tiercache_pin_state",
    "tiercache_pinned_bytes",
    "tiercache_pin_duration_seconds",
    "tiercache_prefault_duration_seconds",
    "tiercache_transfer_backend_info",
    "tiercache_transfer_bytes_total",
    "tiercache_transfer_seconds_total",
    "tiercache_transfers_total",
    "tiercache_transfer_duration_seconds",
    "tiercache_transfer_size_bytes",
    *(name for _, name, _ in _INDEX_COUNTERS),
    "tiercache_index_capacity_blocks",
    "tiercache_index_blocks",
    "tiercache_index_occupancy_ratio",
)


class RegionView(Protocol):
    """What the collector reads from the region (``SharedOffloadRegion`` satisfies it)."""

    layout: RegionLayout

    def info(self) -> HeaderInfo:
        """The header as it is now."""

    def stats(self, rank: int) -> RankStats:
        """The reader view of ``rank``'s stats block."""


class TiercacheCollector(Collector):
    """Everything the region, its workers and the cache index know, read per scrape.

    ``region``: the coordinator's mapping (layout, header, one stats block per rank).
    ``manager_stats``: returns a consistent ``ManagerStats`` of the cache index, or
    ``None`` when this process hosts no index (the index families are then left out).
    ``collect`` may run in several scrape threads at once; it raises only what the
    region header or ``manager_stats`` raise.
    """

    def __init__(self, region: RegionView,
                 manager_stats: Callable[[], ManagerStats] | None = None):
        self._region = region
        self._layout = region.layout
        self._views = tuple(region.stats(r) for r in range(self._layout.world_size))
        self._manager_stats = manager_stats
        self._lock = threading.Lock()
        self._last: list[RankStatsSnapshot | None] = [None] * self._layout.world_size
        self._read_failures = [0] * self._layout.world_size

    def describe(self) -> Iterator[Metric]:
        """Names only: registering must not read shared memory."""
        yield from _Families(self._manager_stats is not None).all()

    def collect(self) -> Iterator[Metric]:
        f = _Families(self._manager_stats is not None)
        self._collect_region(f, self._region.info())
        for view in self._views:
            self._collect_rank(f, view)
        if self._manager_stats is not None:
            self._collect_index(f, self._manager_stats())
        yield from f.all()

    # ------------------------------------------------------------ parts
    def _collect_region(self, f: _Families, header: HeaderInfo) -> None:
        layout = self._layout
        f.build_info.add_metric([__version__, str(FORMAT_VERSION), platform.python_version()], 1)
        f.region_bytes.add_metric([], layout.total_bytes)
        f.region_block_bytes.add_metric([], layout.row_stride * layout.world_size)
        f.region_ranks.add_metric([], layout.world_size)
        for state in RegionState:
            f.region_state.add_metric([state.label], 1 if header.state == state else 0)
        f.region_generation.add_metric([], header.generation)

    def _snapshot(self, view: RankStats) -> RankStatsSnapshot | None:
        """The rank's consistent snapshot, or its last one (counted and logged) when the
        block stays mid-update; ``None`` if it was never read consistently."""
        try:
            snap = view.snapshot()
        except TimeoutError as e:
            with self._lock:
                self._read_failures[view.rank] += 1
            log.warning("%s; exporting rank %d's last consistent snapshot", e, view.rank)
            return self._last[view.rank]
        self._last[view.rank] = snap
        return snap

    def _collect_rank(self, f: _Families, view: RankStats) -> None:
        rank = str(view.rank)
        snap = self._snapshot(view)
        f.read_failures.add_metric([rank], self._read_failures[view.rank])
        if snap is None:
            f.worker_up.add_metric([rank], 0)
            return
        f.worker_up.add_metric([rank], 1 if process_alive(snap.pid, snap.pid_start_ns) else 0)
        f.attaches.add_metric([rank], snap.attach_count)
        f.heartbeat.add_metric([rank], snap.heartbeat_ns / 1e9)
        f.region_pinned.add_metric([rank], 1 if snap.pin_state == PinState.PINNED else 0)
        for state in PinState:
            f.pin_state.add_metric([rank, state.label], 1 if snap.pin_state == state else 0)
        f.pinned_bytes.add_metric([rank], snap.pinned_bytes)
        f.pin_seconds.add_metric([rank], snap.pin_seconds)
        f.prefault_seconds.add_metric([rank], snap.prefault_seconds)
        for direction in Direction:
            d = snap.directions[direction]
            labels = [rank, direction.label]
            f.backend.add_metric(labels + [snap.backends[direction].label], 1)
            f.transfer_bytes.add_metric(labels, d.bytes_total)
            f.transfer_seconds.add_metric(labels, d.busy_seconds_total)
            f.transfers.add_metric(labels + ["ok"], d.transfers_ok)
            f.transfers.add_metric(labels + ["failed"], d.transfers_failed)
            f.duration.add_metric(labels, _cumulative(_DURATION_LE, d.duration_counts),
                                  d.busy_seconds_total)
            f.size.add_metric(labels, _cumulative(_SIZE_LE, d.size_counts), d.bytes_total)

    def _collect_index(self, f: _Families, stats: ManagerStats) -> None:
        for (read, _, _), family in zip(_INDEX_COUNTERS, f.index_counters, strict=True):
            family.add_metric([], read(stats))
        f.index_capacity.add_metric([], stats.capacity_blocks)
        by_state = (stats.free_blocks, stats.writing_blocks, stats.ready_blocks,
                    stats.loading_blocks)
        for state, blocks in zip(INDEX_BLOCK_STATES, by_state, strict=True):
            f.index_blocks.add_metric([state], blocks)
        f.occupancy.add_metric([], stats.occupancy)


def _cumulative(les: tuple[str, ...], counts: tuple[int, ...]) -> list[tuple[str, float]]:
    """Per-bucket counts (as stored) to Prometheus' cumulative ``le`` buckets."""
    total, out = 0, []
    for le, count in zip(les, counts, strict=True):
        total += count
        out.append((le, total))
    return out


class _Families:
    """Fresh, empty metric families for one scrape (or for ``describe``)."""

    def __init__(self, include_index: bool):
        rank, rank_dir = ["rank"], ["rank", "direction"]
        self.build_info = GaugeMetricFamily(
            "tiercache_build_info", "tiercache build; the value is always 1.",
            labels=["version", "region_format", "python_version"])
        self.region_bytes = GaugeMetricFamily(
            "tiercache_region_bytes", "Size of the shared-memory region (header and all slices).")
        self.region_block_bytes = GaugeMetricFamily(
            "tiercache_region_block_bytes",
            "Region bytes one cached block takes, all ranks together.")
        self.region_ranks = GaugeMetricFamily(
            "tiercache_region_ranks", "Ranks (worker slices) the region is partitioned into.")
        self.region_state = GaugeMetricFamily(
            "tiercache_region_state", "1 for the region header's current lifecycle state, else 0.",
            labels=["state"])
        self.region_generation = GaugeMetricFamily(
            "tiercache_region_generation",
            "How many times a coordinator has (re)adopted the region.")
        self.worker_up = GaugeMetricFamily(
            "tiercache_worker_up", "1 while the rank's attached worker process is alive, else 0.",
            labels=rank)
        self.attaches = CounterMetricFamily(
            "tiercache_worker_attaches", "Times a worker attached this rank.", labels=rank)
        self.heartbeat = GaugeMetricFamily(
            "tiercache_worker_heartbeat_timestamp_seconds",
            "Wall-clock time of the rank's last stats update (Unix seconds).", labels=rank)
        self.read_failures = CounterMetricFamily(
            "tiercache_stats_read_failures",
            "Scrapes that found the rank's stats block mid-update and exported its last snapshot.",
            labels=rank)
        self.region_pinned = GaugeMetricFamily(
            "tiercache_region_pinned", "1 when the rank's slice is pinned for its GPU, else 0.",
            labels=rank)
        self.pin_state = GaugeMetricFamily(
            "tiercache_pin_state", "1 for the rank's current pin state, else 0.",
            labels=rank + ["state"])
        self.pinned_bytes = GaugeMetricFamily(
            "tiercache_pinned_bytes", "Bytes of the rank's slice registered with the GPU driver.",
            labels=rank)
        self.pin_seconds = GaugeMetricFamily(
            "tiercache_pin_duration_seconds", "Time the rank's pinning (registration) took.",
            labels=rank)
        self.prefault_seconds = GaugeMetricFamily(
            "tiercache_prefault_duration_seconds",
            "Time the rank's worker took to pre-fault its slice at attach.", labels=rank)
        self.backend = GaugeMetricFamily(
            "tiercache_transfer_backend_info",
            "Copy backend of the rank's handler per direction; the value is always 1.",
            labels=rank_dir + ["backend"])
        self.transfer_bytes = CounterMetricFamily(
            "tiercache_transfer_bytes", "Bytes moved by successful transfers.", labels=rank_dir)
        self.transfer_seconds = CounterMetricFamily(
            "tiercache_transfer_seconds",
            "Busy time of successful transfers (GPU-event timed; wall time on the cpu backend).",
            labels=rank_dir)
        self.transfers = CounterMetricFamily(
            "tiercache_transfers", "Finished transfers by outcome.", labels=rank_dir + ["outcome"])
        self.duration = HistogramMetricFamily(
            "tiercache_transfer_duration_seconds", "Duration of successful transfers.",
            labels=rank_dir)
        self.size = HistogramMetricFamily(
            "tiercache_transfer_size_bytes", "Bytes per successful transfer.", labels=rank_dir)
        self._include_index = include_index
        self.index_counters = [CounterMetricFamily(name.removesuffix("_total"), doc)
                               for _, name, doc in _INDEX_COUNTERS]
        self.index_capacity = GaugeMetricFamily(
            "tiercache_index_capacity_blocks", "Slots of the cache index (CPU blocks).")
        self.index_blocks = GaugeMetricFamily(
            "tiercache_index_blocks", "Slots by state; the states sum to the capacity.",
            labels=["state"])
        self.occupancy = GaugeMetricFamily(
            "tiercache_index_occupancy_ratio", "Fraction of slots not free (0-1).")

    def all(self) -> Iterator[Metric]:
        yield from (self.build_info, self.region_bytes, self.region_block_bytes,
                    self.region_ranks, self.region_state, self.region_generation,
                    self.worker_up, self.attaches, self.heartbeat, self.read_failures,
                    self.region_pinned, self.pin_state, self.pinned_bytes, self.pin_seconds,
                    self.prefault_seconds, self.backend, self.transfer_bytes,
                    self.transfer_seconds, self.transfers, self.duration, self.size)
        if self._include_index:
            yield from self.index_counters
            yield from (self.index_capacity, self.index_blocks, self.occupancy)


__all__ = ["Exporter", "METRIC_NAMES", "RegionView", "TiercacheCollector", "start_exporter"]

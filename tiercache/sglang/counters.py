"""What one SGLang rank's backend counts, and what it hands SGLang's storage metrics.

``BackendCounters`` are this process's figures (pages looked up, hit, loaded, stored,
already there, failed; calls answered while the coordinator was down; errors). They are
read by ``TierCacheHiCacheStorage.counters`` and logged at ``close``. Failed loads and
backups are also counted in the attachment's stats block in the region
(``tiercache_attachment_transfers_total{outcome="failed"}`` once the coordinator scrapes
it), so an operator sees them per SGLang rank process even while the coordinator was
down. SGLang's own ``StorageMetrics`` (pages and GB/s per prefetch and backup call) are
collected when SGLang enables storage metrics and drained by each ``get_stats``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class BackendCounters:
    """Monotonic counters; ``add`` from any thread."""

    lookups: int = 0
    hit_pages: int = 0
    miss_pages: int = 0
    loaded_pages: int = 0
    load_failed_pages: int = 0
    stored_pages: int = 0
    already_stored_pages: int = 0
    store_failed_pages: int = 0
    coordinator_down_calls: int = 0
    errors: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self)
                    if not f.name.startswith("_")}


class StorageSamples:
    """SGLang's ``StorageMetrics`` lists: pages and GB/s per call, drained by ``take``."""

    def __init__(self, page_bytes: int):
        self._gb_per_page = page_bytes / (1 << 30)
        self._lock = threading.Lock()
        self.prefetch_pgs: list[int] = []
        self.backup_pgs: list[int] = []
        self.prefetch_bandwidth: list[float] = []
        self.backup_bandwidth: list[float] = []

    def prefetch(self, pages: int, seconds: float) -> None:
        with self._lock:
            self.prefetch_pgs.append(pages)
            self.prefetch_bandwidth.append(pages * self._gb_per_page / max(seconds, 1e-9))

    def backup(self, pages: int, seconds: float) -> None:
        with self._lock:
            self.backup_pgs.append(pages)
            self.backup_bandwidth.append(pages * self._gb_per_page / max(seconds, 1e-9))

    def take(self) -> tuple[list[int], list[int], list[float], list[float]]:
        with self._lock:
            taken = (self.prefetch_pgs, self.backup_pgs, self.prefetch_bandwidth,
                     self.backup_bandwidth)
            self.prefetch_pgs, self.backup_pgs = [], []
            self.prefetch_bandwidth, self.backup_bandwidth = [], []
            return taken

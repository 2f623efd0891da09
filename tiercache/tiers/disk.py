"""The disk tier: blocks evicted from host memory go to a local file and come back as hits.

A one-way tier (``tiercache.tiers.base``): the index's tier chain decides what goes
down and comes up, reserves and pins the host slots; this tier moves bytes between those
slots (the coordinator's mapping) and its ``DiskSlotFile`` on a small pool of I/O
threads (one lane of ``tiercache.tiers.pump``), and reports. It never calls the index.
Workers and the engine's step never wait on the disk.

* **Promotions go ahead of demotions** (one priority queue): a ``PROMOTE`` job reads each
  key's slot straight into its reserved host slot and checks the data's CRC; a block that
  does not check is reported failed and its disk copy dropped, never served.
* **Demotions** (``DEMOTE`` jobs, ahead of eviction; the chain's admission decides which)
  write each pinned host block into a disk slot: a free one, else the oldest block's
  (never one being read or written), and report; the chain unpins.
* **Durable.** The tier's index (key -> disk slot) is rebuilt at start from the slots'
  headers, the newest write of a key winning. Torn or damaged slots are dropped, counted.
* **A failing disk never stops the host tier.** An I/O error is counted and logged once per
  interval; ``max_errors`` in a row mark the tier down for ``down_s``: ``holds`` says NO,
  jobs fail at once. It comes back by itself.
* **A stalled disk never stops the coordinator.** ``close(timeout_s)`` waits that long for
  the I/O in flight, reports every job never started as failed, and abandons (daemon)
  threads still in a read or write, naming them: the region's owner keeps its mapping.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace

from tiercache.tiers.base import (
    JobKind, JobResult, KeyChange, LowerTier, Presence, TierJob, TierPolicy,
)
from tiercache.results import BlockSource, TierStats
from tiercache.loglimit import LogLimiter
from tiercache.specs import Medium
from tiercache.tiers.disk_file import DiskSlotFile
from tiercache.tiers.pump import JobPump, Lane

log = logging.getLogger(__name__)

PROMOTE_BATCH = 32  # keys per promotion job (its host slots are reserved together)
DEMOTE_BATCH = 4  # keys per demotion job (pinned and unpinned together)
Rows = Callable[[int], list[memoryview]]  # a host slot -> its rows, one per rank


class DiskTier(LowerTier):
    """See the module docstring. ``rows(slot)`` gives a host slot's rows, one writable
    memoryview per rank, in the coordinator's mapping. ``io_threads`` is ``DiskConfig``'s
    (``disk.io_threads``, where its default lives), passed by ``builders``."""

    source = BlockSource.DISK

    def __init__(self, file: DiskSlotFile, rows: Rows, *, io_threads: int,
                 low_watermark: float = 0.1, queue_blocks: int = 256, max_errors: int = 3,
                 down_s: float = 10.0, stop_timeout_s: float = 5.0,
                 log_interval_s: float = 10.0):
        self._file = file
        self._rows = rows
        self.policy = TierPolicy(Medium.STORAGE, demote_below=low_watermark,
                                 max_queued_blocks=queue_blocks, job_blocks=DEMOTE_BATCH,
                                 promote_blocks=PROMOTE_BATCH, stop_timeout_s=stop_timeout_s,
                                 max_in_flight_blocks=io_threads * DEMOTE_BATCH)
        self._max_errors, self._down_s = max_errors, down_s
        self._warn = LogLimiter(log, log_interval_s)
        self._lock = threading.Lock()
        self._pump = JobPump("disk", self._lock, [Lane("io", io_threads, self._run)],
                             self._finish)
        self._index: dict[bytes, int] = {}  # key -> disk slot
        self._order: OrderedDict[int, bytes] = OrderedDict()  # disk slots, oldest write first
        self._free = list(range(file.num_slots - 1, -1, -1))
        self._busy: set[int] = set()  # disk slots being read or written
        self._finished: list[JobResult] = []
        self._changes: list[KeyChange] = []
        self._seq = 1
        self._errors_in_row = 0
        self._down_until = 0.0
        self._wake: Callable[[], None] = lambda: None
        self.stats = TierStats(capacity_blocks=file.num_slots, direct_io=file.direct_io)

    # ------------------------------------------------------------------ life
    def rebuild(self) -> int:
        """Index the file's whole slots (newest write of a key wins); returns how many."""
        newest: dict[bytes, tuple[int, int]] = {}
        for slot, header in self._file.scan():
            seen = newest.get(header.key)
            if seen is None or header.seq > seen[1]:
                newest[header.key] = (slot, header.seq)
            self._seq = max(self._seq, header.seq + 1)
        with self._lock:
            for key, (slot, _) in sorted(newest.items(), key=lambda item: item[1][1]):
                self._index[key] = slot
                self._order[slot] = key
            used = set(self._order)
            self._free = [s for s in range(self._file.num_slots - 1, -1, -1) if s not in used]
            self.stats.rebuilt_blocks = self.stats.used_blocks = len(self._index)
        return len(self._index)

    @property
    def capacity_blocks(self) -> int:
        return self._file.num_slots

    def held_keys(self) -> list[bytes]:
        with self._lock:
            return list(self._index)

    def start(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._pump.start()

    def close(self, timeout_s: float | None = None) -> list[str]:
        """Stop the threads, waiting at most ``timeout_s`` for the I/O in flight; jobs
        never started are reported failed. The file is closed once no thread uses it."""
        with self._lock:
            self._finished += [JobResult(j.job_id, failed=j.keys) for j in self._pump.stop()]
        left = self._pump.join(timeout_s)
        if not left:
            self._file.close()
        with self._lock:
            return [f"{name}: {self._pump.doing(name) or 'stopping'}" for name in left]

    # ------------------------------------------------------------------ the chain's side
    def holds(self, key: bytes, asker: int) -> Presence:
        with self._lock:
            held = key in self._index and time.monotonic() >= self._down_until
        return Presence.YES if held else Presence.NO

    def submit(self, job: TierJob) -> None:
        with self._lock:
            if self._pump.stopping or time.monotonic() < self._down_until:
                self._report(JobResult(job.job_id, failed=job.keys))
                return
            if job.kind is JobKind.PROBE:  # the disk knows: what it holds, in order
                run = []
                for key in job.keys:
                    if key not in self._index:
                        break
                    run.append(key)
                self._report(JobResult(job.job_id, done=tuple(run),
                                       failed=job.keys[len(run):]))
                return
            priority = 0 if job.kind is JobKind.PROMOTE else 1  # loads ahead of spills
            self._pump.put("io", job, priority)

    def take_finished(self) -> list[JobResult]:
        with self._lock:
            finished, self._finished = self._finished, []
            return finished

    def take_changes(self) -> list[KeyChange]:
        with self._lock:
            changes, self._changes = self._changes, []
            return changes

    def _report(self, result: JobResult) -> None:
        """Under the lock."""
        self._finished.append(result)
        self._wake()

    def _changed(self, key: bytes, removed: bool) -> None:
        """Under the lock."""
        self._changes.append(KeyChange((key,), removed))

    # ------------------------------------------------------------------ the pump's jobs
    def _run(self, job: TierJob, worker: int) -> JobResult:
        move = self._read if job.kind is JobKind.PROMOTE else self._write
        done = [key for key, host_slot in job.blocks() if move(key, host_slot)]
        moved = set(done)
        return JobResult(job.job_id, done=tuple(done),
                         failed=tuple(k for k in job.keys if k not in moved))

    def _finish(self, job: TierJob, result: JobResult) -> None:
        """Under the lock."""
        self._report(result)

    # ------------------------------------------------------------------ moving blocks
    def _read(self, key: bytes, host_slot: int) -> bool:
        """Read ``key``'s disk copy into ``host_slot``; whether it came whole and checked."""
        with self._lock:
            disk_slot = self._index.get(key)
            if disk_slot is None:
                return False
            self._busy.add(disk_slot)
        ok: bool | None = None
        try:
            ok = self._io("read", lambda: self._file.read(disk_slot, key, self._rows(host_slot)))
        finally:  # whatever a read raised, its disk slot is not busy any more
            with self._lock:
                self._busy.discard(disk_slot)
        with self._lock:
            if ok:
                self.stats.promotions += 1
            elif ok is False and self._index.get(key) == disk_slot:
                self.stats.checksum_failures += 1
                self._forget(key, disk_slot)
        if ok is False:
            self._warn.warn("checksum", "disk tier: the block of key %r in disk slot %s did not "
                            "check (header or data CRC); dropped, not served", key[:32], disk_slot)
        return bool(ok)

    def _write(self, key: bytes, host_slot: int) -> bool:
        """Write the pinned host block of ``key`` to a disk slot; whether it was."""
        with self._lock:
            if key in self._index:  # written meanwhile (an earlier job of the same key)
                return True
            disk_slot, seq = self._take_slot(), self._seq
            self._seq += 1
            if disk_slot is None:
                self.stats.dropped_spills += 1
                return False
        ok: bool | None = None
        try:
            ok = self._io("write",
                          lambda: self._file.write(disk_slot, key, seq, self._rows(host_slot)))
        finally:  # whatever a write raised, its disk slot goes back
            with self._lock:
                self._busy.discard(disk_slot)
                if not ok:
                    self._free.append(disk_slot)
                    self.stats.dropped_spills += 1
        with self._lock:
            if not ok:
                return False
            self._index[key] = disk_slot
            self._order[disk_slot] = key
            self._changed(key, False)
            self.stats.demotions += 1
            self.stats.used_blocks = len(self._index)
            return True

    def _take_slot(self) -> int | None:
        """A disk slot to write (under the lock): a free one, else the oldest block's
        (its key leaves the tier first), never one being read or written."""
        slot: int | None
        if self._free:
            slot = self._free.pop()
        else:
            slot = next((s for s in self._order if s not in self._busy), None)
            if slot is None:
                return None
            key = self._order.pop(slot)
            del self._index[key]
            self._changed(key, True)
        self._busy.add(slot)
        return slot

    def _forget(self, key: bytes, slot: int) -> None:
        del self._index[key]
        self._changed(key, True)
        self._order.pop(slot, None)
        self._free.append(slot)
        self.stats.used_blocks = len(self._index)

    def _io(self, what: str, call) -> bool | None:
        """Run one read or write: its result (a read's CRC check), or None after an OS
        error (counted; ``max_errors`` in a row mark the tier down for ``down_s``)."""
        start = time.perf_counter()
        try:
            result = call()
        except OSError as e:
            with self._lock:
                self.stats.errors += 1
                self._errors_in_row += 1
                if self._errors_in_row >= self._max_errors:
                    self._down_until = time.monotonic() + self._down_s
                    self.stats.up = False
            self._warn.warn("io", "disk tier: %s on %s failed (%s); after %d errors in a row "
                            "the tier is down for %.0f s: lookups miss, nothing is spilled",
                            what, self._file.path, e, self._max_errors, self._down_s)
            return None
        seconds = time.perf_counter() - start
        num_bytes = self._file.world_size * self._file.row_stride
        with self._lock:
            self._errors_in_row = 0
            self.stats.up = time.monotonic() >= self._down_until
            if what == "read":
                self.stats.read_bytes += num_bytes
                self.stats.read_seconds += seconds
            else:
                self.stats.write_bytes += num_bytes
                self.stats.write_seconds += seconds
        return True if result is None else bool(result)

    def snapshot(self) -> TierStats:
        with self._lock:  # what waits to be written is the chain's to count
            return replace(self.stats, up=time.monotonic() >= self._down_until,
                           calls_in_flight=self._pump.running)

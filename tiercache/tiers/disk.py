"""The disk tier: blocks evicted from host memory go to a local file and come back as hits.

Owned by the coordinator, which maps the region: the tier moves bytes between the host
slots (the coordinator's mapping) and its ``DiskSlotFile`` on a small pool of I/O
threads. Workers and the engine's step never wait on the disk.

* **Demotion ahead of eviction.** A thread watches the host index's free slots; below the
  low watermark it takes the blocks the eviction policy would evict next
  (``OffloadingManager.demotion_candidates``) that are not on disk yet, pins each (as the
  tier's own owner, so it cannot be evicted mid-write), writes it, unpins it. By the time
  the host evicts a block it is usually on disk; one that is not is simply gone (counted
  as a dropped spill).
* **Admission: reused blocks first.** Disk write bandwidth is what runs out. A block that
  was reused in host memory (leased or loaded since it was stored) is always admitted; one
  that never was is admitted only while the write queue is less than half full. Under
  pressure, proven reuse wins, and the unproven spill is dropped, never waited for.
* **Promotion on lookup.** A lookup or lease that misses host memory and finds its next
  keys here starts their promotion and answers "not yet" (``pending``); the promotion
  reserves host slots (as the tier's owner), reads into them straight from the file,
  checks the data's CRC, and completes the store (READY) — or frees the slots and drops the
  disk copy when it does not check. A key is promoted once however many ask: it is WRITING
  in the host index from the reservation on. Promotions go ahead of demotions.
* **Durable.** The tier's index (key → disk slot) is rebuilt at start from the slots'
  headers, the newest write of a key winning. Torn or damaged slots are dropped and counted.
* **A failing disk never stops the host tier.** An I/O error is counted and logged once per
  interval; ``max_errors`` in a row mark the tier down for ``down_s``: lookups then miss,
  demotions stop. It comes back by itself.

Thread-safety: ``holds`` and ``promote`` are called under the index's lock and only take
the tier's own lock briefly; the tier never calls the index while holding its own lock.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import replace

from tiercache.loglimit import LogLimiter
from tiercache.index.manager import TIER_OWNER, OffloadingManager
from tiercache.index.results import BlockSource, TierStats
from tiercache.tiers.disk_file import DiskSlotFile

log = logging.getLogger(__name__)

_PROMOTE, _DEMOTE = 0, 1  # queue priorities: loads go ahead of spills
PROMOTE_BATCH = 32  # keys per promotion job (its host slots are reserved together)
DEMOTE_BATCH = 4  # keys per demotion job (pinned and unpinned together)


class DiskTier:
    """See the module docstring. ``rows(slot)`` gives a host slot's rows, one writable
    memoryview per rank, in the coordinator's mapping."""

    def __init__(self, file: DiskSlotFile, manager: OffloadingManager, rows, *,
                 io_threads: int = 8, low_watermark: float = 0.1, queue_blocks: int = 256,
                 poll_s: float = 0.02, max_errors: int = 3, down_s: float = 10.0,
                 log_interval_s: float = 10.0):
        self._file = file
        self._manager = manager
        self._rows = rows
        self._io_threads = io_threads
        self._low_free = max(1, int(manager.num_blocks * low_watermark))
        self._queue_blocks = queue_blocks
        self._poll_s = poll_s
        self._max_errors, self._down_s = max_errors, down_s
        self._warn = LogLimiter(log, log_interval_s)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._index: dict[bytes, int] = {}  # key -> disk slot
        self._order: OrderedDict[int, bytes] = OrderedDict()  # disk slots, oldest write first
        self._free = list(range(file.num_slots - 1, -1, -1))
        self._busy: set[int] = set()  # disk slots being read or written
        self._queue: list[tuple[int, int, tuple]] = []  # (priority, order, job)
        self._count = itertools.count()
        self._promoting: set[bytes] = set()
        self._demoting: set[bytes] = set()
        self._seq = 1
        self._errors_in_row = 0
        self._down_until = 0.0
        self._stop = False
        self._stopped = threading.Event()  # the watcher sleeps on this, not on ``_work``
        self._threads: list[threading.Thread] = []
        self._key_listener = None
        self.source = BlockSource.DISK
        self.name = self.source.label
        self.stats = TierStats(capacity_blocks=file.num_slots, direct_io=file.direct_io)

    # ------------------------------------------------------------------ life
    def rebuild(self, progress=None) -> int:
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
        if progress is not None:
            progress(len(self._index))
        return len(self._index)

    @property
    def capacity_blocks(self) -> int:
        return self._file.num_slots

    def set_key_listener(self, listener) -> None:
        """Call ``listener(keys, removed)`` (under the tier's lock) when keys come to be
        held on disk or stop being; it is first called with every key held now."""
        with self._lock:
            self._key_listener = listener
            if listener is not None and self._index:
                listener(list(self._index), False)

    def _keys_changed(self, keys: list[bytes], removed: bool) -> None:
        if self._key_listener is not None:
            self._key_listener(keys, removed)

    def start(self) -> None:
        for i in range(self._io_threads):
            self._spawn(self._serve, f"tiercache-disk-io-{i}")
        self._spawn(self._watch, "tiercache-disk-demote")

    def _spawn(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def close(self) -> None:
        """Stop the threads (the I/O in flight finishes first) and close the file."""
        with self._lock:
            self._stop = True
            self._work.notify_all()
        self._stopped.set()
        for thread in self._threads:
            thread.join()
        self._threads.clear()
        self._file.close()

    # ------------------------------------------------------------------ the index's side
    def holds(self, key: bytes, owner: int) -> bool:
        with self._lock:
            return key in self._index and time.monotonic() >= self._down_until

    def promote(self, keys: Sequence[bytes], mine: Collection[bytes], owner: int) -> None:
        """Queue promotions of ``mine`` (those not being promoted already) in jobs over the
        run ``keys``, of at most ``PROMOTE_BATCH`` keys: one job reserves its host slots at
        once."""
        with self._lock:
            todo = [k for k in mine if k not in self._promoting and k in self._index]
            if not todo:
                return
            self._promoting.update(todo)
            for start in range(0, len(keys), PROMOTE_BATCH):  # the run's host keys too: a
                chunk = tuple(keys[start:start + PROMOTE_BATCH])  # job's reservation protects
                self._push(_PROMOTE, ("promote", chunk))  # them from its own evictions

    def stored(self, keys: Sequence[bytes]) -> None:
        """Engine stores reach the disk by demotion ahead of eviction, not at store time."""

    def _push(self, priority: int, job: tuple) -> None:
        heapq.heappush(self._queue, (priority, next(self._count), job))
        self._work.notify()

    # ------------------------------------------------------------------ threads
    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._stop:
                    self._work.wait()
                if self._stop:
                    return
                _, _, (kind, payload) = heapq.heappop(self._queue)
                self.stats.calls_in_flight += 1
            try:
                if kind == "promote":
                    self._promote(payload)
                else:
                    self._demote(*payload)
            except Exception:  # a bug: keep the tier serving, say it loudly
                log.exception("disk tier: %s failed", kind)
            finally:
                with self._lock:
                    self.stats.calls_in_flight -= 1

    def _watch(self) -> None:
        """Demote ahead of eviction while host free slots are below the watermark."""
        while not self._stopped.wait(self._poll_s):
            with self._lock:
                queued = len(self._demoting)
                down = time.monotonic() < self._down_until
            # Refill only once the queue is down to half: a refill walks the policy's
            # eviction end past every block already on disk.
            if down or queued * 2 > self._queue_blocks:
                continue
            free = self._manager.stats().free_blocks
            if free >= self._low_free:
                continue
            want = min(self._queue_blocks - queued, self._low_free - free + self._io_threads)
            admitted = [key for key, reused in
                        self._manager.demotion_candidates(want, self._on_disk_or_busy)
                        if self._admit(key, reused)]
            with self._lock:
                for start in range(0, len(admitted), DEMOTE_BATCH):
                    self._push(_DEMOTE, ("demote", (tuple(admitted[start:start + DEMOTE_BATCH]),)))

    def _on_disk_or_busy(self, key: bytes) -> bool:
        # Called per key of the walk, under the index's lock; reads without the tier's lock
        # (one membership test each is atomic): a key that changes meanwhile is settled by
        # ``_admit``, which holds it.
        return key in self._index or key in self._demoting or key in self._promoting

    def _admit(self, key: bytes, reused: bool) -> bool:
        """Whether ``key`` goes to disk (the admission rule; see the module docstring)."""
        with self._lock:
            if key in self._demoting or key in self._index:
                return False
            if not reused and len(self._demoting) * 2 >= self._queue_blocks:
                self.stats.dropped_spills += 1  # unproven, and the disk is busy: not worth it
                return False
            self._demoting.add(key)
            return True

    # ------------------------------------------------------------------ moving blocks
    def _promote(self, keys: tuple[bytes, ...]) -> None:
        try:
            out = self._manager.prepare_store(list(keys), owner=TIER_OWNER)
        except Exception:
            out = None
            log.exception("disk tier: reserving host slots for a promotion failed")
        if out is None:  # no room in host memory: the lookup will simply miss
            with self._lock:
                self._promoting.difference_update(keys)
            return
        good, bad = [], []
        for key, host_slot in zip(out.keys_to_store, out.store_spec.block_ids.tolist()):
            with self._lock:
                disk_slot = self._index.get(key)
                if disk_slot is not None:
                    self._busy.add(disk_slot)
            ok = disk_slot is not None and self._io(
                "read", lambda: self._file.read(disk_slot, key, self._rows(host_slot)))
            with self._lock:
                self._busy.discard(disk_slot)
                if ok:
                    self.stats.promotions += 1
                elif ok is False and disk_slot is not None and self._index.get(key) == disk_slot:
                    self.stats.checksum_failures += 1
                    self._forget(key, disk_slot)
            if ok is False:
                self._warn.warn("checksum", "disk tier: the block of key %r in disk slot %s "
                                "did not check (header or data CRC); dropped, not served",
                                key[:32], disk_slot)
            (good if ok else bad).append(key)
        self._manager.complete_store(good, True, owner=TIER_OWNER, source=self.source)
        self._manager.complete_store(bad, False, owner=TIER_OWNER, source=self.source)
        with self._lock:
            self._promoting.difference_update(keys)

    def _demote(self, keys: tuple[bytes, ...]) -> None:
        """Write these blocks, pinned (one pin call for the batch where it can) while their
        bytes are read from host memory."""
        try:
            specs = [(keys, self._manager.prepare_load(list(keys), owner=TIER_OWNER))]
        except Exception:  # one was evicted or rewritten since: pin them one by one
            specs = []
            for key in keys:
                try:
                    specs.append(((key,), self._manager.prepare_load([key], owner=TIER_OWNER)))
                except Exception:  # gone: nothing to spill
                    with self._lock:
                        self._demoting.discard(key)
                        self.stats.dropped_spills += 1
        for pinned, spec in specs:
            try:
                for key, host_slot in zip(pinned, spec.block_ids.tolist()):
                    self._write(key, host_slot)
            finally:
                self._manager.complete_load(list(pinned), owner=TIER_OWNER)

    def _write(self, key: bytes, host_slot: int) -> None:
        with self._lock:
            disk_slot, seq = self._take_slot(), self._seq
            self._seq += 1
        ok = disk_slot is not None and self._io(
            "write", lambda: self._file.write(disk_slot, key, seq, self._rows(host_slot)))
        with self._lock:
            self._demoting.discard(key)
            if disk_slot is None:
                self.stats.dropped_spills += 1
                return
            self._busy.discard(disk_slot)
            if ok:
                self._index[key] = disk_slot
                self._order[disk_slot] = key
                self._keys_changed([key], False)
                self.stats.demotions += 1
                self.stats.used_blocks = len(self._index)
            else:
                self._free.append(disk_slot)
                self.stats.dropped_spills += 1

    def _take_slot(self) -> int | None:
        """A disk slot to write (under the lock): a free one, else the oldest block's
        (its key leaves the tier first), never one being read or written."""
        if self._free:
            slot = self._free.pop()
        else:
            slot = next((s for s in self._order if s not in self._busy), None)
            if slot is None:
                return None
            key = self._order.pop(slot)
            del self._index[key]
            self._keys_changed([key], True)
        self._busy.add(slot)
        return slot

    def _forget(self, key: bytes, slot: int) -> None:
        del self._index[key]
        self._keys_changed([key], True)
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
        with self._lock:
            return replace(self.stats, up=time.monotonic() >= self._down_until,
                           queued_blocks=len(self._demoting))

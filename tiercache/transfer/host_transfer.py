"""Fenced host-to-host transfers between an engine's host pages and one rank's region rows.

``HostAttachment.attach`` is ``tiercache.transfer.worker.attach`` for a process with no
GPU caches: it maps the region, claims one of the rank's attachment slots (so status,
metrics and the coordinator see it; a region with a live attachment is kept across a
coordinator restart), marks the slot's stats block attached, pre-faults the rank's slice in
this process's page tables (a short ``/dev/shm`` is an error here, never a SIGBUS in a
copy) and records the pin state ``not_needed``: host-to-host copies need no page-locking,
and the state says so instead of reporting ``unpinned`` as if pinning had failed. Both
directions record the backend ``cpu`` (host memory on both sides).

``HostTransfer`` moves pages: ``store`` copies engine pages into the rows of a fenced
spec's slots (``prepare_store``), ``load`` copies rows out to engine pages (a lease's or
``prepare_load``'s spec). Every call checks the spec with the worker's own rule
(``SlotFence``: this region's identity; each slot still WRITING, resp. READY, with the
generation the index handed out) before a byte moves; a load checks again after its copy,
so a slot handed to another key while it was read (only if its pin was given back: the
session declared dead) is a failure, never a wrong page. The bytes go through a
``HostCopyPool`` per direction (native threads, no GIL held). Every outcome is counted in
the attachment's stats block like a GPU worker's transfers. Failure is a value
(``HostOutcome``), never an exception: the engines that call this must not see one.

Self-contained: the GPU handlers neither use nor know it, so it can sit under the worker's
one transfer contract later as its host implementation.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np

from tiercache.backend_kind import BackendKind
from tiercache.region.hostmem import process_start_ns
from tiercache.region.layout import RegionLayout
from tiercache.region.ledger import IndexLedger
from tiercache.region.shared import SharedOffloadRegion
from tiercache.region.stats import EngineKind, PinState, RankStats
from tiercache.specs import CPULoadStoreSpec, Direction
from tiercache.transfer.fence import SlotFence
from tiercache.transfer.host_copy import HostCopyPool
from tiercache.transfer.host_pages import PageMap

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostOutcome:
    """One transfer's result: ``ok``, else ``reason`` (one line, for a log and a counter)."""

    ok: bool
    num_bytes: int = 0
    seconds: float = 0.0
    reason: str = ""


class HostAttachment:
    """One process's attachment of ``rank`` for host-to-host copies (see module doc)."""

    def __init__(self, region: SharedOffloadRegion, rank: int):
        self.region, self.rank = region, rank
        self.fence = SlotFence(region.region_id, IndexLedger(region.ledger_array()).table)
        base = region.base_address + region.layout.slice_offset(rank)
        stride = region.layout.row_stride
        self._row_base, self._row_stride = np.uint64(base), np.uint64(stride)
        self._closed = False

    @classmethod
    def attach(cls, name: str, rank: int, *, layout: RegionLayout | None = None,
               prefault_threads: int = 4,
               engine: tuple[EngineKind, int, int] = (EngineKind.WORKER, 0, 0)
               ) -> HostAttachment:
        """Map region ``name`` as an attachment of ``rank``; ``layout`` refuses another
        geometry (``LayoutMismatchError``); ``engine`` (kind, rank in it, its ranks) names
        the process in status and metrics. Raises what ``SharedOffloadRegion.attach``
        raises (no region, not READY, not ours, every slot of the rank taken)."""
        region = SharedOffloadRegion.attach(name, rank, layout=layout)
        try:
            stats = region.stats(rank)
            stats.mark_attached(os.getpid(), process_start_ns(os.getpid()))
            try:
                stats.set_engine(*engine)
                region.prefault_slice(prefault_threads)
                stats.set_pin(PinState.NOT_NEEDED)
                for direction in Direction:
                    stats.set_backend(direction, BackendKind.CPU)
                return cls(region, rank)
            except BaseException:
                stats.mark_detached()
                raise
        except BaseException:
            region.close()
            raise

    @property
    def layout(self) -> RegionLayout:
        return self.region.layout

    @property
    def region_id(self) -> int:
        return self.region.region_id

    @property
    def stats(self) -> RankStats:
        return self.region.stats(self.rank)

    def row_addresses(self, slot_ids: np.ndarray) -> np.ndarray:
        """uint64 address of each slot's row in this rank's slice (ids checked in range)."""
        ids = np.asarray(slot_ids, dtype=np.uint64)
        if ids.size and int(ids.max()) >= self.layout.num_blocks:
            raise IndexError(f"slot {int(ids.max())} outside 0..{self.layout.num_blocks - 1}")
        return self._row_base + ids * self._row_stride

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.stats.mark_detached()
        finally:
            self.region.close()


class HostTransfer:
    """Fenced copies between engine pages (``page_map``) and ``attachment``'s rows."""

    def __init__(self, attachment: HostAttachment, page_map: PageMap,
                 copy_threads: int | None = None):
        self.attachment, self.page_map = attachment, page_map
        self._pools = {d: HostCopyPool(copy_threads) for d in Direction}

    def store(self, spec: CPULoadStoreSpec, blob_addrs: np.ndarray) -> HostOutcome:
        """Engine pages -> the rows of ``spec`` (slots WRITING for this store)."""
        return self._move(Direction.GPU_TO_CPU, spec, blob_addrs)

    def load(self, spec: CPULoadStoreSpec, blob_addrs: np.ndarray) -> HostOutcome:
        """The rows of ``spec`` (slots READY, pinned for this load) -> engine pages."""
        return self._move(Direction.CPU_TO_GPU, spec, blob_addrs)

    def _move(self, direction: Direction, spec: CPULoadStoreSpec, blob_addrs: np.ndarray
              ) -> HostOutcome:
        attachment = self.attachment
        refusal = attachment.fence.refusal(direction, spec)
        if refusal is None and not spec.fenced:
            refusal = "the spec is not fenced (no region identity): only the index's specs move"
        if refusal is not None:
            return self._failed(direction, refusal)
        start = time.perf_counter()
        try:
            dst, src, lengths = self.page_map.pieces(direction, blob_addrs,
                                                     attachment.row_addresses(spec.block_ids))
            num_bytes = self._pools[direction].copy(dst, src, lengths)
        except Exception as e:  # a bad address array: the caller's bug, reported as a failure
            return self._failed(direction, f"{type(e).__name__}: {e}")
        seconds = time.perf_counter() - start
        if direction.loads:
            after = attachment.fence.refusal(direction, spec)
            if after is not None:
                return self._failed(direction, f"after the copy: {after}")
        attachment.stats.record_transfer(direction, num_bytes, seconds, True)
        return HostOutcome(True, num_bytes, seconds)

    def _failed(self, direction: Direction, reason: str) -> HostOutcome:
        self.attachment.stats.record_transfer(direction, 0, 0.0, False)
        return HostOutcome(False, reason=f"{direction.label}: {reason}")

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()

"""``BounceBackend``: copies between GPU pages and host rows that are not page-locked yet,
through a page-locked bounce buffer of the worker's own.

Why: while a worker's slice is still being pre-faulted and registered in the background
(``tiercache.region.preparation``), its rows are pageable. The copy engines cannot DMA to
pageable memory; handed pageable rows, the driver copies each descriptor through its own
small staging buffer, synchronously, one at a time: on 32 KiB pages an H100 moved 0.8 / 4.3
GB/s that way, 2–8 % of the ceiling; through this backend 13.8 / 12.5 GB/s, a quarter of it
(docs/benchmarks.md, "The bounce buffer, and instant on at 75 % of RAM"). Here the DMA side
always has page-locked memory (the bounce buffer: two halves, registered once), so it runs
on ``cuMemcpyBatchAsync`` at copy-engine rates, and the pageable side is a host memcpy on the
native copy pool (``tiercache.transfer.host_copy``, handed in by the worker), several
threads, without the GIL: that memcpy is the floor. Chunk by chunk, the two halves
alternate, so one half's DMA overlaps the other half's memcpy::

    store: DMA pages -> half h (on the stream, after the ordering's events), wait for it,
           memcpy half h -> rows              (the next chunk's DMA already queued)
    load:  wait until half h's last DMA passed, memcpy rows -> half h,
           DMA half h -> pages (on the stream)

A transfer holds its caller for its host side (a store until every byte is in its rows, a
load until every byte is in the bounce buffer): ``StreamBackend.submit`` records ``end``
after ``copy`` returns, so the transfer's end event completes only after everything it
wrote. That is a stall of the engine's thread of bytes ÷ memcpy rate (and, for a store,
until the compute stream reached the store's mark: the DMA reads what it wrote), while the
slice is being page-locked only; the driver's own pageable path held it as long and longer
(it is synchronous too). Descriptors larger than a half are cut into pieces that fit.

The chunking (``split``, ``chunks``) is pure numpy and tested without a GPU; the copies are
tested on one (``tests/transfer/test_bounce_gpu.py``).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from typing import Protocol

import numpy as np

from tiercache.backend_kind import BackendKind
from tiercache.backends.base import StreamBackend
from tiercache.backends.ce import CeBackend, CeLoopBackend
from tiercache.device.driver import CUDA_SUCCESS, CudaDriver, SrcAccessOrder
from tiercache.device.events import Stream
from tiercache.errors import BackendError
from tiercache.planning.plans import CopyPlan
from tiercache.specs import Direction

log = logging.getLogger(__name__)


class HostCopier(Protocol):
    """What does the pageable side: ``tiercache.transfer.host_copy.HostCopyPool`` (given by
    the worker; this layer does not import it)."""

    def copy(self, dst: np.ndarray, src: np.ndarray, lengths: np.ndarray) -> int: ...

    def close(self) -> None: ...


HALF_BYTES = 16 << 20  # one half of the bounce buffer: DMAs of this size run at the PCIe rate


def split(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, limit: int
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same copies with every descriptor over ``limit`` bytes cut into pieces of at most
    ``limit`` (in order, the pieces of one descriptor back to back); uint64 arrays."""
    if limit < 1:
        raise ValueError(f"limit = {limit}: must be >= 1")
    src, dst, sizes = (np.asarray(a, dtype=np.uint64) for a in (src, dst, sizes))
    if not sizes.size or int(sizes.max()) <= limit:
        return src, dst, sizes
    pieces = ((sizes + np.uint64(limit - 1)) // np.uint64(limit)).astype(np.int64)
    which = np.repeat(np.arange(sizes.size), pieces)  # the descriptor of each piece
    first = np.cumsum(pieces) - pieces  # the first piece of each descriptor
    within = (np.arange(which.size) - first[which]).astype(np.uint64) * np.uint64(limit)
    out_sizes = np.minimum(sizes[which] - within, np.uint64(limit))
    return src[which] + within, dst[which] + within, out_sizes


def chunks(sizes: np.ndarray, capacity: int) -> list[tuple[int, int]]:
    """Consecutive ``[a, b)`` ranges of descriptors, each of at most ``capacity`` bytes in
    all, greedily as long as fits; every size must be ``<= capacity`` (``split`` first)."""
    sizes = np.asarray(sizes, dtype=np.uint64)
    if sizes.size and int(sizes.max()) > capacity:
        raise ValueError(f"a descriptor of {int(sizes.max())} bytes exceeds the chunk "
                         f"capacity {capacity}: split first")
    ends = np.cumsum(sizes, dtype=np.uint64)
    out, a, before = [], 0, 0
    while a < sizes.size:
        b = int(np.searchsorted(ends, np.uint64(before + capacity), side="right"))
        out.append((a, b))
        a, before = b, int(ends[b - 1])
    return out


def offsets(sizes: np.ndarray) -> np.ndarray:
    """Where each descriptor of a chunk lies in a half: the exclusive prefix sums."""
    ends = np.cumsum(sizes, dtype=np.uint64)
    return ends - sizes


class BounceBackend(StreamBackend[CopyPlan]):
    """Copies on ``device`` through a page-locked bounce buffer of two ``half_bytes`` halves
    (module docstring), in the direction each plan says; one per direction (a load may pass
    a store). ``host_copy``: the pool that does the pageable side (owned: closed with the
    backend). The bounce buffer is allocated and registered on the first transfer, in the
    caller's CUDA context. Its DMAs go on ``cuMemcpyBatchAsync``, or, on a driver without
    it (older than CUDA 12.8), one ``cuMemcpyAsync`` per descriptor (``ce_loop``, said at
    WARNING), as ``ce`` itself falls back."""

    kind = BackendKind.CE  # the DMA side: the copy engines

    def __init__(self, device: int, host_copy: HostCopier, driver: CudaDriver | None = None,
                 half_bytes: int = HALF_BYTES):
        self.device = int(device)
        self.driver = driver or CudaDriver()
        self._ce: CeBackend | CeLoopBackend
        if self.driver.has_batch:
            self._ce = CeBackend(self.device, self.driver)
        else:
            log.warning("the bounce buffer's copies run as ce_loop (one cuMemcpyAsync per "
                        "descriptor): CUDA driver %d has no cuMemcpyBatchAsync",
                        self.driver.driver_version)
            self._ce = CeLoopBackend(self.device, self.driver)
        self._pool = host_copy
        self.half_bytes = int(half_bytes)
        self._buffer: mmap.mmap | None = None
        self._anchor: ctypes.Array | None = None  # keeps the address; dropped before close
        self._base = 0
        self._events = [0, 0]  # per half: recorded after its last DMA
        self._pending = [False, False]
        self._held: list[tuple[object, ...]] = [(), ()]  # descriptors, until the DMA passed
        self._next = 0  # the half the next chunk takes
        self._closed = False
        self.bytes_bounced = 0

    def _allocate(self) -> None:
        """The bounce buffer, allocated and registered on first use."""
        if self._buffer is None:
            buffer = mmap.mmap(-1, 2 * self.half_bytes)
            anchor = (ctypes.c_char * (2 * self.half_bytes)).from_buffer(buffer)
            base = ctypes.addressof(anchor)
            rc = self.driver.mem_host_register(base, 2 * self.half_bytes)
            if rc != CUDA_SUCCESS:
                del anchor
                buffer.close()
                raise BackendError(f"bounce buffer: cuMemHostRegister of "
                                   f"{2 * self.half_bytes} bytes failed: "
                                   f"{self.driver.error_name(rc)}")
            self._events = [self.driver.event_create(), self.driver.event_create()]
            self._buffer, self._anchor, self._base = buffer, anchor, base

    def _take_half(self) -> tuple[int, int]:
        """The next half (its index and address), once its last DMA has passed."""
        h = self._next
        self._next ^= 1
        if self._pending[h]:
            self.driver.event_synchronize(self._events[h])
            self._pending[h], self._held[h] = False, ()
        return h, self._base + h * self.half_bytes

    def _dma(self, h: int, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray,
             order: SrcAccessOrder, handle: int) -> None:
        self._ce.enqueue(src, dst, sizes, order, handle)
        self.driver.event_record(self._events[h], handle)
        self._pending[h], self._held[h] = True, (src, dst, sizes)

    def copy(self, plan: CopyPlan, stream: Stream) -> tuple[object, ...]:
        if self._closed:
            raise BackendError("bounce: the backend is closed")
        handle = self.driver.enter(stream, self.device)
        self._allocate()
        src, dst, sizes = split(*plan.arrays(), self.half_bytes)
        if plan.direction is Direction.GPU_TO_CPU:
            self._store(src, dst, sizes, handle)
        else:
            self._load(src, dst, sizes, handle)
        self.bytes_bounced += int(sizes.sum(dtype=np.uint64))
        return ()

    def _store(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, handle: int) -> None:
        """Pages -> half (DMA), then half -> rows (memcpy), the next DMA queued first."""
        queued: list[tuple[int, np.ndarray, int, int]] = []  # (half, where, a, b): DMA'd only
        for a, b in chunks(sizes, self.half_bytes):
            h, at = self._take_half()
            where = at + offsets(sizes[a:b])
            self._dma(h, src[a:b], where, sizes[a:b], SrcAccessOrder.STREAM, handle)
            queued.append((h, where, a, b))
            if len(queued) == 2:
                self._drain(queued.pop(0), dst, sizes)
        while queued:
            self._drain(queued.pop(0), dst, sizes)

    def _drain(self, entry: tuple[int, np.ndarray, int, int], dst: np.ndarray,
               sizes: np.ndarray) -> None:
        h, where, a, b = entry
        self.driver.event_synchronize(self._events[h])
        self._pending[h], self._held[h] = False, ()
        self._pool.copy(np.ascontiguousarray(dst[a:b]), where, np.ascontiguousarray(sizes[a:b]))

    def _load(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, handle: int) -> None:
        """Rows -> half (memcpy), then half -> pages (DMA), halves alternating."""
        for a, b in chunks(sizes, self.half_bytes):
            h, at = self._take_half()
            where = at + offsets(sizes[a:b])
            part = np.ascontiguousarray(sizes[a:b])
            self._pool.copy(where, np.ascontiguousarray(src[a:b]), part)
            self._dma(h, where, np.ascontiguousarray(dst[a:b]), part, SrcAccessOrder.ANY,
                      handle)

    def close(self) -> None:
        self._closed = True
        try:
            if self._buffer is not None:
                for h in (0, 1):
                    if self._pending[h]:
                        self.driver.event_synchronize(self._events[h])
                for event in self._events:
                    self.driver.event_destroy(event)
                rc = self.driver.mem_host_unregister(self._base)
                if rc != CUDA_SUCCESS:
                    log.error("bounce buffer: cuMemHostUnregister failed: %s",
                              self.driver.error_name(rc))
                self._anchor = None
                self._buffer.close()
                self._buffer = None
        finally:
            self._pool.close()

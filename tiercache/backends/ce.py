"""``ce``: every descriptor on the GPU's copy engines, through ``cuMemcpyBatchAsync``.

Uses no SMs, so the model runs at full speed beside it. Its cost is host time: the
driver walks each descriptor (a fraction of a µs each), and the engines start only once
a batch call has returned. So plans go out in batches that start at ``FIRST_BATCH``
descriptors and double up to ``MAX_BATCH``: the engines start after a few descriptors,
and a large plan pays one call per ``MAX_BATCH``. A large plan of small pages still
holds the calling thread for milliseconds, which is what ``staged`` avoids
(docs/benchmarks.md, "Transfer engine").

Source access order: stores (GPU→CPU) use STREAM, so the engine cannot read KV the
compute stream is still writing; loads use ANY (pinned host sources that nothing writes
while a load runs, which the scheduler guarantees; slightly faster than STREAM).
``load_access_order`` overrides it.

On a driver without the batch API (older than CUDA 12.8) ``create`` builds
``CeLoopBackend`` (one ``cuMemcpyAsync`` per descriptor, a fraction of the PCIe rate on
small pages) and says so: a WARNING in the log and the kind ``CE_LOOP`` in the stats
block, so ``tiercache status`` and ``/metrics`` show it. ``ce_loop`` can also be
configured by name.
"""

from __future__ import annotations

import logging

import numpy as np

from tiercache.backends.base import BackendContext, CopyBackend, StreamBackend
from tiercache.backend_kind import BackendKind
from tiercache.device.driver import (
    CUDA_SUCCESS, CudaDriver, DescriptorArrays, MemcpyAttributes, SrcAccessOrder, device_index,
)
from tiercache.device.events import Stream
from tiercache.errors import BackendError
from tiercache.planning.plans import CopyPlan
from tiercache.specs import Direction

log = logging.getLogger(__name__)

FIRST_BATCH = 16  # descriptors in the first call: the engines start after ~10 µs
MAX_BATCH = 256  # per-call cost (~5 µs) stays small against 256 x ~0.5 µs


class CeBackend(StreamBackend[CopyPlan]):
    """Copy engines through ``cuMemcpyBatchAsync``, in batches growing per plan."""

    kind = BackendKind.CE

    def __init__(self, device: int, driver: CudaDriver | None = None,
                 load_access_order: SrcAccessOrder = SrcAccessOrder.ANY):
        self.device = int(device)
        self.driver = driver or CudaDriver()
        if not self.driver.has_batch:
            raise BackendError(
                f"backend 'ce' needs cuMemcpyBatchAsync (CUDA 12.8 / driver R570 or newer); "
                f"this driver reports CUDA {self.driver.driver_version}. Configure "
                "backend = 'kernel', 'staged' or 'ce_loop'")
        self._attrs = {order: MemcpyAttributes(srcAccessOrder=int(order))
                       for order in SrcAccessOrder}
        self._order = {Direction.GPU_TO_CPU: SrcAccessOrder.STREAM,
                       Direction.CPU_TO_GPU: load_access_order}

    def copy(self, plan: CopyPlan, stream: Stream) -> tuple[object, ...]:
        handle = self.driver.enter(stream, self.device)
        src, dst, sizes = plan.arrays()
        self.enqueue(src, dst, sizes, self._order[plan.direction], handle)
        return (src, dst, sizes)

    def enqueue(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray,
               order: SrcAccessOrder, handle: int) -> None:
        """Enqueue contiguous uint64 arrays on a raw stream handle, in batches growing
        from ``FIRST_BATCH`` to ``MAX_BATCH`` descriptors (see the module docstring)."""
        arrays, count = DescriptorArrays.of(src, dst, sizes), int(sizes.size)
        start, batch = 0, FIRST_BATCH
        while start < count:
            stop = min(start + batch, count)
            try:
                self.enqueue_range(arrays, start, stop, order, handle)
            except BackendError as e:
                raise BackendError(f"{e}; descriptors 0..{start - 1} of {count} are enqueued"
                                   if start else str(e)) from e
            start, batch = stop, min(2 * batch, MAX_BATCH)

    def attributes(self, order: SrcAccessOrder) -> MemcpyAttributes:
        """The batch attributes of ``order`` (what the native chunk loop passes too)."""
        return self._attrs[order]

    def enqueue_range(self, arrays: DescriptorArrays, start: int, stop: int,
                     order: SrcAccessOrder, handle: int) -> None:
        """Enqueue descriptors ``[start, stop)`` of ``arrays`` (used by ``staged`` per chunk)."""
        at = 8 * start  # uint64 elements
        failure = self.driver.memcpy_batch(arrays.dst_ptr + at, arrays.src_ptr + at,
                                           arrays.sizes_ptr + at, stop - start,
                                           self._attrs[order], handle)
        if failure is not None:
            where = ""
            if failure.fail_index is not None and failure.fail_index < stop - start:
                i = start + failure.fail_index
                where = (f" at descriptor {i} (src {int(arrays.src[i]):#x} -> dst "
                         f"{int(arrays.dst[i]):#x}, {int(arrays.sizes[i])} bytes)")
            raise BackendError(f"cuMemcpyBatchAsync of {stop - start} copies failed{where}: "
                               f"{self.driver.error_name(failure.code)}")


class CeLoopBackend(StreamBackend[CopyPlan]):
    """One ``cuMemcpyAsync`` per descriptor: for drivers without the batch API.

    Several µs of host time per descriptor, so slow on small pages; chosen by name, or
    by ``create`` on such a driver, visibly (module docstring).
    """

    kind = BackendKind.CE_LOOP

    def __init__(self, device: int, driver: CudaDriver | None = None):
        self.device = int(device)
        self.driver = driver or CudaDriver()

    def copy(self, plan: CopyPlan, stream: Stream) -> tuple[object, ...]:
        handle = self.driver.enter(stream, self.device)
        src, dst, sizes = plan.arrays()
        self.enqueue(src, dst, sizes, SrcAccessOrder.STREAM, handle)
        return (src, dst, sizes)

    def enqueue(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray,
                order: SrcAccessOrder, handle: int) -> None:
        """``CeBackend.enqueue``'s call, one ``cuMemcpyAsync`` per descriptor (``order``
        has no meaning here: each copy is ordered on the stream)."""
        for i, (s, d, n) in enumerate(zip(src.tolist(), dst.tolist(), sizes.tolist())):
            rc = self.driver.memcpy_async(d, s, n, handle)
            if rc != CUDA_SUCCESS:
                raise BackendError(
                    f"cuMemcpyAsync {i} of {sizes.size} (src {s:#x} -> dst {d:#x}, {n} bytes) "
                    f"failed: {self.driver.error_name(rc)}; copies 0..{i - 1} are enqueued")


def create(context: BackendContext, driver: CudaDriver | None = None) -> CopyBackend:
    """``ce`` for one handler: ``CeBackend``, or ``CeLoopBackend`` where the driver has no
    batch API, with a WARNING naming the direction (one per handler that falls back)."""
    driver = driver or CudaDriver()
    device = device_index(context.device)
    if driver.has_batch:
        return CeBackend(device, driver)
    log.warning("%s: backend 'ce' runs as 'ce_loop' (one cuMemcpyAsync per descriptor): "
                "CUDA driver %d has no cuMemcpyBatchAsync (needs R570 / CUDA 12.8). Expect a "
                "fraction of the PCIe rate on small pages; status and /metrics show "
                "backend ce_loop", context.direction.label, driver.driver_version)
    return CeLoopBackend(device, driver)


def create_loop(context: BackendContext) -> CeLoopBackend:
    """``ce_loop`` configured by name."""
    return CeLoopBackend(device_index(context.device))

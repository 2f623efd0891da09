"""``ce``: every descriptor on the GPU's copy engines, through ``cuMemcpyBatchAsync``.

Uses no SMs, so the model runs at full speed beside it. Its cost is host time: the
driver spends ~0.4–0.7 µs per descriptor, and the engines start only once a batch call
has returned (measured on H100: 16384 x 32 KiB in one call, 0.58 of the ceiling; in
calls of 256, 0.97; one block of 64 pages, 96 µs in one call, 59 µs in calls of 16).
So plans go out in batches that start at ``FIRST_BATCH`` descriptors and double up to
``MAX_BATCH``: the engines start after a few descriptors, and a large plan pays a call
per 256. A 16 k-page plan still holds the calling thread ~7 ms, which is what
``staged`` avoids.

Source access order: stores (GPU→CPU) use STREAM, so the engine cannot read KV the
compute stream is still writing; loads use ANY (pinned host sources that nothing writes
while a load runs, which the scheduler guarantees; measured on H100 at 2 MiB units:
53.9 GB/s against 52.9 with STREAM). ``load_access_order`` overrides it.

On a driver without the batch API (older than CUDA 12.8) ``CeBackend`` refuses to
build; ``CeLoopBackend`` (one ``cuMemcpyAsync`` per descriptor, ~3–6 µs each) must be
asked for by name, and says so in the log and in its ``name``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tiercache.backends.base import CopyBackend, CopyPlan
from tiercache.backends.driver import (
    CUDA_SUCCESS, CudaDriver, MemcpyAttributes, SrcAccessOrder, stream_handle,
)
from tiercache.errors import BackendError
from tiercache.region.stats import BackendCode, Direction

log = logging.getLogger(__name__)

FIRST_BATCH = 16  # descriptors in the first call: the engines start after ~10 µs
MAX_BATCH = 256  # per-call cost (~5 µs) stays small against 256 x ~0.5 µs


def plan_arrays(plan: CopyPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The plan's arrays as C-contiguous uint64 (no copy when they already are)."""
    arrays = tuple(np.ascontiguousarray(a, dtype=np.uint64) for a in (plan.src, plan.dst,
                                                                       plan.sizes))
    return arrays  # type: ignore[return-value]


@dataclass(frozen=True)
class _Submitted:
    """Keeps the descriptor arrays alive until the stream has passed the copies."""

    arrays: tuple[np.ndarray, ...]


@dataclass(frozen=True, eq=False)
class DescriptorArrays:
    """Three C-contiguous uint64 arrays with their addresses read once, so that ranges of
    them can be submitted without re-reading (``ndarray.ctypes`` costs ~1.5 µs each)."""

    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray
    src_ptr: int
    dst_ptr: int
    sizes_ptr: int

    @classmethod
    def of(cls, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> DescriptorArrays:
        arrays = tuple(np.ascontiguousarray(a, dtype=np.uint64) for a in (src, dst, sizes))
        return cls(*arrays, *(a.ctypes.data for a in arrays))


class _CudaBackend(CopyBackend):
    """What every driver-level backend shares: the device, its context, the driver."""

    def __init__(self, device: int, driver: CudaDriver | None = None):
        self.device = int(device)
        self.driver = driver or CudaDriver()

    def _enter(self, stream: Any) -> int:
        handle = stream_handle(stream)
        if not self.driver.has_current_context():
            torch.cuda.set_device(self.device)  # makes the primary context current
        return handle


class CeBackend(_CudaBackend):
    """Copy engines through ``cuMemcpyBatchAsync``; one driver call per plan."""

    code = BackendCode.CE
    name = "ce"

    def __init__(self, device: int, driver: CudaDriver | None = None,
                 load_access_order: SrcAccessOrder = SrcAccessOrder.ANY):
        super().__init__(device, driver)
        if not self.driver.has_batch:
            raise BackendError(
                f"backend 'ce' needs cuMemcpyBatchAsync (CUDA 12.8 / driver R570 or newer); "
                f"this driver reports CUDA {self.driver.driver_version}. Configure "
                "backend = 'kernel' or 'staged', or use CeLoopBackend explicitly")
        self._attrs = {order: MemcpyAttributes(srcAccessOrder=int(order))
                       for order in SrcAccessOrder}
        self._order = {Direction.GPU_TO_CPU: SrcAccessOrder.STREAM,
                       Direction.CPU_TO_GPU: load_access_order}

    def copy_async(self, plan: CopyPlan, stream: Any) -> Any:
        handle = self._enter(stream)
        if plan.num_descriptors == 0:
            return None
        src, dst, sizes = plan_arrays(plan)
        self.submit(src, dst, sizes, self._order[plan.direction], handle)
        return _Submitted((src, dst, sizes))

    def submit(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray,
               order: SrcAccessOrder, handle: int) -> None:
        """Enqueue contiguous uint64 arrays on a raw stream handle, in batches growing
        from ``FIRST_BATCH`` to ``MAX_BATCH`` descriptors (see the module docstring)."""
        arrays, count = DescriptorArrays.of(src, dst, sizes), int(sizes.size)
        start, batch = 0, FIRST_BATCH
        while start < count:
            stop = min(start + batch, count)
            try:
                self.submit_range(arrays, start, stop, order, handle)
            except BackendError as e:
                raise BackendError(f"{e}; descriptors 0..{start - 1} of {count} are enqueued"
                                   if start else str(e)) from e
            start, batch = stop, min(2 * batch, MAX_BATCH)

    def submit_range(self, arrays: DescriptorArrays, start: int, stop: int,
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


class CeLoopBackend(_CudaBackend):
    """One ``cuMemcpyAsync`` per descriptor: only for drivers without the batch API.

    Slow on small pages (3–6 µs of host time per descriptor); never chosen silently.
    """

    code = BackendCode.CE
    name = "ce-loop"

    def __init__(self, device: int, driver: CudaDriver | None = None):
        super().__init__(device, driver)
        log.warning("copy backend ce-loop: one cuMemcpyAsync per descriptor (driver CUDA %d, "
                    "batch API %s); expect a fraction of the PCIe rate on small pages",
                    self.driver.driver_version,
                    "present" if self.driver.has_batch else "missing")

    def copy_async(self, plan: CopyPlan, stream: Any) -> Any:
        handle = self._enter(stream)
        src, dst, sizes = plan_arrays(plan)
        for i, (s, d, n) in enumerate(zip(src.tolist(), dst.tolist(), sizes.tolist())):
            rc = self.driver.memcpy_async(d, s, n, handle)
            if rc != CUDA_SUCCESS:
                raise BackendError(
                    f"cuMemcpyAsync {i} of {sizes.size} (src {s:#x} -> dst {d:#x}, {n} bytes) "
                    f"failed: {self.driver.error_name(rc)}; copies 0..{i - 1} are enqueued")
        return _Submitted((src, dst, sizes))


def device_index(device: Any) -> int:
    """The CUDA device ordinal of a torch device ('cuda' alone means the current one)."""
    device = torch.device(device)
    return torch.cuda.current_device() if device.index is None else int(device.index)


def create(context) -> CopyBackend:
    """``ce`` for a handler; the per-copy loop only where the driver has no batch API."""
    driver = CudaDriver()
    if not driver.has_batch:
        return CeLoopBackend(device_index(context.device), driver)
    return CeBackend(device_index(context.device), driver)

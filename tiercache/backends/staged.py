"""``staged``: pack small GPU pages into a staging ring with a GPU-local kernel, move whole
host runs on the copy engines (and the reverse for loads), chunk by chunk.

Why: the copy engines reach the PCIe ceiling only on large units, and the driver spends
host time on every descriptor. The host side of a transfer is mostly contiguous (a
region row holds all of a block's pages back to back) while the GPU side is not (one
page per layer tensor). Packing the GPU pages in host order, GPU-locally, turns
thousands of page copies into a few hundred row-sized DMAs. The packing runs at HBM
speed, so it holds SMs only briefly (a matmul beside continuous both-ways staged copies
kept its speed). The packer is a kernel because device-to-device batches on the copy
engines are too slow at page sizes to hide.

Per chunk k (slot s of the ring), with ``stream`` the caller's stream and ``dma`` the
backend's own stream::

    store: stream: wait free[s] -> pack pages into s -> record ready[s]
           dma:    wait ready[s] -> DMA s to host runs -> record free[s]
    load:  dma:    wait free[s] -> DMA host runs into s -> record ready[s]
           stream: wait ready[s] -> unpack s into pages -> record free[s]

The DMA stream first waits for everything already on ``stream``, and ``stream`` finally
waits for the last DMA, so the transfer is ordered on ``stream`` like any other
backend's. One DMA stream per backend, not per slot: more streams gave no gain per
direction and made the both-ways low mode more frequent. Slot events outlive transfers:
a slot is reused only after its last user, whatever transfer that was. Descriptors of
``direct_bytes`` or more skip the ring (one DMA each). Host bytes outside the plan's
descriptors are never written (``staging``).

Host cost delays the first DMA, and every chunk costs a kernel launch and a batch call:
the layout is a few numpy passes when the plan is in host order (the planner's), the
descriptor table is uploaded once, and chunks are large (``DEFAULT_CHUNK_BYTES``) so
launches stay few. The ring is ``DEFAULT_NUM_SLOTS`` deep because several ranks share
the host: with two slots a rank's pack -> DMA pipeline stalled whenever its DMAs slowed
under another rank's traffic; four keep it fed, and on one rank they measure the same
as two. Every figure behind these choices: docs/benchmarks.md ("Transfer engine", "End
to end on 2 GPUs").
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tiercache.backends.base import BackendContext, CopyBackend, CopyPlan, Submitted
from tiercache.backends.ce import CeBackend
from tiercache.backends.driver import (
    CudaDriver, DescriptorArrays, SrcAccessOrder, device_index, plan_arrays,
)
from tiercache.backends.kind import BackendKind
from tiercache.backends.staging import RUN_ALIGN, Scratch, StagingLayout, plan_staging
from tiercache.backends.triton_copy import CopyKernel, upload_table
from tiercache.errors import BackendError
from tiercache.specs import Direction

DEFAULT_CHUNK_BYTES = 32 << 20  # ~0.6 ms of PCIe per chunk; 16 MiB doubled the chunk count
DEFAULT_NUM_SLOTS = 4  # 128 MiB of GPU memory per direction
DEFAULT_DIRECT_BYTES = 1 << 20  # units the copy engines move at the ceiling unaided
PACK_PROGRAMS_PER_SM = 2


class StagedBackend(CopyBackend):
    """Staging ring of ``num_slots`` x (``chunk_bytes`` + ``direct_bytes``) on the GPU."""

    kind = BackendKind.STAGED

    def __init__(self, device: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 num_slots: int = DEFAULT_NUM_SLOTS, direct_bytes: int = DEFAULT_DIRECT_BYTES,
                 pack_programs: int | None = None, driver: CudaDriver | None = None,
                 load_order: SrcAccessOrder = SrcAccessOrder.ANY):
        if num_slots < 2:
            raise BackendError(f"num_slots = {num_slots}: staged needs >= 2 to overlap")
        if not 0 < direct_bytes <= chunk_bytes:
            raise BackendError(f"direct_bytes = {direct_bytes}: must be in 1..chunk_bytes "
                               f"({chunk_bytes})")
        self.device = torch.device("cuda", int(device))
        self.chunk_bytes = int(chunk_bytes)
        self.direct_bytes = int(direct_bytes)
        self.num_slots = int(num_slots)
        # slots start RUN_ALIGN-aligned, so packed offsets keep the plan's alignment in any slot
        self.slot_bytes = -(-(self.chunk_bytes + self.direct_bytes) // RUN_ALIGN) * RUN_ALIGN
        self.load_order = load_order  # host sources of loads: nothing writes them meanwhile
        self._ce = CeBackend(int(device), driver)
        self.driver = self._ce.driver
        self._ring = torch.empty((self.num_slots, self.slot_bytes), dtype=torch.uint8,
                                 device=self.device)
        self._ring_base = self._ring.data_ptr()
        self._dma_stream = torch.cuda.Stream(device=self.device)
        self._dma = self._dma_stream.cuda_stream
        ev = self.driver.event_create
        self._free = [ev() for _ in range(self.num_slots)]
        self._ready = [ev() for _ in range(self.num_slots)]
        self._start, self._done = ev(), ev()
        self._cursor = 0
        self._scratch = Scratch()
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._kernel = CopyKernel(pack_programs or PACK_PROGRAMS_PER_SM * sms, num_warps=4)

    # ------------------------------------------------------------ submit
    def copy_async(self, plan: CopyPlan, stream: Any) -> Submitted:
        handle = self.driver.enter(stream, self._ce.device)
        src, dst, sizes = plan_arrays(plan)
        store = plan.direction is Direction.GPU_TO_CPU
        gpu, host = plan.direction.src_dst(src, dst)  # the same swap: (src, dst) -> (gpu, host)
        layout = plan_staging(host, gpu, sizes, self.chunk_bytes, self.direct_bytes,
                              self._scratch)
        drv = self.driver
        drv.event_record(self._start, handle)
        drv.stream_wait_event(self._dma, self._start)
        x = layout.direct
        if x.num_bytes.size:
            order = SrcAccessOrder.STREAM if store else self.load_order
            self._ce.submit(*plan.direction.src_dst(x.gpu, x.host), x.num_bytes, order, self._dma)
        kept: tuple[Any, ...] = (layout, x)
        if layout.num_chunks:
            kept += self._submit_chunks(layout, store, handle, stream)
        drv.event_record(self._done, self._dma)
        drv.stream_wait_event(handle, self._done)
        return Submitted(kept)

    def _submit_chunks(self, layout: StagingLayout, store: bool, handle: int,
                       stream: Any) -> tuple[Any, ...]:
        assert layout.max_slot_bytes <= self.slot_bytes  # staged pieces < direct_bytes
        p, d = layout.pieces, layout.dmas
        num_chunks = layout.num_chunks
        slots = [(self._cursor + k) % self.num_slots for k in range(num_chunks)]
        slot_base = np.array([self._ring_base + s * self.slot_bytes for s in slots], np.uint64)
        stage = np.repeat(slot_base, np.diff(d.first)) + d.slot_offset  # DMAs' slot ends
        dmas = DescriptorArrays.of(stage, d.address, d.num_bytes) if store else \
            DescriptorArrays.of(d.address, stage, d.num_bytes)
        # piece i of chunk k sits at packed[i] - chunk_start[k] in its slot: one shift per chunk
        shifts = [int(b) - int(c) for b, c in zip(slot_base.tolist(), p.chunk_start.tolist())]
        pieces, dma_first = p.first.tolist(), d.first.tolist()
        drv, ce, dma = self.driver, self._ce, self._dma
        with torch.cuda.stream(stream):
            if store:
                table = upload_table(p.gpu, p.packed, p.num_bytes, stream)
            else:
                table = upload_table(p.packed, p.gpu, p.num_bytes, stream)
            for k, s in enumerate(slots):
                first, count = pieces[k], pieces[k + 1] - pieces[k]
                if store:
                    drv.stream_wait_event(handle, self._free[s])
                    self._kernel.launch(table, first, count, dst_shift=shifts[k])
                    drv.event_record(self._ready[s], handle)
                    drv.stream_wait_event(dma, self._ready[s])
                    ce.submit_range(dmas, dma_first[k], dma_first[k + 1], SrcAccessOrder.STREAM,
                                    dma)
                    drv.event_record(self._free[s], dma)
                else:
                    drv.stream_wait_event(dma, self._free[s])
                    ce.submit_range(dmas, dma_first[k], dma_first[k + 1], self.load_order, dma)
                    drv.event_record(self._ready[s], dma)
                    drv.stream_wait_event(handle, self._ready[s])
                    self._kernel.launch(table, first, count, src_shift=shifts[k])
                    drv.event_record(self._free[s], handle)
        self._cursor = (self._cursor + num_chunks) % self.num_slots
        return (dmas, table)

    # ------------------------------------------------------------ teardown
    def close(self) -> None:
        """Call only after every submitted transfer has finished (the handler drains)."""
        if self._ring is None:
            return
        self._dma_stream.synchronize()
        for event in (*self._free, *self._ready, self._start, self._done):
            self.driver.event_destroy(event)
        self._ring = None  # type: ignore[assignment]


def create(context: BackendContext) -> StagedBackend:
    return StagedBackend(device_index(context.device))

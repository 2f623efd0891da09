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

Two layouts, one pipeline. Built with the rank's geometry (a worker's backends are:
``BackendContext.geometry``), the backend takes block plans (``plan_form`` BLOCKS: GPU
ids, region slots, sub-pages) and ``block_layout`` lays them out as row images in
O(blocks); ``block_kernel`` expands each
(pair, tensor) to its page addresses on the device from tables uploaded once. Host work
per transfer is then proportional to blocks, not pages (64 tensors x 256 blocks is 16 k
pages but 256 pairs). Without a geometry (calibration, single-backend rigs), or for a
geometry the block layout refuses (said once at WARNING, with why), it takes page plans
(``plan_form`` PAGES) and ``page_layout`` lays them out.

Who issues it. Block plans go to the native chunk loop (``tiercache.native.chunk_loop``)
with the ordering's events: ``submit`` only reserves a pair-table buffer and queues the
plan; the loop's own thread (no GIL) lays it out (the same layout as ``block_layout``,
its specification and test oracle) and makes every driver call above, in order, and the
``Submission``'s ticket says when it is done. A plan whose pairs fit one chunk that finds
the loop idle is laid out and issued the same way by the caller, inside the submit (its
few driver calls cost the caller less than waking the loop's thread). A transfer of one
chunk has nothing to overlap and runs on ``stream`` alone (no hops to the DMA stream).
Page plans, and block plans with ``native=False``, are issued from Python on the calling
thread, after the loop has issued what it holds (the ring's events are shared). The same
loop takes whole transfers from the native transfer path (``transfer_loop``;
``tiercache.transfer.native_path``), validated, fenced and marked in the same call.

Zero-copy (``zero_copy_bytes``, the config's ``transfer.zero_copy_bytes``; 0, off, by
default): a block plan of at most that many bytes skips the ring. The loop lays its pairs
out with each row offset set to the row image's host address and launches the same
kernel once with slot base 0, so the kernel moves the pages straight between the GPU and
the pinned host rows (registered memory is mapped at the same address, UVA): no DMA, no
slot, no hop between streams. It saves the DMA's and the unpack's hand-off, 1-10 us of
GPU time per block on an H200, but the kernel's programs hold SMs for the PCIe time, and
a matmul beside such loads lost up to 15 % in some rounds (docs/benchmarks.md,
"Zero-copy small transfers"). Only over registered host rows
(``BackendContext.zero_copy_limit``).

Chunks are large (``DEFAULT_CHUNK_BYTES``) so launches stay few. The ring is
``DEFAULT_RING_SLOTS`` deep because several ranks share the host: with two slots a rank's
pack -> DMA pipeline stalled whenever its DMAs slowed under another rank's traffic; four
keep it fed, and on one rank they measure the same as two. The figures behind these
choices: docs/benchmarks.md ("Transfer engine", "End to end on 2 GPUs", "Host path").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import cast

import numpy as np
import torch

from tiercache.backends.base import (
    BackendContext, Ordering, Plan, StreamBackend, Submission,
)
from tiercache.backends.ce import CeBackend
from tiercache.backend_kind import BackendKind
from tiercache.backends.staged.block_kernel import BlockKernel, PairTables
from tiercache.backends.staged.block_layout import SLOT_ALIGN, BlockLayout, BlockStaging
from tiercache.backends.staged.page_layout import RUN_ALIGN, Scratch, StagingLayout, plan_staging
from tiercache.backends.triton_copy import CopyKernel, upload_table
from tiercache.device.driver import (
    CudaDriver, DescriptorArrays, SrcAccessOrder, device_index,
)
from tiercache.device.events import TORCH_DEVICE_ERRORS, Stream, event_handle
from tiercache.errors import BackendError
from tiercache.native.chunk_loop import ChunkLoop, LoopDriver, TableDriver
from tiercache.planning.geometry import TransferGeometry
from tiercache.planning.plans import BlockPlan, CopyPlan, PlanForm
from tiercache.region.layout import registration_rows

DEFAULT_CHUNK_BYTES = 32 << 20  # ~0.6 ms of PCIe per chunk; 16 MiB doubled the chunk count
DEFAULT_RING_SLOTS = 4  # 128 MiB of GPU memory per direction
DEFAULT_DIRECT_BYTES = 1 << 20  # units the copy engines move at the ceiling unaided
PACK_PROGRAMS_PER_SM = 2

log = logging.getLogger(__name__)
BlockPath = tuple[BlockStaging, BlockKernel, PairTables]  # what block plans are issued with


class StagedBackend(StreamBackend[Plan]):
    """Staging ring of ``num_ring_slots`` x (``chunk_bytes`` + ``direct_bytes``) on the GPU."""

    kind = BackendKind.STAGED

    def __init__(self, device: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 num_ring_slots: int = DEFAULT_RING_SLOTS,
                 direct_bytes: int = DEFAULT_DIRECT_BYTES,
                 pack_programs: int | None = None, driver: CudaDriver | None = None,
                 load_order: SrcAccessOrder = SrcAccessOrder.ANY,
                 geometry: TransferGeometry | None = None, load_whole_rows: bool = True,
                 native: bool = True, zero_copy_bytes: int = 0):
        if num_ring_slots < 2:
            raise BackendError(f"num_ring_slots = {num_ring_slots}: staged needs >= 2 to "
                               "overlap")
        if zero_copy_bytes < 0:
            raise BackendError(f"zero_copy_bytes = {zero_copy_bytes}: must be >= 0 (0: off)")
        if not 0 < direct_bytes <= chunk_bytes:
            raise BackendError(f"direct_bytes = {direct_bytes}: must be in 1..chunk_bytes "
                               f"({chunk_bytes})")
        self.device = torch.device("cuda", int(device))
        self.chunk_bytes = int(chunk_bytes)
        self.direct_bytes = int(direct_bytes)
        self.num_ring_slots = int(num_ring_slots)
        # slots start RUN_ALIGN-aligned, so packed offsets keep the plan's alignment in any slot
        self.ring_slot_bytes = -(-(self.chunk_bytes + self.direct_bytes) // RUN_ALIGN) \
            * RUN_ALIGN
        self.load_order = load_order  # host sources of loads: nothing writes them meanwhile
        self._ce = CeBackend(int(device), driver)
        self.driver = self._ce.driver
        self._ring = torch.empty((self.num_ring_slots, self.ring_slot_bytes),
                                 dtype=torch.uint8, device=self.device)
        self._ring_base = self._ring.data_ptr()
        self._dma_stream = torch.cuda.Stream(device=self.device)
        self._dma = self._dma_stream.cuda_stream
        ev = self.driver.event_create
        self._free = [ev() for _ in range(self.num_ring_slots)]
        self._ready = [ev() for _ in range(self.num_ring_slots)]
        self._start, self._done = ev(), ev()
        self._cursor = 0
        self._scratch = Scratch()
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        # The page kernel launches at most pack_programs (default 2 per SM). The block kernel
        # launches one program per (pair, tensor) unless pack_programs is given: bounded at 2
        # per SM it gave a matmul beside both-ways copies +0-2 points and took 4-11 points
        # of the copies' own rate (docs/benchmarks.md, "The pack kernels' share of the SMs").
        self._kernel = CopyKernel(pack_programs or PACK_PROGRAMS_PER_SM * sms, num_warps=4)
        self._blocks = None if geometry is None else self._block_path(geometry, load_whole_rows,
                                                                        pack_programs)
        self._loop = self._chunk_loop(self._blocks) if native and self._blocks is not None \
            else None
        self.zero_copy_pairs = 0
        if self._loop is not None and geometry is not None and zero_copy_bytes:
            self.zero_copy_pairs = zero_copy_bytes // max(geometry.pair_bytes)
            self._loop.set_zero_copy(self.zero_copy_pairs)
        self.plan_form = PlanForm.PAGES if self._blocks is None else PlanForm.BLOCKS

    def _block_path(self, geometry: TransferGeometry, load_whole_rows: bool,
                    max_programs: int | None) -> BlockPath | None:
        try:  # whole-row loads: one DMA per CPU row, extra host bytes read, none written
            staging = BlockStaging.of_geometry(
                geometry, self.chunk_bytes, load_whole_rows,
                registration_rows(geometry.cpu_pages[0].block_stride_bytes))
        except BackendError as e:
            log.warning("staged on %s: this geometry takes the page-level layout (%s)",
                        self.device, e)
            return None
        return (staging, BlockKernel(staging, self.device, max_programs=max_programs,
                                     compiled_launch=True),
                PairTables(self.device, self.driver))

    def _chunk_loop(self, blocks: BlockPath) -> ChunkLoop:
        """The native chunk loop over this ring; raises BackendError when it cannot be
        built or started (no quiet fallback to the Python loop)."""
        staging, kernel, _ = blocks
        if self.ring_slot_bytes % SLOT_ALIGN:
            raise BackendError(f"ring_slot_bytes = {self.ring_slot_bytes}: not a multiple of "
                               f"{SLOT_ALIGN}")
        attrs = (bytes(self._ce.attributes(self.load_order)),
                 bytes(self._ce.attributes(SrcAccessOrder.STREAM)))
        loop_kernel = kernel.loop_kernel(self._ring_base)  # compiles both directions
        drv = self.driver
        if not drv.batch_address or drv.batch_abi is None:  # found together, or neither
            raise BackendError(f"CUDA driver {drv.driver_version} has no cuMemcpyBatchAsync "
                               "(needs R570 / CUDA 12.8 or newer)")
        entry = drv.entry_point
        tables = TableDriver(entry("cuMemHostAlloc"), entry("cuMemFreeHost"),
                             entry("cuEventCreate"), entry("cuEventDestroy_v2"),
                             entry("cuEventQuery"))
        loop_driver = LoopDriver(entry("cuLaunchKernel"), entry("cuEventRecord"),
                                 entry("cuStreamWaitEvent"), drv.batch_address,
                                 entry("cuCtxSetCurrent"), int(drv.batch_abi),
                                 drv.current_context(), entry("cuCtxGetCurrent"), tables)
        geometry = staging.loop_geometry()
        loop = ChunkLoop(loop_driver, loop_kernel, geometry, dma_stream=self._dma,
                         ring_base=self._ring_base, ring_slot_bytes=self.ring_slot_bytes,
                         free_events=self._free, ready_events=self._ready,
                         begin_event=self._start, done_event=self._done, attrs=attrs)
        # a job that fits one chunk is a handful of driver calls: the caller issues it
        # itself when the loop is idle
        loop.set_inline(geometry.one_chunk_pairs)
        return loop

    def transfer_loop(self, geometry: TransferGeometry) -> ChunkLoop | None:
        """The chunk loop, when this backend issues block plans natively and was built for
        ``geometry`` (its tables lay out only that geometry's pairs); else None."""
        if self._loop is None or self._blocks is None \
                or self._blocks[0].groups is not geometry.groups:
            return None
        return self._loop

    @property
    def chunk_loop(self) -> ChunkLoop | None:
        """The native chunk loop issuing block plans (None without one)."""
        return self._loop

    @property
    def native(self) -> bool:
        """Block plans are issued by the native chunk loop's thread."""
        return self._loop is not None

    def submit(self, plan: Plan | None, ordering: Ordering) -> Submission:
        """Block plans (and empty transfers) with a chunk loop: queued to it whole, with
        the ordering's events. Everything else on the calling thread, once the loop has
        issued what it holds."""
        if self._loop is not None and not isinstance(plan, CopyPlan):
            return self._queue(plan, ordering)
        if self._loop is not None:
            self._loop.wait()  # the ring's events: the loop's records come first
        return super().submit(plan, ordering)

    def _queue(self, plan: BlockPlan | None, ordering: Ordering) -> Submission:
        assert self._loop is not None and self._blocks is not None, "a loop has a block path"
        staging = self._blocks[0]
        handle = self.driver.enter(ordering.stream, self._ce.device)
        if len(ordering.after) > 2:
            raise BackendError(f"{len(ordering.after)} events to wait for: the chunk loop "
                               "takes two")
        after, prev_end = (*map(event_handle, ordering.after), 0, 0)[:2]
        start, end = event_handle(ordering.start), event_handle(ordering.end)
        submit = self._loop.submit
        if plan is None or plan.empty:
            return Submission((), submit(stream=handle, after=after, prev_end=prev_end,
                                         start_event=start, end_event=end))
        try:
            staging.check(plan)
        except BackendError:
            submit(stream=handle, after=after, prev_end=prev_end, start_event=start,
                   end_event=end)  # the end event is still recorded, in order
            raise
        ticket = submit(stream=handle, after=after, prev_end=prev_end, start_event=start,
                        end_event=end, direction=plan.direction, validated=plan.buffer,
                        num_pairs=plan.num_pairs, num_works=plan.num_works,
                        keep=plan)  # a pair table of the loop's own
        return Submission((plan,), ticket)

    def copy(self, plan: Plan, stream: Stream) -> tuple[object, ...]:
        """A page plan, or a block plan without the chunk loop, from Python (torch's
        pinned tables and Triton's launches: a device failure under them is re-raised as
        ``BackendError``)."""
        try:
            if isinstance(plan, BlockPlan):
                return self._copy_blocks(plan, stream)
            return self._copy_pages(plan, stream)
        except TORCH_DEVICE_ERRORS as e:
            raise BackendError(f"staged copy of a {type(plan).__name__} could not be "
                               f"submitted: {e}") from e

    # ------------------------------------------------------------ issue from Python
    def _copy_pages(self, plan: CopyPlan, stream: Stream) -> tuple[object, ...]:
        handle = self.driver.enter(stream, self._ce.device)
        src, dst, sizes = plan.arrays()
        store = plan.direction.stores
        gpu, host = plan.direction.src_dst(src, dst)  # the same swap: (src, dst) -> (gpu, host)
        layout = plan_staging(host, gpu, sizes, self.chunk_bytes, self.direct_bytes,
                              self._scratch)
        self._begin(handle)
        x = layout.direct
        if x.num_bytes.size:
            order = SrcAccessOrder.STREAM if store else self.load_order
            self._ce.enqueue(*plan.direction.src_dst(x.gpu, x.host), x.num_bytes, order,
                             self._dma)
        kept: tuple[object, ...] = (layout, x)
        if layout.num_chunks:
            kept += self._page_chunks(layout, store, handle, stream)
        self._end(handle)
        return kept

    def _copy_blocks(self, plan: BlockPlan, stream: Stream) -> tuple[object, ...]:
        assert self._blocks is not None, "block plans are planned only with a block path"
        staging, kernel, tables = self._blocks
        handle = self.driver.enter(stream, self._ce.device)
        store = plan.direction.stores
        layout = staging.layout(plan)
        self._begin(handle)
        kept: tuple[object, ...] = (layout,)
        if layout.num_chunks:
            with torch.cuda.stream(cast(torch.cuda.Stream, stream)):  # a GPU kind's (Ordering)
                pairs, token = tables.upload(layout.pairs, stream)
                move = kernel.pack if store else kernel.unpack

                def gpu_half(k: int, slot_base: int) -> None:
                    move(pairs, layout.num_pairs, *layout.pair_range(k), slot_base)

                kept += self._pipeline(layout.num_chunks, store, handle,
                                       lambda bases: self._block_dmas(layout, bases, store),
                                       layout.dma_first.tolist(), gpu_half)
                tables.release(token, stream)
        self._end(handle)
        return kept

    @staticmethod
    def _block_dmas(layout: BlockLayout, slot_bases: np.ndarray, store: bool
                    ) -> DescriptorArrays:
        stage = layout.dma_slot_addresses(slot_bases)
        return DescriptorArrays.of(stage, layout.dma_host, layout.dma_bytes) if store else \
            DescriptorArrays.of(layout.dma_host, stage, layout.dma_bytes)

    def _begin(self, handle: int) -> None:
        """The DMA stream starts after everything already on the caller's stream."""
        self.driver.event_record(self._start, handle)
        self.driver.stream_wait_event(self._dma, self._start)

    def _end(self, handle: int) -> None:
        """The caller's stream continues after the last DMA."""
        self.driver.event_record(self._done, self._dma)
        self.driver.stream_wait_event(handle, self._done)

    def _page_chunks(self, layout: StagingLayout, store: bool, handle: int,
                     stream: Stream) -> tuple[object, ...]:
        assert layout.max_slot_bytes <= self.ring_slot_bytes  # staged pieces < direct_bytes
        p, d = layout.pieces, layout.dmas

        def dmas_at(slot_base: np.ndarray) -> DescriptorArrays:
            stage = np.repeat(slot_base, np.diff(d.first)) + d.slot_offset  # DMAs' slot ends
            return DescriptorArrays.of(stage, d.address, d.num_bytes) if store else \
                DescriptorArrays.of(d.address, stage, d.num_bytes)

        cuda = cast(torch.cuda.Stream, stream)  # a GPU kind's stream is torch's (Ordering)
        with torch.cuda.stream(cuda):
            table = upload_table(*((p.gpu, p.packed) if store else (p.packed, p.gpu)),
                                 p.num_bytes, cuda)
            pieces, chunk_start = p.first.tolist(), p.chunk_start.tolist()

            # piece i of chunk k sits at packed[i] - chunk_start[k] in its slot: one shift
            def gpu_half(k: int, slot_base: int) -> None:
                shift = slot_base - int(chunk_start[k])
                first, count = pieces[k], pieces[k + 1] - pieces[k]
                if store:
                    self._kernel.launch(table, first, count, dst_shift=shift)
                else:
                    self._kernel.launch(table, first, count, src_shift=shift)

            kept = self._pipeline(layout.num_chunks, store, handle, dmas_at, d.first.tolist(),
                                  gpu_half)
        return kept + (table,)

    def _pipeline(self, num_chunks: int, store: bool, handle: int,
                  dmas_at: Callable[[np.ndarray], DescriptorArrays], dma_first: list[int],
                  gpu_half: Callable[[int, int], None]) -> tuple[object, ...]:
        """Chunk k through slot s: the GPU half (pack / unpack on the caller's stream) and
        the DMA half (copy engines on the DMA stream), ordered by the slot's events (module
        docstring). ``dmas_at(slot_bases)`` gives the DMAs, ``dma_first`` their chunk
        boundaries; ``gpu_half(k, slot_base)`` enqueues chunk k's kernel."""
        slots = [(self._cursor + k) % self.num_ring_slots for k in range(num_chunks)]
        bases = [self._ring_base + s * self.ring_slot_bytes for s in slots]
        dmas = dmas_at(np.array(bases, np.uint64))
        drv, ce, dma = self.driver, self._ce, self._dma
        for k, s in enumerate(slots):
            lo, hi = dma_first[k], dma_first[k + 1]
            if store:
                drv.stream_wait_event(handle, self._free[s])
                gpu_half(k, bases[k])
                drv.event_record(self._ready[s], handle)
                drv.stream_wait_event(dma, self._ready[s])
                ce.enqueue_range(dmas, lo, hi, SrcAccessOrder.STREAM, dma)
                drv.event_record(self._free[s], dma)
            else:
                drv.stream_wait_event(dma, self._free[s])
                ce.enqueue_range(dmas, lo, hi, self.load_order, dma)
                drv.event_record(self._ready[s], dma)
                drv.stream_wait_event(handle, self._ready[s])
                gpu_half(k, bases[k])
                drv.event_record(self._free[s], handle)
        self._cursor = (self._cursor + num_chunks) % self.num_ring_slots
        return (dmas,)

    # ------------------------------------------------------------ teardown
    def close(self) -> None:
        """Call only after every submitted transfer has finished (the handler waits for
        them first)."""
        if self._ring is None:
            return
        if self._loop is not None:
            self._loop.close()  # issues what is queued first
            self._loop = None
        self._dma_stream.synchronize()
        for event in (*self._free, *self._ready, self._start, self._done):
            self.driver.event_destroy(event)
        if self._blocks is not None:
            self._blocks[2].close()
        self._ring = None  # type: ignore[assignment]  # closed: the ring's memory goes now


def create(context: BackendContext) -> StagedBackend:
    return StagedBackend(device_index(context.device), geometry=context.geometry,
                         zero_copy_bytes=context.zero_copy_limit)

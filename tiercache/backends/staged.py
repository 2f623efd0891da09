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

Two layouts, one pipeline. With the rank's planner (a worker's backends get it), the
transfer arrives at block level (``BlockPlan``: GPU ids, CPU rows, sub-pages) and
``block_staging`` lays it out as row images in O(blocks); ``block_kernel`` expands each
(pair, tensor) to its page addresses on the device from tables uploaded once. Host work
per transfer is then proportional to blocks, not pages (the point of the design: 64
tensors x 256 blocks is 16 k pages but 256 pairs). Without a planner (single-backend
rigs), or for a geometry the block layout refuses (said once at WARNING, with why), the
page-level layout below is used.

Who issues it. With a planner, block transfers go to the native chunk loop
(``native_loop``, ``native/chunk_loop.c``): ``plan`` validates the ids in C on the caller's
thread, ``submit_ordered`` queues the transfer with the handler's ordering events, and the
loop's own thread (no GIL) lays it out (the same layout as ``block_staging``, which is its
specification and its test oracle) and makes every driver call above, in order. The
caller's thread is held for validation and one queue call, not for the chunks: 256 blocks
of 64 x 32 KiB cost it 77-364 µs (the spread is the host's cache after a large transfer)
instead of 637-1170 µs through the Python loop, in the same runs (H100). A
transfer of one chunk has nothing to overlap and runs on ``stream`` alone (no hops to the
DMA stream). Page plans, and ``native=False``, issue the same pipeline from Python.

Chunks are large (``DEFAULT_CHUNK_BYTES``) so launches stay few. The ring is
``DEFAULT_NUM_SLOTS`` deep because several ranks share the host: with two slots a rank's
pack -> DMA pipeline stalled whenever its DMAs slowed under another rank's traffic; four
keep it fed, and on one rank they measure the same as two. Every figure behind these
choices: docs/benchmarks.md ("Transfer engine", "End to end on 2 GPUs", "Host path").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tiercache.backends.base import BackendContext, BlockPlan, CopyBackend, CopyPlan, Submitted
from tiercache.backends.block_kernel import BlockKernel, PairTables
from tiercache.backends.block_staging import SLOT_ALIGN, BlockLayout, BlockStaging
from tiercache.backends.ce import CeBackend
from tiercache.backends.driver import (
    CudaDriver, DescriptorArrays, SrcAccessOrder, device_index, plan_arrays,
)
from tiercache.backends.kind import BackendKind
from tiercache.backends.native_loop import SPEC_ERRORS, ChunkLoop, Geometry, Validated
from tiercache.backends.staging import RUN_ALIGN, Scratch, StagingLayout, plan_staging
from tiercache.backends.triton_copy import CopyKernel, upload_table
from tiercache.errors import BackendError, SpecError
from tiercache.specs import Direction

DEFAULT_CHUNK_BYTES = 32 << 20  # ~0.6 ms of PCIe per chunk; 16 MiB doubled the chunk count
DEFAULT_NUM_SLOTS = 4  # 128 MiB of GPU memory per direction
DEFAULT_DIRECT_BYTES = 1 << 20  # units the copy engines move at the ceiling unaided
PACK_PROGRAMS_PER_SM = 2

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class NativePlan:
    """A transfer validated by the chunk loop (``StagedBackend.plan``), for its
    ``submit_ordered``: the works it lays out, and what the handler reports."""

    direction: Direction
    validated: Validated
    num_bytes: int

    @property
    def num_pairs(self) -> int:
        return self.validated.num_pairs


class StagedBackend(CopyBackend):
    """Staging ring of ``num_slots`` x (``chunk_bytes`` + ``direct_bytes``) on the GPU."""

    kind = BackendKind.STAGED

    def __init__(self, device: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 num_slots: int = DEFAULT_NUM_SLOTS, direct_bytes: int = DEFAULT_DIRECT_BYTES,
                 pack_programs: int | None = None, driver: CudaDriver | None = None,
                 load_order: SrcAccessOrder = SrcAccessOrder.ANY, planner: Any = None,
                 load_whole_rows: bool = True, native: bool = True):
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
        self._planner = planner
        self._blocks = None if planner is None else self._block_path(planner, load_whole_rows)
        self._loop = self._chunk_loop() if native and self._blocks is not None else None

    def _block_path(self, planner: Any, load_whole_rows: bool
                    ) -> tuple[BlockStaging, BlockKernel, PairTables] | None:
        try:  # whole-row loads: one DMA per CPU row, extra host bytes read, none written
            staging = BlockStaging.of_planner(planner, self.chunk_bytes, load_whole_rows)
        except BackendError as e:
            log.warning("staged on %s: this geometry takes the page-level layout (%s)",
                        self.device, e)
            return None
        # the compiled launcher: 9.9 against 17 µs of host time per launch (H100, probe)
        return (staging, BlockKernel(staging, self.device, compiled_launch=True),
                PairTables(self.device, self.driver))

    def _chunk_loop(self) -> ChunkLoop:
        """The native chunk loop over this ring (``native_loop``); raises BackendError
        when it cannot be built or started (no quiet fallback to the Python loop)."""
        kernel = self._blocks[1].loop_kernel(self._ring_base)
        self._pair_bytes = [g.pair_bytes for g in self._planner.groups]
        if self.slot_bytes % SLOT_ALIGN:
            raise BackendError(f"slot_bytes = {self.slot_bytes}: not a multiple of {SLOT_ALIGN}")
        attrs = tuple(bytes(self._ce.attributes(order))
                      for order in (self.load_order, SrcAccessOrder.STREAM))
        return ChunkLoop(self.driver.loop_driver(), kernel,
                         Geometry.of(self._blocks[0], self._planner),
                         dma_stream=self._dma,
                         ring_base=self._ring_base, slot_bytes=self.slot_bytes,
                         free_events=self._free, ready_events=self._ready,
                         begin_event=self._start, done_event=self._done, attrs=attrs)

    @property
    def takes_blocks(self) -> bool:  # type: ignore[override]
        return self._blocks is not None

    @property
    def native(self) -> bool:
        """Block transfers are issued by the native chunk loop's thread."""
        return self._loop is not None

    def drain(self) -> None:
        if self._loop is not None:
            self._loop.wait()

    def plan(self, planner: Any, direction: Direction, transfer: Any, out: Any = None) -> Any:
        """With the chunk loop: the transfer's ids validated in C on the calling thread
        (``tc_validate``, the planner's rules; a refusal is re-checked by the planner, whose
        ``SpecError`` names what is wrong). Otherwise the base's plans."""
        if self._loop is None or planner is not self._planner:
            return super().plan(planner, direction, transfer, out)
        gpu, cpu = planner.specs(direction, transfer)
        sizes = gpu.group_sizes
        validated = self._loop.validate(direction is Direction.GPU_TO_CPU, gpu.block_ids, sizes,
                                        gpu.block_indices, cpu.block_ids)
        if isinstance(validated, int):
            planner.block_plan(direction, transfer)  # raises the SpecError that says why
            raise SpecError(f"transfer refused: {SPEC_ERRORS.get(validated, validated)}")
        return NativePlan(direction, validated,
                          sum(n * b for n, b in zip(sizes, self._pair_bytes)))

    def submit_ordered(self, plan: Any, stream: Any, after: tuple[Any, ...], start: Any,
                       end: Any) -> Submitted | None:
        """Native plans, block plans and empty transfers go to the chunk loop whole, with
        the handler's events: the calling thread only picks a pair-table buffer. Page
        plans: the base."""
        if self._loop is None or isinstance(plan, CopyPlan):
            return super().submit_ordered(plan, stream, after, start, end)
        return self._submit_native(plan, stream, after, start, end)

    def submit_plan(self, plan: Any, stream: Any) -> Submitted:
        """``submit_plan`` of the base, and of what ``plan`` returns (a NativePlan)."""
        if isinstance(plan, NativePlan):
            return self._submit_direct(plan, stream)
        return super().submit_plan(plan, stream)

    def _submit_direct(self, plan: NativePlan | BlockPlan, stream: Any) -> Submitted:
        """A transfer outside the handlers (bench, calibration): issued by the loop, and
        waited for until issued, so work the caller enqueues on ``stream`` after this call
        comes after it."""
        submitted = self._submit_native(plan, stream, (), None, None)
        submitted.ticket.wait()
        if submitted.ticket.status:
            raise BackendError(f"the chunk loop failed: "
                               f"{self.driver.error_name(submitted.ticket.status)}")
        return Submitted(submitted.keep + (submitted.ticket,))  # its arrays with it

    def _submit_native(self, plan: NativePlan | BlockPlan | None, stream: Any,
                       after: tuple[Any, ...], start: Any, end: Any) -> Submitted:
        staging, _, tables = self._blocks
        handle = self.driver.enter(stream, self._ce.device)
        if len(after) > 2:
            raise BackendError(f"{len(after)} events to wait for: the chunk loop takes two")
        marks = [0 if e is None else e.handle for e in after] + [0, 0]
        order = dict(stream=handle, after=marks[0], prev_end=marks[1],
                     start_event=0 if start is None else start.handle,
                     end_event=0 if end is None else end.handle)
        try:
            validated = None if plan is None else plan.validated if isinstance(plan, NativePlan) \
                else Validated.of_items(staging.work_items(plan.pairs))
        except BackendError:
            self._loop.submit(**order)  # the end event is still recorded in order
            raise
        if validated is None or not validated.num_works:
            return Submitted((), self._loop.submit(**order))
        address, token = tables.reserve(validated.num_pairs)
        ticket = self._loop.submit(**order, table_event=tables.table_event(token),
                                   store=plan.direction is Direction.GPU_TO_CPU,
                                   validated=validated, pairs=address, keep=plan)
        tables.release_after(token, ticket)
        return Submitted((plan,), ticket)

    # ------------------------------------------------------------ submit
    def copy_async(self, plan: CopyPlan, stream: Any) -> Submitted:
        self.drain()  # the ring's events: the loop's records come first
        handle = self.driver.enter(stream, self._ce.device)
        src, dst, sizes = plan_arrays(plan)
        store = plan.direction is Direction.GPU_TO_CPU
        gpu, host = plan.direction.src_dst(src, dst)  # the same swap: (src, dst) -> (gpu, host)
        layout = plan_staging(host, gpu, sizes, self.chunk_bytes, self.direct_bytes,
                              self._scratch)
        self._begin(handle)
        x = layout.direct
        if x.num_bytes.size:
            order = SrcAccessOrder.STREAM if store else self.load_order
            self._ce.submit(*plan.direction.src_dst(x.gpu, x.host), x.num_bytes, order, self._dma)
        kept: tuple[Any, ...] = (layout, x)
        if layout.num_chunks:
            kept += self._page_chunks(layout, store, handle, stream)
        self._end(handle)
        return Submitted(kept)

    def copy_blocks_async(self, plan: BlockPlan, stream: Any) -> Submitted:
        if self._blocks is None:
            raise BackendError("staged has no block layout for this geometry (built without "
                               "a planner, or the layout refused it): pass a page plan")
        if self._loop is not None:
            return self._submit_direct(plan, stream)
        staging, kernel, tables = self._blocks
        handle = self.driver.enter(stream, self._ce.device)
        store = plan.direction is Direction.GPU_TO_CPU
        layout = staging.layout(plan.pairs, store)
        self._begin(handle)
        kept: tuple[Any, ...] = (layout,)
        if layout.num_chunks:
            with torch.cuda.stream(stream):
                pairs, token = tables.upload(layout.pairs, stream)
                move = kernel.pack if store else kernel.unpack

                def gpu_half(k: int, slot_base: int) -> None:
                    move(pairs, layout.num_pairs, *layout.pair_range(k), slot_base)

                kept += self._pipeline(layout.num_chunks, store, handle,
                                       lambda bases: self._block_dmas(layout, bases, store),
                                       layout.dma_first.tolist(), gpu_half)
                tables.release(token, stream)
        self._end(handle)
        return Submitted(kept)

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
                     stream: Any) -> tuple[Any, ...]:
        assert layout.max_slot_bytes <= self.slot_bytes  # staged pieces < direct_bytes
        p, d = layout.pieces, layout.dmas

        def dmas_at(slot_base: np.ndarray) -> DescriptorArrays:
            stage = np.repeat(slot_base, np.diff(d.first)) + d.slot_offset  # DMAs' slot ends
            return DescriptorArrays.of(stage, d.address, d.num_bytes) if store else \
                DescriptorArrays.of(d.address, stage, d.num_bytes)

        with torch.cuda.stream(stream):
            table = upload_table(*((p.gpu, p.packed) if store else (p.packed, p.gpu)),
                                 p.num_bytes, stream)
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
                  gpu_half: Callable[[int, int], None]) -> tuple[Any, ...]:
        """Chunk k through slot s: the GPU half (pack / unpack on the caller's stream) and
        the DMA half (copy engines on the DMA stream), ordered by the slot's events (module
        docstring). ``dmas_at(slot_bases)`` gives the DMAs, ``dma_first`` their chunk
        boundaries; ``gpu_half(k, slot_base)`` enqueues chunk k's kernel."""
        slots = [(self._cursor + k) % self.num_slots for k in range(num_chunks)]
        bases = [self._ring_base + s * self.slot_bytes for s in slots]
        dmas = dmas_at(np.array(bases, np.uint64))
        drv, ce, dma = self.driver, self._ce, self._dma
        for k, s in enumerate(slots):
            lo, hi = dma_first[k], dma_first[k + 1]
            if store:
                drv.stream_wait_event(handle, self._free[s])
                gpu_half(k, bases[k])
                drv.event_record(self._ready[s], handle)
                drv.stream_wait_event(dma, self._ready[s])
                ce.submit_range(dmas, lo, hi, SrcAccessOrder.STREAM, dma)
                drv.event_record(self._free[s], dma)
            else:
                drv.stream_wait_event(dma, self._free[s])
                ce.submit_range(dmas, lo, hi, self.load_order, dma)
                drv.event_record(self._ready[s], dma)
                drv.stream_wait_event(handle, self._ready[s])
                gpu_half(k, bases[k])
                drv.event_record(self._free[s], handle)
        self._cursor = (self._cursor + num_chunks) % self.num_slots
        return (dmas,)

    # ------------------------------------------------------------ teardown
    def close(self) -> None:
        """Call only after every submitted transfer has finished (the handler drains)."""
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
        self._ring = None  # type: ignore[assignment]


def create(context: BackendContext) -> StagedBackend:
    return StagedBackend(device_index(context.device), planner=context.planner)

"""The staged chunk loop: the native library's issuing thread (``src/queue.c``), driven
from Python.

Why: a staged transfer of 256 blocks is 16 chunks, and each chunk costs a kernel launch,
a ``cuMemcpyBatchAsync`` and four event calls. A Python thread cannot issue them without
holding up the engine's thread (under the GIL it waits a switch interval per step while
the engine runs Python), so a native thread does: the engine's thread hands a validated
block plan over in one call (``submit``); the loop lays it out and issues the chunks
while the first DMA already runs. The measurements behind this: docs/benchmarks.md,
"Host path".

The loop takes the driver's entry points as function addresses (``LoopDriver``), so
tests drive it with recording functions where no GPU exists. Torch-free.
"""

from __future__ import annotations

import ctypes
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from tiercache.errors import BackendError
from tiercache.native.codes import (
    ATTRS_BYTES, KERNEL_ARGS, MAX_PARAMS, MAX_RING_SLOTS, STATUS_PENDING, Outcome, TransferCode,
)
from tiercache.native.library import library
from tiercache.native.structs import (
    ConfigStruct, GeometryStruct, JobStruct, OutcomeStruct, address_of,
)
from tiercache.native.transfer_call import TransferChecks
from tiercache.specs import Direction

_REFUSED = "the staged chunk loop refused a job (closing, or no memory for it or its pair table)"
_I64, _U64 = np.dtype(np.int64), np.dtype(np.uint64)


@dataclass(frozen=True, eq=False)
class Geometry:
    """What the loop lays transfers out with: a block layout's static tables (block
    factor, groups' CPU strides, row origins and pitches, run templates), the chunk size
    and whether loads read whole row images (``BlockLayout.loop_geometry``)."""

    factor: int
    chunk_bytes: int
    whole_rows: bool
    cpu_stride: np.ndarray
    row_origin: np.ndarray
    pitch: np.ndarray
    tpl_first: np.ndarray
    tpl_count: np.ndarray
    run_offset: np.ndarray
    run_bytes: np.ndarray
    break_rows: int = 0  # no DMA runs into a row whose slot is a multiple (0: none)

    @property
    def max_runs(self) -> int:
        """The most runs one row's template has."""
        return max(int(self.tpl_count.max()), 1)

    @property
    def one_chunk_pairs(self) -> int:
        """A job of at most this many pairs fits one chunk (a row holds at least one
        pair, and no row is wider than the widest pitch)."""
        return self.chunk_bytes // int(self.pitch.max())

    def struct(self) -> GeometryStruct:
        g = GeometryStruct(self.factor, int(self.pitch.size), int(self.whole_rows),
                           self.max_runs, self.chunk_bytes)
        for name in ("cpu_stride", "row_origin", "pitch", "tpl_first", "tpl_count",
                     "run_offset", "run_bytes"):
            setattr(g, name, getattr(self, name).ctypes.data)
        g.break_rows = int(self.break_rows)
        return g


class Ticket:
    """One submitted job (``tiercache.backends.base.Ticket``): ``issued()`` once the loop
    has enqueued all of it (its events mean something only then), ``status`` the first
    failing CUresult (0: none)."""

    __slots__ = ("_loop", "seq", "_status", "_keep")

    def __init__(self, loop: ChunkLoop, seq: int, status: ctypes.c_int32, keep: object):
        self._loop, self.seq, self._status, self._keep = loop, seq, status, keep

    def issued(self) -> bool:
        return self._status.value != STATUS_PENDING

    def wait(self) -> None:
        if not self.issued():
            self._loop.wait(self.seq)

    @property
    def status(self) -> int:
        """The job's CUresult once issued (STATUS_PENDING before)."""
        return self._status.value


class Stamps(NamedTuple):
    """The last issued job's clock (ns, ``time.monotonic_ns``) and how it was issued."""

    submitted: int
    picked: int
    issued: int
    inline: bool  # by the caller, inside its submit (else by the loop's thread)
    zero_copy: bool  # no ring: the kernel moved its pages to or from the host rows


@dataclass(frozen=True)
class LoopKernel:
    """How the loop launches the pack / unpack kernel: CUfunction handles ([0] unpack,
    [1] pack), threads per program, shared bytes ([0], [1]), the grid's second dimension,
    the first dimension's bound (0: one program per pair), the kernel's parameter count
    (the first ``KERNEL_ARGS`` are the loop's, the rest are passed as zero) and its four
    static arguments (tensor table, its stride, group table, group count)."""

    functions: tuple[int, int]
    block_x: int
    shared: tuple[int, int]
    grid_y: int
    max_grid_x: int
    num_params: int
    static_args: tuple[int, int, int, int]


@dataclass(frozen=True)
class TableDriver:
    """Entry points for the loop's own pair tables (``cuMemHostAlloc``, ``cuMemFreeHost``,
    ``cuEventCreate``, ``cuEventDestroy``, ``cuEventQuery``): pinned host memory the
    kernels read through UVA, each table with an event recorded after its job's last
    launch and reused once that event completed."""

    host_alloc: int
    host_free: int
    event_create: int
    event_destroy: int
    event_query: int


@dataclass(frozen=True)
class LoopDriver:
    """Driver entry points as C function addresses (``cuLaunchKernel``, ``cuEventRecord``,
    ``cuStreamWaitEvent``, ``cuMemcpyBatchAsync`` of ``batch_abi``, ``cuCtxSetCurrent``)
    and the context to make current on the loop's thread (0: none); ``ctx_get``
    (``cuCtxGetCurrent``; 0: none) lets a caller issue a small job itself, only while
    that context is current on its thread (``ChunkLoop.set_inline``); ``tables`` (None:
    every job brings its table) lets jobs take pair tables of the loop's own (``transfer``
    needs them)."""

    launch: int
    record: int
    wait: int
    batch: int
    ctx_set: int
    batch_abi: int
    ctx: int
    ctx_get: int = 0
    tables: TableDriver | None = None


class ChunkLoop:
    """One backend's loop thread (``close`` issues what is queued, then stops it)."""

    def __init__(self, driver: LoopDriver, kernel: LoopKernel, geometry: Geometry, *,
                 dma_stream: int, ring_base: int, ring_slot_bytes: int,
                 free_events: list[int], ready_events: list[int], begin_event: int,
                 done_event: int, attrs: tuple[bytes, bytes]):
        n = len(free_events)
        if not 1 <= n <= MAX_RING_SLOTS or len(ready_events) != n:
            raise BackendError(f"{n} ring slots ({len(ready_events)} ready events): need "
                               f"1..{MAX_RING_SLOTS}, one event of each kind per ring slot")
        if not KERNEL_ARGS <= kernel.num_params <= MAX_PARAMS:
            raise BackendError(f"a pack kernel of {kernel.num_params} parameters: the loop "
                               f"passes {KERNEL_ARGS}..{MAX_PARAMS}")
        c = ConfigStruct()
        c.launch, c.record, c.wait = driver.launch, driver.record, driver.wait
        c.batch, c.ctx_set, c.batch_abi, c.ctx = driver.batch, driver.ctx_set, \
            driver.batch_abi, driver.ctx or None
        c.ctx_get = driver.ctx_get or None
        if driver.tables is not None:
            t = driver.tables
            c.host_alloc, c.host_free = t.host_alloc, t.host_free
            c.event_create, c.event_destroy, c.event_query = \
                t.event_create, t.event_destroy, t.event_query
        c.num_ring_slots, c.dma_stream = n, dma_stream
        c.ring_base, c.ring_slot_bytes = ring_base, ring_slot_bytes
        for i in range(n):
            c.free_ev[i], c.ready_ev[i] = free_events[i], ready_events[i]
        c.begin_ev, c.done_ev = begin_event, done_event
        c.function[0], c.function[1] = kernel.functions
        c.block_x, c.grid_y, c.max_grid_x = kernel.block_x, kernel.grid_y, kernel.max_grid_x
        c.shared[0], c.shared[1] = kernel.shared
        c.num_params = kernel.num_params
        for i, value in enumerate(kernel.static_args):
            c.static_args[i] = value
        for i, raw in enumerate(attrs):
            ctypes.memmove(c.attrs[i], raw, min(len(raw), ATTRS_BYTES))
        if geometry.factor < 1 or int(geometry.pitch.max()) > geometry.chunk_bytes:
            raise BackendError(f"a geometry of factor {geometry.factor} and row pitches "
                               f"{geometry.pitch.tolist()} for chunks of {geometry.chunk_bytes} "
                               "bytes: a row must fit a chunk")
        self._own_tables = driver.tables is not None
        self.geometry = geometry
        self._geometry = geometry.struct()
        c.geometry = ctypes.pointer(self._geometry)
        self._config = c  # function pointers and events stay alive with the loop
        self._lib = library()
        self._queue = self._lib.tc_open(ctypes.byref(c))
        if not self._queue:
            raise BackendError("the staged chunk loop could not start its thread")
        self.num_ring_slots = n
        self._job = JobStruct()
        self._job_ref = ctypes.byref(self._job)
        self._submit = self._lib.tc_submit
        self._transfer = self._lib.tc_transfer
        self._outcome = OutcomeStruct()
        self._outcome_ref = ctypes.byref(self._outcome)
        self._pending: deque[tuple[ctypes.c_int32, object]] = deque()  # alive until issued

    def submit(self, *, stream: int, after: int = 0, prev_end: int = 0, start_event: int = 0,
               end_event: int = 0, table_event: int = 0, direction: Direction | None = None,
               validated: np.ndarray | None = None, num_pairs: int = 0, num_works: int = 0,
               table: int = 0, keep: object = None) -> Ticket:
        """Queue one transfer moving in ``direction``: ``validated`` is a block plan's
        buffer (C-contiguous int64: (3, ``num_pairs``) GPU ids, region slots, sub-pages of
        the non-empty groups, then (``num_works``, 2) group and pair count of each), laid
        out by the loop into the pair table at address ``table`` ((4, P) int64: the memory
        the kernels read, until ``table_event``; 0: one of the loop's own tables, with
        ``LoopDriver.tables``) and DMAs of the loop's own. No works: only the ordering
        events (wait for ``after``, then ``prev_end``; record ``start_event``,
        ``end_event``). Called from one thread (the job struct is reused: ``tc_submit``
        copies it)."""
        if self._queue is None:
            raise BackendError("the staged chunk loop is closed")
        status = self._new_job(stream, after, prev_end, start_event, end_event, direction)
        j = self._job
        j.table_ev = table_event or None
        if num_works:
            j.num_works, j.num_pairs = num_works, num_pairs
            j.validated, j.pairs = address_of(validated), table
            held: tuple[object, ...] = (keep, validated)
        else:
            j.num_works = j.num_pairs = 0
            held = (keep,)
        seq = self._submit(self._queue, self._job_ref)
        if not seq:
            raise BackendError(_REFUSED)
        return self._ticket(seq, status, held)

    def _new_job(self, stream: int, after: int, prev_end: int, start_event: int,
                 end_event: int, direction: Direction | None) -> ctypes.c_int32:
        """The reused job struct's stream, ordering events and direction set for a new job;
        its fresh status cell. Drops the pending jobs the loop has issued since."""
        status = ctypes.c_int32(STATUS_PENDING)
        j = self._job
        j.stream, j.after, j.prev_end = stream, after or None, prev_end or None
        j.start_ev, j.end_ev = start_event or None, end_event or None
        j.store = direction is not None and direction.stores  # None: an empty job
        j.status = ctypes.addressof(status)
        pending = self._pending
        while pending and pending[0][0].value != STATUS_PENDING:
            pending.popleft()  # issued: the loop no longer reads its arrays or status cell
        return status

    def _ticket(self, seq: int, status: ctypes.c_int32, held: object) -> Ticket:
        if status.value == STATUS_PENDING:  # not issued inline: the loop will read these
            self._pending.append((status, held))  # whatever the caller drops, they live
        return Ticket(self, seq, status, held)

    def transfer(self, checks: TransferChecks, direction: Direction, gpu_ids: np.ndarray,
                 group_sizes: tuple[int, ...], block_indices: tuple[int, ...],
                 slots: np.ndarray, slot_gens: np.ndarray | None, region_id: int, *,
                 stream: int, compute: int, mark: int, prev_end: int = 0,
                 start_event: int = 0, end_event: int = 0) -> Outcome:
        """A whole transfer in one native call (``tc_transfer``,
        ``tiercache.native.transfer_call``): the ids of a GPU spec (``gpu_ids``,
        ``group_sizes``, ``block_indices``) and a CPU spec (``slots``, ``slot_gens``,
        ``region_id``) validated against ``checks``, the slots fenced, ``mark`` recorded on
        the ``compute`` stream, and the job queued on ``stream`` after ``mark`` and
        ``prev_end``, between ``start_event`` and ``end_event``, its pairs laid out into
        one of the loop's own tables (``LoopDriver.tables``). Called from one thread, like
        ``submit``."""
        if self._queue is None:
            raise BackendError("the staged chunk loop is closed")
        if not self._own_tables:
            raise BackendError("ChunkLoop.transfer needs a loop with tables of its own "
                               "(LoopDriver.tables)")
        num_groups = checks.num_groups
        if len(group_sizes) != num_groups or len(block_indices) != num_groups:
            return Outcome(TransferCode.SPEC_GROUPS, 0, 0, None)  # not one entry per group
        groups = checks.groups
        groups[:] = [*group_sizes, *block_indices]
        # the arrays go by their objects' addresses (tc_ndarray): flat, of the C's types
        if gpu_ids.dtype is not _I64 or not gpu_ids.flags.c_contiguous:
            gpu_ids = np.ascontiguousarray(gpu_ids, dtype=_I64).reshape(-1)
        if slots.dtype is not _I64 or not slots.flags.c_contiguous:
            slots = np.ascontiguousarray(slots, dtype=_I64).reshape(-1)
        if slot_gens is not None and (slot_gens.dtype is not _U64
                                      or not slot_gens.flags.c_contiguous):
            slot_gens = np.ascontiguousarray(slot_gens, dtype=_U64).reshape(-1)
        status = self._new_job(stream, mark, prev_end, start_event, end_event, direction)
        j = self._job
        j.table_ev = j.pairs = None  # one of the loop's own tables
        out = self._outcome
        if self._transfer(self._queue, checks.ref, self._job_ref, compute or None,
                          num_groups, groups, id(gpu_ids), id(slots),
                          None if slot_gens is None else id(slot_gens), region_id,
                          self._outcome_ref):
            raise BackendError(_REFUSED)
        if not out.seq:  # refused by the validation: nothing queued
            if out.code == TransferCode.NOT_FLAT:
                raise BackendError("tc_transfer refused an id array that is not 1-d and "
                                   "C-contiguous (converted above: a bug)")
            return Outcome(out.code, 0, 0, None)
        return Outcome(out.code, out.cu, out.num_bytes, self._ticket(out.seq, status, None))

    def transfer_spans(self) -> tuple[int, int, int, int]:
        """Of the last ``transfer``, ns from its start until validated, fenced, marked and
        queued (the last includes an inline issue): where the native call's time went."""
        return tuple(self._outcome.spans_ns)

    def set_inline(self, max_pairs: int) -> None:
        """Jobs of at most ``max_pairs`` pairs that find the loop idle (nothing queued,
        nothing being issued) are issued by ``submit`` on the caller's thread, before it
        returns (their few driver calls instead of the loop thread's wake-up); -1: every
        job goes to the loop's thread. Issue order is submission order either way."""
        if self._queue is not None:
            self._lib.tc_set_inline(self._queue, max_pairs)

    def set_zero_copy(self, max_pairs: int) -> None:
        """Jobs of at most ``max_pairs`` pairs skip the ring: one launch of the pack /
        unpack kernel moves their pages straight between the GPU and the host rows, which
        the kernel reaches through UVA (no DMA, no hop between streams); 0: none. Only
        for host rows that are page-locked and mapped for the loop's device: the kernel
        dereferences them, and an unmapped address loses the CUDA context."""
        if self._queue is not None:
            self._lib.tc_set_zero_copy(self._queue, max_pairs)

    def stamps(self) -> Stamps:
        """The last issued job: when it was submitted, picked up and issued
        (``time.monotonic_ns`` clock), whether the caller issued it and whether it moved
        zero-copy."""
        out = (ctypes.c_int64 * 5)()
        if self._queue is not None:
            self._lib.tc_stamps(self._queue, out)
        return Stamps(out[0], out[1], out[2], bool(out[3]), bool(out[4]))

    def wait(self, seq: int = 0) -> None:
        """Block (GIL released) until job ``seq`` (0: every job so far) was issued."""
        if self._queue is not None:
            self._lib.tc_wait(self._queue, seq)

    def close(self) -> None:
        queue, self._queue = self._queue, None  # no submit reaches it while it closes
        if queue is not None:
            self._lib.tc_close(queue)
            self._pending.clear()

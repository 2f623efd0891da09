"""The native chunk loop's stand-in GPU (tests/native): a driver table of Python functions
that do what the GPU would, on numpy memory, and the numpy specification of what the loop
must issue (``contract``).

A launch runs the numpy model of the pack / unpack kernel over the pair table, range and
slot base it was given (slot base 0: a zero-copy launch, whose row offsets are host
addresses), a batch copies its descriptors, and event records / waits are logged. A slot is poisoned when a chunk claims it (its ``free`` wait), so a DMA or an
unpack that read bytes the chunk did not write would show.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import numpy as np

from block_reference import (
    CPU_BASE, GPU_BASE, Case, Memory, aligned, draw_case, fill, page_places,
)
from tiercache.backends.staged.block_layout import BlockStaging
from tiercache.native.chunk_loop import ChunkLoop, LoopDriver, LoopKernel, TableDriver
from tiercache.planning.planner import TransferPlanner
from tiercache.specs import CPULoadStoreSpec, GPULoadStoreSpec

RING_BASE = 0x30_0000_0000
SLOT_POISON = 0xA5
NUM_RING_SLOTS = 3
EXTRA_PARAMS = 2  # Triton's scratch pointers: passed as zero
ABI_12_8, ABI_13_0 = 12080, 13000

_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint,
                           ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                           ctypes.c_uint, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                           ctypes.c_void_p)
_RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_WAIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
_BATCH = {ABI_13_0: ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_void_p] * 3, ctypes.c_size_t,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                     ctypes.c_void_p),
          ABI_12_8: ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_void_p] * 3, ctypes.c_size_t,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                     ctypes.c_void_p, ctypes.c_void_p)}
_CTX = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_CTX_GET = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))
_HOST_ALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                               ctypes.c_uint)
_EVENT_CREATE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint)
_ONE_HANDLE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)  # free, destroy, query
NOT_READY = 600  # CUDA_ERROR_NOT_READY
TABLE_EVENTS = 0x800  # the loop's own tables' events: 0x800, 0x801, ... (named "table")
LOOP_CTX = 0xC7  # the context the loop makes current on its thread

# handles: small distinct integers (the stand-ins only compare them)
STREAM, DMA, PACK, UNPACK, COMPUTE = 0x100, 0x200, 0x300, 0x301, 0x400
START, END, PREV, TABLE, BEGIN, DONE, AFTER = 0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16
FREE = [0x40 + s for s in range(NUM_RING_SLOTS)]
READY = [0x60 + s for s in range(NUM_RING_SLOTS)]
NAMES = {STREAM: "S", DMA: "D", COMPUTE: "C", START: "start", END: "end", PREV: "prev",
         TABLE: "table", BEGIN: "begin", DONE: "done", AFTER: "after",
         **{e: f"free{s}" for s, e in enumerate(FREE)},
         **{e: f"ready{s}" for s, e in enumerate(READY)}}


def _u64s(address: int, count: int) -> list[int]:
    return list((ctypes.c_uint64 * count).from_address(address)) if count else []


class FakeGpu:
    """The driver table: executes launches and batches on numpy memory, logs the rest."""

    def __init__(self, case, layout, gpu_pages, cpu_pages, gpu: Memory, cpu: Memory,
                 slot_bytes: int, abi: int = ABI_13_0, fail_batch: int = 0):
        self.case, self.layout = case, layout
        self.gpu_pages, self.cpu_pages = gpu_pages, cpu_pages
        self.ring = Memory(aligned(NUM_RING_SLOTS * slot_bytes, SLOT_POISON), RING_BASE)
        self.slot_bytes = slot_bytes
        self.memories = (gpu, cpu, self.ring)
        self.trace: list[tuple] = []
        self.names = dict(NAMES)  # handle -> its name in the trace (stand-in streams add theirs)
        self.errors: list[BaseException] = []
        self.fail_batch = fail_batch
        self.fail_record: dict[int, int] = {}  # event -> the CUresult its records return
        self.pinned: dict[int, np.ndarray] = {}  # the loop's own tables: address -> memory
        self.allocated: list[int] = []  # (sizes in bytes) every table the loop made
        self.freed: list[int] = []  # addresses given back
        self.table_events: list[int] = []  # created, in order
        self.destroyed: list[int] = []
        self.busy: set[int] = set()  # table events the device has not passed yet
        self.ctx_calls: list[tuple[int, int]] = []  # (thread, context) of cuCtxSetCurrent
        self.threads: set[int] = set()  # who made the calls (context calls aside)
        self.current = LOOP_CTX  # what cuCtxGetCurrent answers (on any thread)
        self.gate: threading.Event | None = None  # set: the next end record waits for it
        self.gate_on = END  # the end event the gate holds (a stand-in stream's may be another)
        self.at_gate = threading.Event()  # the loop's thread waits at the gate
        self.claimed = -1  # the slot of the chunk being issued (its free wait came last)
        self.tables: list[np.ndarray] = []  # the pair table of each launch, as the kernel saw it
        self.dmas: list[tuple[int, int, int]] = []  # (host, slot offset, bytes), issue order
        self.c_launch = _LAUNCH(self._guard(self.launch))
        self.c_record = _RECORD(self._guard(self.record))
        self.c_wait = _WAIT(self._guard(self.wait))
        self.c_batch = _BATCH[abi](self._guard(self.batch))
        self.c_ctx = _CTX(self._guard(self.ctx_set, False))
        self.c_ctx_get = _CTX_GET(self._guard(self.ctx_get, False))
        self.c_tables = (_HOST_ALLOC(self._guard(self.host_alloc, False)),
                         _ONE_HANDLE(self._guard(self.host_free, False)),
                         _EVENT_CREATE(self._guard(self.event_create, False)),
                         _ONE_HANDLE(self._guard(self.event_destroy, False)),
                         _ONE_HANDLE(self._guard(self.event_query, False)))
        address = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
        self.driver = LoopDriver(address(self.c_launch), address(self.c_record),
                                 address(self.c_wait), address(self.c_batch),
                                 address(self.c_ctx), abi, LOOP_CTX, address(self.c_ctx_get),
                                 TableDriver(*map(address, self.c_tables)))

    def _guard(self, fn, track: bool = True):
        def call(*args):
            if track:
                self.threads.add(threading.get_ident())
            try:
                return fn(*args)
            except BaseException as e:  # noqa: BLE001 - surfaced by the test
                self.errors.append(e)
                return 999
        return call

    def memory(self, address: int, n: int) -> np.ndarray:
        for m in self.memories:
            if m.base <= address < m.base + m.data.size:
                return m.at(address, n)
        raise AssertionError(f"{address:#x} is in no memory")

    def name(self, handle: int) -> str:
        return "table" if handle in self.table_events else self.names[handle]

    def host_alloc(self, out, num_bytes, flags):
        assert flags == 0 and num_bytes % 8 == 0
        memory = aligned(num_bytes, 0xEE)
        out[0] = memory.ctypes.data
        self.pinned[out[0]] = memory
        self.allocated.append(num_bytes)
        return 0

    def host_free(self, address):
        del self.pinned[address]
        self.freed.append(address)
        return 0

    def event_create(self, out, flags):
        assert flags == 2  # CU_EVENT_DISABLE_TIMING: a marker
        out[0] = TABLE_EVENTS + len(self.table_events)
        self.table_events.append(out[0])
        return 0

    def event_destroy(self, event):
        self.destroyed.append(event)
        return 0

    def event_query(self, event):
        return NOT_READY if event in self.busy else 0

    def ctx_set(self, ctx):
        self.ctx_calls.append((threading.get_ident(), ctx))
        self.trace.append(("ctx", ctx))
        return 0

    def ctx_get(self, out):
        out[0] = self.current
        return 0

    def record(self, event, stream):
        if event == self.gate_on and self.gate is not None:
            gate, self.gate = self.gate, None
            self.at_gate.set()
            assert gate.wait(30), "the test never opened the gate"
        self.trace.append(("record", self.name(event), self.name(stream)))
        return self.fail_record.get(event, 0)

    def wait(self, stream, event, flags):
        assert flags == 0
        self.trace.append(("wait", self.name(stream), self.name(event)))
        if event in FREE:  # a chunk claims slot s: whatever it held is gone
            s = self.claimed = FREE.index(event)
            self.ring.data[s * self.slot_bytes:(s + 1) * self.slot_bytes] = SLOT_POISON
        return 0

    def launch(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        values = [ctypes.c_uint64.from_address(params[i]).value for i in range(9)]
        pairs, num_pairs, first, count, slot_base = values[:5]
        tail = [ctypes.c_uint64.from_address(params[i]).value for i in range(9, 9 + EXTRA_PARAMS)]
        assert tail == [0] * EXTRA_PARAMS and values[5:] == [0xAA, 4, 0xBB, 1]
        assert extra is None and (gy, gz, bx, by, bz) == (7, 1, 128, 1, 1)
        assert shared == (16 if function == PACK else 8) and self.name(stream).startswith("S")
        table = np.ctypeslib.as_array((ctypes.c_int64 * (4 * num_pairs)).from_address(pairs))
        table = table.reshape(4, -1).copy()
        self.tables.append(table)
        assert gx == min(count, 5)  # max_grid_x bounds the first dimension
        store = function == PACK
        assert store == self.case.store
        zero_copy = slot_base == 0  # the pages move straight to / from the host rows
        assert zero_copy or slot_base == RING_BASE + self.claimed * self.slot_bytes, \
            "not the claimed slot"

        self.trace.append(("launch", "pack" if store else "unpack", first, count))
        places = page_places(self.case, self.gpu_pages, self.cpu_pages,
                             table[:, first:first + count])
        for address, offset, n in places:
            slot = self.memory(offset, n) if zero_copy else self.ring.at(slot_base + offset, n)
            page = self.memory(address, n)
            if store:
                slot[:] = page
            else:
                page[:] = slot
        return 0

    def batch(self, dsts, srcs, sizes, count, attrs, attr_idx, num_attrs, *rest):
        stream = rest[-1]
        if len(rest) == 2:
            _ = ctypes.c_size_t.from_address(rest[0]).value  # the 12.8 ABI's failIdx is writable
        order = ctypes.c_int.from_address(attrs).value
        assert num_attrs == 1 and ctypes.c_size_t.from_address(attr_idx).value == 0
        assert order == (1 if self.case.store else 3)
        self.trace.append(("batch", count, self.name(stream)))
        if self.fail_batch and sum(1 for t in self.trace if t[0] == "batch") == self.fail_batch:
            return 700
        slot = RING_BASE + self.claimed * self.slot_bytes
        staged = _u64s(srcs if self.case.store else dsts, count)
        hosts = _u64s(dsts if self.case.store else srcs, count)
        assert all(slot <= a and a + n <= slot + self.slot_bytes
                   for a, n in zip(staged, _u64s(sizes, count))), "a DMA outside the claimed slot"
        self.dmas += [(h, a - slot, n) for h, a, n in zip(hosts, staged, _u64s(sizes, count))]
        for d, s, n in zip(_u64s(dsts, count), _u64s(srcs, count), _u64s(sizes, count)):
            self.memory(d, n)[:] = self.memory(s, n)
        return 0


def make_loop(fake: FakeGpu, slot_bytes: int, staging: BlockStaging) -> ChunkLoop:
    attrs = (bytes([3, 0, 0, 0]) + bytes(20), bytes([1, 0, 0, 0]) + bytes(20))
    kernel = LoopKernel((UNPACK, PACK), 128, (8, 16), 7, 5, 9 + EXTRA_PARAMS, (0xAA, 4, 0xBB, 1))
    return ChunkLoop(fake.driver, kernel, staging.loop_geometry(), dma_stream=DMA,
                     ring_base=RING_BASE,
                     ring_slot_bytes=slot_bytes, free_events=FREE, ready_events=READY,
                     begin_event=BEGIN, done_event=DONE, attrs=attrs)


def contract(layout, store: bool, cursor: int) -> list[tuple]:
    """staged's pipeline order (backends/staged/backend.py docstring), written out
    independently."""
    out = [("wait", "S", "after"), ("wait", "S", "prev"), ("record", "start", "S")]
    if layout.num_chunks == 1:  # nothing to overlap: everything on the transfer's stream
        first, count = layout.pair_range(0)
        n = int(layout.dma_first[1])
        launch = [("launch", "pack" if store else "unpack", first, count)] if count else []
        dma = [("batch", n, "S")] if n else []
        s = cursor % NUM_RING_SLOTS
        body = [*launch, *dma] if store else [*dma, *launch]
        return out + [("wait", "S", f"free{s}"), *body, ("record", f"free{s}", "S"),
                      ("record", "table", "S"), ("record", "end", "S")]
    if layout.num_chunks:
        out += [("record", "begin", "S"), ("wait", "D", "begin")]
    for k in range(layout.num_chunks):
        s = (cursor + k) % NUM_RING_SLOTS
        first, count = layout.pair_range(k)
        n = int(layout.dma_first[k + 1] - layout.dma_first[k])
        launch = [("launch", "pack" if store else "unpack", first, count)] if count else []
        dma = [("batch", n, "D")] if n else []
        if store:
            out += [("wait", "S", f"free{s}"), *launch, ("record", f"ready{s}", "S"),
                    ("wait", "D", f"ready{s}"), *dma, ("record", f"free{s}", "D")]
        else:
            out += [("wait", "D", f"free{s}"), *dma, ("record", f"ready{s}", "D"),
                    ("wait", "S", f"ready{s}"), *launch, ("record", f"free{s}", "S")]
    if layout.num_chunks:
        out += [("record", "table", "S"), ("record", "done", "D"), ("wait", "S", "done")]
    return out + [("record", "end", "S")]


def zero_copy_contract(num_pairs: int, store: bool) -> list[tuple]:
    """A zero-copy job's calls: one launch over every pair on the transfer's stream, no
    slot, no DMA."""
    return [("wait", "S", "after"), ("wait", "S", "prev"), ("record", "start", "S"),
            ("launch", "pack" if store else "unpack", 0, num_pairs), ("record", "table", "S"),
            ("record", "end", "S")]


def zero_copy_pairs(staging, validated) -> list[tuple[int, int, int, int]]:
    """The pairs a zero-copy table must hold, sorted: (GPU id, the host address of the
    pair's row image, sub-page, group) for each pair of the validated plan."""
    geometry = staging.loop_geometry()
    out = []
    for w in validated.group_pairs():
        g = int(w.group)
        for gpu, row, sub in zip(w.gpu_ids.tolist(), np.asarray(w.slots).tolist(),
                                 w.sub_pages.tolist()):
            out.append((gpu, int(geometry.row_origin[g]) + row * int(geometry.cpu_stride[g]),
                        sub, g))
    return sorted(out)


def submit_plan(loop: ChunkLoop, planner: TransferPlanner, case):
    """Validate ``case``'s transfer in C (the planner's block plan) and queue it with a
    fresh pair-table buffer (returned with the ticket and the plan)."""
    plan = planner.block_plan(case.direction, case.spec)
    table = np.full((4, plan.num_pairs), -1, dtype=np.int64)
    ticket = loop.submit(stream=STREAM, after=AFTER, prev_end=PREV, start_event=START,
                         end_event=END, table_event=TABLE, direction=case.direction,
                         validated=plan.buffer, num_pairs=plan.num_pairs,
                         num_works=plan.num_works, table=table.ctypes.data,
                         keep=table)
    return ticket, table, plan


@dataclass
class Prepared:
    """One case's planner, layout (the numpy specification) and filled memories."""

    case: Case
    planner: TransferPlanner
    staging: BlockStaging
    plan: object  # the numpy planner's block plan (the reference validation)
    layout: object
    gpu_pages: list
    cpu_pages: list
    gpu_data: np.ndarray
    cpu_data: np.ndarray

    def rig(self, abi: int = ABI_13_0, fail_batch: int = 0) -> tuple[FakeGpu, ChunkLoop]:
        """A stand-in GPU over the memories and a real loop driven by it (close the loop)."""
        fake = FakeGpu(self.case, self.layout, self.gpu_pages, self.cpu_pages,
                       Memory(self.gpu_data, GPU_BASE), Memory(self.cpu_data, CPU_BASE),
                       self.case.chunk_bytes, abi, fail_batch)
        return fake, make_loop(fake, self.case.chunk_bytes, self.staging)

    def submit(self, loop: ChunkLoop):
        return submit_plan(loop, self.planner, self.case)


def prepare(case) -> Prepared:
    gpu_pages, cpu_pages = case.page_arrays(GPU_BASE, CPU_BASE)
    planner = TransferPlanner(gpu_pages, cpu_pages, case.factor, case.groups)
    staging = BlockStaging.of_geometry(planner.geometry, case.chunk_bytes, case.load_whole_rows,
                                       case.break_rows)
    reference = TransferPlanner(gpu_pages, cpu_pages, case.factor, case.groups,
                                native_validation=False)
    plan = reference.block_plan(case.direction, case.spec)
    layout = BlockStaging.of_geometry(reference.geometry, case.chunk_bytes,
                                     case.load_whole_rows, case.break_rows).layout(plan)
    gpu_data = np.empty(case.gpu_bytes, dtype=np.uint8)
    cpu_data = np.empty(case.cpu_bytes, dtype=np.uint8)
    fill(case, gpu_data, cpu_data, 0)
    return Prepared(case, planner, staging, plan, layout, gpu_pages, cpu_pages, gpu_data,
                    cpu_data)


def row_order_is_unique(case, plan) -> bool:
    """False when a group's rows repeat out of order: numpy's argsort may then order equal
    rows either way, the loop keeps them in pair order (both are valid layouts)."""
    if case.factor == 1:
        return True  # the planner sorted the rows stably already
    for w in plan.group_pairs():
        rows = np.asarray(w.slots)
        if not (rows[1:] >= rows[:-1]).all() and np.unique(rows).size < num_rows(case, w):
            return False
    return True


def num_rows(case, w) -> int:
    skip = int(w.sub_pages[0])
    return (skip + int(w.gpu_ids.size) - 1) // case.factor + 1


def multi_chunk_store():
    """A drawn store case that has at least two chunks."""
    from block_reference import RngDraw
    for seed in range(500):
        case = draw_case(RngDraw(seed))
        if not case.store:
            continue
        prepared = prepare(case)
        if prepared.layout.num_chunks >= 2:
            return prepared
    raise AssertionError("no two-chunk store among the drawn cases")



def spoil(d, case):
    """``case`` with one thing wrong (or nothing): out-of-range or repeated ids, a CPU id
    too few or too many, a group more, block_indices moved."""
    gpu = case.gpu_spec.block_ids.tolist()
    cpu = case.cpu_spec.block_ids.tolist()
    sizes, starts = list(case.gpu_spec.group_sizes), list(case.gpu_spec.block_indices)
    how = d.int(0, 7)
    if how == 1 and gpu:
        gpu[d.int(0, len(gpu) - 1)] = case.num_gpu_blocks + d.int(0, 2)
    elif how == 2 and cpu:
        cpu[d.int(0, len(cpu) - 1)] = case.num_cpu_blocks + d.int(0, 2)
    elif how == 3 and len(gpu) > 1:
        gpu[d.int(1, len(gpu) - 1)] = gpu[0]
    elif how == 4 and len(cpu) > 1:
        cpu[d.int(1, len(cpu) - 1)] = cpu[0]
    elif how == 5:
        cpu = cpu[:-1] if cpu and d.int(0, 1) else cpu + [0]
    elif how == 6:
        sizes, starts = sizes + [0], starts + [0]
    elif how == 7 and starts:
        starts[d.int(0, len(starts) - 1)] += d.int(1, 3)
    return GPULoadStoreSpec(gpu, sizes, starts), CPULoadStoreSpec(cpu)


"""The native chunk loop (``tiercache/native/chunk_loop.c``) on the CPU, driven by a
driver table of Python functions that do what the GPU would, on numpy memory.

The loop is the real compiled C on its own thread, laying transfers out itself; only the
five driver entry points are stand-ins (no GPU here): a launch runs the numpy model of
the pack / unpack kernel over the pair table, range and slot base it was given, a batch
copies its descriptors, and event records / waits are logged. Each case
(hypothesis-drawn geometries and transfers, the same as test_block_staging's) must leave
exactly the bytes the per-page plan leaves; the pair table, the DMAs and the calls must be
those of the numpy layout (``BlockStaging.layout``, the specification) in the order of
staged's pipeline contract. A slot is poisoned when a chunk claims it (its ``free``
wait), so a DMA or an unpack that read bytes the chunk did not write would show.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from block_reference import (
    CPU_BASE, GPU_BASE, Case, HypDraw, Memory, aligned, assert_same, draw_case, expected_after, fill,
    page_places,
)
from tiercache.backends.staged.block_layout import BlockStaging
from tiercache.errors import BackendError, SpecError
from tiercache.native import build as native_build
from tiercache.native.chunk_loop import ChunkLoop, LoopDriver, LoopKernel
from tiercache.native.validator import SPEC_ERRORS, NativeValidator
from tiercache.planning.planner import TransferPlanner
from tiercache.region.layout import RegionLayout
from tiercache.specs import CPULoadStoreSpec, GPULoadStoreSpec

RING_BASE = 0x30_0000_0000
SLOT_POISON = 0xA5
NUM_SLOTS = 3
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
LOOP_CTX = 0xC7  # the context the loop makes current on its thread

# handles: small distinct integers (the stand-ins only compare them)
STREAM, DMA, PACK, UNPACK = 0x100, 0x200, 0x300, 0x301
START, END, PREV, TABLE, BEGIN, DONE, AFTER = 0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16
FREE = [0x40 + s for s in range(NUM_SLOTS)]
READY = [0x60 + s for s in range(NUM_SLOTS)]
NAMES = {STREAM: "S", DMA: "D", START: "start", END: "end", PREV: "prev", TABLE: "table",
         BEGIN: "begin", DONE: "done", AFTER: "after", **{e: f"free{s}" for s, e in enumerate(FREE)},
         **{e: f"ready{s}" for s, e in enumerate(READY)}}


def _u64s(address: int, count: int) -> list[int]:
    return list((ctypes.c_uint64 * count).from_address(address)) if count else []


class FakeGpu:
    """The driver table: executes launches and batches on numpy memory, logs the rest."""

    def __init__(self, case, layout, gpu_pages, cpu_pages, gpu: Memory, cpu: Memory,
                 slot_bytes: int, abi: int = ABI_13_0, fail_batch: int = 0):
        self.case, self.layout = case, layout
        self.gpu_pages, self.cpu_pages = gpu_pages, cpu_pages
        self.ring = Memory(aligned(NUM_SLOTS * slot_bytes, SLOT_POISON), RING_BASE)
        self.slot_bytes = slot_bytes
        self.memories = (gpu, cpu, self.ring)
        self.trace: list[tuple] = []
        self.errors: list[BaseException] = []
        self.fail_batch = fail_batch
        self.threads: set[int] = set()  # who made the calls (context calls aside)
        self.current = LOOP_CTX  # what cuCtxGetCurrent answers (on any thread)
        self.gate: threading.Event | None = None  # set: the next end record waits for it
        self.at_gate = threading.Event()  # the loop's thread waits at the gate
        self.claimed = -1  # the slot of the chunk being issued (its free wait came last)
        self.tables: list[np.ndarray] = []  # the pair table of each launch, as the kernel saw it
        self.dmas: list[tuple[int, int, int]] = []  # (host, slot offset, bytes), issue order
        self.c_launch = _LAUNCH(self._guard(self.launch))
        self.c_record = _RECORD(self._guard(self.record))
        self.c_wait = _WAIT(self._guard(self.wait))
        self.c_batch = _BATCH[abi](self._guard(self.batch))
        self.c_ctx = _CTX(self._guard(lambda ctx: self.trace.append(("ctx", ctx)) or 0, False))
        self.c_ctx_get = _CTX_GET(self._guard(self.ctx_get, False))
        address = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
        self.driver = LoopDriver(address(self.c_launch), address(self.c_record),
                                 address(self.c_wait), address(self.c_batch),
                                 address(self.c_ctx), abi, LOOP_CTX, address(self.c_ctx_get))

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

    def ctx_get(self, out):
        out[0] = self.current
        return 0

    def record(self, event, stream):
        if event == END and self.gate is not None:
            gate, self.gate = self.gate, None
            self.at_gate.set()
            assert gate.wait(30), "the test never opened the gate"
        self.trace.append(("record", NAMES[event], NAMES[stream]))
        return 0

    def wait(self, stream, event, flags):
        assert flags == 0
        self.trace.append(("wait", NAMES[stream], NAMES[event]))
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
        assert shared == (16 if function == PACK else 8) and NAMES[stream] == "S"
        table = np.ctypeslib.as_array((ctypes.c_int64 * (4 * num_pairs)).from_address(pairs))
        table = table.reshape(4, -1).copy()
        self.tables.append(table)
        assert gx == min(count, 5)  # max_grid_x bounds the first dimension
        store = function == PACK
        assert store == self.case.store
        assert slot_base == RING_BASE + self.claimed * self.slot_bytes, "not the claimed slot"

        self.trace.append(("launch", "pack" if store else "unpack", first, count))
        places = page_places(self.case, self.gpu_pages, self.cpu_pages,
                             table[:, first:first + count])
        for address, offset, n in places:
            slot = self.ring.at(slot_base + offset, n)
            page = self.memory(address, n)
            if store:
                slot[:] = page
            else:
                page[:] = slot
        return 0

    def batch(self, dsts, srcs, sizes, count, attrs, attr_idx, num_attrs, *rest):
        stream = rest[-1]
        if len(rest) == 2:
            ctypes.c_size_t.from_address(rest[0]).value  # the 12.8 ABI's failIdx is writable
        order = ctypes.c_int.from_address(attrs).value
        assert num_attrs == 1 and ctypes.c_size_t.from_address(attr_idx).value == 0
        assert order == (1 if self.case.store else 3)
        self.trace.append(("batch", count, NAMES[stream]))
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


def _loop(fake: FakeGpu, slot_bytes: int, staging: BlockStaging) -> ChunkLoop:
    attrs = (bytes([3, 0, 0, 0]) + bytes(20), bytes([1, 0, 0, 0]) + bytes(20))
    kernel = LoopKernel((UNPACK, PACK), 128, (8, 16), 7, 5, 9 + EXTRA_PARAMS, (0xAA, 4, 0xBB, 1))
    return ChunkLoop(fake.driver, kernel, staging.loop_geometry(), dma_stream=DMA,
                     ring_base=RING_BASE,
                     slot_bytes=slot_bytes, free_events=FREE, ready_events=READY,
                     begin_event=BEGIN, done_event=DONE, attrs=attrs)


def _contract(layout, store: bool, cursor: int) -> list[tuple]:
    """staged's pipeline order (backends/staged/backend.py docstring), written out
    independently."""
    out = [("wait", "S", "after"), ("wait", "S", "prev"), ("record", "start", "S")]
    if layout.num_chunks == 1:  # nothing to overlap: everything on the transfer's stream
        first, count = layout.pair_range(0)
        n = int(layout.dma_first[1])
        launch = [("launch", "pack" if store else "unpack", first, count)] if count else []
        dma = [("batch", n, "S")] if n else []
        s = cursor % NUM_SLOTS
        body = [*launch, *dma] if store else [*dma, *launch]
        return out + [("wait", "S", f"free{s}"), *body, ("record", f"free{s}", "S"),
                      ("record", "table", "S"), ("record", "end", "S")]
    if layout.num_chunks:
        out += [("record", "begin", "S"), ("wait", "D", "begin")]
    for k in range(layout.num_chunks):
        s = (cursor + k) % NUM_SLOTS
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


def _submit(loop: ChunkLoop, planner: TransferPlanner, case):
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
        return fake, _loop(fake, self.case.chunk_bytes, self.staging)

    def submit(self, loop: ChunkLoop):
        return _submit(loop, self.planner, self.case)


def _prepare(case) -> Prepared:
    gpu_pages, cpu_pages = case.page_arrays(GPU_BASE, CPU_BASE)
    planner = TransferPlanner(gpu_pages, cpu_pages, case.factor, case.groups)
    staging = BlockStaging.of_planner(planner, case.chunk_bytes, case.load_whole_rows)
    reference = TransferPlanner(gpu_pages, cpu_pages, case.factor, case.groups,
                                native_validation=False)
    plan = reference.block_plan(case.direction, case.spec)
    layout = BlockStaging.of_planner(reference, case.chunk_bytes,
                                     case.load_whole_rows).layout(plan)
    gpu_data = np.empty(case.gpu_bytes, dtype=np.uint8)
    cpu_data = np.empty(case.cpu_bytes, dtype=np.uint8)
    fill(case, gpu_data, cpu_data, 0)
    return Prepared(case, planner, staging, plan, layout, gpu_pages, cpu_pages, gpu_data,
                    cpu_data)


def _row_order_is_unique(case, plan) -> bool:
    """False when a group's rows repeat out of order: numpy's argsort may then order equal
    rows either way, the loop keeps them in pair order (both are valid layouts)."""
    if case.factor == 1:
        return True  # the planner sorted the rows stably already
    for w in plan.group_pairs():
        rows = np.asarray(w.slots)
        if not (rows[1:] >= rows[:-1]).all() and np.unique(rows).size < _num_rows(case, w):
            return False
    return True


def _num_rows(case, w) -> int:
    skip = int(w.sub_pages[0])
    return (skip + int(w.gpu_ids.size) - 1) // case.factor + 1


@settings(max_examples=150, deadline=None)
@given(st.data(), st.sampled_from([ABI_13_0, ABI_12_8]), st.booleans())
def test_loop_lays_out_and_moves_the_plans_bytes_in_the_pipeline_order(data, abi, inline):
    """Issued by the loop's thread, or (``inline``) by the caller inside ``submit``: the
    same bytes, table, DMAs and calls either way."""
    _check(draw_case(HypDraw(data)), abi, inline)


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("factor", [1, 2])
def test_adjacent_rows_merge_into_one_dma_per_chunk_run(store, factor):
    """Region-like rows (the stride is the pitch) and consecutive CPU blocks: the loop
    merges neighbours into one DMA up to each chunk's end, as the numpy layout does."""
    pages, tensors, blocks = 4096, 4, 64
    n = 24 * factor - (factor - 1)  # factor 2: the last CPU block half used
    rng = np.random.default_rng(factor)
    case = Case(factor=factor, pages=[pages] * tensors,
                gpu_offset=[t * blocks * pages for t in range(tensors)],
                gpu_stride=[pages] * tensors, num_gpu_blocks=blocks,
                cpu_offset=[t * factor * pages for t in range(tensors)],
                cpu_stride=tensors * factor * pages, num_cpu_blocks=blocks,
                groups=[list(range(tensors))],
                gpu_spec=GPULoadStoreSpec(rng.permutation(blocks)[:n].tolist()),
                cpu_spec=CPULoadStoreSpec(list(range(10, 10 + 24))), store=store, chunk_rows=5)
    layout = _check(case, ABI_13_0)
    partial = int(factor > 1)  # the last row: sub-page 0 of each tensor only, four runs
    assert layout.dma_first[-1 - partial] == layout.num_chunks - partial  # one DMA per chunk
    assert layout.num_chunks > 1 and layout.dma_bytes.size < layout.num_rows


@pytest.mark.parametrize("rows, dmas", [(2, [2560]), (5, [2560, 2560, 1280])])
def test_whole_row_loads_merge_rows_when_the_groups_pitches_differ(rows, dmas):
    """The Hypothesis example that found it: two groups of different pitches (tensors 0
    and 4, whose image spans the whole 1280-byte row, and tensors 1..3, 768 bytes), so no
    uniform pitch; a whole-row load of adjacent rows of the first group. The rows continue
    each other on the host and in the slot, so both layouts merge them up to each chunk's
    end (chunks of two rows); numpy's one-template path used to compare the run with the
    geometry's uniform pitch (0 here) and never merged, the loop did."""
    region = RegionLayout(1, rows, (256,) * 5, 1)
    case = Case(factor=1, pages=[256] * 5, gpu_offset=[768 * t for t in range(5)],
                gpu_stride=[256] * 5, num_gpu_blocks=rows,
                cpu_offset=list(region.page_offsets), cpu_stride=region.row_stride,
                num_cpu_blocks=rows, groups=[[0, 4], [2, 3, 1]],
                gpu_spec=GPULoadStoreSpec(list(range(rows)), [rows, 0], [0, 0]),
                cpu_spec=CPULoadStoreSpec(list(range(rows))), store=False, chunk_rows=2,
                load_whole_rows=True)
    for abi in (ABI_13_0, ABI_12_8):
        layout = _check(case, abi)  # the loop's DMAs are the numpy layout's, exactly
    assert layout.dma_bytes.tolist() == dmas
    assert layout.dma_slot.tolist() == [0] * len(dmas)  # each from its chunk's slot start


def _check(case, abi, inline: bool = False):
    prepared = _prepare(case)
    reference, layout = prepared.plan, prepared.layout
    gpu_data, cpu_data = prepared.gpu_data, prepared.cpu_data
    plan, gpu_expected, cpu_expected = expected_after(case, prepared.planner, gpu_data,
                                                      cpu_data, GPU_BASE, CPU_BASE)
    fake, loop = prepared.rig(abi)
    try:
        if inline:
            loop.set_inline(1 << 40)
        ticket, table, validated = prepared.submit(loop)
        assert ticket.issued() or not inline  # issued inside submit
        ticket.wait()
        assert ticket.issued() and ticket.status == 0
        assert loop.stamps()[3] == inline
    finally:
        loop.close()
    np.testing.assert_array_equal(validated.pairs, reference.pairs)  # C = numpy validation
    np.testing.assert_array_equal(validated.works, reference.works)
    assert not fake.errors, fake.errors
    # every call came from one thread: the caller's when inline, else the loop's
    assert (fake.threads == {threading.get_ident()}) == inline and len(fake.threads) == 1
    assert_same(case, plan, layout, gpu_data, cpu_data, gpu_expected, cpu_expected)
    assert all(np.array_equal(t, table) for t in fake.tables)  # the launches read the table
    assert ("ctx", LOOP_CTX) in fake.trace  # the loop's thread makes its context current
    if not inline:
        assert fake.trace[0] == ("ctx", LOOP_CTX)  # before any job
    calls = [t for t in fake.trace if t[0] != "ctx"]
    if _row_order_is_unique(case, reference):  # the numpy layout, exactly
        np.testing.assert_array_equal(table, layout.pairs)
        assert fake.dmas == list(zip(layout.dma_host.tolist(), layout.dma_slot.tolist(),
                                     layout.dma_bytes.tolist()))
        assert calls == _contract(layout, case.store, 0)
    return layout


def test_the_ring_cursor_carries_over_between_jobs():
    prepared = _multi_chunk_store()
    layout = prepared.layout
    fake, loop = prepared.rig()
    try:
        tickets = [prepared.submit(loop) for _ in range(3)]
        loop.wait()
        assert [t.status for t, _, _ in tickets] == [0, 0, 0]
    finally:
        loop.close()
    assert not fake.errors, fake.errors
    ends = [i for i, t in enumerate(fake.trace) if t == ("record", "end", "S")]
    starts = [1] + [e + 1 for e in ends[:-1]]
    for n, (lo, hi) in enumerate(zip(starts, ends)):
        assert fake.trace[lo:hi + 1] == _contract(layout, True, n * layout.num_chunks % NUM_SLOTS)


def _multi_chunk_store():
    """A drawn store case that has at least two chunks."""
    from block_reference import RngDraw
    for seed in range(500):
        case = draw_case(RngDraw(seed))
        if not case.store:
            continue
        prepared = _prepare(case)
        if prepared.layout.num_chunks >= 2:
            return prepared
    raise AssertionError("no two-chunk store among the drawn cases")


def test_a_failed_batch_fails_its_job_still_records_its_end_and_later_jobs_run():
    prepared = _multi_chunk_store()
    layout = prepared.layout
    fake, loop = prepared.rig(fail_batch=1)
    try:
        failed, _, _ = prepared.submit(loop)
        later, _, _ = prepared.submit(loop)
        loop.wait()
        assert failed.status == 700 and later.status == 0
        assert failed.issued() and later.issued()
    finally:
        loop.close()
    first_end = fake.trace.index(("record", "end", "S"))
    batches_before = [t for t in fake.trace[:first_end] if t[0] == "batch"]
    assert len(batches_before) == 1  # the chunks after the failure were skipped
    # but the table's event and the join of the DMA stream still came before the end
    assert fake.trace[first_end - 3:first_end] == [("record", "table", "S"),
                                                   ("record", "done", "D"), ("wait", "S", "done")]
    assert fake.trace.count(("record", "end", "S")) == 2
    second = fake.trace[first_end + 1:]
    # the failed job still advanced the cursor past the chunks it planned
    assert second == _contract(layout, True, layout.num_chunks % NUM_SLOTS)


def test_an_empty_job_only_orders():
    fake, loop = _multi_chunk_store().rig()
    try:
        ticket = loop.submit(stream=STREAM, after=AFTER, prev_end=PREV, start_event=START,
                             end_event=END)
        ticket.wait()
        assert ticket.status == 0
    finally:
        loop.close()
    assert fake.trace[1:] == [("wait", "S", "after"), ("wait", "S", "prev"),
                              ("record", "start", "S"), ("record", "end", "S")]


def test_a_small_job_goes_to_the_loop_while_it_is_busy_and_keeps_its_order():
    """The caller issues a job itself only when the loop is idle: while the loop's thread
    is still issuing an earlier job (held here at that job's end record), a small job is
    queued behind it, not issued beside it (they share the ring and the DMA scratch)."""
    prepared = _multi_chunk_store()
    layout = prepared.layout
    fake, loop = prepared.rig()
    fake.gate = gate = threading.Event()
    try:
        first, _, _ = prepared.submit(loop)  # inline off: to the loop's thread, held there
        assert fake.at_gate.wait(30)  # the loop is inside the first job
        loop.set_inline(1 << 40)
        second, _, _ = prepared.submit(loop)
        assert not second.issued() and not first.issued()
        gate.set()
        loop.wait()
        assert (first.status, second.status) == (0, 0)
        assert loop.stamps()[3] is False  # the second too was issued by the loop's thread
        third, _, _ = prepared.submit(loop)  # the loop idle again: inline
        assert third.issued() and third.status == 0 and loop.stamps()[3] is True
    finally:
        gate.set()
        loop.close()
    assert not fake.errors, fake.errors
    calls = [t for t in fake.trace if t[0] != "ctx"]
    n = layout.num_chunks
    assert calls == (_contract(layout, True, 0) + _contract(layout, True, n % NUM_SLOTS)
                     + _contract(layout, True, 2 * n % NUM_SLOTS))  # in order, cursor shared
    assert len(fake.threads) == 2  # the loop's thread for two, the caller's for the third


def test_only_a_job_within_the_inline_bound_is_issued_by_the_caller():
    prepared = _multi_chunk_store()
    fake, loop = prepared.rig()
    pairs = prepared.plan.num_pairs
    try:
        loop.set_inline(pairs - 1)
        over, _, _ = prepared.submit(loop)
        over.wait()
        assert over.status == 0 and loop.stamps()[3] is False
        loop.set_inline(pairs)
        within, _, _ = prepared.submit(loop)
        assert within.issued() and within.status == 0 and loop.stamps()[3] is True
    finally:
        loop.close()
    assert not fake.errors, fake.errors
    assert threading.get_ident() in fake.threads and len(fake.threads) == 2


def test_one_chunk_pairs_bounds_a_job_that_fits_one_chunk():
    """The backend's inline bound: any job of that many pairs lays out as one chunk."""
    from block_reference import RngDraw
    checked = 0
    for seed in range(300):
        case = draw_case(RngDraw(seed))
        prepared = _prepare(case)
        bound = prepared.staging.loop_geometry().one_chunk_pairs
        if prepared.plan.num_pairs <= bound:
            assert prepared.layout.num_chunks <= 1, (seed, bound, prepared.plan.num_pairs)
            checked += 1
    assert checked >= 20  # the bound was exercised, not vacuous


def test_a_caller_without_the_loops_context_never_issues_inline():
    prepared = _multi_chunk_store()
    fake, loop = prepared.rig()
    fake.current = 0xD0  # another context is current on the caller's thread
    try:
        loop.set_inline(1 << 40)
        ticket, _, _ = prepared.submit(loop)
        ticket.wait()
        assert ticket.status == 0 and loop.stamps()[3] is False
    finally:
        loop.close()
    assert threading.get_ident() not in fake.threads


def test_bad_configurations_and_jobs_are_refused():
    prepared = _multi_chunk_store()
    fake, loop = prepared.rig()
    loop.close()
    kernel = LoopKernel((UNPACK, PACK), 128, (8, 16), 7, 5, 8, (0, 0, 0, 0))
    with pytest.raises(BackendError, match="8 parameters"):
        ChunkLoop(fake.driver, kernel, prepared.staging.loop_geometry(),
                  dma_stream=DMA, ring_base=RING_BASE, slot_bytes=256, free_events=FREE,
                  ready_events=READY, begin_event=BEGIN, done_event=DONE,
                  attrs=(bytes(24), bytes(24)))
    with pytest.raises(BackendError, match="closed"):
        prepared.submit(loop)


def _spoil(d, case):
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


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_validation_accepts_and_refuses_what_the_planner_does(data):
    """Drawn transfers, some spoiled: the C validation refuses exactly those the numpy
    validation refuses (the planner then raises numpy's SpecError, which says why), and
    writes what the numpy validation writes for the others."""
    case = draw_case(HypDraw(data))
    gpu, cpu = _spoil(HypDraw(data), case)
    gpu_pages, cpu_pages = case.page_arrays(GPU_BASE, CPU_BASE)
    numpy_planner = TransferPlanner(gpu_pages, cpu_pages, case.factor, case.groups,
                                    native_validation=False)
    planner = TransferPlanner(gpu_pages, cpu_pages, case.factor, case.groups)
    spec = (gpu, cpu) if case.store else (cpu, gpu)
    try:
        reference = numpy_planner.block_plan(case.direction, spec)
    except SpecError as e:
        reference, refusal = None, str(e)
    validator = NativeValidator(case.factor, [g.num_gpu_blocks for g in planner.groups],
                                [g.num_slots for g in planner.groups])
    got = validator.validate(case.direction, gpu.block_ids, gpu.group_sizes, gpu.block_indices,
                             cpu.block_ids)
    if reference is None:
        assert isinstance(got, int) and got in SPEC_ERRORS
        with pytest.raises(SpecError) as raised:
            planner.block_plan(case.direction, spec)
        assert str(raised.value) == refusal
        return
    assert not isinstance(got, int), SPEC_ERRORS.get(got)
    plan = planner.block_plan(case.direction, spec)
    assert plan.num_works == got[1] == reference.num_works
    assert plan.num_bytes == reference.num_bytes
    np.testing.assert_array_equal(plan.pairs, reference.pairs)
    np.testing.assert_array_equal(plan.works, reference.works)


def test_a_missing_compiler_is_an_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "no-such-cc-tiercache")
    with pytest.raises(BackendError, match="no-such-cc-tiercache"):
        native_build.build(directory=tmp_path)


def test_a_broken_source_is_an_error_with_the_compilers_message(tmp_path):
    source = tmp_path / "broken.c"
    source.write_text("int f( {\n")
    with pytest.raises(BackendError, match="broken.c"):
        native_build.build(source, tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.so"))  # nothing half-built left


def test_builds_once_per_source_version(tmp_path):
    first = native_build.build(directory=tmp_path)
    stamp = first.stat().st_mtime_ns
    assert native_build.build(directory=tmp_path) == first
    assert first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]

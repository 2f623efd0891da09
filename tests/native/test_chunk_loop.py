"""The native chunk loop (``tiercache/native/src/``) on the CPU, driven by a
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

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from block_reference import (
    CPU_BASE, GPU_BASE, Case, HypDraw, assert_same, draw_case, expected_after,
)
from loop_fakes import (
    ABI_12_8, ABI_13_0, AFTER, BEGIN, DMA, DONE, END, FREE, LOOP_CTX, NUM_RING_SLOTS, PACK, PREV,
    RING_BASE, READY, SLOT_POISON, START, STREAM, UNPACK, contract, multi_chunk_store, prepare,
    row_order_is_unique, spoil, zero_copy_contract, zero_copy_pairs,
)
from tiercache.errors import BackendError, SpecError
from tiercache.native import build as native_build
from tiercache.native.chunk_loop import ChunkLoop, LoopKernel
from tiercache.native.codes import SPEC_ERRORS
from tiercache.native.validator import NativeValidator
from tiercache.planning.planner import TransferPlanner
from tiercache.region.layout import RegionLayout
from tiercache.specs import CPULoadStoreSpec, GPULoadStoreSpec


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


@pytest.mark.parametrize("store", [True, False])
def test_the_loop_merges_no_dma_into_a_row_where_a_registration_begins(store):
    """As the numpy layout does (``break_rows``: a slice registered in pieces): slots 10..33
    with a piece every 8 rows, chunks of 64 rows: DMAs 10..15, 16..23, 24..31, 32..33."""
    pages, tensors, blocks = 4096, 4, 64
    rng = np.random.default_rng(3)
    case = Case(factor=1, pages=[pages] * tensors,
                gpu_offset=[t * blocks * pages for t in range(tensors)],
                gpu_stride=[pages] * tensors, num_gpu_blocks=blocks,
                cpu_offset=[t * pages for t in range(tensors)],
                cpu_stride=tensors * pages, num_cpu_blocks=blocks,
                groups=[list(range(tensors))],
                gpu_spec=GPULoadStoreSpec(rng.permutation(blocks)[:24].tolist()),
                cpu_spec=CPULoadStoreSpec(list(range(10, 34))), store=store, chunk_rows=64,
                break_rows=8)
    layout = _check(case, ABI_13_0)
    assert layout.num_chunks == 1
    assert layout.dma_bytes.tolist() == [r * tensors * pages for r in (6, 8, 8, 2)]


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


@settings(max_examples=100, deadline=None)
@given(st.data(), st.booleans())
def test_zero_copy_jobs_move_the_plans_bytes_in_one_launch_over_the_host_rows(data, inline):
    """A job within the zero-copy bound: one launch of the kernel over all its pairs, each
    row offset the host address of its row image, and nothing through the ring (no DMA,
    no slot claimed); the same bytes as the per-page plan."""
    _check(draw_case(HypDraw(data)), ABI_13_0, inline, zero_copy=True)


@pytest.mark.parametrize("bound, expect", [(-1, False), (0, False), (1, False), (2, True),
                                           (1 << 40, True)])
def test_zero_copy_takes_jobs_of_at_most_its_bound_in_pairs(bound, expect):
    """A two-pair load: zero-copy exactly when the bound is two pairs or more; the bytes
    are the plan's either way."""
    case = Case(factor=1, pages=[512] * 3, gpu_offset=[0, 4096, 8192], gpu_stride=[512] * 3,
                num_gpu_blocks=8, cpu_offset=[0, 512, 1024], cpu_stride=1536,
                num_cpu_blocks=8, groups=[[0, 1, 2]], gpu_spec=GPULoadStoreSpec([5, 2]),
                cpu_spec=CPULoadStoreSpec([7, 1]), store=False, chunk_rows=4)
    _check(case, ABI_13_0, zero_copy=expect, bound=bound)


def _check(case, abi, inline: bool = False, zero_copy: bool = False, bound: int | None = None):
    """Run ``case`` through the loop (``zero_copy``: expect it to move zero-copy, with
    the bound ``bound``, default every job)."""
    prepared = prepare(case)
    reference, layout = prepared.plan, prepared.layout
    gpu_data, cpu_data = prepared.gpu_data, prepared.cpu_data
    plan, gpu_expected, cpu_expected = expected_after(case, prepared.planner, gpu_data,
                                                      cpu_data, GPU_BASE, CPU_BASE)
    fake, loop = prepared.rig(abi)
    try:
        if inline:
            loop.set_inline(1 << 40)
        if zero_copy or bound is not None:
            loop.set_zero_copy(1 << 40 if bound is None else bound)
        ticket, table, validated = prepared.submit(loop)
        assert ticket.issued() or not inline  # issued inside submit
        ticket.wait()
        assert ticket.issued() and ticket.status == 0
        assert loop.stamps().inline == inline
        assert loop.stamps().zero_copy == (zero_copy and validated.num_pairs > 0)
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
    if zero_copy and validated.num_pairs:  # straight to / from the host rows
        assert calls == zero_copy_contract(validated.num_pairs, case.store)
        assert sorted(map(tuple, table.T.tolist())) == zero_copy_pairs(prepared.staging,
                                                                      validated)
        assert fake.dmas == [] and (fake.ring.data == SLOT_POISON).all()  # no slot touched
    elif row_order_is_unique(case, reference):  # the numpy layout, exactly
        np.testing.assert_array_equal(table, layout.pairs)
        assert fake.dmas == list(zip(layout.dma_host.tolist(), layout.dma_slot.tolist(),
                                     layout.dma_bytes.tolist()))
        assert calls == contract(layout, case.store, 0)
    return layout


def test_the_ring_cursor_carries_over_between_jobs():
    prepared = multi_chunk_store()
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
        cursor = n * layout.num_chunks % NUM_RING_SLOTS
        assert fake.trace[lo:hi + 1] == contract(layout, True, cursor)


def test_a_failed_batch_fails_its_job_still_records_its_end_and_later_jobs_run():
    prepared = multi_chunk_store()
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
    assert second == contract(layout, True, layout.num_chunks % NUM_RING_SLOTS)


def test_an_empty_job_only_orders():
    fake, loop = multi_chunk_store().rig()
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
    prepared = multi_chunk_store()
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
        assert loop.stamps().inline is False  # the second too was issued by the loop's thread
        third, _, _ = prepared.submit(loop)  # the loop idle again: inline
        assert third.issued() and third.status == 0 and loop.stamps().inline is True
    finally:
        gate.set()
        loop.close()
    assert not fake.errors, fake.errors
    calls = [t for t in fake.trace if t[0] != "ctx"]
    n = layout.num_chunks
    assert calls == (contract(layout, True, 0) + contract(layout, True, n % NUM_RING_SLOTS)
                     + contract(layout, True, 2 * n % NUM_RING_SLOTS))  # in order, cursor shared
    assert len(fake.threads) == 2  # the loop's thread for two, the caller's for the third


def test_only_a_job_within_the_inline_bound_is_issued_by_the_caller():
    prepared = multi_chunk_store()
    fake, loop = prepared.rig()
    pairs = prepared.plan.num_pairs
    try:
        loop.set_inline(pairs - 1)
        over, _, _ = prepared.submit(loop)
        over.wait()
        assert over.status == 0 and loop.stamps().inline is False
        loop.set_inline(pairs)
        within, _, _ = prepared.submit(loop)
        assert within.issued() and within.status == 0 and loop.stamps().inline is True
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
        prepared = prepare(case)
        bound = prepared.staging.loop_geometry().one_chunk_pairs
        if prepared.plan.num_pairs <= bound:
            assert prepared.layout.num_chunks <= 1, (seed, bound, prepared.plan.num_pairs)
            checked += 1
    assert checked >= 20  # the bound was exercised, not vacuous


def test_a_caller_without_the_loops_context_never_issues_inline():
    prepared = multi_chunk_store()
    fake, loop = prepared.rig()
    fake.current = 0xD0  # another context is current on the caller's thread
    try:
        loop.set_inline(1 << 40)
        ticket, _, _ = prepared.submit(loop)
        ticket.wait()
        assert ticket.status == 0 and loop.stamps().inline is False
    finally:
        loop.close()
    assert threading.get_ident() not in fake.threads


def test_bad_configurations_and_jobs_are_refused():
    prepared = multi_chunk_store()
    fake, loop = prepared.rig()
    loop.close()
    kernel = LoopKernel((UNPACK, PACK), 128, (8, 16), 7, 5, 8, (0, 0, 0, 0))
    with pytest.raises(BackendError, match="8 parameters"):
        ChunkLoop(fake.driver, kernel, prepared.staging.loop_geometry(),
                  dma_stream=DMA, ring_base=RING_BASE, ring_slot_bytes=256, free_events=FREE,
                  ready_events=READY, begin_event=BEGIN, done_event=DONE,
                  attrs=(bytes(24), bytes(24)))
    with pytest.raises(BackendError, match="closed"):
        prepared.submit(loop)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_validation_accepts_and_refuses_what_the_planner_does(data):
    """Drawn transfers, some spoiled: the C validation refuses exactly those the numpy
    validation refuses (the planner then raises numpy's SpecError, which says why), and
    writes what the numpy validation writes for the others."""
    case = draw_case(HypDraw(data))
    gpu, cpu = spoil(HypDraw(data), case)
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
    (tmp_path / "broken.c").write_text("int f( {\n")
    with pytest.raises(BackendError, match="broken.c"):
        native_build.build(tmp_path, tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.so"))  # nothing half-built left


def test_builds_once_per_source_version(tmp_path):
    first = native_build.build(directory=tmp_path)
    stamp = first.stat().st_mtime_ns
    assert native_build.build(directory=tmp_path) == first
    assert first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


def test_a_changed_header_is_a_new_build(tmp_path):
    """The C files are built together, and what they include is part of the version: a
    header changed alone (here a limit in ``codes.h``) gives another library."""
    import shutil

    sources = tmp_path / "src"
    shutil.copytree(native_build.SOURCES, sources)
    first = native_build.build(sources, tmp_path / "out")
    header = sources / "codes.h"
    header.write_text(header.read_text().replace("#define TC_MAX_PARAMS 16",
                                                 "#define TC_MAX_PARAMS 17"))
    second = native_build.build(sources, tmp_path / "out")
    assert second != first and sorted(p.name for p in (tmp_path / "out").iterdir()) == \
        sorted([first.name, second.name])


@pytest.mark.parametrize("inline", [False, True])
def test_a_job_without_a_table_lays_out_into_one_of_the_loops_own(inline):
    """``submit`` with no table (what staged's block plans do): the loop takes one of its
    own, the launches read it, its event is recorded after them, and the bytes land."""
    prepared = multi_chunk_store()
    case = prepared.case
    gpu_data, cpu_data = prepared.gpu_data, prepared.cpu_data
    plan, gpu_expected, cpu_expected = expected_after(case, prepared.planner, gpu_data,
                                                      cpu_data, GPU_BASE, CPU_BASE)
    fake, loop = prepared.rig()
    try:
        if inline:
            loop.set_inline(1 << 40)
        validated = prepared.planner.block_plan(case.direction, case.spec)
        ticket = loop.submit(stream=STREAM, after=AFTER, prev_end=PREV, start_event=START,
                             end_event=END, direction=case.direction, validated=validated.buffer,
                             num_pairs=validated.num_pairs, num_works=validated.num_works,
                             keep=validated)
        ticket.wait()
        assert ticket.status == 0 and loop.stamps().inline == inline
    finally:
        loop.close()
    assert not fake.errors, fake.errors
    assert len(fake.allocated) == 1 and fake.tables
    assert_same(case, plan, prepared.layout, gpu_data, cpu_data, gpu_expected, cpu_expected)
    calls = [t for t in fake.trace if t[0] != "ctx"]
    if row_order_is_unique(case, prepared.plan):
        assert all(np.array_equal(t, prepared.layout.pairs) for t in fake.tables)
        assert calls == contract(prepared.layout, case.store, 0)

"""One native call per transfer (``ChunkLoop.transfer``, ``tc_transfer``) on the CPU, with
the stand-in GPU of ``loop_fakes``: the real compiled C validates, fences, marks the
compute stream and queues; only the driver entry points are stand-ins.

What must hold: a transfer the planner accepts moves exactly the bytes of the per-page
plan with the calls of staged's pipeline contract, after one record of the mark on the
compute stream; one the planner refuses is refused with the validator's code and queues
nothing; one the fence refuses (a slot handed out again since, another region) or whose
mark fails copies nothing but keeps its place in the order (its end is still recorded).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from block_reference import (
    CPU_BASE, GPU_BASE, Case, HypDraw, Memory, RngDraw, assert_same, draw_case, expected_after,
)
from loop_fakes import (
    AFTER, COMPUTE, END, LOOP_CTX, PREV, START, STREAM, contract, multi_chunk_store, prepare,
    row_order_is_unique, spoil, zero_copy_contract,
)
from tiercache.errors import BackendError, SpecError
from tiercache.native.codes import SPEC_ERRORS, TransferCode
from tiercache.native.transfer_call import FenceTable, TransferChecks
from tiercache.region.ledger import RECORD, LedgerState
from tiercache.specs import CPULoadStoreSpec, GPULoadStoreSpec

REGION = 0x5EED_0000_0001
ORDERING_ONLY = [("wait", "S", "prev"), ("record", "start", "S"), ("record", "end", "S")]


def _ledger(case, rng: np.random.Generator) -> np.ndarray:
    """An index ledger whose slots all hold what ``case``'s direction needs."""
    ledger = np.zeros(case.num_cpu_blocks, dtype=RECORD)
    ledger["gen"] = rng.integers(1, 1 << 40, size=ledger.size, dtype=np.uint64)
    ledger["state"] = LedgerState.WRITING if case.store else LedgerState.READY
    return ledger


def _fenced(spec: CPULoadStoreSpec, ledger: np.ndarray, region_id: int = REGION
            ) -> CPULoadStoreSpec:
    return CPULoadStoreSpec(spec.block_ids, ledger["gen"][spec.block_ids], region_id)


def _transfer(loop, prepared, cpu: CPULoadStoreSpec, fence: FenceTable | None, gpu=None):
    case = prepared.case
    gpu = case.gpu_spec if gpu is None else gpu
    checks = TransferChecks(prepared.planner.validator(), prepared.planner.pair_bytes, fence)
    return loop.transfer(checks, case.direction, gpu.block_ids, gpu.group_sizes,
                         gpu.block_indices, cpu.block_ids, cpu.slot_gens, cpu.region_id,
                         stream=STREAM, compute=COMPUTE, mark=AFTER, prev_end=PREV,
                         start_event=START, end_event=END)


@settings(max_examples=120, deadline=None)
@given(st.data(), st.booleans(), st.sampled_from(["none", "unfenced", "fenced"]),
       st.booleans())
def test_a_transfer_moves_the_plans_bytes_after_the_mark_in_the_pipeline_order(
        data, inline, fencing, zero_copy):
    """Through the ring, or (``zero_copy``) in one launch over the host rows."""
    case = draw_case(HypDraw(data))
    prepared = prepare(case)
    gpu_data, cpu_data = prepared.gpu_data, prepared.cpu_data
    plan, gpu_expected, cpu_expected = expected_after(case, prepared.planner, gpu_data,
                                                      cpu_data, GPU_BASE, CPU_BASE)
    ledger = _ledger(case, np.random.default_rng(data.draw(st.integers(0, 1 << 30))))
    fence = None if fencing == "none" else FenceTable(REGION, ledger)
    cpu = _fenced(case.cpu_spec, ledger) if fencing == "fenced" else case.cpu_spec
    fake, loop = prepared.rig()
    try:
        if inline:
            loop.set_inline(1 << 40)
        if zero_copy:
            loop.set_zero_copy(1 << 40)
        outcome = _transfer(loop, prepared, cpu, fence)
        assert outcome.code == TransferCode.QUEUED and outcome.cu == 0
        assert outcome.num_bytes == prepared.plan.num_bytes
        assert outcome.ticket.issued() or not inline
        outcome.ticket.wait()
        assert outcome.ticket.status == 0 and loop.stamps().inline == inline
        zero_copy = zero_copy and prepared.plan.num_pairs > 0
        assert loop.stamps().zero_copy == zero_copy
    finally:
        loop.close()
    assert not fake.errors, fake.errors
    # the mark is the caller's; the rest the caller's too when inline, else the loop's
    assert threading.get_ident() in fake.threads and len(fake.threads) == (1 if inline else 2)
    assert_same(case, plan, prepared.layout, gpu_data, cpu_data, gpu_expected, cpu_expected)
    calls = [t for t in fake.trace if t[0] != "ctx"]
    assert calls[0] == ("record", "after", "C")  # the mark, on the compute stream, first
    if zero_copy:
        assert calls[1:] == zero_copy_contract(prepared.plan.num_pairs, case.store)
        assert fake.dmas == []
    elif row_order_is_unique(case, prepared.plan):
        assert all(np.array_equal(t, prepared.layout.pairs) for t in fake.tables)
        assert calls[1:] == contract(prepared.layout, case.store, 0)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_what_the_planner_refuses_is_refused_and_nothing_is_queued(data):
    case = draw_case(HypDraw(data))
    gpu, cpu = spoil(HypDraw(data), case)
    prepared = prepare(case)
    spec = (gpu, cpu) if case.store else (cpu, gpu)
    try:
        prepared.planner.block_plan(case.direction, spec)
        refused = False
    except SpecError:
        refused = True
    fake, loop = prepared.rig()
    try:
        outcome = _transfer(loop, prepared, cpu, None, gpu=gpu)
        if outcome.ticket is not None:
            outcome.ticket.wait()
    finally:
        loop.close()
    assert not fake.errors, fake.errors
    calls = [t for t in fake.trace if t[0] != "ctx"]
    if refused:
        assert outcome.code in SPEC_ERRORS
        assert outcome.ticket is None and calls == []  # not even the mark
    else:
        assert outcome.code == TransferCode.QUEUED and outcome.ticket.status == 0
        assert calls[0] == ("record", "after", "C")


def _case_of_two_slots():
    for seed in range(500):
        case = draw_case(RngDraw(seed))
        if len(case.cpu_spec) >= 2:
            prepared = prepare(case)
            if prepared.plan.num_pairs:
                return prepared
    raise AssertionError("no drawn case with two slots")


@pytest.mark.parametrize("spoilt", ["generation", "state", "region"])
def test_a_fenced_off_transfer_copies_nothing_and_keeps_its_place(spoilt):
    """A slot handed to another block since (a newer generation, or no longer in the state
    the direction needs) or a spec of another region: nothing is copied, the mark is not
    recorded, the transfer still waits for the previous one and records its end (later
    transfers wait on it); the next transfer of good slots runs."""
    prepared = _case_of_two_slots()
    case = prepared.case
    ledger = _ledger(case, np.random.default_rng(7))
    good = _fenced(case.cpu_spec, ledger)
    slot = int(case.cpu_spec.block_ids[-1])
    bad = good
    if spoilt == "region":
        bad = _fenced(case.cpu_spec, ledger, REGION + 1)
    gpu_before, cpu_before = prepared.gpu_data.copy(), prepared.cpu_data.copy()
    fake, loop = prepared.rig()
    try:
        if spoilt == "generation":
            ledger["gen"][slot] += 1  # handed out again since the spec was made
        elif spoilt == "state":
            ledger["state"][slot] = LedgerState.FREE
        outcome = _transfer(loop, prepared, bad, FenceTable(REGION, ledger))
        assert outcome.code == TransferCode.FENCED and outcome.ticket is not None
        outcome.ticket.wait()
        assert outcome.ticket.status == 0
        np.testing.assert_array_equal(prepared.gpu_data, gpu_before)
        np.testing.assert_array_equal(prepared.cpu_data, cpu_before)
        refused_calls = [t for t in fake.trace if t[0] != "ctx"]
        assert refused_calls == ORDERING_ONLY
        if spoilt != "region":  # the ledger as the spec saw it again: the same spec runs
            ledger["gen"][slot] = good.slot_gens[-1]
            ledger["state"][slot] = LedgerState.WRITING if case.store else LedgerState.READY
        again = _transfer(loop, prepared, good, FenceTable(REGION, ledger))
        again.ticket.wait()
        assert again.code == TransferCode.QUEUED and again.ticket.status == 0
    finally:
        loop.close()
    assert not fake.errors, fake.errors
    assert not (np.array_equal(prepared.gpu_data, gpu_before)
                and np.array_equal(prepared.cpu_data, cpu_before))  # the good one copied


def test_an_unfenced_spec_is_the_callers_and_a_fence_without_generations_checks_the_region():
    prepared = _case_of_two_slots()
    case = prepared.case
    ledger = _ledger(case, np.random.default_rng(3))
    ledger["state"] = LedgerState.FREE  # every slot would be refused if it were checked
    fence = FenceTable(REGION, ledger)
    fake, loop = prepared.rig()
    try:
        unfenced = _transfer(loop, prepared, case.cpu_spec, fence)
        region_only = _transfer(loop, prepared, CPULoadStoreSpec(case.cpu_spec.block_ids,
                                                                    None, REGION), fence)
        other = _transfer(loop, prepared, CPULoadStoreSpec(case.cpu_spec.block_ids,
                                                              None, REGION + 1), fence)
        loop.wait()
    finally:
        loop.close()
    assert (unfenced.code, region_only.code, other.code) == (0, 0, TransferCode.FENCED)


def test_a_failed_mark_copies_nothing_says_why_and_the_next_transfer_runs():
    prepared = _case_of_two_slots()
    fake, loop = prepared.rig()
    fake.fail_record[AFTER] = 700
    try:
        failed = _transfer(loop, prepared, prepared.case.cpu_spec, None)
        assert (failed.code, failed.cu) == (TransferCode.MARK_FAILED, 700)
        failed.ticket.wait()
        marks = len(fake.trace)
        del fake.fail_record[AFTER]
        later = _transfer(loop, prepared, prepared.case.cpu_spec, None)
        later.ticket.wait()
        assert later.code == TransferCode.QUEUED and later.ticket.seq == failed.ticket.seq + 1
    finally:
        loop.close()
    calls = [t for t in fake.trace[:marks] if t[0] != "ctx"]
    assert calls == [("record", "after", "C")] + ORDERING_ONLY


def test_a_caller_without_a_context_gets_the_loops_before_the_mark():
    """A thread with no current context (a fresh engine thread) gets the loop's made
    current by the call, as ``torch.cuda.set_device`` would; one that has a context keeps
    it."""
    prepared = _case_of_two_slots()
    fake, loop = prepared.rig()
    me = threading.get_ident()
    try:
        loop.wait()
        _transfer(loop, prepared, prepared.case.cpu_spec, None).ticket.wait()
        assert [c for c in fake.ctx_calls if c[0] == me] == []
        fake.current = 0
        outcome = _transfer(loop, prepared, prepared.case.cpu_spec, None)
        outcome.ticket.wait()
        assert outcome.code == TransferCode.QUEUED
        assert [c for c in fake.ctx_calls if c[0] == me] == [(me, LOOP_CTX)]
    finally:
        loop.close()
    # closing frees the loop's tables: it needs the context too
    assert [c for c in fake.ctx_calls if c[0] == me] == [(me, LOOP_CTX)] * 2


def test_an_empty_transfer_marks_and_orders_and_a_closed_loop_refuses():
    prepared = _case_of_two_slots()
    case = prepared.case
    empty_gpu = GPULoadStoreSpec([], [0] * len(case.gpu_spec.group_sizes),
                                 [0] * len(case.gpu_spec.group_sizes))
    fake, loop = prepared.rig()
    try:
        outcome = _transfer(loop, prepared, CPULoadStoreSpec([]), None, gpu=empty_gpu)
        outcome.ticket.wait()
        assert outcome.code == TransferCode.QUEUED and outcome.num_bytes == 0
    finally:
        loop.close()
    assert [t for t in fake.trace if t[0] != "ctx"] == [
        ("record", "after", "C"), ("wait", "S", "after")] + ORDERING_ONLY
    with pytest.raises(BackendError, match="closed"):
        _transfer(loop, prepared, case.cpu_spec, None)


def test_a_fence_table_must_have_the_ledgers_fields():
    with pytest.raises(BackendError, match="gen"):
        FenceTable(REGION, np.zeros(4, dtype=[("gen", "<u4"), ("state", "<u4")]))


def test_id_arrays_of_other_types_or_strides_are_converted_first():
    """The call reads the id arrays in place (flat int64 / uint64); any other array is
    converted before the call, and moves the same bytes."""
    prepared = _case_of_two_slots()
    case = prepared.case
    gpu_data, cpu_data = prepared.gpu_data, prepared.cpu_data
    plan, gpu_expected, cpu_expected = expected_after(case, prepared.planner, gpu_data,
                                                      cpu_data, GPU_BASE, CPU_BASE)
    ledger = _ledger(case, np.random.default_rng(5))
    fenced = _fenced(case.cpu_spec, ledger)
    spread = lambda a, t: np.repeat(a.astype(t), 2)[::2]  # noqa: E731  strided copies
    assert not spread(case.gpu_spec.block_ids, np.int32).flags.c_contiguous
    checks = TransferChecks(prepared.planner.validator(), prepared.planner.pair_bytes,
                            FenceTable(REGION, ledger))
    fake, loop = prepared.rig()
    try:
        gpu = case.gpu_spec
        outcome = loop.transfer(checks, case.direction, spread(gpu.block_ids, np.int32),
                                gpu.group_sizes, gpu.block_indices,
                                spread(fenced.block_ids, np.uint32),
                                spread(fenced.slot_gens, np.int64), REGION, stream=STREAM,
                                compute=COMPUTE, mark=AFTER, prev_end=PREV, start_event=START,
                                end_event=END)
        assert outcome.code == TransferCode.QUEUED
        outcome.ticket.wait()
    finally:
        loop.close()
    assert not fake.errors, fake.errors
    assert_same(case, plan, prepared.layout, gpu_data, cpu_data, gpu_expected, cpu_expected)


def test_the_loops_own_pair_tables_are_reused_only_once_the_device_passed_them():
    """A table goes back to use once its job was issued and the event recorded after the
    job's last launch completed: back-to-back transfers share one table while the device
    keeps up; a table whose event the device has not passed is never written again (a new
    one is made); closing frees every table and its event."""
    prepared = multi_chunk_store()
    fake, loop = prepared.rig()
    try:
        for _ in range(3):
            _transfer(loop, prepared, prepared.case.cpu_spec, None).ticket.wait()
        assert len(fake.allocated) == 1 and len(fake.table_events) == 1
        fake.busy.add(fake.table_events[0])  # the device still reads table 0
        _transfer(loop, prepared, prepared.case.cpu_spec, None).ticket.wait()
        assert len(fake.allocated) == 2
        fake.busy.clear()
        _transfer(loop, prepared, prepared.case.cpu_spec, None).ticket.wait()
        assert len(fake.allocated) == 2  # both idle again: no third
        tables = list(fake.pinned)
        assert all(n >= 32 * prepared.plan.num_pairs for n in fake.allocated)
    finally:
        loop.close()
    assert not fake.errors, fake.errors
    assert sorted(fake.freed) == sorted(tables) and fake.pinned == {}
    assert sorted(fake.destroyed) == sorted(fake.table_events)
    # every launch read a table of the loop's, each recorded after its job's launches
    records = [t for t in fake.trace if t[:2] == ("record", "table")]
    assert len(records) == 5


def test_a_job_larger_than_every_table_gets_a_larger_one():
    """600 pairs (the smallest table holds 512) after a small job: a second, larger
    table, and the bytes of both transfers land as the per-page plans say."""
    blocks, pages = 640, [256, 256]
    rng = np.random.default_rng(9)
    for n, expect in ((5, [2048 * 8]), (600, [2048 * 8, 600 * 32])):
        case = Case(factor=1, pages=pages, gpu_offset=[0, blocks * 256], gpu_stride=[256, 256],
                    num_gpu_blocks=blocks, cpu_offset=[0, 256], cpu_stride=512,
                    num_cpu_blocks=blocks, groups=[[0, 1]],
                    gpu_spec=GPULoadStoreSpec(rng.permutation(blocks)[:n].tolist()),
                    cpu_spec=CPULoadStoreSpec(rng.permutation(blocks)[:n].tolist()),
                    store=bool(n % 2), chunk_rows=64)
        prepared = prepare(case)
        gpu_data, cpu_data = prepared.gpu_data, prepared.cpu_data
        plan, gpu_expected, cpu_expected = expected_after(case, prepared.planner, gpu_data,
                                                          cpu_data, GPU_BASE, CPU_BASE)
        if n == 5:
            fake, loop = prepared.rig()
        else:  # the same loop's pool: a new rig over this case's memories, same tables
            fake.case, fake.layout = case, prepared.layout
            fake.memories = (Memory(gpu_data, GPU_BASE), Memory(cpu_data, CPU_BASE), fake.ring)
            fake.gpu_pages, fake.cpu_pages = case.page_arrays(GPU_BASE, CPU_BASE)
        outcome = _transfer(loop, prepared, case.cpu_spec, None)
        outcome.ticket.wait()
        assert outcome.code == TransferCode.QUEUED and outcome.ticket.status == 0
        assert fake.allocated == expect
        assert_same(case, plan, prepared.layout, gpu_data, cpu_data, gpu_expected, cpu_expected)
    loop.close()
    assert not fake.errors, fake.errors

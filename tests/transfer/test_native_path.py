"""The native transfer path through a real handler, on the CPU: the compiled C validates,
fences, marks and queues each transfer on its loop's thread; only the driver is the
stand-in GPU of ``loop_fakes`` (it copies on numpy memory and logs every call), and the
handler's streams and events are handles it knows (``fake_streams``).

What the contract (``tiercache.transfer.path.TransferPath``) promises, held here for the
native path (the planned path: tests/transfer/test_handlers.py, test_fence.py): the bytes
the per-page plan moves, after the compute stream's mark and the previous transfer's end;
a spec the rank cannot take is the planner's ``SpecError`` and nothing is enqueued; a
fenced transfer, or one whose mark failed, copies nothing, is logged with why and is
reported failed in its place; a transfer is reported only once its ticket says issued.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest

from block_reference import CPU_BASE, GPU_BASE, RngDraw, assert_same, draw_case, expected_after
from fake_streams import FakeStreams
from loop_fakes import prepare
from tiercache.backend_kind import BackendKind
from tiercache.backends.base import CopyBackend
from tiercache.backends.cpu import CpuCopyBackend
from tiercache.device.host_streams import HostStreams
from tiercache.errors import SpecError
from tiercache.planning.planner import TransferPlanner
from tiercache.planning.plans import PlanForm
from tiercache.region.ledger import RECORD, LedgerState
from tiercache.specs import CPULoadStoreSpec, GPULoadStoreSpec
from tiercache.transfer.fence import SlotFence
from tiercache.transfer.handlers import SingleDirectionOffloadingHandler, TransferResult
from tiercache.transfer.native_path import NativePath
from tiercache.transfer.planned_path import PlannedPath
from tiercache.transfer.wiring import path_for

REGION = 0x5EED_0000_0002


class LoopBackend(CopyBackend):
    """What the native path uses of a ``staged`` backend, over the stand-in's loop: the
    loop it lends for its geometry, its kind, its close."""

    kind = BackendKind.STAGED
    plan_form = PlanForm.BLOCKS

    def __init__(self, loop, geometry):
        self.loop, self.geometry, self.closed = loop, geometry, False

    def submit(self, plan, ordering):
        raise AssertionError("the native path never submits a plan")

    def transfer_loop(self, geometry):
        return self.loop if geometry is self.geometry else None

    def close(self) -> None:
        self.loop.close()
        self.closed = True


class Rig:
    """A drawn case's memories, the real loop over the stand-in, and a handler whose path
    ``path_for`` chose (the native one)."""

    def __init__(self, prepared, fence: SlotFence | None = None):
        self.prepared, self.case = prepared, prepared.case
        self.fake, loop = prepared.rig()
        self.streams = FakeStreams(self.fake)
        self.backend = LoopBackend(loop, prepared.planner.geometry)
        path = path_for(self.case.direction, self.backend, prepared.planner, self.streams, fence)
        assert isinstance(path, NativePath)
        self.handler = SingleDirectionOffloadingHandler(path, self.streams)
        self.jobs = iter(range(1, 1 << 20))

    def spec(self, cpu: CPULoadStoreSpec | None = None, gpu: GPULoadStoreSpec | None = None):
        gpu = self.case.gpu_spec if gpu is None else gpu
        cpu = self.case.cpu_spec if cpu is None else cpu
        return (gpu, cpu) if self.case.store else (cpu, gpu)

    def calls(self) -> list[tuple]:
        return [t for t in self.fake.trace if t[0] != "ctx"]

    def close(self) -> list[TransferResult]:
        results = self.handler.shutdown()
        assert self.backend.closed and not self.fake.errors, self.fake.errors
        return results


@pytest.fixture
def rigs():
    made: list[Rig] = []

    def make(*args, **kwargs) -> Rig:
        made.append(Rig(*args, **kwargs))
        return made[-1]

    yield make
    for rig in made:
        if not rig.backend.closed:
            rig.handler.shutdown()


def _two_slot_case(store: bool):
    for seed in range(500):
        case = draw_case(RngDraw(seed))
        if case.store == store and len(case.cpu_spec) >= 2:
            prepared = prepare(case)
            if prepared.plan.num_pairs:
                return prepared
    raise AssertionError("no drawn case with two slots")


def _ledger(case, seed: int) -> np.ndarray:
    """An index ledger whose slots all hold what ``case``'s direction needs."""
    ledger = np.zeros(case.num_cpu_blocks, dtype=RECORD)
    ledger["gen"] = np.random.default_rng(seed).integers(1, 1 << 40, size=ledger.size,
                                                         dtype=np.uint64)
    ledger["state"] = LedgerState.WRITING if case.store else LedgerState.READY
    return ledger


def _fenced(spec: CPULoadStoreSpec, ledger: np.ndarray) -> CPULoadStoreSpec:
    return CPULoadStoreSpec(spec.block_ids, ledger["gen"][spec.block_ids], REGION)


@pytest.mark.parametrize("store", [True, False])
def test_transfers_move_the_plans_bytes_after_the_mark_and_the_previous_one(rigs, store):
    """Two transfers submitted back to back: each is one job of the loop, after its own
    compute mark (recorded on the compute stream ``C``) and, the second, after the first's
    end; both are reported in order with the plan's bytes, and the bytes are the per-page
    plan's."""
    rig = rigs(_two_slot_case(store))
    prepared, case = rig.prepared, rig.case
    plan, gpu_expected, cpu_expected = expected_after(
        case, prepared.planner, prepared.gpu_data, prepared.cpu_data, GPU_BASE, CPU_BASE)
    assert rig.handler.native and rig.handler.kind is BackendKind.STAGED
    assert rig.handler.transfer_async(1, rig.spec())
    assert rig.handler.transfer_async(2, rig.spec())
    rig.handler.wait([1, 2])
    results = rig.handler.get_finished()
    assert [(r.job_id, r.success, r.transfer_size) for r in results] == \
        [(1, True, plan.num_bytes), (2, True, plan.num_bytes)]
    calls = rig.calls()
    assert calls[0] == ("record", "mark1", "C")  # the first transfer's mark, first of all
    first = [c for c in calls if "S1" in c]
    second = [c for c in calls if "S2" in c]
    assert first[:2] == [("wait", "S1", "mark1"), ("record", "event1", "S1")]
    assert second[:3] == [("wait", "S2", "mark2"), ("wait", "S2", "event2"),  # the first's end
                          ("record", "event3", "S2")]
    assert (first[-1], second[-1]) == (("record", "event2", "S1"), ("record", "event4", "S2"))
    assert calls.index(("record", "mark2", "C")) < calls.index(second[0])
    rig.close()
    assert_same(case, plan, prepared.layout, prepared.gpu_data, prepared.cpu_data,
                gpu_expected, cpu_expected)


def test_a_spec_the_rank_cannot_take_is_the_planners_error_and_nothing_is_enqueued(rigs):
    rig = rigs(_two_slot_case(True))
    case = rig.case
    bad = GPULoadStoreSpec(np.full(case.gpu_spec.block_ids.size, case.num_gpu_blocks),
                           case.gpu_spec.group_sizes, case.gpu_spec.block_indices)
    with pytest.raises(SpecError, match=f"GPU block id {case.num_gpu_blocks} in group "
                                        r"\d+ is out of range"):
        rig.handler.transfer_async(1, rig.spec(gpu=bad))
    with pytest.raises(SpecError, match=r"a gpu_to_cpu transfer takes .* got "
                                        r"\(CPULoadStoreSpec, GPULoadStoreSpec\)"):
        rig.handler.transfer_async(2, (case.cpu_spec, case.gpu_spec))
    assert rig.handler.num_in_flight == 0 and rig.calls() == []  # not even the mark
    assert rig.handler.transfer_async(3, rig.spec())
    rig.handler.wait([3])
    assert [r.success for r in rig.handler.get_finished()] == [True]
    assert rig.calls()[:2] == [("record", "mark1", "C"), ("wait", "S1", "mark1")]  # reused


@pytest.mark.parametrize("spoilt", ["generation", "region"])
def test_a_fenced_transfer_copies_nothing_says_why_and_fails_in_its_place(rigs, caplog,
                                                                          spoilt):
    prepared = _two_slot_case(True)
    ledger = _ledger(prepared.case, 3)
    rig = rigs(prepared, SlotFence(REGION, ledger))
    good = _fenced(rig.case.cpu_spec, ledger)
    bad = good
    if spoilt == "generation":
        ledger["gen"][int(good.block_ids[-1])] += 1  # handed to another block since
    else:
        bad = CPULoadStoreSpec(good.block_ids, good.slot_gens, REGION + 1)
    before = prepared.cpu_data.copy()
    with caplog.at_level(logging.ERROR, logger="tiercache.transfer.native_path"):
        assert not rig.handler.transfer_async(1, rig.spec(bad))
    rig.handler.wait([1])
    (result,) = rig.handler.get_finished()
    assert (result.job_id, result.success, result.transfer_time) == (1, False, 0.0)
    np.testing.assert_array_equal(prepared.cpu_data, before)  # nothing landed
    why = "but now has generation" if spoilt == "generation" else "the coordinator replaced"
    assert any("gpu_to_cpu job 1 refused, nothing copied" in r.getMessage() and
               why in r.getMessage() for r in caplog.records)
    assert ("record", "mark1", "C") not in rig.calls()  # a fenced transfer is not marked
    if spoilt == "generation":
        ledger["gen"][int(good.block_ids[-1])] -= 1
    assert rig.handler.transfer_async(2, rig.spec(good))
    rig.handler.wait([2])
    assert [r.success for r in rig.handler.get_finished()] == [True]
    assert not np.array_equal(prepared.cpu_data, before)


def test_a_failed_mark_copies_nothing_says_why_and_the_next_transfer_runs(rigs, caplog):
    prepared = _two_slot_case(False)
    rig = rigs(prepared)
    assert rig.handler.transfer_async(1, rig.spec())
    rig.handler.wait([1])
    rig.handler.get_finished()
    (mark,) = rig.streams.marks  # pooled: the next transfer takes it again
    rig.fake.fail_record[mark.handle] = 700
    before = prepared.gpu_data.copy()
    prepared.cpu_data[:] = 0x3C  # what a load would bring: none of it may land
    with caplog.at_level(logging.ERROR, logger="tiercache.transfer.native_path"):
        assert not rig.handler.transfer_async(2, rig.spec())
    rig.handler.wait([2])
    assert [(r.job_id, r.success) for r in rig.handler.get_finished()] == [(2, False)]
    np.testing.assert_array_equal(prepared.gpu_data, before)
    assert any("mark could not be recorded (CUresult 700)" in r.getMessage()
               for r in caplog.records)
    del rig.fake.fail_record[mark.handle]
    assert rig.handler.transfer_async(3, rig.spec())
    rig.handler.wait([3])
    assert [(r.job_id, r.success) for r in rig.handler.get_finished()] == [(3, True)]


def test_a_transfer_the_loop_cannot_take_fails_in_its_place(rigs, caplog):
    """The loop refuses a job (here it is closed; out of memory is the same answer): the
    transfer copies nothing, says why, and its end still follows the previous one's, so
    the order holds for the transfers after it."""
    rig = rigs(_two_slot_case(True))
    assert rig.handler.transfer_async(1, rig.spec())
    rig.backend.loop.close()  # issues what it holds, then takes nothing more
    with caplog.at_level(logging.ERROR, logger="tiercache.transfer.native_path"):
        assert not rig.handler.transfer_async(2, rig.spec())
    rig.handler.wait([1, 2])
    assert [(r.job_id, r.success) for r in rig.handler.get_finished()] == [(1, True), (2, False)]
    assert rig.calls()[-2:] == [("wait", "S2", "event2"), ("record", "event4", "S2")]
    assert any("gpu_to_cpu job 2: the staged backend could not submit" in r.getMessage()
               and "closed" in r.getMessage() for r in caplog.records)


def test_a_transfer_is_reported_only_once_its_ticket_says_issued(rigs):
    """The loop's thread is held at the transfer's end record: whatever its events say,
    the handler neither reports it nor lets ``wait`` return until the loop issued it."""
    rig = rigs(_two_slot_case(True))
    assert rig.handler.transfer_async(1, rig.spec())  # its end event, event2, made now
    rig.handler.wait([1])
    rig.handler.get_finished()
    end = next(h for h, n in rig.fake.names.items() if n == "event2")
    gate = rig.fake.gate = threading.Event()
    rig.fake.gate_on = end  # the next transfer takes the pooled events again
    assert rig.handler.transfer_async(2, rig.spec())
    assert rig.fake.at_gate.wait(30)
    assert rig.handler.get_finished() == []  # its events "passed", but it is not issued
    waiter = threading.Thread(target=rig.handler.wait, args=([2],))
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive()
    gate.set()
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    assert [(r.job_id, r.success) for r in rig.handler.get_finished()] == [(2, True)]


def test_the_path_is_chosen_once_per_handler():
    """Native only where the backend lends a loop for the planner's own geometry, the
    planner validates natively and the streams name the compute stream's handle."""
    prepared = _two_slot_case(True)
    fake, loop = prepared.rig()
    host = HostStreams()
    try:
        backend = LoopBackend(loop, prepared.planner.geometry)
        direction, planner = prepared.case.direction, prepared.planner
        assert isinstance(path_for(direction, backend, planner, FakeStreams(fake)), NativePath)
        numpy_planner = TransferPlanner.of(planner.geometry, native_validation=False)
        other = TransferPlanner(planner.gpu_pages, planner.cpu_pages, planner.block_size_factor)
        for chosen in (path_for(direction, backend, numpy_planner, FakeStreams(fake)),
                       path_for(direction, backend, other, FakeStreams(fake)),
                       path_for(direction, backend, planner, host),
                       path_for(direction, CpuCopyBackend(), planner, FakeStreams(fake))):
            assert isinstance(chosen, PlannedPath) and not chosen.native
    finally:
        loop.close()
        host.close()

"""``GatedPath``: while a slice is page-locked in the background, every transfer goes to the
unpinned path, and from the moment the slice is registered to the pinned one; what a path
holds goes back to that path; both close. The two paths here record what they are
given (the real ones need a CUDA device: tests/transfer/test_background_pinning_gpu.py);
the specs and the routing rule are the real ones."""

from __future__ import annotations

import pytest

from tiercache.backend_kind import BackendKind
from tiercache.errors import SpecError
from tiercache.native.codes import Outcome
from tiercache.specs import CPULoadStoreSpec, Direction, GPULoadStoreSpec
from tiercache.transfer.gated_path import GatedPath
from tiercache.transfer.path import TransferPath


class Recording(TransferPath):
    def __init__(self, name: str, kind: BackendKind):
        self.direction, self.kind, self.name = Direction.GPU_TO_CPU, kind, name
        self.jobs: list[int] = []
        self.released: list[object] = []
        self.closed = False
        self.closes = 0

    def transfer(self, job_id, transfer, stream, mark, previous, start, end):
        gpu, cpu = transfer
        if not isinstance(cpu, CPULoadStoreSpec):
            raise SpecError(f"{self.name}: not a CPU spec")
        self.jobs.append(job_id)
        return Outcome(0, 0, 4096 * cpu.block_ids.size, None, held=f"{self.name}-{job_id}")

    def release(self, held):
        self.released.append(held)

    def close(self):
        self.closed = True
        self.closes += 1


def _gated(registered: list[bool]):
    pinned = Recording("pinned", BackendKind.STAGED)
    unpinned = Recording("unpinned", BackendKind.CE)
    return GatedPath(pinned, unpinned, lambda: registered[0]), pinned, unpinned


def _store(path: GatedPath, job: int, slots: list[int]) -> Outcome:
    return path.transfer(job, (GPULoadStoreSpec(list(range(len(slots)))),
                               CPULoadStoreSpec(slots)), None, None, None, None, None)


def test_transfers_take_the_pinned_path_from_the_moment_the_slice_is_registered():
    registered = [False]
    gated, pinned, unpinned = _gated(registered)
    assert (gated.kind, gated.direction) == (BackendKind.STAGED, Direction.GPU_TO_CPU)
    _store(gated, 1, [0, 7])
    _store(gated, 2, [3, 8])
    registered[0] = True  # the preparer registered the slice
    _store(gated, 3, [20])
    _store(gated, 4, [20, 2])
    assert (pinned.jobs, unpinned.jobs) == ([3, 4], [1, 2])
    assert gated.routed == {"pinned": 2, "unpinned": 2}


def test_the_unpinned_path_is_closed_by_the_first_pinned_transfer_and_once():
    registered = [False]
    gated, pinned, unpinned = _gated(registered)
    held = _store(gated, 1, [0]).held
    assert not unpinned.closed  # in use until the slice is registered
    registered[0] = True
    _store(gated, 2, [1])
    assert unpinned.closes == 1 and not pinned.closed  # its bounce buffer goes back now
    _store(gated, 3, [2])
    gated.release(held)  # a transfer it made before is still released to it
    gated.close()
    assert (unpinned.closes, pinned.closes) == (1, 1)
    assert unpinned.released == ["unpinned-1"]


def test_what_a_path_holds_goes_back_to_it_and_both_close():
    registered = [True]
    gated, pinned, unpinned = _gated(registered)
    held = [_store(gated, 1, [1]).held]
    registered[0] = False  # (never so in a worker: here only to reach both paths)
    held.append(_store(gated, 2, [9]).held)
    for h in held:
        gated.release(h)
    assert (pinned.released, unpinned.released) == (["pinned-1"], ["unpinned-2"])
    gated.close()
    assert pinned.closed and unpinned.closed


def test_a_refused_pair_is_refused_by_the_path_it_went_to_and_nothing_is_counted():
    gated, pinned, unpinned = _gated([False])
    with pytest.raises(SpecError, match="unpinned: not a CPU spec"):
        gated.transfer(1, (GPULoadStoreSpec([0]), GPULoadStoreSpec([1])), None, None, None,
                       None, None)
    assert unpinned.jobs == [] and gated.routed == {"pinned": 0, "unpinned": 0}

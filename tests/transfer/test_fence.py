"""The worker's fence: a spec's slots are copied only into (or out of) the region it names
and only while each slot still has the generation it was handed out with. Real region,
real index over its ledger, a real worker (CPU tensors, the ``cpu`` backend)."""

from __future__ import annotations

import pytest
import torch

from tiercache.config import KVGeometry, PinningPolicy, RegionConfig
from tiercache.index.manager import OffloadingManager
from tiercache.region.ledger import IndexLedger
from tiercache.region.shared import SharedOffloadRegion
from tiercache.specs import CPULoadStoreSpec, Direction, GPULoadStoreSpec
from tiercache.transfer.worker import attach

PAGE = 4096


ON_GPU = [pytest.mark.gpu,
          pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(params=["cpu", pytest.param("auto", marks=ON_GPU),
                        pytest.param("staged", marks=ON_GPU)])
def rig(make_config, request):
    """The index over a real region and a worker: host tensors with the ``cpu`` backend, or
    (gpu marker) CUDA tensors with the ``auto`` or the ``staged`` backend (whose fence is
    checked in its native whole-transfer call) and the slice pinned."""
    config = make_config(world_size=1, kv=KVGeometry(page_bytes=(PAGE,)),
                         region=RegionConfig(capacity_bytes=None, num_blocks=4,
                                             prefault_threads=1))
    region = SharedOffloadRegion.create(config)
    index = OffloadingManager(4, ledger=IndexLedger(region.ledger_array()),
                              region_id=region.region_id)
    backend = request.param
    gpu = torch.zeros((4, PAGE), dtype=torch.uint8, device="cpu" if backend == "cpu" else "cuda")
    pinning = PinningPolicy.ALLOW_UNPINNED if backend == "cpu" else PinningPolicy.REQUIRED
    worker = attach(config, 0, [gpu], backend=backend, pinning=pinning)
    if backend == "staged":
        assert all(worker.handlers.handler(d).native for d in Direction)
    yield region, index, worker, gpu
    worker.close()
    region.close()


def run(worker, job: int, store: bool, cpu: CPULoadStoreSpec, gpu_block: int = 0) -> bool:
    gpu = GPULoadStoreSpec([gpu_block])
    (worker.submit_store(job, gpu, cpu) if store else worker.submit_load(job, cpu, gpu))
    worker.wait([job])
    (result,) = worker.get_finished()
    return result.success


def test_a_store_into_a_slot_given_away_since_copies_nothing(rig):
    """Owner 1's session ends (declared dead) while its store spec is still unused; owner 2
    gets the slot for another block. Owner 1's copy is refused: the slot keeps owner 2's
    bytes (was: written over them)."""
    region, index, worker, gpu = rig
    stale = index.prepare_store([b"one"], owner=1).store_spec
    index.end_session(1)
    fresh = index.prepare_store([b"two"], owner=2).store_spec
    assert fresh.block_ids.tolist() == stale.block_ids.tolist()  # the same slot, reused
    gpu[0] = 7
    assert run(worker, 1, True, fresh)
    gpu[0] = 99
    assert not run(worker, 2, True, stale)
    row = region.rank_array(0)[int(fresh.block_ids[0])]
    assert (row[:PAGE] == 7).all()
    index.complete_store([b"two"], owner=2)
    assert run(worker, 3, False, index.prepare_load([b"two"]), gpu_block=1)
    assert (gpu[1] == 7).all()


def test_a_load_of_a_slot_that_holds_another_block_since_is_refused(rig):
    region, index, worker, gpu = rig
    index.prepare_store([b"a"], owner=1)
    index.complete_store([b"a"], owner=1)
    load = index.prepare_load([b"a"], owner=1)
    index.end_session(1)  # its pin is gone; a store evicts "a" and takes the slot
    for i in range(4):
        index.prepare_store([b"x%d" % i], owner=2)
    assert not run(worker, 1, False, load)
    assert (gpu[0] == 0).all()  # nothing landed


def test_a_spec_of_another_region_is_refused_and_an_unfenced_one_is_the_callers(rig):
    region, index, worker, gpu = rig
    out = index.prepare_store([b"a"]).store_spec
    other = CPULoadStoreSpec(out.block_ids, out.slot_gens, region.region_id ^ 1)
    assert not run(worker, 1, True, other)
    assert run(worker, 2, True, out)
    assert run(worker, 3, True, CPULoadStoreSpec(out.block_ids))  # region 0: not fenced
    assert worker.reattach_count == 0  # no region of that identity exists: nothing to follow

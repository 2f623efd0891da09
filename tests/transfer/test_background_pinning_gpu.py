"""A worker that attaches while its slice is still being page-locked (GPU; issue 41,
"instant on"): until the slice is registered every transfer goes through the worker's
page-locked bounce buffer (``BounceBackend``), after it through the chosen backend, every byte exact both ways, also
transfers of adjacent slots (``staged`` merges their DMAs: one DMA over two registrations
fails, which is why the slice is registered whole); the stats block says PINNING, then
PINNED with the whole slice. The real ``HostPinner`` registers; the test holds the
slice's registration (an event, no sleep) so that which path each transfer takes is known
when it is submitted."""

from __future__ import annotations

import threading

import pytest
import torch

import tiercache.region.preparation as preparation
import tiercache.transfer.worker as worker_module
from tiercache.backends.bounce import BounceBackend
from tiercache.config import KVGeometry, PinningPolicy, RegionConfig
from tiercache.device.pinning import HostPinner
from tiercache.region.shared import SharedOffloadRegion
from tiercache.region.stats import PinState
from tiercache.specs import CPULoadStoreSpec, Direction, GPULoadStoreSpec
from tiercache.transfer.gated_path import GatedPath
from tiercache.transfer.worker import attach

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PAGE = 32 << 10
TENSORS = 4
NUM_BLOCKS = 256  # rows of 128 KiB: a 32 MiB slice
CHUNK_ROWS = 16  # 2 MiB chunks: 16 of them


class HeldPinner(HostPinner):
    """The real pinner; every registration after the attach's one-page probe waits for
    ``go``."""

    go = threading.Event()
    calls = 0

    def pin(self, ranges, progress=None):
        HeldPinner.calls += 1
        if HeldPinner.calls > 1:
            assert HeldPinner.go.wait(300), "the test never let the pinning go on"
        return super().pin(ranges, progress)


@pytest.mark.parametrize("backend", ["auto", "staged", "ce"])
def test_transfers_during_background_pinning_are_exact_on_either_path(
        make_config, monkeypatch, backend):
    config = make_config(world_size=1, kv=KVGeometry(page_bytes=(PAGE,) * TENSORS),
                         region=RegionConfig(capacity_bytes=None, num_blocks=NUM_BLOCKS,
                                             prefault_threads=2))
    region = SharedOffloadRegion.create(config)
    row = region.layout.row_stride
    monkeypatch.setattr(preparation, "PREPARE_CHUNK_BYTES", CHUNK_ROWS * row)
    monkeypatch.setattr(worker_module, "HostPinner", HeldPinner)
    HeldPinner.go.clear()
    HeldPinner.calls = 0
    gen = torch.Generator(device="cuda").manual_seed(41)
    caches = [torch.randint(0, 256, (2 * NUM_BLOCKS, PAGE), dtype=torch.uint8, device="cuda",
                            generator=gen) for _ in range(TENSORS)]
    original = [c[:NUM_BLOCKS].clone() for c in caches]
    worker = attach(config, 0, caches, backend=backend, pinning=PinningPolicy.REQUIRED)
    try:
        paths = {d: worker.handlers.handler(d).path for d in Direction}
        assert all(isinstance(p, GatedPath) for p in paths.values())
        snap = worker.stats.snapshot()
        assert (snap.pin_state, snap.pinned_bytes) == (PinState.PINNING, 0)
        low, high = list(range(CHUNK_ROWS)), list(range(NUM_BLOCKS - CHUNK_ROWS, NUM_BLOCKS))
        job = iter(range(1, 100))

        def move(store: bool, gpu_blocks, slots) -> None:
            gpu, cpu = GPULoadStoreSpec(gpu_blocks), CPULoadStoreSpec(slots)
            j = next(job)
            (worker.submit_store(j, gpu, cpu) if store else worker.submit_load(j, cpu, gpu))
            worker.wait([j])
            assert all(r.success for r in worker.get_finished())

        move(True, low, low)  # nothing pinned yet: through the bounce buffer
        move(True, high, high)
        assert paths[Direction.GPU_TO_CPU].routed == {"pinned": 0, "unpinned": 2}
        bounce = paths[Direction.GPU_TO_CPU].unpinned.backend
        assert isinstance(bounce, BounceBackend)
        assert bounce.bytes_bounced == 2 * CHUNK_ROWS * TENSORS * PAGE
        view = region.rank_array(0)
        for blocks in (low, high):
            for b in blocks:
                for t in range(TENSORS):
                    got = torch.from_numpy(view[b, t * PAGE:(t + 1) * PAGE].copy())
                    assert torch.equal(got, original[t][b].cpu())
        move(False, [NUM_BLOCKS + i for i in range(CHUNK_ROWS)], high)  # unpinned load
        HeldPinner.go.set()
        assert worker.preparer.wait(300)
        snap = worker.stats.snapshot()
        assert (snap.pin_state, snap.pinned_bytes) == (PinState.PINNED, NUM_BLOCKS * row)
        assert worker.pin_state is PinState.PINNED
        move(True, list(range(CHUNK_ROWS, NUM_BLOCKS - CHUNK_ROWS)),
             list(range(CHUNK_ROWS, NUM_BLOCKS - CHUNK_ROWS)))  # now all pinned
        move(False, [NUM_BLOCKS + CHUNK_ROWS + i for i in range(NUM_BLOCKS - CHUNK_ROWS)],
             list(range(CHUNK_ROWS, NUM_BLOCKS)))  # pinned load
        assert paths[Direction.GPU_TO_CPU].routed == {"pinned": 1, "unpinned": 2}
        assert paths[Direction.CPU_TO_GPU].routed == {"pinned": 1, "unpinned": 1}
        torch.cuda.synchronize()
        for t in range(TENSORS):  # every block back where the loads put it
            assert torch.equal(caches[t][NUM_BLOCKS:NUM_BLOCKS + CHUNK_ROWS],
                               original[t][NUM_BLOCKS - CHUNK_ROWS:])
            assert torch.equal(caches[t][NUM_BLOCKS + CHUNK_ROWS:], original[t][CHUNK_ROWS:])
    finally:
        HeldPinner.go.set()
        worker.close()
        region.close()

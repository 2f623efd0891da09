"""``BounceBackend`` on a GPU (issue 41, "instant on"): copies between GPU pages and host
memory that is NOT page-locked (plain numpy memory, never registered), through the backend's
own page-locked bounce buffer, byte-exact both ways: many chunks (a half far smaller than
the transfer), descriptors larger than a half (cut), host bytes outside the plan untouched,
and a store ordered after the compute stream's write it must read. The chunking itself is
tested without a GPU: tests/backends/test_bounce.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiercache.backends.base import Ordering
from tiercache.backends.bounce import BounceBackend
from tiercache.errors import BackendError
from tiercache.planning.plans import CopyPlan
from tiercache.specs import Direction
from tiercache.transfer.host_copy import HostCopyPool

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PAGE = 32 << 10
HALF = 256 << 10  # 8 pages a chunk: a 64-page transfer takes 8+ chunks
BIG = 3 * HALF + 4096  # one descriptor cut into four pieces


def _plan(direction: Direction, src, dst, sizes) -> CopyPlan:
    return CopyPlan(np.array(src, dtype=np.uint64), np.array(dst, dtype=np.uint64),
                    np.array(sizes, dtype=np.uint64), direction)


@pytest.fixture
def bounce():
    made = []

    def build() -> BounceBackend:
        backend = BounceBackend(torch.cuda.current_device(), HostCopyPool(3), half_bytes=HALF)
        made.append(backend)
        return backend

    yield build
    for backend in made:
        backend.close()


def test_pageable_rows_round_trip_exactly_through_the_bounce_buffer(bounce):
    rng = np.random.default_rng(41)
    pages, host_pages = 64, 80
    gpu = torch.randint(0, 256, (pages, PAGE), dtype=torch.uint8, device="cuda")
    big = torch.randint(0, 256, (BIG,), dtype=torch.uint8, device="cuda")
    host = np.full(host_pages * PAGE + BIG, 0x5A, dtype=np.uint8)  # pageable, unregistered
    slots = rng.permutation(host_pages)[:pages]  # scattered rows, some left untouched
    base = host.ctypes.data
    src = [gpu[i].data_ptr() for i in range(pages)] + [big.data_ptr()]
    dst = [base + int(s) * PAGE for s in slots] + [base + host_pages * PAGE]
    sizes = [PAGE] * pages + [BIG]
    stream = torch.cuda.Stream()
    store = bounce()
    store.submit(_plan(Direction.GPU_TO_CPU, src, dst, sizes), Ordering(stream))
    stream.synchronize()
    expected = np.full_like(host, 0x5A)
    gpu_host = gpu.cpu().numpy()
    for i, s in enumerate(slots):
        expected[s * PAGE:(s + 1) * PAGE] = gpu_host[i]
    expected[host_pages * PAGE:] = big.cpu().numpy()
    assert np.array_equal(host, expected)  # every page where it belongs, nothing else written
    assert store.bytes_bounced == pages * PAGE + BIG

    back = torch.zeros_like(gpu)
    big_back = torch.zeros_like(big)
    load = bounce()
    order = rng.permutation(pages)  # loaded into other places
    load.submit(_plan(Direction.CPU_TO_GPU, [dst[i] for i in order] + [dst[-1]],
                      [back[j].data_ptr() for j in range(pages)] + [big_back.data_ptr()],
                      sizes), Ordering(stream))
    stream.synchronize()
    assert torch.equal(back, gpu[torch.as_tensor(order, device="cuda")])
    assert torch.equal(big_back, big)


def test_a_store_reads_what_the_compute_stream_wrote_before_its_mark(bounce):
    gpu = torch.zeros((16, PAGE), dtype=torch.uint8, device="cuda")
    host = np.zeros(16 * PAGE, dtype=np.uint8)
    compute, copies = torch.cuda.Stream(), torch.cuda.Stream()
    mark = torch.cuda.Event()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(50_000_000)  # the write lands well after the store is submitted
        gpu.fill_(0xC3)
        mark.record(compute)
    store = bounce()
    store.submit(_plan(Direction.GPU_TO_CPU, [gpu[i].data_ptr() for i in range(16)],
                       [host.ctypes.data + i * PAGE for i in range(16)], [PAGE] * 16),
                 Ordering(copies, (mark,)))
    assert (host == 0xC3).all()  # the store returned with the written bytes in the rows


def test_close_gives_back_the_buffer_and_the_copy_threads(bounce):
    store = bounce()
    gpu = torch.ones((2, PAGE), dtype=torch.uint8, device="cuda")
    host = np.zeros(2 * PAGE, dtype=np.uint8)
    plan = _plan(Direction.GPU_TO_CPU, [gpu[0].data_ptr(), gpu[1].data_ptr()],
                 [host.ctypes.data, host.ctypes.data + PAGE], [PAGE, PAGE])
    store.submit(plan, Ordering(torch.cuda.Stream()))
    assert (host == 1).all()
    store.close()
    with pytest.raises(BackendError, match="is closed"):
        store.submit(plan, Ordering(torch.cuda.Stream()))


def test_on_a_driver_without_the_batch_api_the_dmas_run_as_ce_loop_and_it_says_so(caplog):
    """attach's unpinned path on a driver older than R570 (no ``cuMemcpyBatchAsync``): the
    bounce buffer's DMAs one ``cuMemcpyAsync`` each, a WARNING, every byte exact."""
    from tiercache.device.driver import CudaDriver

    class NoBatchDriver(CudaDriver):
        has_batch = False  # as the backend sees a driver older than R570

    pages = 24  # three chunks of eight pages
    gpu = torch.randint(0, 256, (pages, PAGE), dtype=torch.uint8, device="cuda")
    back = torch.zeros_like(gpu)
    host = np.zeros(pages * PAGE, dtype=np.uint8)
    rows = [host.ctypes.data + i * PAGE for i in range(pages)]
    stream = torch.cuda.Stream()
    made = []
    try:
        with caplog.at_level("WARNING", logger="tiercache.backends.bounce"):
            for _ in range(2):
                made.append(BounceBackend(torch.cuda.current_device(), HostCopyPool(1),
                                          driver=NoBatchDriver(), half_bytes=HALF))
        assert sum("ce_loop" in r.getMessage() for r in caplog.records) == 2
        store, load = made
        store.submit(_plan(Direction.GPU_TO_CPU, [gpu[i].data_ptr() for i in range(pages)],
                           rows, [PAGE] * pages), Ordering(stream))
        assert np.array_equal(host, gpu.cpu().numpy().ravel())
        load.submit(_plan(Direction.CPU_TO_GPU, rows, [back[i].data_ptr() for i in range(pages)],
                          [PAGE] * pages), Ordering(stream))
        stream.synchronize()
        assert torch.equal(back, gpu)
    finally:
        for backend in made:
            backend.close()

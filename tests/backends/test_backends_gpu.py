"""GPU backends, byte-exact against a numpy reference, and stream ordering.

Each test draws fresh random data, poisons the destination, runs a plan through a
backend and compares every byte of both buffers with the plan applied in numpy: the
copied bytes must match and every other byte must keep its poison. Run on a GPU
machine: ``python -m pytest -q -m gpu tests/backends/test_backends_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from tiercache.backends.base import Ordering  # noqa: E402
from tiercache.backend_kind import BackendKind  # noqa: E402
from tiercache.errors import BackendError  # noqa: E402
from tiercache.planning.plans import CopyPlan, PlanForm  # noqa: E402
from tiercache.specs import Direction  # noqa: E402

POISON = 0xA5
GPU_BYTES = 24 << 20
HOST_BYTES = 24 << 20


def _ce(**kwargs):
    from tiercache.backends.ce import CeBackend

    return CeBackend(0, **kwargs)


def _ce_stream():
    from tiercache.device.driver import SrcAccessOrder

    return _ce(load_access_order=SrcAccessOrder.STREAM)


def _ce_loop():
    from tiercache.backends.ce import CeLoopBackend

    return CeLoopBackend(0)


def _kernel():
    from tiercache.backends.kernel import KernelBackend

    return KernelBackend(0, num_programs=7)


def _staged(**kwargs):
    from tiercache.backends.staged.backend import StagedBackend

    return StagedBackend(0, **kwargs)


# name -> factory of one backend (one per direction is built)
BUILDERS = {
    "ce": _ce,
    "ce-stream": _ce_stream,
    "ce_loop": _ce_loop,
    "kernel": _kernel,
    "staged": _staged,
    # small chunks: many chunks, the ring wraps several times
    "staged-small": lambda: _staged(chunk_bytes=96 << 10, num_ring_slots=2,
                                    direct_bytes=64 << 10),
    "staged-odd": lambda: _staged(chunk_bytes=160 << 10, num_ring_slots=3,
                                  direct_bytes=20 << 10),
}
BACKENDS = list(BUILDERS)
# block-level staged: built with the rank's geometry (as a worker builds it)
PLANNED = {
    "staged-blocks": lambda geometry: _staged(geometry=geometry),
    # a row image (4 x 32 KiB x factor) or two per chunk: the ring wraps every chunk or two
    "staged-blocks-small": lambda geometry: _staged(geometry=geometry, chunk_bytes=320 << 10,
                                                    num_ring_slots=2, direct_bytes=64 << 10),
    # the same pipeline issued from Python on the caller's thread (the native loop off)
    "staged-blocks-python": lambda geometry: _staged(geometry=geometry, native=False),
    # as many pack programs as tensor columns: one program per column strides over every
    # pair of a chunk (by default the block kernel launches one per (pair, tensor))
    "staged-blocks-strided": lambda geometry: _staged(geometry=geometry, pack_programs=4),
    # every transfer of these tests zero-copy: the kernel moves pages to / from the host rows
    "staged-blocks-zero-copy": lambda geometry: _staged(geometry=geometry,
                                                        zero_copy_bytes=64 << 20),
}


def _build(name: str, direction: Direction, planner=None):
    if name in PLANNED:
        backend = PLANNED[name](planner.geometry)
        assert backend.plan_form is PlanForm.BLOCKS  # the block layout accepted the geometry
        if name == "staged-blocks-strided":  # one program per column: every launch strides
            assert backend._blocks[1].max_pair_programs == 1
        assert (backend.zero_copy_pairs > 0) == (name == "staged-blocks-zero-copy")
        return backend
    return BUILDERS[name]()


def _copy(backend, plan: CopyPlan, stream):
    """``plan`` on ``stream`` alone (no events), as the tests before the handlers need."""
    return backend.submit(plan, Ordering(stream))


@pytest.fixture(scope="module")
def buffers():
    gpu = torch.empty(GPU_BYTES, dtype=torch.uint8, device="cuda")
    host = torch.empty(HOST_BYTES, dtype=torch.uint8, pin_memory=True)
    yield gpu, host
    torch.cuda.synchronize()


def _plan_offsets(rng, pages: list[int], num_blocks: int, row_pad: int, merge: bool):
    """(gpu offsets, host offsets, sizes): tensors of pages in padded host rows, random
    GPU and host blocks; with ``merge`` pairs of adjacent blocks become one descriptor."""
    row_stride = sum(pages) + row_pad
    gpu_tensor = max(pages) * 2 * num_blocks + 512
    gpu_blocks = rng.permutation(2 * num_blocks)[:num_blocks]
    rows = rng.permutation(2 * num_blocks)[:num_blocks]
    if merge:  # consecutive block pairs, tensor pages adjacent in the row
        gpu_blocks = np.repeat(rng.permutation(num_blocks)[: num_blocks // 2] * 2, 2) + np.tile([0, 1], num_blocks // 2)
    g, h, s = [], [], []
    for t, page in enumerate(pages):
        for k in range(gpu_blocks.size):
            g.append(t * gpu_tensor + 64 * t + int(gpu_blocks[k]) * page)
            h.append(int(rows[k]) * row_stride + sum(pages[:t]))
            s.append(page)
    g, h, s = (np.array(a, dtype=np.uint64) for a in (g, h, s))
    assert int((g + s).max()) <= GPU_BYTES and int((h + s).max()) <= HOST_BYTES
    if merge and len(pages) == 1:  # single tensor, rows adjacent too: merge on both sides
        order = np.argsort(g)
        g, h, s = g[order], h[order], s[order]
        rows_adjacent = (g[1:] == g[:-1] + s[:-1]) & (h[1:] == h[:-1] + s[:-1])
        keep = np.ones(g.size, dtype=bool)
        keep[1:] = ~rows_adjacent
        starts = np.flatnonzero(keep)
        s = np.add.reduceat(s, starts).astype(np.uint64)
        g, h = g[starts], h[starts]
    return g, h, s


def _apply(src: np.ndarray, dst: np.ndarray, src_off, dst_off, sizes) -> np.ndarray:
    out = dst.copy()
    for a, b, n in zip(src_off.tolist(), dst_off.tolist(), sizes.tolist()):
        out[b:b + n] = src[a:a + n]
    return out


def _roundtrip(name: str, pages: list[int], num_blocks: int, row_pad: int, merge: bool,
               buffers, seed: int, host_order: bool = False) -> None:
    gpu, host = buffers
    rng = np.random.default_rng(seed)
    g_off, h_off, sizes = _plan_offsets(rng, pages, num_blocks, row_pad, merge)
    if host_order:  # the planner's order: staged takes it without sorting
        order = np.argsort(h_off)
        g_off, h_off, sizes = g_off[order], h_off[order], sizes[order]
    stream = torch.cuda.Stream()
    gbase, hbase = np.uint64(gpu.data_ptr()), np.uint64(host.data_ptr())

    for direction in Direction:  # the source random, the destination poisoned
        src_mem, dst_mem = direction.src_dst(gpu, host)
        src_off, dst_off = direction.src_dst(g_off + gbase, h_off + hbase)
        data = rng.integers(0, 256, src_mem.numel(), dtype=np.uint8)
        src_mem.copy_(torch.from_numpy(data))
        dst_mem.fill_(POISON)
        torch.cuda.synchronize()
        backend = _build(name, direction)
        token = _copy(backend, CopyPlan(src_off, dst_off, sizes, direction), stream)
        stream.synchronize()
        del token
        expected = _apply(data, np.full(dst_mem.numel(), POISON, np.uint8),
                          *direction.src_dst(g_off, h_off), sizes)
        bad = np.flatnonzero(dst_mem.cpu().numpy() != expected)
        assert bad.size == 0, f"{name} {direction.label}: {bad.size} bytes differ, first at " \
                              f"{bad[0]}"
        backend.close()


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("pages,num_blocks,row_pad,merge", [
    ([32768] * 8, 24, 0, False),           # Llama-like pages, rows contiguous
    ([16384, 4096, 8192], 20, 4096, False),  # mixed pages, padded rows
    ([1000, 3000, 24], 16, 200, False),      # odd sizes: narrow accesses, odd runs
    ([65536], 32, 0, True),                  # one tensor, merged descriptors of 128 KiB+
    ([4096] * 4, 40, 0, True),               # merged pairs across several tensors
])
def test_backend_is_byte_exact(name, pages, num_blocks, row_pad, merge, buffers):
    _roundtrip(name, pages, num_blocks, row_pad, merge, buffers,
               seed=hash((name, tuple(pages), num_blocks)) % (1 << 31))


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("pages,num_blocks,row_pad", [
    ([32768] * 8, 24, 0),                  # whole rows: one DMA per row
    ([1000, 3000, 24], 16, 200),           # odd sizes, padded rows: runs need alignment padding
])
def test_backend_is_byte_exact_in_host_order(name, pages, num_blocks, row_pad, buffers):
    _roundtrip(name, pages, num_blocks, row_pad, False, buffers,
               seed=hash((name, tuple(pages), "host")) % (1 << 31), host_order=True)


@pytest.mark.parametrize("name", BACKENDS)
def test_load_sees_data_after_queued_compute_writes(name, buffers):
    """Queued compute-stream writes to the destination land before the load's bytes."""
    gpu, host = buffers
    rng = np.random.default_rng(11)
    g_off, h_off, sizes = _plan_offsets(rng, [32768] * 4, 16, 0, False)
    host_data = rng.integers(0, 256, HOST_BYTES, dtype=np.uint8)
    host.copy_(torch.from_numpy(host_data))
    gpu.fill_(POISON)
    torch.cuda.synchronize()
    compute, transfer = torch.cuda.Stream(), torch.cuda.Stream()
    backend = _build(name, Direction.CPU_TO_GPU)
    with torch.cuda.stream(compute):
        torch.cuda._sleep(20_000_000)  # ~10 ms: the load is submitted long before the write runs
        gpu.fill_(0x11)  # e.g. zeroing freshly allocated blocks
    transfer.wait_stream(compute)  # what the handler does for every transfer
    token = _copy(backend, CopyPlan(h_off + np.uint64(host.data_ptr()),
                                    g_off + np.uint64(gpu.data_ptr()), sizes,
                                    Direction.CPU_TO_GPU), transfer)
    transfer.synchronize()
    del token
    expected = _apply(host_data, np.full(GPU_BYTES, 0x11, np.uint8), h_off, g_off, sizes)
    assert np.array_equal(gpu.cpu().numpy(), expected)
    backend.close()


@pytest.mark.parametrize("name", BACKENDS)
def test_store_reads_data_written_by_queued_compute(name, buffers):
    gpu, host = buffers
    rng = np.random.default_rng(12)
    g_off, h_off, sizes = _plan_offsets(rng, [32768] * 4, 16, 0, False)
    gpu.fill_(POISON)
    host.fill_(0)
    torch.cuda.synchronize()
    written = torch.from_numpy(rng.integers(0, 256, GPU_BYTES, dtype=np.uint8)).cuda()
    compute, transfer = torch.cuda.Stream(), torch.cuda.Stream()
    backend = _build(name, Direction.GPU_TO_CPU)
    with torch.cuda.stream(compute):
        torch.cuda._sleep(20_000_000)
        gpu.copy_(written)  # the model writing KV
    transfer.wait_stream(compute)
    token = _copy(backend, CopyPlan(g_off + np.uint64(gpu.data_ptr()),
                                    h_off + np.uint64(host.data_ptr()), sizes,
                                    Direction.GPU_TO_CPU), transfer)
    transfer.synchronize()
    del token
    expected = _apply(written.cpu().numpy(), np.zeros(HOST_BYTES, np.uint8), g_off, h_off, sizes)
    assert np.array_equal(host.numpy(), expected)
    backend.close()


def test_legacy_default_stream_is_refused(buffers):
    from tiercache.backends.ce import CeBackend

    gpu, host = buffers
    plan = CopyPlan(np.array([gpu.data_ptr()], np.uint64), np.array([host.data_ptr()], np.uint64),
                    np.array([4096], np.uint64), Direction.GPU_TO_CPU)
    with pytest.raises(BackendError, match="legacy default stream"):
        _copy(CeBackend(0), plan, torch.cuda.default_stream())


def test_auto_chooses_a_copy_engine_path_and_says_why(buffers):
    from tiercache.backends import BackendContext
    from tiercache.backends.auto import AutoBackend, create
    from tiercache.pages import PageArray
    from tiercache.device.streams import CudaStreams

    gpu, host = buffers
    page, tensors, blocks = 32768, 8, 32
    gpu_pages = tuple(PageArray(gpu.data_ptr() + t * blocks * page, blocks, page, page)
                      for t in range(tensors))
    cpu_pages = tuple(PageArray(host.data_ptr() + t * page, blocks, tensors * page, page)
                      for t in range(tensors))
    for direction in Direction:
        backend = create(BackendContext(direction, gpu_pages, cpu_pages, torch.device("cuda", 0),
                                        True, CudaStreams("cuda:0")))
        assert isinstance(backend, AutoBackend)
        assert backend.choice.kind in (BackendKind.CE, BackendKind.STAGED)
        assert backend.kind is backend.choice.kind  # what the stats block records
        assert "GB/s" in backend.choice.reason and len(backend.choice.rates_gbps) == 2
        assert {kind for kind, _ in backend.choice.rates_gbps} == {BackendKind.CE,
                                                                    BackendKind.STAGED}
        backend.close()


def test_ce_on_a_driver_without_the_batch_api_runs_as_ce_loop_and_says_so(buffers, caplog):
    """``ce.create`` on such a driver: CE_LOOP (the kind the stats block records), a
    WARNING naming the direction, and byte-exact copies through the loop."""
    from tiercache.backends import BackendContext
    from tiercache.backends.ce import CeLoopBackend, create
    from tiercache.device.driver import CudaDriver
    from tiercache.device.streams import CudaStreams
    from tiercache.pages import PageArray

    class NoBatchDriver(CudaDriver):
        has_batch = False  # a driver older than R570, as ce.create sees it

    gpu, host = buffers
    pages = (PageArray(gpu.data_ptr(), 8, 4096, 4096),)
    rows = (PageArray(host.data_ptr(), 8, 4096, 4096),)
    context = BackendContext(Direction.CPU_TO_GPU, pages, rows, torch.device("cuda", 0), True,
                             CudaStreams("cuda:0"))
    with caplog.at_level("WARNING", logger="tiercache.backends.ce"):
        backend = create(context, driver=NoBatchDriver())
    assert isinstance(backend, CeLoopBackend) and backend.kind is BackendKind.CE_LOOP
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "cpu_to_gpu: backend 'ce' runs as 'ce_loop'" in \
        warnings[0].getMessage()
    host_data = torch.randint(0, 256, (8 * 4096,), dtype=torch.uint8)
    host[:8 * 4096].copy_(host_data)
    gpu.fill_(POISON)
    stream = torch.cuda.Stream()
    order = np.array([3, 0, 5], np.uint64)
    plan = CopyPlan(np.uint64(host.data_ptr()) + order * np.uint64(4096),
                    np.uint64(gpu.data_ptr()) + np.arange(3, dtype=np.uint64) * np.uint64(4096),
                    np.full(3, 4096, np.uint64), Direction.CPU_TO_GPU)
    token = _copy(backend, plan, stream)
    stream.synchronize()
    del token
    got = gpu[:3 * 4096].cpu().view(3, 4096)
    for i, row in enumerate(order.tolist()):
        assert torch.equal(got[i], host_data.view(8, 4096)[row])


def _handlers(name: str, gpu, host, tensors: int, page: int, gpu_blocks: int, cpu_blocks: int,
              factor: int):
    """Both handlers over tensors of pages in ``gpu`` and region-like rows in ``host``."""
    from tiercache.transfer.wiring import build_handlers
    from tiercache.region.layout import RegionLayout
    from tiercache.pages import PageArray
    from tiercache.planning.planner import TransferPlanner
    from tiercache.device.streams import CudaStreams

    layout = RegionLayout(1, cpu_blocks, (page,) * tensors, block_size_factor=factor)
    gpu_pages = [PageArray(gpu.data_ptr() + t * gpu_blocks * page, gpu_blocks, page, page)
                 for t in range(tensors)]
    cpu_pages = [PageArray(host.data_ptr() + layout.page_offsets[t], cpu_blocks,
                           layout.row_stride, page, pages_per_block=factor)
                 for t in range(tensors)]
    planner = TransferPlanner(gpu_pages, cpu_pages, block_size_factor=factor)
    backends = {d: _build(name, d, planner) for d in Direction}
    handlers = build_handlers(planner, backends, CudaStreams("cuda:0"))
    return handlers, layout


def _page_pairs(layout, gpu_ids, cpu_ids, tensors: int, page: int, factor: int):
    """(gpu offset, host offset) of every page the transfer moves."""
    pairs = []
    for t in range(tensors):
        for i, g in enumerate(gpu_ids):
            cpu_block, sub = cpu_ids[i // factor], i % factor
            pairs.append((t * 64 * page + g * page,
                          cpu_block * layout.row_stride + layout.page_offsets[t] + sub * page))
    return pairs


@pytest.mark.parametrize("name", ["ce", "ce_loop", "kernel", "staged", "staged-small",
                                  "staged-blocks", "staged-blocks-small",
                                  "staged-blocks-python", "staged-blocks-strided",
                                  "staged-blocks-zero-copy"])
@pytest.mark.parametrize("factor", [1, 2])  # 1: the planner emits host order (page by page)
def test_handlers_order_transfers_after_queued_compute(name, factor, buffers):
    """Through the real handlers: a load submitted after queued compute writes to its
    blocks sees the loaded data; a store submitted after queued writes stores them."""
    from tiercache.specs import CPULoadStoreSpec, GPULoadStoreSpec

    gpu, host = buffers
    tensors, page = 4, 32768
    rng = np.random.default_rng(21)
    handlers, layout = _handlers(name, gpu, host, tensors, page, gpu_blocks=64, cpu_blocks=32,
                                 factor=factor)
    gpu_ids = rng.permutation(64)[:16].tolist()
    cpu_ids = rng.permutation(32)[:16 // factor].tolist()
    pairs = _page_pairs(layout, gpu_ids, cpu_ids, tensors, page, factor)
    compute = torch.cuda.Stream()

    host_data = rng.integers(0, 256, HOST_BYTES, dtype=np.uint8)
    host.copy_(torch.from_numpy(host_data))
    gpu.fill_(POISON)
    torch.cuda.synchronize()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(20_000_000)
        gpu.fill_(0x11)
        assert handlers.transfer_async(1, (CPULoadStoreSpec(cpu_ids), GPULoadStoreSpec(gpu_ids)))
    handlers.wait([1])
    got = gpu.cpu().numpy()
    for g, h in pairs:
        assert np.array_equal(got[g:g + page], host_data[h:h + page])
    assert int(got[64 * page * tensors]) == 0x11  # outside the plan: the compute write

    written = torch.from_numpy(rng.integers(0, 256, GPU_BYTES, dtype=np.uint8)).cuda()
    host.fill_(0)
    torch.cuda.synchronize()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(20_000_000)
        gpu.copy_(written)
        assert handlers.transfer_async(2, (GPULoadStoreSpec(gpu_ids), CPULoadStoreSpec(cpu_ids)))
    handlers.wait([2])
    want, got = written.cpu().numpy(), host.numpy()
    for g, h in pairs:
        assert np.array_equal(got[h:h + page], want[g:g + page])
    results = handlers.get_finished()
    assert sorted(r.job_id for r in results) == [1, 2] and all(r.success for r in results)
    assert all(r.transfer_size == len(pairs) * page for r in results)
    handlers.shutdown()


@pytest.mark.parametrize("name", ["staged-blocks", "staged-blocks-small", "staged-blocks-python",
                                  "staged-blocks-zero-copy"])
def test_block_level_mid_block_load_writes_only_its_pages(name, buffers):
    """block_size_factor 2, a load starting at the second sub-page of its first CPU block
    (vLLM's block_indices): the pages land byte-exact and no other GPU byte changes."""
    from tiercache.specs import CPULoadStoreSpec, GPULoadStoreSpec

    gpu, host = buffers
    tensors, page, factor = 4, 32768, 2
    rng = np.random.default_rng(5)
    handlers, layout = _handlers(name, gpu, host, tensors, page, gpu_blocks=64, cpu_blocks=32,
                                 factor=factor)
    # the native loop's handlers take whole transfers in one native call; Python's plan
    assert handlers.cpu_to_gpu_handler.native == (name != "staged-blocks-python")
    gpu_ids = rng.permutation(64)[:7].tolist()
    cpu_ids = rng.permutation(32)[:4].tolist()  # sub-pages 1..7 of 4 CPU blocks
    host_data = rng.integers(0, 256, HOST_BYTES, dtype=np.uint8)
    host.copy_(torch.from_numpy(host_data))
    gpu.fill_(POISON)
    torch.cuda.synchronize()
    spec = GPULoadStoreSpec(gpu_ids, group_sizes=[7], block_indices=[1])
    assert handlers.transfer_async(1, (CPULoadStoreSpec(cpu_ids), spec))
    handlers.wait([1])
    got = gpu.cpu().numpy()
    expected = np.full_like(got, POISON)
    for t in range(tensors):
        for i, g in enumerate(gpu_ids):
            cpu_block, sub = cpu_ids[(i + 1) // factor], (i + 1) % factor
            h = cpu_block * layout.row_stride + layout.page_offsets[t] + sub * page
            expected[t * 64 * page + g * page:][:page] = host_data[h:h + page]
    assert np.array_equal(got, expected)
    (result,) = handlers.get_finished()
    assert result.success and result.transfer_size == 7 * tensors * page
    handlers.shutdown()


@pytest.mark.parametrize("name", ["staged-blocks", "staged-blocks-small", "staged-blocks-strided",
                                  "staged-blocks-zero-copy"])
def test_back_to_back_transfers_through_the_chunk_loop_finish_in_order(name, buffers):
    """Transfers submitted without waiting (the native loop issues them while the caller
    submits more): stores of random blocks, then loads of them into other GPU blocks,
    results in submission order, every page byte-exact, the loop's tables reused safely."""
    from tiercache.specs import CPULoadStoreSpec, GPULoadStoreSpec

    gpu, host = buffers
    tensors, page = 4, 32768
    rng = np.random.default_rng(8)
    handlers, layout = _handlers(name, gpu, host, tensors, page, gpu_blocks=64, cpu_blocks=32,
                                 factor=1)
    assert handlers.gpu_to_cpu_handler.path.backend.native
    assert handlers.gpu_to_cpu_handler.native and handlers.cpu_to_gpu_handler.native
    written = torch.from_numpy(rng.integers(0, 256, GPU_BYTES, dtype=np.uint8)).cuda()
    gpu.copy_(written)
    host.fill_(0)
    torch.cuda.synchronize()
    jobs, loads = [], []
    for k in range(8):  # stores of 4 blocks each into rows 4k..4k+3, then loads of them
        src = rng.permutation(32)[:4].tolist()
        rows = list(range(4 * k, 4 * k + 4))
        assert handlers.transfer_async(k, (GPULoadStoreSpec(src), CPULoadStoreSpec(rows)))
        jobs.append(k)
        loads.append((src, rows))
    handlers.wait(jobs)  # the two directions are not ordered with each other (the engine's job)
    targets = (32 + rng.permutation(32)).reshape(8, 4).tolist()  # no GPU block loaded twice
    for k, (src, rows) in enumerate(loads):
        dst = targets[k]
        assert handlers.transfer_async(100 + k, (CPULoadStoreSpec(rows), GPULoadStoreSpec(dst)))
        jobs.append(100 + k)
        loads[k] = (src, dst)
    results = []
    while len(results) < len(jobs):
        results += handlers.get_finished()
    assert [r.job_id for r in results if r.transfer_type is Direction.GPU_TO_CPU] == jobs[:8]
    assert [r.job_id for r in results if r.transfer_type is Direction.CPU_TO_GPU] == jobs[8:]
    assert all(r.success and r.transfer_time > 0 for r in results)
    for h in (handlers.gpu_to_cpu_handler, handlers.cpu_to_gpu_handler):  # how they moved
        assert h.path.backend.chunk_loop.stamps().zero_copy == \
            (name == "staged-blocks-zero-copy")
    want, got = written.cpu().numpy(), gpu.cpu().numpy()
    for src, dst in loads:
        for t in range(tensors):
            for a, b in zip(src, dst):
                base = t * 64 * page
                assert np.array_equal(got[base + b * page:][:page], want[base + a * page:][:page])
    handlers.shutdown()


def test_chunk_loop_validation_refuses_bad_ids_with_the_planners_message(buffers):
    """The native path validates in C; a refusal raises the planner's SpecError, nothing
    is enqueued, and the handler goes on with the next transfer."""
    from tiercache.errors import SpecError
    from tiercache.specs import CPULoadStoreSpec, GPULoadStoreSpec

    gpu, host = buffers
    handlers, layout = _handlers("staged-blocks", gpu, host, 4, 32768, gpu_blocks=64,
                                 cpu_blocks=32, factor=1)
    with pytest.raises(SpecError, match="CPU block id 32 in group 0 is out of range"):
        handlers.transfer_async(1, (GPULoadStoreSpec([1, 2]), CPULoadStoreSpec([3, 32])))
    with pytest.raises(SpecError, match="repeat|twice|more than once"):
        handlers.transfer_async(2, (GPULoadStoreSpec([1, 2]), CPULoadStoreSpec([3, 3])))
    assert handlers.gpu_to_cpu_handler.num_in_flight == 0
    assert handlers.transfer_async(3, (GPULoadStoreSpec([1, 2]), CPULoadStoreSpec([3, 4])))
    handlers.wait([3])
    (result,) = handlers.get_finished()
    assert result.job_id == 3 and result.success
    handlers.shutdown()


def test_a_transfer_from_a_thread_without_a_context_gets_the_loops(buffers):
    """The engine may submit from a thread that never made a CUDA call: the native call
    makes the loop's context current there before it marks the compute stream (a mark
    on no context would refuse the transfer), and the bytes land."""
    import threading

    from tiercache.specs import CPULoadStoreSpec, GPULoadStoreSpec

    gpu, host = buffers
    tensors, page = 4, 32768
    handlers, layout = _handlers("staged-blocks", gpu, host, tensors, page, gpu_blocks=64,
                                 cpu_blocks=32, factor=1)
    assert handlers.gpu_to_cpu_handler.native
    written = torch.from_numpy(np.random.default_rng(11).integers(
        0, 256, GPU_BYTES, dtype=np.uint8)).cuda()
    gpu.copy_(written)
    torch.cuda.synchronize()
    assert handlers.transfer_async(1, (GPULoadStoreSpec([0]), CPULoadStoreSpec([0])))
    handlers.wait([1])  # the pools now hold a stream and events: the thread creates none
    got: list[object] = []

    def submit() -> None:
        from tiercache.device.driver import CudaDriver

        got.append(CudaDriver().has_current_context())
        got.append(handlers.transfer_async(2, (GPULoadStoreSpec([5, 9]), CPULoadStoreSpec([3, 4]))))

    thread = threading.Thread(target=submit)
    thread.start()
    thread.join()
    assert got == [False, True]
    handlers.wait([2])
    results = handlers.get_finished()
    assert [r.success for r in results] == [True, True]
    want, region = written.cpu().numpy(), host.cpu().numpy()
    for t in range(tensors):
        for block, row in ((5, 3), (9, 4)):
            h = row * layout.row_stride + layout.page_offsets[t]
            assert np.array_equal(region[h:h + page], want[t * 64 * page + block * page:][:page])
    handlers.shutdown()

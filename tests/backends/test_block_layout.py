"""Block staging layout against the per-page plan, byte for byte, on host memory.

Every case runs twice over copies of the same buffers: once as the existing planner's
descriptors (``TransferPlanner.plan``), once as the block layout (pack pages into a
poisoned slot from the pair table, DMA the chunk's runs to a poisoned region; loads
the reverse), see ``tests/support/block_reference.py``. The kernels themselves are in
test_block_kernel.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from block_reference import (
    CPU_BASE, GPU_BASE, HypDraw, check_case, draw_case, fill,
)
from tiercache.specs import Direction
from tiercache.backends.staged.block_layout import SLOT_ALIGN, BlockStaging
from tiercache.errors import BackendError
from tiercache.pages import PageArray
from tiercache.region.layout import RegionLayout
from tiercache.specs import CPULoadStoreSpec, GPULoadStoreSpec
from tiercache.planning.planner import TransferPlanner


def _run(case, seed: int = 0):
    gpu, cpu = case.page_arrays(GPU_BASE, CPU_BASE)
    planner = TransferPlanner(gpu, cpu, case.factor, case.groups)
    staging = BlockStaging.of_geometry(planner.geometry, case.chunk_bytes, case.load_whole_rows,
                                       case.break_rows)
    layout = staging.layout(planner.block_plan(case.direction, case.spec))
    gpu_data = np.empty(case.gpu_bytes, dtype=np.uint8)
    cpu_data = np.empty(case.cpu_bytes, dtype=np.uint8)
    fill(case, gpu_data, cpu_data, seed)
    check_case(case, layout, planner, gpu, cpu, GPU_BASE, CPU_BASE, gpu_data, cpu_data)
    return staging, layout


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_layout_moves_the_plans_bytes_and_no_other(data):
    case = draw_case(HypDraw(data))
    staging, layout = _run(case)
    pitch = {g: int(staging.pitch[g]) for g in range(staging.num_groups)}
    for k in range(layout.num_chunks):  # every staged row inside its chunk's slot
        first, count = layout.pair_range(k)
        rows = layout.pairs[:, first:first + count]
        assert count > 0
        assert all(s + pitch[g] <= case.chunk_bytes for s, g in zip(rows[1], rows[3]))
    assert layout.num_pairs == len(case.gpu_spec)
    assert np.all(layout.pairs[1] % SLOT_ALIGN == 0)  # rows start aligned: 16-byte accesses


def _rank(num_tensors: int, page: int, factor: int, gpu_blocks: int = 1024,
          cpu_blocks: int = 512, row_pad: int = 0):
    gpu = [PageArray(GPU_BASE + t * (1 << 32), gpu_blocks, page, page)
           for t in range(num_tensors)]
    region = RegionLayout(1, cpu_blocks, (page,) * num_tensors, factor)
    cpu = [PageArray(CPU_BASE + region.page_offsets[t], cpu_blocks, region.row_stride + row_pad,
                     page, factor) for t in range(num_tensors)]
    return TransferPlanner(gpu, cpu, factor)


def _layout(planner, gpu_ids, cpu_ids, chunk_bytes=32 << 20, store=True, block_index=0,
            load_whole_rows=False, break_rows=0):
    staging = BlockStaging.of_geometry(planner.geometry, chunk_bytes, load_whole_rows,
                                       break_rows)
    gpu_spec = GPULoadStoreSpec(gpu_ids, None, [block_index])
    cpu_spec = CPULoadStoreSpec(cpu_ids)
    if store:
        return staging.layout(planner.block_plan(Direction.GPU_TO_CPU, (gpu_spec, cpu_spec)))
    return staging.layout(planner.block_plan(Direction.CPU_TO_GPU, (cpu_spec, gpu_spec)))


def _sizes(layout) -> tuple[int, ...]:
    return (layout.pairs.size, layout.pair_first.size, layout.dma_host.size,
            layout.dma_first.size)


@pytest.mark.parametrize("page", [16 << 10, 32 << 10, 64 << 10])
def test_per_transfer_arrays_scale_with_blocks_not_pages(page):
    rng = np.random.default_rng(page)
    gpu_ids, cpu_ids = rng.permutation(1024)[:256], rng.permutation(512)[:256]
    wide = _layout(_rank(64, page, 1), gpu_ids, cpu_ids)
    narrow = _layout(_rank(4, page, 1), gpu_ids, cpu_ids)
    assert wide.pairs.shape == (4, 256)  # one pair per GPU block, whatever the tensor count
    assert wide.num_rows == 256 and wide.dma_host.size <= 256
    chunks = wide.num_chunks  # rows of 64 x page bytes in 32 MiB chunks
    assert chunks == -(-256 // ((32 << 20) // (64 * page)))
    assert wide.pair_first.size == wide.dma_first.size == chunks + 1
    assert _sizes(narrow)[0] == _sizes(wide)[0] and narrow.dma_host.size <= 256
    assert wide.num_bytes == 256 * 64 * page


def test_block_size_factor_with_a_mid_block_load_is_rows_plus_partial_ends():
    planner = _rank(64, 32 << 10, 4)
    rng = np.random.default_rng(4)
    n, skip = 1021, 1  # 1 + 1021 = 1022 sub-pages: 256 rows, the first and last partial
    layout = _layout(planner, rng.permutation(1024)[:n], rng.permutation(512)[:256],
                     store=False, block_index=4 * 7 + skip)
    assert layout.pairs.shape == (4, n) and layout.num_rows == 256
    # full rows are one run each; a partial row is one run per tensor
    assert layout.dma_host.size <= (256 - 2) + 2 * 64
    assert layout.num_bytes == n * 64 * (32 << 10)


@pytest.mark.parametrize("blocks", [1, 3, 255])
def test_whole_row_loads_are_one_dma_per_row_and_stores_never_are(blocks):
    planner = _rank(64, 32 << 10, 4)
    rng = np.random.default_rng(blocks)
    rows = -(-(blocks + 1) // 4)  # a mid-block load: sub-page 1 onwards
    gpu_ids, cpu_ids = rng.permutation(1024)[:blocks], rng.permutation(512)[:rows]
    whole = _layout(planner, gpu_ids, cpu_ids, store=False, block_index=1, load_whole_rows=True)
    assert whole.num_rows == rows and whole.dma_host.size <= rows
    assert whole.num_bytes == rows * 64 * 4 * (32 << 10)  # whole rows read, pages unpacked only
    exact = _layout(planner, gpu_ids, cpu_ids, store=False, block_index=1)
    assert exact.num_bytes == blocks * 64 * (32 << 10) and exact.dma_host.size >= 64
    np.testing.assert_array_equal(whole.pairs, exact.pairs)
    store = _layout(planner, gpu_ids, cpu_ids, store=True, block_index=1, load_whole_rows=True)
    assert store.num_bytes == exact.num_bytes  # the policy never widens a store


def test_adjacent_rows_merge_into_one_dma_per_chunk_and_padded_rows_do_not():
    planner = _rank(8, 4096, 1)  # rows of 32 KiB, no padding: images of rows r, r+1 meet
    layout = _layout(planner, np.arange(100, 164), np.arange(10, 74), chunk_bytes=1 << 20)
    assert layout.num_chunks == 2 and layout.dma_host.size == 2
    assert layout.dma_bytes.tolist() == [1 << 20, 1 << 20]
    padded = _layout(_rank(8, 4096, 1, row_pad=256), np.arange(100, 164), np.arange(10, 74),
                     chunk_bytes=1 << 20)
    assert padded.dma_host.size == 64  # padding between rows is never written


@pytest.mark.parametrize("store", [True, False])
def test_no_dma_runs_into_a_row_where_a_registration_begins(store):
    """A slice registered in pieces (RegionLayout.registrations, every ``break_rows``
    rows): one DMA over two registrations fails on the GPU (CUDA_ERROR_INVALID_VALUE), so
    adjacent rows merge only within a piece."""
    planner = _rank(8, 4096, 1)  # rows of 32 KiB, no padding: images of rows r, r+1 meet
    whole = _layout(planner, np.arange(100, 164), np.arange(10, 74), store=store)
    assert whole.dma_host.size == 1  # 64 adjacent rows, one DMA
    cut = _layout(planner, np.arange(100, 164), np.arange(10, 74), store=store, break_rows=16)
    assert cut.num_bytes == whole.num_bytes
    row = 32 << 10
    # pieces begin at slots 16, 32, 48, 64: rows 10..15 | 16..31 | 32..47 | 48..63 | 64..73
    assert cut.dma_bytes.tolist() == [6 * row, 16 * row, 16 * row, 16 * row, 10 * row]
    starts = (cut.dma_host.astype(np.int64) - int(whole.dma_host[0])) // row + 10
    assert starts.tolist() == [10, 16, 32, 48, 64]


def test_whole_row_loads_merge_adjacent_rows_of_a_group_whose_pitch_is_not_the_others():
    """Groups of different pitches (no uniform one): a whole-row load of one group's
    adjacent rows merges them per chunk, as any neighbours continuing each other on both
    sides (the loop does the same, test_native_loop)."""
    region = RegionLayout(1, 8, (256,) * 5, 1)  # rows of 1280 bytes
    gpu = [PageArray(GPU_BASE + t * (1 << 20), 8, 256, 256) for t in range(5)]
    cpu = [PageArray(CPU_BASE + region.page_offsets[t], 8, region.row_stride, 256)
           for t in range(5)]
    planner = TransferPlanner(gpu, cpu, 1, [[0, 4], [1, 2, 3]])  # pitches 1280 and 768
    staging = BlockStaging.of_geometry(planner.geometry, 2 * 1280, load_whole_rows=True)
    assert staging.pitch.tolist() == [1280, 768]
    spec = (CPULoadStoreSpec([3, 4, 5, 6, 7]), GPULoadStoreSpec([0, 1, 2, 3, 4], [5, 0], [0, 0]))
    layout = staging.layout(planner.block_plan(Direction.CPU_TO_GPU, spec))
    assert layout.dma_bytes.tolist() == [2560, 2560, 1280]  # chunks of two rows
    assert layout.dma_first.tolist() == [0, 1, 2, 3]
    assert (layout.dma_host - CPU_BASE).tolist() == [3 * 1280, 5 * 1280, 7 * 1280]


@pytest.mark.parametrize("factor", [1, 2])
def test_scattered_rows_are_taken_in_host_order(factor):
    planner = _rank(2, 4096, factor)
    gpu_ids = np.arange(4 * factor)[::-1]  # rows 30, 10, 20, 11 in the spec
    layout = _layout(planner, gpu_ids, [30, 10, 20, 11], chunk_bytes=1 << 20)
    by_row = gpu_ids.reshape(4, factor)[[1, 3, 2, 0]].reshape(-1)  # rows 10, 11, 20, 30
    assert layout.pairs[0].tolist() == by_row.tolist()
    assert layout.pairs[2].tolist() == list(range(factor)) * 4
    assert layout.dma_host.size == 3  # rows 10 and 11 merge
    assert np.all(np.diff(layout.dma_host.astype(np.int64)) > 0)


def test_access_width_follows_every_address_and_size():
    assert BlockStaging.of_geometry(_rank(4, 4096, 2).geometry, 1 << 20).access_bytes == 16
    gpu = [PageArray(GPU_BASE + 8, 4, 24, 24)]
    cpu = [PageArray(CPU_BASE, 4, 256, 24)]
    geometry = TransferPlanner(gpu, cpu, 1).geometry
    assert BlockStaging.of_geometry(geometry, 1 << 20).access_bytes == 8


def test_refuses_rows_that_do_not_fit_and_work_of_another_planner():
    planner = _rank(64, 32 << 10, 4)  # rows of 8 MiB
    with pytest.raises(BackendError, match=r"8388608 bytes, more than chunk_bytes = 4194304"):
        BlockStaging.of_geometry(planner.geometry, 4 << 20)
    with pytest.raises(BackendError, match="multiple of 256"):
        BlockStaging.of_geometry(planner.geometry, 1000)
    other = _rank(64, 32 << 10, 4)
    plan = other.block_plan(Direction.GPU_TO_CPU, (GPULoadStoreSpec([1, 2]), CPULoadStoreSpec([3])))
    with pytest.raises(BackendError, match="not built for"):
        BlockStaging.of_geometry(planner.geometry, 8 << 20).layout(plan)


def test_refuses_groups_whose_rows_would_overlap():
    gpu = [PageArray(GPU_BASE, 4, 256, 256), PageArray(GPU_BASE + 4096, 4, 256, 256)]
    cpu = [PageArray(CPU_BASE, 4, 512, 256), PageArray(CPU_BASE + 2048, 4, 512, 256)]
    with pytest.raises(BackendError, match="wider than the CPU block stride 512"):
        BlockStaging.of_geometry(TransferPlanner(gpu, cpu, 1).geometry, 1 << 20)


def test_an_empty_transfer_has_no_chunks():
    planner = _rank(4, 4096, 1)
    layout = _layout(planner, [], [])
    assert layout.num_chunks == 0 and layout.num_pairs == 0 and layout.num_bytes == 0

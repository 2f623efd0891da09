"""The block pack/unpack kernels against the numpy reference (tests only; needs triton).

``run_kernel_case`` runs one case with the real ``BlockKernel``: on ``"cpu"`` under
Triton's interpreter (GPU pages and slots are numpy buffers at real host addresses;
the process must have started with ``TRITON_INTERPRET=1``), on ``"cuda"`` with GPU
pages and the slot in device memory and the pair table uploaded by ``PairTables``.
The copy-engine half is the numpy executor either way.

Entry point for test_block_kernel.py (a subprocess, because the interpreter is chosen
when triton is imported): ``python -m block_kernels SEEDS`` runs seeded random cases
and a few engine-sized geometries, prints one line per case, exits 1 on a mismatch.
"""

from __future__ import annotations

import sys
import traceback

import numpy as np
import torch

from block_reference import (
    Case, Memory, RngDraw, aligned, assert_same, draw_case, expected_after, fill, run_layout,
)
from tiercache.backends.staged.block_kernel import BlockKernel, PairTables
from tiercache.backends.staged.block_layout import BlockStaging
from tiercache.specs import CPULoadStoreSpec, GPULoadStoreSpec
from tiercache.planning.planner import TransferPlanner


def engine_case(num_tensors: int, page: int, factor: int, blocks: int, skip: int, store: bool,
                seed: int) -> Case:
    """A vLLM-like rank: one dense tensor per layer, the region's rows, scattered ids."""
    from tiercache.region.layout import RegionLayout

    rng = np.random.default_rng(seed)
    num_gpu, num_cpu = blocks * factor + 3, blocks + 2
    region = RegionLayout(1, num_cpu, (page,) * num_tensors, factor)
    n = blocks * factor - skip
    return Case(factor, [page] * num_tensors, [t * num_gpu * page for t in range(num_tensors)],
                [page] * num_tensors, num_gpu, list(region.page_offsets), region.row_stride,
                num_cpu, [list(range(num_tensors))],
                GPULoadStoreSpec(rng.permutation(num_gpu)[:n], None, [skip]),
                CPULoadStoreSpec(rng.permutation(num_cpu)[:blocks]), store, chunk_rows=2,
                load_whole_rows=skip > 0)


def run_kernel_case(case: Case, seed: int, device: str) -> BlockStaging:
    gpu_data, cpu_data = aligned(case.gpu_bytes), aligned(case.cpu_bytes)
    fill(case, gpu_data, cpu_data, seed)
    on_gpu = device != "cpu"
    gpu_tensor = torch.from_numpy(gpu_data).to(device) if on_gpu else None
    gpu_base = gpu_tensor.data_ptr() if on_gpu else gpu_data.ctypes.data
    cpu_base = cpu_data.ctypes.data
    gpu_pages, cpu_pages = case.page_arrays(gpu_base, cpu_base)
    planner = TransferPlanner(gpu_pages, cpu_pages, case.factor, case.groups)
    staging = BlockStaging.of_geometry(planner.geometry, case.chunk_bytes, case.load_whole_rows)
    layout = staging.layout(planner.block_plan(case.direction, case.spec))
    plan, gpu_expected, cpu_expected = expected_after(case, planner, gpu_data, cpu_data,
                                                      gpu_base, cpu_base)
    kernel = BlockKernel(staging, device, max_programs=None if seed % 2 else 5,
                         compiled_launch=seed % 3 == 0)
    launch = kernel.pack if case.store else kernel.unpack
    pairs = np.ascontiguousarray(layout.pairs)
    if on_gpu:
        tables, stream = PairTables(device), torch.cuda.current_stream()
        pairs_address, token = tables.upload(pairs, stream)
        slot_tensor = torch.empty(case.chunk_bytes, dtype=torch.uint8, device=device)

    def pack(slot: np.ndarray, first: int, count: int) -> None:
        if not on_gpu:
            launch(pairs.ctypes.data, layout.num_pairs, first, count, slot.ctypes.data)
            return
        slot_tensor.copy_(torch.from_numpy(slot))  # poison, or the DMA'd rows of a load
        launch(pairs_address, layout.num_pairs, first, count, slot_tensor.data_ptr())
        slot[:] = slot_tensor.cpu().numpy()

    run_layout(case, layout, gpu_pages, cpu_pages, Memory(gpu_data, gpu_base),
               Memory(cpu_data, cpu_base), pack)
    if on_gpu:
        tables.release(token, stream)
        gpu_data[:] = gpu_tensor.cpu().numpy()
    assert_same(case, plan, layout, gpu_data, cpu_data, gpu_expected, cpu_expected)
    return staging


def cases(num_seeds: int):
    """(name, seed, case): seeded random geometries, then engine-sized ones."""
    for seed in range(num_seeds):
        yield f"random {seed}", seed, draw_case(RngDraw(seed))
    for i, (tensors, page, factor, blocks, skip) in enumerate([
            (64, 32 << 10, 1, 3, 0), (32, 16 << 10, 1, 4, 0), (32, 64 << 10, 1, 2, 0),
            (16, 32 << 10, 4, 3, 1), (8, 4096, 2, 5, 1)]):
        for store in (True, False):
            name = f"engine {tensors}t x {page >> 10} KiB F={factor} skip={skip} " \
                   f"{'store' if store else 'load'}"
            yield name, i, engine_case(tensors, page, factor, blocks, skip, store, seed=i)


def main(argv: list[str]) -> int:
    device = argv[1] if len(argv) > 1 else "cpu"
    for name, seed, case in cases(int(argv[0])):
        try:
            staging = run_kernel_case(case, seed, device)
        except Exception:  # report which case, then fail the run
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
            return 1
        print(f"ok {name} access={staging.access_bytes}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

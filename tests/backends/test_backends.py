"""CPU tests of the GPU backends' pure logic: the staged backend's run/chunk layout and
the widest-access rule of the copy kernel. The copies themselves run in
tests/test_backends_gpu.py on a GPU machine.

The staging layout is checked by executing it with numpy — pack every chunk's pieces
into a slot, then move the chunk's DMAs between the slot and host memory — and
comparing with the plan applied directly, on random plans with padded, odd-sized,
merged and unsorted pages.
"""

from __future__ import annotations

import numpy as np
import pytest

from tiercache.backends.staged.page_layout import RUN_ALIGN, plan_staging
from tiercache.errors import BackendError
from tiercache.specs import Direction

POISON = 0xA5


def _random_plan(rng: np.random.Generator, num_blocks: int, page_bytes: list[int],
                 row_pad: int, shuffle: bool):
    """Pages of several tensors in host rows (with padding), scattered GPU pages."""
    row_payload = sum(page_bytes)
    row_stride = row_payload + row_pad
    host_bytes = row_stride * (num_blocks + 3)
    gpu_bytes = (row_payload + 64 * len(page_bytes)) * (num_blocks + 3)
    rows = rng.choice(num_blocks + 3, num_blocks, replace=False)
    gpu_slots = rng.permutation(num_blocks + 3)[:num_blocks]
    host, gpu, sizes = [], [], []
    for b in range(num_blocks):
        offset = 0
        for t, page in enumerate(page_bytes):
            host.append(int(rows[b]) * row_stride + offset)
            gpu.append(int(gpu_slots[b]) * (row_payload + 64 * len(page_bytes)) + 64 * t
                       + sum(page_bytes[:t]))
            sizes.append(page)
            offset += page
    host, gpu, sizes = (np.array(a, dtype=np.uint64) for a in (host, gpu, sizes))
    if shuffle:
        order = rng.permutation(host.size)
        host, gpu, sizes = host[order], gpu[order], sizes[order]
    return host, gpu, sizes, host_bytes, gpu_bytes


def _run(layout, direction: Direction, gpu_mem: np.ndarray, host_mem: np.ndarray,
         num_slots: int) -> None:
    """Execute a transfer through the layout. Store: pack pieces into a slot, DMA runs to
    host; load: DMA runs into a slot, unpack pieces."""
    ring = np.full((num_slots, layout.max_slot_bytes), POISON, dtype=np.uint8)
    x = layout.direct
    for h, g, n in zip(x.host.tolist(), x.gpu.tolist(), x.num_bytes.tolist()):
        dst, src = direction.src_dst(host_mem[h:h + n], gpu_mem[g:g + n])
        dst[:] = src
    p, d = layout.pieces, layout.dmas
    for k in range(layout.num_chunks):
        slot = ring[k % num_slots]
        slot[:] = POISON
        pieces = (gpu_mem, p.gpu[p.chunk(k)], p.slot_offset(k), p.num_bytes[p.chunk(k)])
        dmas = (host_mem, d.address[d.chunk(k)], d.slot_offset[d.chunk(k)],
                d.num_bytes[d.chunk(k)])
        into_slot, out_of_slot = direction.src_dst(pieces, dmas)
        mem, addresses, offsets, sizes = into_slot
        for a, o, n in zip(addresses, offsets, sizes):
            slot[int(o):int(o + n)] = mem[int(a):int(a + n)]
        mem, addresses, offsets, sizes = out_of_slot
        for a, o, n in zip(addresses, offsets, sizes):
            mem[int(a):int(a + n)] = slot[int(o):int(o + n)]


def _reference(src_mem, dst_mem, src, dst, sizes):
    out = dst_mem.copy()
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        out[d:d + n] = src_mem[s:s + n]
    return out


@pytest.mark.parametrize("page_bytes,row_pad,chunk_bytes,direct_bytes,shuffle", [
    ([4096, 4096, 4096], 0, 8192, None, False),       # rows contiguous: one run per row
    ([4096, 4096, 4096], 0, 4096 * 7, None, True),    # unsorted plan, chunks cut runs
    ([1000, 3000, 17], 300, 2048, None, True),        # odd pages, padded rows
    ([8192], 0, 256 * 5, None, False),                # consecutive rows merge into long runs
    ([512, 1536], 4096, 1 << 20, None, True),         # whole transfer in one chunk
    ([65536, 4096, 4096], 0, 16384, 65536, True),     # large pages bypass the ring
    ([1000, 3000, 17], 300, 256, None, True),         # chunks smaller than pages: no empty chunk
])
def test_staged_layout_moves_exact_bytes(page_bytes, row_pad, chunk_bytes, direct_bytes, shuffle):
    rng = np.random.default_rng(sum(page_bytes) + row_pad + chunk_bytes)
    host, gpu, sizes, host_bytes, gpu_bytes = _random_plan(rng, 9, page_bytes, row_pad, shuffle)
    gpu_mem = rng.integers(0, 256, gpu_bytes, dtype=np.uint8)
    host_mem = np.full(host_bytes, POISON, dtype=np.uint8)
    layout = plan_staging(host, gpu, sizes, chunk_bytes, direct_bytes)
    staged = int(layout.pieces.num_bytes.sum())
    assert staged + int(layout.direct.num_bytes.sum()) == int(sizes.sum())
    assert int(layout.dmas.num_bytes.sum()) == staged
    assert layout.max_slot_bytes <= chunk_bytes + int(sizes.max())
    p, d = layout.pieces, layout.dmas
    assert np.all(np.diff(p.first) > 0) and np.all(np.diff(d.first) > 0)  # no empty chunk
    assert all(int(p.slot_offset(k)[0]) < RUN_ALIGN and int(p.slot_offset(k).max()) < chunk_bytes
               for k in range(layout.num_chunks))
    if direct_bytes is not None:
        assert int(layout.direct.num_bytes.min()) >= direct_bytes
        assert int(layout.pieces.num_bytes.max()) < direct_bytes

    expected = _reference(gpu_mem, host_mem, gpu, host, sizes)
    _run(layout, Direction.GPU_TO_CPU, gpu_mem, host_mem, num_slots=2)
    assert np.array_equal(host_mem, expected)  # padding and unused rows untouched

    fresh_gpu = np.full(gpu_bytes, POISON, dtype=np.uint8)
    host_mem[:] = rng.integers(0, 256, host_bytes, dtype=np.uint8)
    expected_gpu = _reference(host_mem, fresh_gpu, host, gpu, sizes)
    _run(layout, Direction.CPU_TO_GPU, fresh_gpu, host_mem, num_slots=3)
    assert np.array_equal(fresh_gpu, expected_gpu)


def test_staged_layout_runs_follow_host_contiguity():
    # three tensors of 4 KiB per row, rows 0,1,2 adjacent and row 5 apart: two runs
    page = 4096
    host = np.array([r * 3 * page + t * page for r in (0, 1, 2, 5) for t in range(3)],
                    dtype=np.uint64)
    gpu = np.arange(host.size, dtype=np.uint64) * np.uint64(2 * page) + np.uint64(1 << 30)
    sizes = np.full(host.size, page, dtype=np.uint64)
    layout = plan_staging(host[::-1].copy(), gpu[::-1].copy(), sizes, chunk_bytes=64 * page)
    assert layout.num_runs == 2
    assert layout.num_chunks == 1
    assert layout.dmas.num_bytes.tolist() == [9 * page, 3 * page]
    assert layout.dmas.address.tolist() == [0, 15 * page]
    # slot offsets keep the host address modulo RUN_ALIGN
    assert all(int(o) % RUN_ALIGN == int(a) % RUN_ALIGN
               for o, a in zip(layout.dmas.slot_offset, layout.dmas.address))


def test_staged_layout_keeps_alignment_of_pieces():
    rng = np.random.default_rng(7)
    host, gpu, sizes, _, _ = _random_plan(rng, 16, [4096, 2048, 6144], 512, True)
    gpu = gpu + np.uint64(1 << 20)
    layout = plan_staging(host, gpu, sizes, chunk_bytes=10240)
    p = layout.pieces
    offsets = np.concatenate([p.slot_offset(k) for k in range(layout.num_chunks)])
    for arr in (p.gpu, offsets, p.num_bytes,
                layout.dmas.address, layout.dmas.slot_offset, layout.dmas.num_bytes):
        assert int(np.bitwise_or.reduce(arr)) % 16 == 0


def test_staged_layout_rejects_bad_input():
    one = np.array([0], dtype=np.uint64)
    with pytest.raises(BackendError, match="chunk_bytes = 1000"):
        plan_staging(one, one, np.array([16], dtype=np.uint64), 1000)
    empty = plan_staging(np.zeros(0, np.uint64), np.zeros(0, np.uint64), np.zeros(0, np.uint64),
                         4096)
    assert empty.num_chunks == 0


@pytest.mark.parametrize("seed", range(4))
def test_host_order_matches_a_stable_argsort(seed):
    from tiercache.backends.staged.page_layout import _host_order

    rng = np.random.default_rng(seed)
    granule = int(rng.choice([1, 256, 32768]))
    host = (np.uint64(1 << 40) + rng.permutation(5000)[:3000].astype(np.uint64) * np.uint64(granule))
    order = _host_order(host)
    assert order is not None and np.array_equal(order, np.argsort(host, kind="stable"))
    assert _host_order(np.sort(host)) is None


def test_staged_layout_with_reused_scratch_equals_fresh():
    from tiercache.backends.staged.page_layout import Scratch

    rng = np.random.default_rng(3)
    scratch = Scratch()
    for num_blocks, shuffle in ((12, True), (5, False), (20, True), (3, True)):
        host, gpu, sizes, _, _ = _random_plan(rng, num_blocks, [4096, 8192, 4096], 0, shuffle)
        fresh = plan_staging(host, gpu, sizes, 16384)
        reused = plan_staging(host, gpu, sizes, 16384, scratch=scratch)
        for field in ("gpu", "packed", "num_bytes", "first", "chunk_start"):
            assert np.array_equal(getattr(fresh.pieces, field), getattr(reused.pieces, field))
        for field in ("address", "slot_offset", "num_bytes", "first"):
            assert np.array_equal(getattr(fresh.dmas, field), getattr(reused.dmas, field))

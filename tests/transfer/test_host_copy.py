"""The native host-to-host copy pool and the page map, against numpy references."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tiercache.errors import ArgumentError, LayoutMismatchError
from tiercache.region.layout import RegionLayout
from tiercache.specs import Direction
from tiercache.transfer.host_copy import HostCopyPool
from tiercache.transfer.host_pages import PageMap


def _addresses(buf: np.ndarray, offsets) -> np.ndarray:
    return (buf.ctypes.data + np.asarray(offsets, dtype=np.uint64)).astype(np.uint64)


@pytest.mark.parametrize("threads,min_share", [(0, 1), (1, 1), (3, 1), (3, 1 << 20)])
def test_pieces_land_exactly_where_they_are_sent(threads, min_share):
    rng = np.random.default_rng(threads)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    lengths = rng.integers(1, 5000, 150).astype(np.uint64)
    src_off = np.cumsum(np.r_[0, lengths[:-1] + 7]).astype(np.uint64)  # gaps in between
    perm = rng.permutation(lengths.size)  # scattered destinations, in another order
    dst_off = np.zeros_like(src_off)
    dst_off[perm] = np.cumsum(np.r_[0, lengths[perm][:-1] + 3]).astype(np.uint64)
    want = np.zeros_like(src)
    for s, d, n in zip(src_off, dst_off, lengths):
        want[d:d + n] = src[s:s + n]
    with HostCopyPool(threads, min_share_bytes=min_share) as pool:
        assert pool.num_threads == threads
        copied = pool.copy(_addresses(dst, dst_off), _addresses(src, src_off), lengths)
    assert copied == int(lengths.sum())
    assert np.array_equal(dst, want)  # and not a byte more (gaps stay zero)


def test_concurrent_calls_on_one_pool_each_complete_whole():
    src = np.arange(1 << 22, dtype=np.uint64).view(np.uint8)
    outs = [np.zeros_like(src) for _ in range(4)]
    lengths = np.full(64, src.size // 64, dtype=np.uint64)
    offsets = np.arange(64, dtype=np.uint64) * lengths[0]
    with HostCopyPool(2) as pool:
        threads = [threading.Thread(target=pool.copy, args=(
            _addresses(out, offsets), _addresses(src, offsets), lengths)) for out in outs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert all(np.array_equal(out, src) for out in outs)


def test_bad_arguments_are_refused_before_a_byte_moves():
    buf = np.zeros(64, dtype=np.uint8)
    one = np.array([buf.ctypes.data], dtype=np.uint64)
    with HostCopyPool(1) as pool:
        with pytest.raises(ArgumentError, match="uint64"):
            pool.copy(one, one, np.array([8], dtype=np.int64))
        with pytest.raises(ArgumentError, match="2 entries"):
            pool.copy(one, one, np.array([8, 8], dtype=np.uint64))
        with pytest.raises(ArgumentError, match="null address"):
            pool.copy(np.array([0], dtype=np.uint64), one, np.array([8], dtype=np.uint64))
    with pytest.raises(ArgumentError, match="0..256"):
        HostCopyPool(-1)


def test_a_page_of_two_blobs_fills_a_row_of_per_layer_tensors_in_stream_order():
    # a vLLM-shaped row: 3 layer pages of 96 bytes (256-aligned offsets: gaps) holds an
    # SGLang page of a K blob and a V blob of 144 bytes each
    layout = RegionLayout(world_size=1, num_blocks=4, page_bytes=(96, 96, 96))
    page_map = PageMap.onto((144, 144), layout)
    assert page_map.pieces_per_page == 4  # K: 96 + 48, V: 48 + 96
    region = np.zeros(layout.num_blocks * layout.row_stride, dtype=np.uint8)
    pages = np.random.default_rng(0).integers(0, 256, (2, 288), dtype=np.uint8)
    blobs = np.array([[p.ctypes.data, p.ctypes.data + 144] for p in pages], dtype=np.uint64)
    rows = region.ctypes.data + np.array([3, 1], dtype=np.uint64) * layout.row_stride
    with HostCopyPool(1, min_share_bytes=1) as pool:
        pool.copy(*page_map.pieces(Direction.GPU_TO_CPU, blobs, rows.astype(np.uint64)))
        row = region.reshape(layout.num_blocks, layout.row_stride)
        stream = np.concatenate([row[3, o:o + n] for o, n in zip(layout.page_offsets,
                                                                 layout.cpu_page_bytes)])
        assert np.array_equal(stream, pages[0])
        back = np.zeros_like(pages)
        back_blobs = np.array([[b.ctypes.data, b.ctypes.data + 144] for b in back],
                              dtype=np.uint64)
        pool.copy(*page_map.pieces(Direction.CPU_TO_GPU, back_blobs, rows.astype(np.uint64)))
    assert np.array_equal(back, pages)


def test_a_page_that_does_not_fill_a_row_is_refused_naming_both_sizes():
    layout = RegionLayout(world_size=1, num_blocks=4, page_bytes=(96, 96))
    with pytest.raises(LayoutMismatchError, match="300 bytes.*192 bytes"):
        PageMap.onto((150, 150), layout)

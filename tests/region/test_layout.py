"""Layout arithmetic: slices and rows never overlap, are aligned, and fit (hypothesis)."""

import pytest
from hypothesis import given, settings, strategies as st

from tiercache.config import Config, KVGeometry, RegionConfig
from tiercache.errors import ConfigError
from tiercache.region.layout import (
    HEADER_FIXED_BYTES, OS_PAGE, ROW_ALIGN, SLICE_ALIGN, RegionLayout,
)
from tiercache.region.stats import STATS_BLOCK_BYTES

layouts = st.builds(
    RegionLayout,
    world_size=st.integers(1, 8),
    num_blocks=st.integers(1, 300),
    page_bytes=st.lists(st.integers(1, 70_000), min_size=1, max_size=12).map(tuple),
    block_size_factor=st.integers(1, 5),
)


@settings(max_examples=300, deadline=None)
@given(layouts)
def test_slices_are_aligned_disjoint_and_fit(layout):
    assert layout.header_bytes % SLICE_ALIGN == 0
    assert layout.header_bytes >= HEADER_FIXED_BYTES + layout.world_size * STATS_BLOCK_BYTES
    spans = [(layout.slice_offset(r), layout.slice_offset(r) + layout.slice_used_bytes)
             for r in range(layout.world_size)]
    for start, end in spans:
        assert start % SLICE_ALIGN == 0
        assert layout.header_bytes <= start < end <= layout.total_bytes
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start
    assert layout.stats_offset(layout.world_size - 1) + STATS_BLOCK_BYTES <= layout.header_bytes


@settings(max_examples=300, deadline=None)
@given(layouts)
def test_rows_hold_every_page_without_overlap(layout):
    assert layout.row_stride % ROW_ALIGN == 0
    pages = sorted(zip(layout.page_offsets, layout.cpu_page_bytes))
    for (off, size), (next_off, _) in zip(pages, pages[1:]):
        assert off + size <= next_off
    for off, size in pages:
        assert off % ROW_ALIGN == 0 and off + size <= layout.row_stride
    # padding is bounded: at most one alignment unit per page plus the row's page rounding
    payload = layout.row_payload_bytes
    assert layout.row_stride < payload + ROW_ALIGN * layout.num_tensors + max(ROW_ALIGN, payload // 32 + OS_PAGE)
    last = layout.page_offset(layout.world_size - 1, layout.num_blocks - 1, layout.num_tensors - 1)
    assert last + layout.cpu_page_bytes[-1] <= layout.total_bytes


@settings(max_examples=200, deadline=None)
@given(layouts, st.integers(1, 1 << 22))
def test_registrations_cover_the_slice_on_row_boundaries(layout, max_bytes):
    for rank in range(layout.world_size):
        ranges = layout.registrations(rank, max_bytes)
        start = layout.slice_offset(rank)
        cursor = start
        for off, length in ranges:
            assert off == cursor and (off - start) % layout.row_stride == 0
            assert length % layout.row_stride == 0
            assert length <= max(max_bytes, layout.row_stride)
            cursor += length
        assert cursor == start + layout.slice_used_bytes


@settings(max_examples=200, deadline=None)
@given(layouts, st.integers(1, 64))
def test_prefault_ranges_are_disjoint_page_aligned_and_cover(layout, threads):
    ranges = layout.prefault_ranges(threads)
    assert len(ranges) <= threads
    cursor = 0
    for off, length in ranges:
        assert off == cursor and off % OS_PAGE == 0 and length > 0
        cursor += length
    assert cursor == layout.total_bytes


@settings(max_examples=200, deadline=None)
@given(layouts)
def test_encode_decode_round_trip_and_digest_names_the_geometry(layout):
    assert RegionLayout.decode(layout.encode()) == layout
    other = RegionLayout(layout.world_size, layout.num_blocks + 1, layout.page_bytes,
                         layout.block_size_factor)
    assert other.digest != layout.digest


def test_from_config_sizes_blocks_from_capacity():
    cfg = Config(world_size=2, kv=KVGeometry(page_bytes=(4096,) * 4),
                 region=RegionConfig(capacity_bytes=1 << 20))
    layout = RegionLayout.from_config(cfg)
    assert layout.row_stride == 16384
    assert layout.num_blocks == (1 << 20) // (2 * 16384)


def test_capacity_below_one_block_is_refused_with_both_sizes():
    cfg = Config(world_size=2, kv=KVGeometry(page_bytes=(1 << 20,)),
                 region=RegionConfig(capacity_bytes=1 << 20))
    with pytest.raises(ConfigError, match=r"1.00 MiB is smaller than one CPU block across 2 rank"):
        RegionLayout.from_config(cfg)


def test_bad_rank_is_named():
    from tiercache.errors import RankError

    layout = RegionLayout(2, 4, (4096,))
    with pytest.raises(RankError, match=r"rank 2 is outside 0..1"):
        layout.slice_offset(2)

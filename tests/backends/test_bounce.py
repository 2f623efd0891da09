"""The bounce buffer's chunking (``tiercache.backends.bounce``), without a GPU: cutting
descriptors to fit a half, grouping them into chunks of at most a half, and where each lies
in it. The copies themselves: tests/transfer/test_bounce_gpu.py. Here the same functions
drive a byte-exact host emulation (numpy memory for pages, rows and the bounce buffer), so a
wrong cut, chunk or offset shows as a wrong byte."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.backends.bounce import chunks, offsets, split


@st.composite
def plans(draw):
    """Non-overlapping copies between two buffers, sizes 1..5,000, and a half of 1..6,000."""
    n = draw(st.integers(0, 40))
    sizes = draw(st.lists(st.integers(1, 5_000), min_size=n, max_size=n))
    gaps = draw(st.lists(st.integers(0, 64), min_size=n, max_size=n))
    order = draw(st.permutations(range(n)))  # the destination side in another order
    src, at = [], 0
    for size, gap in zip(sizes, gaps):
        src.append(at + gap)
        at += gap + size
    dst, at = [0] * n, 0
    for i in order:
        dst[i] = at
        at += sizes[i] + 7
    return (np.array(src, dtype=np.uint64), np.array(dst, dtype=np.uint64),
            np.array(sizes, dtype=np.uint64), draw(st.integers(1, 6_000)))


@settings(max_examples=300, deadline=None)
@given(plans())
def test_split_chunked_copies_through_a_bounce_move_exactly_the_plan(plan):
    src, dst, sizes, half = plan
    rng = np.random.default_rng(int(sizes.sum()) + half)
    source = rng.integers(0, 256, int(src.max(initial=0) + sizes.max(initial=0)) + 1,
                          dtype=np.uint8)
    target = np.zeros(int(dst.max(initial=0) + sizes.max(initial=0)) + 1, dtype=np.uint8)
    expected = target.copy()
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        expected[d:d + n] = source[s:s + n]
    s2, d2, n2 = split(src, dst, sizes, half)
    assert int(n2.sum()) == int(sizes.sum()) and (n2 <= half).all() and (n2 > 0).all()
    ranges = chunks(n2, half)
    assert [a for a, _ in ranges] == [0, *[b for _, b in ranges]][:len(ranges)]  # consecutive
    assert (ranges[-1][1] if ranges else 0) == n2.size
    bounce = np.full(half, 0xEE, dtype=np.uint8)
    for a, b in ranges:
        where = offsets(n2[a:b])
        assert int(where[-1] + n2[b - 1]) <= half  # the chunk fits the half
        if b < n2.size:  # greedy: the next descriptor would not have fit
            assert int(where[-1] + n2[b - 1] + n2[b]) > half
        for s, o, n in zip(s2[a:b].tolist(), where.tolist(), n2[a:b].tolist()):
            bounce[o:o + n] = source[s:s + n]  # the DMA into the half
        for d, o, n in zip(d2[a:b].tolist(), where.tolist(), n2[a:b].tolist()):
            target[d:d + n] = bounce[o:o + n]  # the memcpy out of it
        bounce[:] = 0xEE  # whatever the half held before is never read again
    assert np.array_equal(target, expected)


def test_a_descriptor_is_cut_in_order_and_small_ones_are_left_alone():
    src, dst, sizes = split(np.array([1000, 5]), np.array([0, 9000]), np.array([2500, 3]), 1000)
    assert src.tolist() == [1000, 2000, 3000, 5]
    assert dst.tolist() == [0, 1000, 2000, 9000]
    assert sizes.tolist() == [1000, 1000, 500, 3]


def test_chunks_refuse_a_descriptor_larger_than_a_half_and_split_refuses_no_room():
    with pytest.raises(ValueError, match="split first"):
        chunks(np.array([10, 4097]), 4096)
    with pytest.raises(ValueError, match="limit = 0"):
        split(np.array([0]), np.array([0]), np.array([1]), 0)
    assert chunks(np.array([], dtype=np.uint64), 4096) == []

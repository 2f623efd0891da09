"""The stats block's NUMA words, at the byte offsets its docstring documents."""

from __future__ import annotations

import struct

import pytest

from tiercache.numa.placement import NumaPlacement, NumaState
from tiercache.region.stats import STATS_BLOCK_BYTES, RankStats

OFFSET = 3 * STATS_BLOCK_BYTES  # a block not at the buffer's start


def _words(buffer: bytearray, first: int, count: int) -> tuple[int, ...]:
    return struct.unpack_from(f"<{count}Q", buffer, OFFSET + 8 * first)


def test_the_placement_goes_to_words_11_to_15_as_documented():
    buffer = bytearray(4 * STATS_BLOCK_BYTES)
    stats = RankStats(buffer, OFFSET, rank=2)
    stats.set_numa(NumaPlacement(NumaState.PLACED, 1, 4096, 3000, 0.25))
    assert _words(buffer, 11, 5) == (NumaState.PLACED, 1, 4096, 3000, 250_000_000)
    assert stats.snapshot().numa == NumaPlacement(NumaState.PLACED, 1, 4096, 3000, 0.25)
    assert stats.snapshot().numa.local_ratio == pytest.approx(3000 / 4096)
    stats.set_numa(NumaPlacement(NumaState.UNKNOWN_NODE, None))
    assert _words(buffer, 11, 3) == (NumaState.UNKNOWN_NODE, (1 << 64) - 1, 0)  # int64 -1
    assert stats.snapshot().numa == NumaPlacement(NumaState.UNKNOWN_NODE, None)
    stats.release()


def test_an_attach_resets_the_placement_and_a_detach_keeps_it():
    buffer = bytearray(4 * STATS_BLOCK_BYTES)
    stats = RankStats(buffer, OFFSET, rank=0)
    stats.set_numa(NumaPlacement(NumaState.OFF, 0, 10, 10, 0.1))
    stats.mark_detached()  # the pages stay where they are: so does the record
    assert stats.snapshot().numa.state is NumaState.OFF
    stats.mark_attached(1234, 1)
    assert stats.snapshot().numa == NumaPlacement()
    assert _words(buffer, 11, 5) == (0, (1 << 64) - 1, 0, 0, 0)
    stats.release()


def test_zero_words_of_an_older_worker_and_unknown_states_read_as_not_checked():
    buffer = bytearray(4 * STATS_BLOCK_BYTES)
    stats = RankStats(buffer, OFFSET, rank=0)
    assert stats.snapshot().numa == NumaPlacement()  # node 0 in the zero words means nothing
    struct.pack_into("<QQ", buffer, OFFSET + 8 * 11, 99, 1)  # a newer worker's state code
    assert stats.snapshot().numa == NumaPlacement()
    stats.release()

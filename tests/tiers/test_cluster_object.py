"""The pool object's header: what it names is checked on every get; anything else is a
miss (tiercache.tiers.cluster_object)."""

from __future__ import annotations

import pytest

from tiercache.errors import TierError
from tiercache.tiers.cluster_object import HEADER_BYTES, BlockFormat

FMT = BlockFormat(world_size=2, row_stride=8192, page_bytes=(4096, 4096), block_size_factor=1)
ROW = bytes(range(256)) * 32
KEY = b"ns/model/block-1"


def header(fmt=FMT, key=KEY, rank=1, row=ROW) -> bytearray:
    return bytearray(fmt.header(key, rank, row).ljust(HEADER_BYTES, b"\0"))


def test_a_whole_object_checks():
    assert FMT.check(header(), KEY, 1, ROW)


@pytest.mark.parametrize("what", ["row", "key", "rank", "format", "header byte", "magic"])
def test_anything_else_does_not(what):
    head, row, key, rank = header(), bytearray(ROW), KEY, 1
    if what == "row":
        row[4000] ^= 1
    elif what == "key":
        key = b"ns/model/block-2"
    elif what == "rank":
        rank = 0
    elif what == "format":
        head = header(fmt=BlockFormat(2, 8192, (8192,), 1))
    elif what == "header byte":
        head[50] ^= 1
    else:
        head[0] ^= 1
    assert not FMT.check(head, key, rank, row)


def test_names_differ_by_key_rank_and_geometry_not_by_region_size():
    names = {FMT.name(KEY, 0), FMT.name(KEY, 1), FMT.name(b"other", 0),
             BlockFormat(2, 8192, (4096, 4096), 2).name(KEY, 0),
             BlockFormat(1, 8192, (4096, 4096), 1).name(KEY, 0)}
    assert len(names) == 5
    assert FMT.name(KEY, 0) == BlockFormat(2, 8192, (4096, 4096), 1).name(KEY, 0)
    assert FMT.object_bytes == HEADER_BYTES + 8192


def test_a_key_too_long_for_the_header_is_refused():
    with pytest.raises(TierError, match="at most 256"):
        FMT.header(b"x" * 257, 0, ROW)

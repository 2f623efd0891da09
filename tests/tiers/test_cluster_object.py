"""The pool object's header: what it names, its CRC and the cluster's MAC are checked on
every get; anything else is a miss (tiercache.tiers.cluster_object)."""

from __future__ import annotations

import os

import pytest

from tiercache.errors import TierError
from tiercache.tiers.block_header import HEADER_BYTES as SIGNED_BYTES
from tiercache.tiers.block_header import (
    ZERO_ID, BlockHeader, BlockMac, Container, checksum,
)
from tiercache.tiers.cluster_object import HEADER_BYTES, BlockFormat

MAC = BlockMac(os.urandom(32))
FMT = BlockFormat(world_size=2, row_stride=8192, page_bytes=(4096, 4096), block_size_factor=1,
                  mac=MAC)
ROW = bytes(range(256)) * 32
KEY = b"ns/model/block-1"


def header(fmt=FMT, key=KEY, rank=1, row=ROW) -> bytearray:
    return bytearray(fmt.header(key, rank, row).ljust(HEADER_BYTES, b"\0"))


def test_a_whole_object_checks():
    assert FMT.check(header(), KEY, 1, ROW)


@pytest.mark.parametrize("what", ["row", "key", "rank", "format", "header byte", "magic",
                                  "mac byte"])
def test_anything_else_does_not(what):
    head, row, key, rank = header(), bytearray(ROW), KEY, 1
    if what == "row":
        row[4000] ^= 1
    elif what == "key":
        key = b"ns/model/block-2"
    elif what == "rank":
        rank = 0
    elif what == "format":
        head = header(fmt=BlockFormat(2, 8192, (8192,), 1, MAC))
    elif what == "header byte":
        head[50] ^= 1
    elif what == "mac byte":
        head[SIGNED_BYTES + 3] ^= 1
    else:
        head[0] ^= 1
    assert not FMT.check(head, key, rank, row)


@pytest.mark.parametrize("how", ["another key", "no MAC", "a recomputed CRC over new bytes"])
def test_an_object_made_without_the_clusters_key_never_checks(how):
    """What a pool peer without ``cluster.key_file`` can make: a whole header, every CRC
    right, under tiercache's names; signed with its own key, unsigned, or a node's real
    header kept with the row replaced and the CRC made to fit."""
    row = bytes(reversed(ROW))
    if how == "another key":
        rogue = BlockFormat(2, 8192, (4096, 4096), 1, BlockMac(os.urandom(32)))
        head = header(fmt=rogue, row=row)
    elif how == "no MAC":
        fields = BlockHeader(Container.POOL_OBJECT, FMT.digest, ZERO_ID, 0, 1, 2, 8192,
                             checksum([row]), KEY)
        head = bytearray(fields.seal(None).ljust(HEADER_BYTES, b"\0"))
    else:
        real = BlockHeader.decode(bytes(header()), Container.POOL_OBJECT)
        forged = BlockHeader(real.container, real.format, real.instance, real.seq, real.rank,
                             real.world_size, real.data_bytes, checksum([row]), real.key)
        head = header()
        head[:SIGNED_BYTES] = forged.encode()  # the node's tag kept: it no longer fits
    assert BlockHeader.decode(bytes(head), Container.POOL_OBJECT).holds([row])  # CRC fits
    assert not FMT.check(head, KEY, 1, row)


def test_names_differ_by_key_rank_and_geometry_not_by_region_size_or_key():
    names = {FMT.name(KEY, 0), FMT.name(KEY, 1), FMT.name(b"other", 0),
             BlockFormat(2, 8192, (4096, 4096), 2).name(KEY, 0),
             BlockFormat(1, 8192, (4096, 4096), 1).name(KEY, 0)}
    assert len(names) == 5
    assert FMT.name(KEY, 0) == BlockFormat(2, 8192, (4096, 4096), 1).name(KEY, 0)
    assert FMT == BlockFormat(2, 8192, (4096, 4096), 1, BlockMac(os.urandom(32)))
    assert FMT.object_bytes == HEADER_BYTES + 8192


def test_a_key_too_long_for_the_header_is_refused():
    with pytest.raises(TierError, match="at most 256"):
        FMT.header(b"x" * 257, 0, ROW)


def test_no_object_is_made_or_checked_without_the_clusters_key():
    keyless = BlockFormat(2, 8192, (4096, 4096), 1)
    with pytest.raises(TierError, match="cluster.key_file"):
        keyless.header(KEY, 0, ROW)
    with pytest.raises(TierError, match="cluster.key_file"):
        keyless.check(header(), KEY, 1, ROW)
    assert "key" not in repr(MAC).replace("<key>", "")

"""The lower tiers' one header codec (``tiercache.tiers.block_header``): what is sealed
decodes to itself; a header of the other container, cut short, with any byte flipped, or
whole (its CRC right) but with a field out of range, decodes to nothing and never raises."""

from __future__ import annotations

import os
import random
import struct

import pytest

from tiercache.errors import TierError
from tiercache.tiers.block_header import (
    HEADER_BYTES, MAX_SEQ, SEALED_BYTES, ZERO_ID, BlockHeader, BlockMac, Container, checksum,
)

DATA = [bytes(range(256)) * 16, b"second rank's row" * 100]


def header(**change) -> BlockHeader:
    fields = dict(container=Container.DISK_SLOT, format=b"F" * 16, instance=b"I" * 16,
                  seq=7, rank=0xFFFFFFFF, world_size=2,
                  data_bytes=sum(len(d) for d in DATA), data_crc=checksum(DATA), key=b"key")
    fields.update(change)
    return BlockHeader(**fields)


def test_a_sealed_header_decodes_to_itself_and_holds_its_data():
    raw = header().seal(None)
    assert len(raw) == SEALED_BYTES and raw[HEADER_BYTES:] == bytes(32)
    got = BlockHeader.decode(raw, Container.DISK_SLOT)
    assert got == header() and got.holds(DATA)
    assert not got.holds([DATA[0], DATA[1][:-1] + b"!"])
    assert BlockHeader.decode(raw, Container.POOL_OBJECT) is None  # the other container


def test_any_flipped_byte_or_a_cut_decodes_to_nothing():
    raw = header().seal(None)
    for at in range(HEADER_BYTES):
        damaged = bytearray(raw)
        damaged[at] ^= 0x10
        assert BlockHeader.decode(bytes(damaged), Container.DISK_SLOT) is None, at
    assert BlockHeader.decode(raw[:HEADER_BYTES - 1], Container.DISK_SLOT) is None


def whole(fields: bytes) -> bytes:
    """``fields`` (328 bytes) with their CRC: a header whose CRC is right."""
    return fields + struct.pack("<I", checksum([fields]))


@pytest.mark.parametrize("what", ["key_len", "seq"])
def test_a_whole_header_with_a_field_out_of_range_is_nothing(what):
    good = header().encode()[:328]
    fields = bytearray(good)
    if what == "key_len":
        fields[68:70] = struct.pack("<H", 300)
    else:
        fields[40:48] = struct.pack("<Q", (1 << 64) - 1)
    assert BlockHeader.decode(whole(bytes(fields)), Container.DISK_SLOT) is None
    assert BlockHeader.decode(whole(good), Container.DISK_SLOT) is not None
    assert BlockHeader.decode(header(seq=MAX_SEQ).seal(None), Container.DISK_SLOT).seq == MAX_SEQ


def test_random_bytes_never_raise():
    rng = random.Random(33)
    magic = Container.DISK_SLOT.value
    for _ in range(2000):
        got = BlockHeader.decode(whole(magic + rng.randbytes(320)), Container.DISK_SLOT)
        assert got is None or (len(got.key) <= 256 and got.seq <= MAX_SEQ)
        BlockHeader.decode(rng.randbytes(rng.randrange(400)), Container.DISK_SLOT)


def test_a_writer_gets_an_error_naming_the_bad_value():
    with pytest.raises(TierError, match="at most 256"):
        header(key=b"k" * 257)
    with pytest.raises(TierError, match="seq of -1"):
        header(seq=-1)
    assert header(seq=(1 << 64) - 1).encode()  # written up to u64, read back up to MAX_SEQ


def test_the_mac_binds_header_and_data_to_the_key():
    mac = BlockMac(os.urandom(32))
    head = header(container=Container.POOL_OBJECT, instance=ZERO_ID, rank=1)
    raw = head.seal(mac, DATA)
    assert mac.verify(raw, DATA)
    assert not mac.verify(raw, [DATA[0], DATA[1] + b"x"])
    assert not BlockMac(os.urandom(32)).verify(raw, DATA)
    assert not mac.verify(head.seal(None), DATA)
    with pytest.raises(TierError, match="at least 32"):
        BlockMac(b"short")

"""The disk tier's slot file: what is written reads back exact, and anything torn, damaged,
of another key or another geometry reads as nothing. O_DIRECT where the filesystem takes
it and the rows are 4 KiB aligned (the suite's tmp_path on ext4), buffered I/O otherwise
(asked for, or rows the region does not align)."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from tiercache.errors import ConfigError
from tiercache.tiers.disk_file import HEADER_BYTES, DiskSlotFile

ROW = 8192
DIGEST = b"L" * 16


def rows(n: int = 2, fill: int = 0) -> list[np.ndarray]:
    """Page-aligned rows (what the region's mapping gives)."""
    import mmap

    buf = mmap.mmap(-1, n * ROW)
    arr = np.frombuffer(buf, np.uint8).reshape(n, ROW)
    arr[:] = fill
    return [arr[i] for i in range(n)]


def filled(key: bytes, n: int = 2) -> list[np.ndarray]:
    out = rows(n)
    for rank, row in enumerate(out):
        row[:] = np.frombuffer((key + bytes([rank])) * (ROW // (len(key) + 1) + 1), np.uint8)[:ROW]
    return out


@pytest.fixture(params=["direct", "buffered"])
def where(request, tmp_path):
    """(directory, direct_io setting, what the file must run)."""
    return (str(tmp_path), None, True) if request.param == "direct" else \
        (str(tmp_path), False, False)


def open_file(directory: str, slots: int = 4, digest: bytes = DIGEST, **kw) -> DiskSlotFile:
    return DiskSlotFile(os.path.join(directory, "t.disk"), slots * (HEADER_BYTES + 2 * ROW),
                        world_size=2, row_stride=ROW, layout_digest=digest, **kw)


def test_a_block_reads_back_exact_and_only_under_its_key(where):
    directory, setting, direct = where
    f = open_file(directory, direct_io=setting)
    assert f.direct_io is direct and f.num_slots == 4
    assert stat.S_IMODE(os.stat(f.path).st_mode) == 0o600
    f.write(2, b"key-a", 7, [memoryview(r) for r in filled(b"key-a")])
    back = rows()
    assert f.read(2, b"key-a", [memoryview(r) for r in back])
    assert all(np.array_equal(a, b) for a, b in zip(back, filled(b"key-a")))
    assert not f.read(2, b"key-b", [memoryview(r) for r in rows()])  # another key: nothing
    assert not f.read(1, b"key-a", [memoryview(r) for r in rows()])  # never written
    assert [(slot, h.key, h.seq) for slot, h in f.scan()] == [(2, b"key-a", 7)]
    f.close()
    again = open_file(directory, direct_io=setting)  # reopened: the block is still there
    assert [(slot, h.key) for slot, h in again.scan()] == [(2, b"key-a")]
    again.close()


@pytest.mark.parametrize("where_in_slot", ["header", "data"])
def test_any_flipped_byte_makes_the_slot_read_as_nothing(where, where_in_slot):
    directory, setting, _ = where
    f = open_file(directory, direct_io=setting)
    f.write(0, b"k", 1, [memoryview(r) for r in filled(b"k")])
    offset = f.offset(0) + (20 if where_in_slot == "header" else HEADER_BYTES + ROW + 100)
    with open(f.path, "r+b") as raw:
        raw.seek(offset)
        byte = raw.read(1)
        raw.seek(offset)
        raw.write(bytes([byte[0] ^ 0x40]))
    assert not f.read(0, b"k", [memoryview(r) for r in rows()])
    if where_in_slot == "header":
        assert f.scan() == []
    f.close()


def test_a_file_of_another_geometry_gives_no_block(where):
    directory, setting, _ = where
    f = open_file(directory, direct_io=setting)
    f.write(0, b"k", 1, [memoryview(r) for r in filled(b"k")])
    f.close()
    other = open_file(directory, digest=b"M" * 16, direct_io=setting)
    assert other.scan() == [] and not other.read(0, b"k", [memoryview(r) for r in rows()])
    other.close()


def test_bad_settings_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="holds no block"):
        DiskSlotFile(str(tmp_path / "x"), 100, world_size=2, row_stride=ROW, layout_digest=DIGEST)
    with pytest.raises(ConfigError, match="cannot allocate"):
        DiskSlotFile(str(tmp_path / "y"), 1 << 60, world_size=2, row_stride=ROW,
                     layout_digest=DIGEST)
    unaligned = dict(world_size=1, row_stride=ROW + 256, layout_digest=DIGEST)
    with pytest.raises(ConfigError, match="direct_io = true, but region rows of 8448 bytes"):
        DiskSlotFile(str(tmp_path / "z"), 1 << 20, direct_io=True, **unaligned)
    auto = DiskSlotFile(str(tmp_path / "w"), 1 << 20, **unaligned)
    assert not auto.direct_io and "not 4096-byte aligned" in auto.direct_io_reason
    auto.close()
    loose = tmp_path / "loose.disk"
    loose.write_bytes(b"")
    os.chmod(loose, 0o644)
    with pytest.raises(ConfigError, match="not ours with mode 0600"):
        DiskSlotFile(str(loose), 1 << 20, world_size=2, row_stride=ROW, layout_digest=DIGEST)

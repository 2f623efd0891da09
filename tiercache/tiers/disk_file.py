"""The disk tier's file: one preallocated file of fixed, block-sized slots on a local
filesystem, each slot a header and one host block (every rank's row of it).

Slot layout (``slot_bytes`` apart, from offset 0)::

    offset        size                         what
    0             4096                         header (below)
    4096 + r*R    R = round_up(row_stride, 4096)   rank r's row of the block (row_stride bytes
                                               used; the rest of R is padding)

Header, little-endian (the rest of its 4096 bytes is zero)::

    offset  size  field
    0       8     magic        b"TCDISK01"
    8       8     seq          u64: write order over the whole file (larger = newer)
    16      16    layout       the region's layout digest: only blocks of this geometry
    32      8     data_bytes   u64: world_size * row_stride
    40      4     data_crc     u32: zlib.crc32 over the ranks' rows, in rank order
    44      2     key_len      u16
    46      2     reserved
    48      256   key          the block's key (namespaced keys name their namespace)
    304     4     header_crc   u32: zlib.crc32 of bytes 0..304

Decisions and reasons:

* **One preallocated file, fixed slots** (``posix_fallocate`` at start: a full disk is a
  start-up error, not a failed write later). For a single-owner local NVMe this beat
  file-per-chunk in every peer's measurements (docs: research tiers.md §2).
* **O_DIRECT straight from the shared mapping**, no bounce buffer: ``preadv``/``pwritev``
  with one iovec per rank row, when rows are 4 KiB aligned in the region and the
  filesystem takes O_DIRECT (tmpfs does not). Otherwise buffered I/O. Which one runs is
  ``direct_io`` (exported and logged at start), never a quiet switch.
* **Header and data in one call; both checked on every read.** A header is whole only if
  its own CRC checks, and a block is served only if the data's CRC matches the header: a
  write cut at any point (process death) leaves a slot whose header or data does not
  check, which is dropped on rebuild or read, never served. A flipped byte anywhere
  likewise. So the header need not be written last, and one ``pwritev`` (one ``preadv``)
  moves a whole slot when its rows lie back to back.
* The header names the layout digest, so a file written for another geometry gives no
  block (the rebuild drops every slot of another layout).
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from tiercache.errors import ConfigError, TierError
from tiercache.region.layout import round_up

MAGIC = b"TCDISK01"
HEADER_BYTES = 4096
ALIGN = 4096
KEY_BYTES = 256
_HEADER = struct.Struct("<8sQ16sQIHH256s")
_CRC = struct.Struct("<I")
assert _HEADER.size == 304
FILE_MODE = 0o600


@dataclass(frozen=True)
class SlotHeader:
    seq: int
    key: bytes
    data_crc: int


class DiskSlotFile:
    """The slot file at ``path`` (created 0600 and preallocated, or reopened). ``rows``
    gives, for a host slot, each rank's row as a writable buffer (in the coordinator's
    mapping). Thread-safe: every call is one positioned read or write of its own slot."""

    def __init__(self, path: str, capacity_bytes: int, *, world_size: int, row_stride: int,
                 layout_digest: bytes, direct_io: bool | None = None):
        self.path = path
        self.world_size = world_size
        self.row_stride = row_stride
        self.row_span = round_up(row_stride, ALIGN)
        self.slot_bytes = HEADER_BYTES + world_size * self.row_span
        self.num_slots = capacity_bytes // self.slot_bytes
        if self.num_slots < 1:
            raise ConfigError(f"disk.capacity = {capacity_bytes} bytes holds no block of "
                              f"{self.slot_bytes} bytes (header + {world_size} row(s)); "
                              "give at least one block")
        self.layout_digest = layout_digest
        self.direct_io_reason = ""
        aligned_rows = row_stride % ALIGN == 0
        self._fd = -1
        self._fd = self._open(path)
        try:
            self._preallocate(self.num_slots * self.slot_bytes)
            self.direct_io = self._choose_direct(direct_io, aligned_rows)
        except BaseException:
            os.close(self._fd)
            raise

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def _open(path: str) -> int:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
        except OSError as e:
            raise ConfigError(f"disk tier file {path}: cannot open it ({e.strerror})") from e
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            os.close(fd)
            raise ConfigError(f"disk tier file {path} is not ours with mode 0600 (owner uid "
                              f"{st.st_uid}, mode {st.st_mode & 0o777:o}); remove it or "
                              "choose another disk.path")
        return fd

    def _preallocate(self, num_bytes: int) -> None:
        try:
            os.posix_fallocate(self._fd, 0, num_bytes)
        except OSError as e:
            free = os.statvfs(os.path.dirname(self.path) or ".")
            raise ConfigError(
                f"disk.capacity: cannot allocate {num_bytes} bytes in {self.path} "
                f"({e.strerror}; {free.f_bavail * free.f_frsize} bytes free there)") from e

    def _choose_direct(self, wanted: bool | None, aligned_rows: bool) -> bool:
        """O_DIRECT when the filesystem takes it and the rows are aligned; ``wanted`` True
        makes either missing an error, False turns it off."""
        if wanted is False:
            return False
        why = None
        if not aligned_rows:
            why = (f"region rows of {self.row_stride} bytes are not {ALIGN}-byte aligned "
                   "(O_DIRECT reads and writes them in place)")
        else:
            try:
                flags = os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT
                probe = os.open(self.path, flags)
                os.close(probe)
            except OSError as e:
                why = f"the filesystem refuses O_DIRECT ({e.strerror})"
        if why is None:
            os.close(self._fd)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT)
            return True
        if wanted:
            raise ConfigError(f"disk.direct_io = true, but {why}")
        self.direct_io_reason = why
        return False

    # ------------------------------------------------------------------ blocks
    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def write(self, slot: int, key: bytes, seq: int, rows: Sequence[memoryview]) -> None:
        """Write one block: the rows first, then the header naming ``key``. Raises
        ``OSError`` as the filesystem does (the caller counts it and drops the spill)."""
        if len(key) > KEY_BYTES:
            raise TierError(f"a key of {len(key)} bytes; the disk tier holds at most {KEY_BYTES}")
        crc = 0
        for row in rows:
            crc = zlib.crc32(row, crc)
        head = _HEADER.pack(MAGIC, seq, self.layout_digest, self.world_size * self.row_stride,
                            crc, len(key), 0, key)
        buf = _page()
        buf[:len(head)] = head
        buf[len(head):len(head) + 4] = _CRC.pack(zlib.crc32(head))
        self._transfer(os.pwritev, slot, memoryview(buf), rows)

    def read(self, slot: int, key: bytes, rows: Sequence[memoryview]) -> bool:
        """Read the block of ``slot`` into ``rows``; True only if its header names ``key``
        and the data's CRC matches (on False the rows hold garbage: never serve them)."""
        buf = _page()
        self._transfer(os.preadv, slot, memoryview(buf), rows)
        header = self._decode(bytes(buf[:_HEADER.size + 4]))
        if header is None or header.key != key:
            return False
        crc = 0
        for row in rows:
            crc = zlib.crc32(row, crc)
        return crc == header.data_crc

    def _transfer(self, call, slot: int, header: memoryview, rows: Sequence[memoryview]) -> None:
        """The header and the rows of ``slot`` in one positioned call when the rows lie
        back to back in the slot (4 KiB aligned rows), else one call each. Order does not
        matter for safety: the header names the data's CRC, so a slot torn anywhere does
        not check."""
        base = self.offset(slot)
        if self.row_span == self.row_stride:
            self._full(call, [header, *rows], base)
            return
        self._full(call, [header], base)
        for rank, row in enumerate(rows):
            self._full(call, [row], base + HEADER_BYTES + rank * self.row_span)

    def read_header(self, slot: int) -> SlotHeader | None:
        """The slot's header if it is whole, of this layout; else None."""
        buf = memoryview(_page())
        self._full(os.preadv, [buf], self.offset(slot))
        return self._decode(bytes(buf[:_HEADER.size + 4]))

    def _decode(self, raw: bytes) -> SlotHeader | None:
        head, (crc,) = raw[:_HEADER.size], _CRC.unpack(raw[_HEADER.size:])
        if head[:8] != MAGIC or zlib.crc32(head) != crc:
            return None
        _, seq, layout, data_bytes, data_crc, key_len, _, key = _HEADER.unpack(head)
        if layout != self.layout_digest or data_bytes != self.world_size * self.row_stride \
                or key_len > KEY_BYTES:
            return None
        return SlotHeader(seq, key[:key_len], data_crc)

    def _full(self, call, views: list, offset: int) -> None:
        want = sum(len(v) for v in views)
        done = call(self._fd, views, offset)
        if done != want:
            raise OSError(errno.EIO, f"short {'read' if call is os.preadv else 'write'} of "
                          f"{done} of {want} bytes at offset {offset} of {self.path}")

    def scan(self) -> list[tuple[int, SlotHeader]]:
        """Every slot whose header is whole (data CRCs are checked on read, not here)."""
        found = []
        for slot in range(self.num_slots):
            header = self.read_header(slot)
            if header is not None:
                found.append((slot, header))
        return found

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _page() -> mmap.mmap:
    """A zeroed, page-aligned 4 KiB buffer (what O_DIRECT needs for a header); one per call,
    since the tier's I/O threads read and write headers at once."""
    return mmap.mmap(-1, HEADER_BYTES)

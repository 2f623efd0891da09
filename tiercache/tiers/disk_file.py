"""The disk tier's file: one preallocated file of fixed, block-sized slots on a local
filesystem, each slot a header and one host block (every rank's row of it), after the
file's own header (``disk_claim``: who made it, who holds it).

File layout::

    offset                     size                 what
    0                          4096                 the file's header (``disk_claim``)
    4096 + s*S                 S = slot_bytes       slot s:
      + 0                      4096                   its header (``block_header``: a
                                                      DISK_SLOT header, rank ALL_RANKS)
      + 4096 + r*R             R = round_up(row_stride, 4096)   rank r's row (row_stride
                                                      bytes used; the rest is padding)

``disk.capacity`` is the slots' bytes; the file is 4 KiB larger.

Decisions and reasons:

* **One preallocated file, fixed slots** (``posix_fallocate`` at start: a full disk is a
  start-up error, not a failed write later). For a single-owner local NVMe this beat
  file-per-chunk in every peer's published measurements (not repeated here); this file's
  rate against the disk's raw O_DIRECT rate is docs/benchmarks.md, "Disk tier (issue 18)".
* **Claimed once** (``disk_claim``): the directory and the file are checked on the
  descriptors used, the file locked against a second coordinator; every read and write
  goes through that one descriptor.
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
* **Bound to this file's instance.** Every slot header names the instance id in the
  file's header (random when the file was made, or remade for another geometry): a slot
  another instance wrote (a file copied or transplanted, two writers of one path before
  the lock) is never served; a file made under another name (``tiercache-a.disk`` copied
  to ``tiercache-b.disk``) is refused at start. A file whose own header does not check (an
  older format, damage) or names another geometry starts empty under a new instance id
  (``fresh_reason`` says why; its old slots can never check again).
* **No header read from disk can stop the tier**: decoding never raises, and a seq past
  ``MAX_SEQ`` is not whole (``block_header``), so the next write's seq stays in range.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiercache.errors import ConfigError
from tiercache.region.layout import round_up
from tiercache.tiers.block_header import ALL_RANKS, BlockHeader, Container, checksum
from tiercache.sizes import format_bytes
from tiercache.tiers.disk_claim import (
    FILE_HEADER_BYTES, FileHeader, check_claimable, claim, new_instance, unclaim,
)

HEADER_BYTES = 4096
ALIGN = 4096


def _slot_bytes(world_size: int, row_stride: int) -> int:
    return HEADER_BYTES + world_size * round_up(row_stride, ALIGN)


def _num_slots(capacity_bytes: int, world_size: int, row_stride: int) -> int:
    """How many slots ``capacity_bytes`` holds; ``ConfigError`` when not one."""
    slot_bytes = _slot_bytes(world_size, row_stride)
    if capacity_bytes < slot_bytes:
        raise ConfigError(f"disk.capacity = {capacity_bytes} bytes holds no block of "
                          f"{slot_bytes} bytes (header + {world_size} row(s)); "
                          "give at least one block")
    return capacity_bytes // slot_bytes


@dataclass(frozen=True)
class SlotHeader:
    seq: int
    key: bytes
    data_crc: int


class DiskSlotFile:
    """The slot file at ``path`` (created 0600 and preallocated, or reopened; claimed:
    see ``disk_claim``). ``rows`` gives, for a host slot, each rank's row as a writable
    buffer (in the coordinator's mapping). Thread-safe: every call is one positioned read
    or write of its own slot."""

    def __init__(self, path: str, capacity_bytes: int, *, world_size: int, row_stride: int,
                 layout_digest: bytes, direct_io: bool | None = None):
        self.path = path
        self.world_size = world_size
        self.row_stride = row_stride
        self.row_span = round_up(row_stride, ALIGN)
        self.slot_bytes = _slot_bytes(world_size, row_stride)
        self.num_slots = _num_slots(capacity_bytes, world_size, row_stride)
        self.layout_digest = layout_digest
        self.direct_io_reason = ""
        self.fresh_reason = ""  # why the file started empty ("" when its blocks were kept)
        claimed = claim(path)
        self._fd = claimed.fd
        try:
            self._preallocate(FILE_HEADER_BYTES + self.num_slots * self.slot_bytes)
            self.instance = self._adopt()
            self.direct_io = self._choose_direct(direct_io, row_stride % ALIGN == 0)
        except BaseException:
            unclaim(path, claimed)  # a file this start made goes with it
            self._fd = -1
            raise

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def check(path: str, capacity_bytes: int, *, world_size: int, row_stride: int) -> None:
        """What the constructor would refuse, found before anything is created or
        allocated (the coordinator checks it before it allocates the region): no block
        fits ``capacity_bytes``, the directory or a file under the name may not be used
        (``disk_claim.check_claimable``), or the filesystem has not the room the file
        still needs. ``ConfigError`` (one line)."""
        num_slots = _num_slots(capacity_bytes, world_size, row_stride)
        need = FILE_HEADER_BYTES + num_slots * _slot_bytes(world_size, row_stride)
        missing = need - check_claimable(path)
        st = os.statvfs(os.path.dirname(os.path.abspath(path)))
        free = st.f_bavail * st.f_frsize
        if missing > free:
            raise ConfigError(
                f"disk.capacity = {capacity_bytes} bytes: {path} needs {need} bytes "
                f"({format_bytes(need)}), {missing} more than it has, and its filesystem has "
                f"{free} bytes ({format_bytes(free)}) free; shrink disk.capacity or free "
                "room there")

    def _preallocate(self, num_bytes: int) -> None:
        size = os.fstat(self._fd).st_size
        try:
            os.posix_fallocate(self._fd, 0, num_bytes)
        except OSError as e:
            # a failed allocation may keep what it got before the disk ran full (73 GB in a
            # test here): give it back, keeping the file's own bytes
            os.ftruncate(self._fd, size)
            free = os.fstatvfs(self._fd)
            raise ConfigError(
                f"disk.capacity: cannot allocate {num_bytes} bytes in {self.path} "
                f"({e.strerror}; {free.f_bavail * free.f_frsize} bytes free there)") from e

    def _adopt(self) -> bytes:
        """This file's instance id: the one its header names if it is a file of this
        name and geometry, else a new one (the file starts empty, ``fresh_reason`` says
        why). A file made under another name is refused. The header is rewritten naming
        this process as the holder."""
        name = os.path.basename(self.path)
        raw = os.pread(self._fd, FILE_HEADER_BYTES, 0)
        found = FileHeader.decode(raw)
        wanted = FileHeader(new_instance(), self.layout_digest, self.world_size,
                            self.row_stride, self.slot_bytes, time.time_ns(), name)
        if found is not None and found.name != name:
            raise ConfigError(f"disk tier file {self.path} was made as {found.name!r}, not "
                              f"{name!r} (copied or renamed from another instance): its "
                              "blocks are not this instance's; remove it or move it back")
        if found is None:
            self.fresh_reason = ("a new file" if not any(raw) else
                                 "its header did not check (an older format, or damaged)")
        elif (found.layout, found.world_size, found.row_stride, found.slot_bytes) != \
                (wanted.layout, wanted.world_size, wanted.row_stride, wanted.slot_bytes):
            self.fresh_reason = "it was made for another block geometry"
        else:
            wanted = found
        head = bytearray(_page())
        encoded = wanted.held_by_me().encode()
        head[:len(encoded)] = encoded
        self._full(os.pwritev, [memoryview(head)], 0)
        os.fsync(self._fd)  # the instance id is on disk before any slot names it
        return wanted.instance

    def _choose_direct(self, wanted: bool | None, aligned_rows: bool) -> bool:
        """O_DIRECT, switched on the claimed descriptor, when the filesystem takes it and
        the rows are aligned; ``wanted`` True makes either missing an error, False turns
        it off."""
        if wanted is False:
            return False
        why = None
        if not aligned_rows:
            why = (f"region rows of {self.row_stride} bytes are not {ALIGN}-byte aligned "
                   "(O_DIRECT reads and writes them in place)")
        else:
            try:
                flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
                fcntl.fcntl(self._fd, fcntl.F_SETFL, flags | os.O_DIRECT)
                return True
            except OSError as e:
                why = f"the filesystem refuses O_DIRECT ({e.strerror})"
        if wanted:
            raise ConfigError(f"disk.direct_io = true, but {why}")
        self.direct_io_reason = why
        return False

    # ------------------------------------------------------------------ blocks
    def offset(self, slot: int) -> int:
        return FILE_HEADER_BYTES + slot * self.slot_bytes

    def write(self, slot: int, key: bytes, seq: int, rows: Sequence[memoryview]) -> None:
        """Write one block under ``key``: its header (this instance's) and rows. Raises
        ``OSError`` as the filesystem does (the caller counts it and drops the spill), and
        ``TierError`` for a key longer than ``block_header.KEY_BYTES``."""
        header = BlockHeader(Container.DISK_SLOT, self.layout_digest, self.instance, seq,
                             ALL_RANKS, self.world_size, self.world_size * self.row_stride,
                             checksum(rows), key)
        sealed = header.seal(None)
        buf = _page()
        buf[:len(sealed)] = sealed
        self._transfer(os.pwritev, slot, memoryview(buf), rows)

    def read(self, slot: int, key: bytes, rows: Sequence[memoryview]) -> bool:
        """Read the block of ``slot`` into ``rows``; True only if its header is this
        instance's, names ``key`` and the data's CRC matches (on False the rows hold
        garbage: never serve them). Raises nothing but ``OSError``."""
        buf = _page()
        self._transfer(os.preadv, slot, memoryview(buf), rows)
        header = self._decode(bytes(buf[:HEADER_BYTES]))
        return header is not None and header.key == key and header.holds(rows)

    def _transfer(self, call: Callable, slot: int, header: memoryview,
                  rows: Sequence[memoryview]) -> None:
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
        """The slot's header if it is whole, this instance's, of this layout; else None."""
        buf = memoryview(_page())
        self._full(os.preadv, [buf], self.offset(slot))
        header = self._decode(bytes(buf))
        return None if header is None else SlotHeader(header.seq, header.key, header.data_crc)

    def _decode(self, raw: bytes) -> BlockHeader | None:
        header = BlockHeader.decode(raw, Container.DISK_SLOT)
        if header is None or header.instance != self.instance \
                or header.format != self.layout_digest or header.rank != ALL_RANKS \
                or header.world_size != self.world_size \
                or header.data_bytes != self.world_size * self.row_stride:
            return None
        return header

    def _full(self, call: Callable, views: list, offset: int) -> None:
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
        """Close the file (its lock goes with the descriptor)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _page() -> mmap.mmap:
    """A zeroed, page-aligned 4 KiB buffer (what O_DIRECT needs for a header); one per call,
    since the tier's I/O threads read and write headers at once."""
    return mmap.mmap(-1, HEADER_BYTES)

"""Region layout: pure arithmetic over the geometry, no I/O.

::

    offset 0                     header_bytes           + slice_bytes          + slice_bytes
    | header (fixed part, stats  | rank 0 slice          | rank 1 slice         | ...
    |  blocks: attachments_per_  | row 0 | row 1 | ...   | row 0 | row 1 | ... |
    |  rank per rank, index      |
    |  ledger, session table,    |
    |  padding)                  |

A slice is ``num_blocks`` rows of ``row_stride`` bytes, starting on a 2 MiB boundary,
so each rank can pin exactly its own contiguous range. A row holds one CPU block of
that rank: ``[tensor 0 page | tensor 1 page | ...]``; tensor t's page is
``block_size_factor`` GPU pages (``cpu_page_bytes[t]``) starting at
``page_offsets[t]`` (256-byte aligned). Rows are 256-byte aligned and page-aligned
(4 KiB) where that wastes at most 1/32 of a row.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from functools import cached_property

from tiercache.config import MAX_ATTACHMENTS_PER_RANK, MAX_TENSORS, Config
from tiercache.sizes import format_bytes
from tiercache.errors import ConfigError, RankError
from tiercache.region.ledger import RECORD_BYTES as LEDGER_RECORD_BYTES
from tiercache.region.sessions import MAX_SESSIONS, RECORD_BYTES as SESSION_RECORD_BYTES
from tiercache.region.stats import STATS_BLOCK_BYTES

# 2: the index ledger after the stats blocks; 3: attachments_per_rank stats blocks per rank;
# 4: region_id in the header, ledger records with generation, writer, pins and checksum,
# the session table after the ledger
FORMAT_VERSION = 4
HEADER_FIXED_BYTES = 4096
SLICE_ALIGN = 2 << 20
ROW_ALIGN = 256
OS_PAGE = 4096  # the smallest Linux page: rows and pre-fault ranges align to it
MAX_REGISTRATION_BYTES = 64 << 30  # one cudaHostRegister >= 512 GiB fails on r580+ drivers
_PAGE_ALIGN_MAX_WASTE = 32  # page-align rows when the padding is <= 1/32 of a row


def registration_rows(row_stride: int, max_bytes: int = MAX_REGISTRATION_BYTES) -> int:
    """Rows per registration of a slice: a registration boundary falls before every row
    whose slot is a multiple of this (one DMA over two registrations fails)."""
    return max(max_bytes // row_stride, 1)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class RegionLayout:
    """Geometry of one region; every offset is derived, nothing is stored twice."""

    world_size: int
    num_blocks: int
    page_bytes: tuple[int, ...]  # GPU page bytes per tensor
    block_size_factor: int = 1
    attachments_per_rank: int = 4  # stats blocks (attachment slots) per rank

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world_size = {self.world_size}: must be >= 1")
        if self.num_blocks < 1:
            raise ConfigError(f"num_blocks = {self.num_blocks}: must be >= 1")
        if not self.page_bytes or any(b <= 0 for b in self.page_bytes):
            raise ConfigError(f"page_bytes = {self.page_bytes}: need >= 1 positive sizes")
        if len(self.page_bytes) > MAX_TENSORS:
            raise ConfigError(f"{len(self.page_bytes)} tensors: the region header describes at "
                              f"most {MAX_TENSORS}")
        if self.block_size_factor < 1:
            raise ConfigError(f"block_size_factor = {self.block_size_factor}: must be >= 1")
        if not 1 <= self.attachments_per_rank <= MAX_ATTACHMENTS_PER_RANK:
            raise ConfigError(f"attachments_per_rank = {self.attachments_per_rank}: allowed "
                              f"1..{MAX_ATTACHMENTS_PER_RANK}")

    @classmethod
    def from_config(cls, config: Config) -> RegionLayout:
        kv, region = config.kv, config.region
        num_blocks = region.num_blocks
        if num_blocks is None:
            assert region.capacity_bytes is not None
            probe = cls(config.world_size, 1, kv.page_bytes, kv.block_size_factor,
                        region.attachments_per_rank)
            per_block = probe.row_stride * config.world_size
            num_blocks = region.capacity_bytes // per_block
            if num_blocks < 1:
                raise ConfigError(
                    f"region.capacity = {format_bytes(region.capacity_bytes)} is smaller than one "
                    f"CPU block across {config.world_size} rank(s) ({format_bytes(per_block)})"
                )
        return cls(config.world_size, num_blocks, kv.page_bytes, kv.block_size_factor,
                   region.attachments_per_rank)

    # ------------------------------------------------------------ rows
    @property
    def num_tensors(self) -> int:
        return len(self.page_bytes)

    @cached_property
    def cpu_page_bytes(self) -> tuple[int, ...]:
        return tuple(b * self.block_size_factor for b in self.page_bytes)

    @cached_property
    def page_offsets(self) -> tuple[int, ...]:
        offsets, cursor = [], 0
        for size in self.cpu_page_bytes:
            offsets.append(cursor)
            cursor = round_up(cursor + size, ROW_ALIGN)
        return tuple(offsets)

    @cached_property
    def row_stride(self) -> int:
        used = self.page_offsets[-1] + self.cpu_page_bytes[-1]
        aligned = round_up(used, ROW_ALIGN)
        paged = round_up(used, OS_PAGE)
        return paged if (paged - used) * _PAGE_ALIGN_MAX_WASTE <= used else aligned

    @property
    def row_payload_bytes(self) -> int:
        return sum(self.cpu_page_bytes)

    # ------------------------------------------------------------ slices and header
    @property
    def ledger_offset(self) -> int:
        """Where the index ledger starts: right after the stats blocks (see region.ledger)."""
        return HEADER_FIXED_BYTES + self.world_size * self.attachments_per_rank * STATS_BLOCK_BYTES

    @property
    def ledger_bytes(self) -> int:
        """One ledger record per slot; part of the header, so of the digest's format."""
        return self.num_blocks * LEDGER_RECORD_BYTES

    @property
    def sessions_offset(self) -> int:
        """Where the session table starts: right after the ledger (see region.sessions)."""
        return self.ledger_offset + self.ledger_bytes

    @property
    def sessions_bytes(self) -> int:
        return MAX_SESSIONS * SESSION_RECORD_BYTES

    @property
    def header_bytes(self) -> int:
        return round_up(self.sessions_offset + self.sessions_bytes, SLICE_ALIGN)

    def stats_offset(self, rank: int, slot: int = 0) -> int:
        """Offset of the stats block of ``rank``'s attachment slot ``slot``: the blocks of
        rank r are ``attachments_per_rank`` consecutive ones (see region.attachments)."""
        self.check_rank(rank)
        self.check_slot(slot)
        return HEADER_FIXED_BYTES + (rank * self.attachments_per_rank + slot) * STATS_BLOCK_BYTES

    @property
    def slice_bytes(self) -> int:
        return round_up(self.num_blocks * self.row_stride, SLICE_ALIGN)

    @property
    def slice_used_bytes(self) -> int:
        return self.num_blocks * self.row_stride

    def slice_offset(self, rank: int) -> int:
        self.check_rank(rank)
        return self.header_bytes + rank * self.slice_bytes

    @property
    def total_bytes(self) -> int:
        return self.header_bytes + self.world_size * self.slice_bytes

    def row_offset(self, rank: int, block: int) -> int:
        if not 0 <= block < self.num_blocks:
            raise ConfigError(f"block {block} outside 0..{self.num_blocks - 1}")
        return self.slice_offset(rank) + block * self.row_stride

    def page_offset(self, rank: int, block: int, tensor: int) -> int:
        return self.row_offset(rank, block) + self.page_offsets[tensor]

    def check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise RankError(f"rank {rank!r} is outside 0..{self.world_size - 1} "
                            f"(world_size {self.world_size})")

    def check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.attachments_per_rank:
            raise RankError(f"attachment slot {slot!r} is outside "
                            f"0..{self.attachments_per_rank - 1}"
                            f" (attachments_per_rank {self.attachments_per_rank})")

    # ------------------------------------------------------------ work splitting
    def registrations(self, rank: int, max_bytes: int = MAX_REGISTRATION_BYTES
                      ) -> list[tuple[int, int]]:
        """(offset, length) registrations covering ``rank``'s rows, each <= max_bytes and
        cut on row boundaries (every ``registration_rows`` rows), so no block copy straddles
        two registrations; ``staged`` merges no DMA across them either."""
        rows_each = registration_rows(self.row_stride, max_bytes)
        start = self.slice_offset(rank)
        ranges = []
        for first in range(0, self.num_blocks, rows_each):
            rows = min(rows_each, self.num_blocks - first)
            ranges.append((start + first * self.row_stride, rows * self.row_stride))
        return ranges

    def prefault_ranges(self, num_threads: int, start: int = 0, length: int | None = None
                        ) -> list[tuple[int, int]]:
        """Disjoint, OS-page-aligned (offset, length) ranges covering [start, start+length)."""
        length = self.total_bytes - start if length is None else length
        step = round_up(-(-length // max(num_threads, 1)), OS_PAGE)
        end = start + length
        return [(off, min(step, end - off)) for off in range(start, end, step)]

    # ------------------------------------------------------------ identity
    def encode(self) -> bytes:
        """The geometry as stored in the region header (see RegionHeader)."""
        return struct.pack(
            f"<IIQI{self.num_tensors}QI", self.world_size, self.block_size_factor,
            self.num_blocks, self.num_tensors, *self.page_bytes, self.attachments_per_rank,
        )

    @classmethod
    def decode(cls, data: bytes) -> RegionLayout:
        world, factor, blocks, ntensors = struct.unpack_from("<IIQI", data)
        pages = struct.unpack_from(f"<{ntensors}Q", data, struct.calcsize("<IIQI"))
        (attachments,) = struct.unpack_from("<I", data, struct.calcsize(f"<IIQI{ntensors}Q"))
        return cls(world, blocks, tuple(pages), factor, attachments)

    @cached_property
    def digest(self) -> bytes:
        """16 bytes naming the format version and the geometry."""
        return hashlib.sha256(struct.pack("<I", FORMAT_VERSION) + self.encode()).digest()[:16]

    def describe(self) -> str:
        return (
            f"{self.world_size} rank(s) x {self.num_blocks} blocks x "
            f"{format_bytes(self.row_stride)} "
            f"rows ({self.num_tensors} tensors, block_size_factor {self.block_size_factor}, "
            f"{self.attachments_per_rank} attachment(s) per rank); "
            f"{format_bytes(self.total_bytes)} in all"
        )

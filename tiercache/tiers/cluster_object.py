"""What the cluster tier stores in the pool: one object per block and rank, named by the
block's key, the block format's geometry and the rank, made of a header and the rank's row.

Name: ``tiercache/<format>/r<rank>/<key as hex>``, where ``<format>`` is ``BlockFormat.digest``
(32 hex digits) over the object format version and the geometry of one block: world size,
page sizes, block size factor, row stride. Not the number of blocks: nodes with regions of
different sizes share, nodes of another model layout never see each other's objects (the
key, namespaced by the vLLM adapter, already names model, dtype and parallel layout; the
format adds what the region's geometry says).

Object layout::

    offset  size        what
    0       512         header (below)
    512     row_stride  the rank's row of the block, as the host region holds it

Header, little-endian (the rest of its 512 bytes is zero)::

    offset  size  field
    0       8     magic        b"TCPOOL01"
    8       16    format       BlockFormat.digest
    24      4     rank         u32
    28      4     world_size   u32
    32      8     data_bytes   u64: row_stride
    40      4     data_crc     u32: CRC-32C (Castagnoli) of the row
    44      2     key_len      u16
    46      2     reserved
    48      256   key          the block's key
    304     4     header_crc   u32: zlib.crc32 of bytes 0..304

Every get checks the header (magic, its CRC, format, rank, length, key) and the row's CRC
before the block becomes READY in host memory: an object written by anyone else, cut
short, or damaged in the pool is a miss, never a load.

The row's checksum is CRC-32C, computed with the CPU's instruction (the ``crc32c``
package; about 15 GB/s a core, against 3.8 GB/s for zlib's CRC-32 on the development VM):
a node publishes into its own segment at memory speed, and zlib's CRC held publishing to
a quarter of it (docs/benchmarks.md). The header's own CRC stays zlib's (304 bytes).
"""

from __future__ import annotations

import hashlib
import struct
import zlib

from crc32c import crc32c
from dataclasses import dataclass
from functools import cached_property

from tiercache.errors import TierError
from tiercache.region.layout import RegionLayout
from tiercache.region.ledger import KEY_BYTES

FORMAT_VERSION = 1
MAGIC = b"TCPOOL01"
HEADER_BYTES = 512
_HEADER = struct.Struct("<8s16sIIQIHH256s")
_CRC = struct.Struct("<I")
assert _HEADER.size == 304


@dataclass(frozen=True)
class BlockFormat:
    """The geometry of one block in the pool (see the module docstring)."""

    world_size: int
    row_stride: int
    page_bytes: tuple[int, ...]
    block_size_factor: int

    @classmethod
    def of(cls, layout: RegionLayout) -> BlockFormat:
        return cls(layout.world_size, layout.row_stride, tuple(layout.page_bytes),
                   layout.block_size_factor)

    @cached_property
    def digest(self) -> bytes:
        raw = struct.pack(f"<IIIQI{len(self.page_bytes)}Q", FORMAT_VERSION, self.world_size,
                          self.block_size_factor, self.row_stride, len(self.page_bytes),
                          *self.page_bytes)
        return hashlib.sha256(raw).digest()[:16]

    @cached_property
    def object_bytes(self) -> int:
        return HEADER_BYTES + self.row_stride

    def name(self, key: bytes, rank: int) -> str:
        return f"tiercache/{self.digest.hex()}/r{rank}/{key.hex()}"

    def header(self, key: bytes, rank: int, row) -> bytes:
        """The header of ``key``'s object for ``rank`` whose row is ``row`` (its CRC taken
        now: the caller holds the row pinned until the put is done)."""
        if len(key) > KEY_BYTES:
            raise TierError(f"a key of {len(key)} bytes; the cluster tier holds at most "
                            f"{KEY_BYTES}")
        head = _HEADER.pack(MAGIC, self.digest, rank, self.world_size, self.row_stride,
                            crc32c(row), len(key), 0, key)
        return head + _CRC.pack(zlib.crc32(head))

    def check(self, header, key: bytes, rank: int, row) -> bool:
        """Whether ``header`` (the first bytes of a fetched object) names exactly this
        block, format and rank, and ``row`` matches its CRC."""
        raw = bytes(header[:_HEADER.size + _CRC.size])
        head, (crc,) = raw[:_HEADER.size], _CRC.unpack(raw[_HEADER.size:])
        if head[:8] != MAGIC or zlib.crc32(head) != crc:
            return False
        _, digest, got_rank, world, data_bytes, data_crc, key_len, _, got_key = \
            _HEADER.unpack(head)
        if (digest != self.digest or got_rank != rank or world != self.world_size
                or data_bytes != self.row_stride or key_len > KEY_BYTES
                or got_key[:key_len] != key):
            return False
        return crc32c(row) == data_crc

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
    0       512         header: ``block_header`` (a POOL_OBJECT header for one rank, with
                        the cluster's MAC), the rest zero
    512     row_stride  the rank's row of the block, as the host region holds it

Every get checks the header (magic, its CRC, format, rank, world size, length, key), the
row's CRC-32C and the MAC over both, before the block is handed back: an object written
by anyone without the cluster's key (``cluster.key_file``), cut short, damaged in the pool
or of another block is a miss, never a load. The CRC is checked first (cheap; damage),
the MAC last (authority).

``BlockFormat`` carries the MAC (``mac``, not part of its identity or digest): the format
of a block in this cluster's pool is its geometry and the key that signs it.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from tiercache.errors import TierError
from tiercache.region.layout import RegionLayout
from tiercache.tiers.block_header import (
    SEALED_BYTES, ZERO_ID, BlockHeader, BlockMac, Container, checksum,
)

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

FORMAT_VERSION = 2  # 2: the shared header codec with the cluster's MAC
HEADER_BYTES = 512
assert SEALED_BYTES <= HEADER_BYTES


@dataclass(frozen=True)
class BlockFormat:
    """The geometry of one block in the pool (see the module docstring), and ``mac``, the
    cluster's key that signs and checks every object."""

    world_size: int
    row_stride: int
    page_bytes: tuple[int, ...]
    block_size_factor: int
    mac: BlockMac | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, layout: RegionLayout, mac: BlockMac | None = None) -> BlockFormat:
        return cls(layout.world_size, layout.row_stride, tuple(layout.page_bytes),
                   layout.block_size_factor, mac)

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

    def header(self, key: bytes, rank: int, row: ReadableBuffer) -> bytes:
        """The sealed header (``SEALED_BYTES``) of ``key``'s object for ``rank`` whose row
        is ``row``: its CRC and MAC taken now, over ``row`` as it is (the caller holds it
        still until the object is written)."""
        mac = self._mac()
        head = BlockHeader(Container.POOL_OBJECT, self.digest, ZERO_ID, 0, rank,
                           self.world_size, self.row_stride, checksum([row]), key)
        return head.seal(mac, [row])

    def check(self, header: ReadableBuffer, key: bytes, rank: int, row: ReadableBuffer,
              ) -> bool:
        """Whether ``header`` (the first bytes of a fetched object) names exactly this
        block, format and rank, ``row`` matches its CRC, and the MAC over both is the
        cluster key's. Never raises for what came from the pool."""
        raw = bytes(memoryview(header)[:SEALED_BYTES])
        got = BlockHeader.decode(raw, Container.POOL_OBJECT)
        if (got is None or got.format != self.digest or got.rank != rank
                or got.world_size != self.world_size or got.key != key
                or not got.holds([row])):
            return False
        return self._mac().verify(raw, [row])

    def _mac(self) -> BlockMac:
        if self.mac is None:
            raise TierError("the cluster tier signs and checks every pool object with the "
                            "cluster's key: this block format has none (cluster.key_file)")
        return self.mac

"""The one header codec and the one block-integrity checksum of the lower tiers' byte
containers: the disk tier's slot (``disk_file``) and the cluster tier's pool object
(``cluster_object``) carry the same header in front of their bytes, and the pool's adds a
keyed MAC. Nothing here does I/O.

Header, little-endian (``SEALED_BYTES``; the container pads it: 4096 bytes on disk, 512
in the pool, the padding zero and never read)::

    offset  size  field
    0       8     magic       the container: b"TCDISK02" a disk slot, b"TCPOOL02" a pool object
    8       16    format      the block geometry's digest (disk: the region's layout digest;
                              pool: ``BlockFormat.digest``)
    24      16    instance    who may have written it (disk: the file's random instance id;
                              pool: zero, the MAC says who)
    40      8     seq         u64 write order, at most ``MAX_SEQ`` (disk; pool: 0)
    48      4     rank        u32 the rank whose row this is; ``ALL_RANKS`` for every rank's
                              rows in rank order (disk)
    52      4     world_size  u32
    56      8     data_bytes  u64 bytes after the header: the rows, unpadded
    64      4     data_crc    u32 ``checksum`` (CRC-32C) of those bytes
    68      2     key_len     u16 (<= KEY_BYTES)
    70      2     reserved    0
    72      256   key         the block's key, zero padded
    328     4     header_crc  u32 ``checksum`` of bytes 0..328
    332     32    mac         HMAC-SHA256 under the cluster's key of bytes 0..332 and then
                              the data bytes (pool); zero (disk)

Decisions and reasons:

* **One checksum: CRC-32C** (Castagnoli, the CPU's instruction through the ``crc32c``
  package: about 15 GB/s a core on the development VM against 4 GB/s for zlib's CRC-32).
  It catches damage and mix-ups (a torn write, a flipped bit, another key), not an
  adversary: anyone can recompute it.
* **Decoding never raises.** Every field of a header read from a file or a pool is
  untrusted: ``BlockHeader.decode`` answers None for anything that is not a whole header of
  the asked container (magic, CRC, ranges), so no header can stop a tier's thread; a seq
  past ``MAX_SEQ`` (2**62, a thousand years of writes at 10**8 a second) is not whole, so a
  damaged or forged header never drives the next write's sequence number out of range.
* **The pool's MAC: HMAC-SHA256**, keyed by ``cluster.key_file`` (shared by the nodes,
  read by nobody else). It covers the header and the bytes, so a peer who reaches the
  pool but not the key can neither forge an object under tiercache's names nor replace
  one (a recomputed CRC does not help it). HMAC-SHA256 over keyed BLAKE2b: 1.8 against
  0.93 GB/s a core on the development VM (its SHA extensions); both from ``hashlib``
  (docs/benchmarks.md). The tag is compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from crc32c import crc32c

from tiercache.errors import TierError

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

KEY_BYTES = 256
DIGEST_BYTES = 16  # format and instance fields
MAC_BYTES = 32
MIN_KEY_BYTES = 32  # what cluster.key_file must hold at least
MAX_SEQ = 1 << 62
ALL_RANKS = 0xFFFFFFFF
_FIELDS = struct.Struct("<8s16s16sQIIQIHH256s")
_U32 = struct.Struct("<I")
HEADER_BYTES = _FIELDS.size + _U32.size  # what the CRC closes
SEALED_BYTES = HEADER_BYTES + MAC_BYTES
assert (_FIELDS.size, HEADER_BYTES, SEALED_BYTES) == (328, 332, 364)
ZERO_ID = bytes(DIGEST_BYTES)


class Container(Enum):
    """Which byte container a header opens: its magic."""

    DISK_SLOT = b"TCDISK02"
    POOL_OBJECT = b"TCPOOL02"


def checksum(buffers: Sequence[ReadableBuffer], crc: int = 0) -> int:
    """CRC-32C over ``buffers`` in order (anything with the buffer protocol)."""
    for buf in buffers:
        crc = crc32c(buf, crc)
    return crc


@dataclass(frozen=True)
class BlockHeader:
    """One block's header (see the module docstring). Built by a writer, it is validated
    here (``TierError`` for a value out of range: a caller's bug, never data)."""

    container: Container
    format: bytes
    instance: bytes
    seq: int
    rank: int
    world_size: int
    data_bytes: int
    data_crc: int
    key: bytes

    def __post_init__(self) -> None:
        if len(self.key) > KEY_BYTES:
            raise TierError(f"a key of {len(self.key)} bytes; the lower tiers hold at most "
                            f"{KEY_BYTES}")
        if len(self.format) != DIGEST_BYTES or len(self.instance) != DIGEST_BYTES:
            raise TierError(f"a block header's format and instance are {DIGEST_BYTES} bytes "
                            f"each, not {len(self.format)} and {len(self.instance)}")
        if not 0 <= self.seq < 1 << 64:  # written up to u64; read back only up to MAX_SEQ
            raise TierError(f"a block header's seq of {self.seq}: allowed 0..2**64-1")
        for name, value, top in (("rank", self.rank, ALL_RANKS),
                                 ("world_size", self.world_size, ALL_RANKS),
                                 ("data_crc", self.data_crc, 0xFFFFFFFF),
                                 ("data_bytes", self.data_bytes, 1 << 63)):
            if not 0 <= value <= top:
                raise TierError(f"a block header's {name} of {value}: allowed 0..{top}")

    def encode(self) -> bytes:
        """The header's ``HEADER_BYTES`` (its CRC included; no MAC)."""
        fields = _FIELDS.pack(self.container.value, self.format, self.instance, self.seq,
                              self.rank, self.world_size, self.data_bytes, self.data_crc,
                              len(self.key), 0, self.key)
        return fields + _U32.pack(checksum([fields]))

    def seal(self, mac: BlockMac | None, data: Sequence[ReadableBuffer] = ()) -> bytes:
        """``SEALED_BYTES``: the header and, with ``mac``, its tag over the header and
        ``data`` (the block's bytes, in order); zeros in its place without."""
        head = self.encode()
        return head + (mac.tag(head, data) if mac is not None else bytes(MAC_BYTES))

    @classmethod
    def decode(cls, raw: bytes, container: Container) -> BlockHeader | None:
        """The header at the start of ``raw`` if it is a whole header of ``container``
        (magic, its CRC, every field in range), else None. Never raises."""
        if len(raw) < HEADER_BYTES or raw[:8] != container.value:
            return None
        fields = raw[:_FIELDS.size]
        (crc,) = _U32.unpack_from(raw, _FIELDS.size)
        if checksum([fields]) != crc:
            return None
        (_, fmt, instance, seq, rank, world, data_bytes, data_crc, key_len, _,
         key) = _FIELDS.unpack(fields)
        if key_len > KEY_BYTES or seq > MAX_SEQ or data_bytes > 1 << 63:
            return None
        return cls(container, fmt, instance, seq, rank, world, data_bytes, data_crc,
                   key[:key_len])

    def holds(self, data: Sequence[ReadableBuffer]) -> bool:
        """Whether ``data`` (the block's bytes, in order) has the header's length and CRC."""
        return (sum(memoryview(d).nbytes for d in data) == self.data_bytes
                and checksum(data) == self.data_crc)


def sealed_tag(raw: bytes) -> bytes:
    """The MAC field of a sealed header."""
    return bytes(raw[HEADER_BYTES:SEALED_BYTES])


class BlockMac:
    """HMAC-SHA256 under one key (the cluster's): ``tag`` of a header and its data,
    ``verify`` in constant time. Holds the key only in this object (no repr of it)."""

    def __init__(self, key: bytes):
        if len(key) < MIN_KEY_BYTES:
            raise TierError(f"a MAC key of {len(key)} bytes; give at least {MIN_KEY_BYTES}")
        self._key = bytes(key)

    def tag(self, header: bytes, data: Sequence[ReadableBuffer]) -> bytes:
        mac = hmac.new(self._key, header[:HEADER_BYTES], hashlib.sha256)
        for buf in data:
            mac.update(buf)
        return mac.digest()

    def verify(self, raw: bytes, data: Sequence[ReadableBuffer]) -> bool:
        """Whether the sealed header ``raw`` carries the tag of its header and ``data``."""
        return len(raw) >= SEALED_BYTES and hmac.compare_digest(
            self.tag(raw, data), sealed_tag(raw))

    def __repr__(self) -> str:
        return "BlockMac(<key>)"


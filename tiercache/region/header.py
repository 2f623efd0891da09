"""The region header: identity, lifecycle state and geometry, at offset 0 of the region.

Fixed part (``HEADER_FIXED_BYTES`` = 4096), little-endian::

    offset  size  field
    0       8     magic            b"TIERCACH"
    8       4     format_version   u32, FORMAT_VERSION
    12      4     state            u32, RegionState (READY is written last)
    16      16    layout_digest    RegionLayout.digest
    32      8     generation       u64, +1 each time a coordinator (re)adopts the region
    40      8     owner_pid        u64, the coordinator's pid
    48      8     owner_start_ns   u64, the coordinator's process start time (pid-reuse check)
    56      8     created_ns       u64, wall clock when the region was created
    64      8     total_bytes      u64, size of the whole region
    72      4     layout_len       u32, bytes of the encoded layout that follow
    76      4     reserved
    80      8     region_id        u64, random and never 0: this region's identity (its
                                   incarnation), kept when a coordinator re-adopts it, new
                                   when a region is created; every spec the index hands out
                                   carries it, and a worker copies only for its own region
    88      ...   layout           RegionLayout.encode() (world, factor, blocks, tensors, pages,
                                   attachments_per_rank)
    3952    4     reservation      u32, Reservation: how far the slices are reserved
                                   (fallocated). 0 (COMPLETE) is what every region of a
                                   tiercache that reserved all before READY holds
    3956    4     reserve_errno    u32, the errno that stopped the reservation (FAILED)
    3960    8     reserved_rows    u64, rows of every rank's slice reserved so far (in slot
                                   order); a slot at or past it is never handed out. Written
                                   before the index hands a slot below it out
    3968    2     socket_len       u16, bytes of the control socket path that follow
    3970    126   socket_path      the coordinator's control socket (UTF-8), so clients and
                                   ``tiercache status`` find it whatever their environment

Then, at ``HEADER_FIXED_BYTES + (rank * attachments_per_rank + slot) * STATS_BLOCK_BYTES``,
one stats block per attachment slot of each rank (see ``tiercache.region.stats`` and
``tiercache.region.attachments``), then the index ledger (``tiercache.region.ledger``) and
the session table (``tiercache.region.sessions``). The header is padded to a 2 MiB
boundary (``header_bytes``).
"""

from __future__ import annotations

import secrets
import struct
from dataclasses import dataclass
from enum import IntEnum

from tiercache.errors import LayoutMismatchError
from tiercache.region.layout import FORMAT_VERSION, HEADER_FIXED_BYTES, RegionLayout

MAGIC = b"TIERCACH"
_FIXED = struct.Struct("<8sII16sQQQQQI4xQ")
_STATE_OFFSET = 12
assert _FIXED.size == 88
_SOCKET = struct.Struct("<H126s")
_SOCKET_OFFSET = HEADER_FIXED_BYTES - _SOCKET.size
_RESERVATION = struct.Struct("<IIQ")
_RESERVATION_OFFSET = _SOCKET_OFFSET - _RESERVATION.size  # after the longest layout (MAX_TENSORS)


def new_region_id() -> int:
    """A region's identity: 64 random bits, never 0 (0 marks a spec that is not fenced)."""
    return secrets.randbits(64) or 1


class Reservation(IntEnum):
    """How far a region's slices are reserved (``tiercache.region.reservation``)."""

    COMPLETE = 0  # every row of every slice (and a region made before reservations ran late)
    RESERVING = 1  # rows [0, reserved_rows) reserved; the coordinator reserves the rest
    FAILED = 2  # stopped at reserved_rows (reserve_errno says why): the rest is never used

    @property
    def label(self) -> str:
        return self.name.lower()


class RegionState(IntEnum):
    EMPTY = 0  # never written (creator mid-setup)
    CREATING = 1
    READY = 2
    CLOSING = 3

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class HeaderInfo:
    format_version: int
    state: RegionState
    layout_digest: bytes
    generation: int
    owner_pid: int
    owner_start_ns: int
    created_ns: int
    total_bytes: int
    layout: RegionLayout
    socket_path: str = ""  # "" until the coordinator serves its control socket
    region_id: int = 0
    reservation: Reservation = Reservation.COMPLETE
    reserve_errno: int = 0
    reserved_rows: int = 0  # of every rank's slice; num_blocks once COMPLETE

    def reserved_bytes(self, rank: int) -> int:
        """Bytes of ``rank``'s slice reserved (fallocated) so far."""
        layout = self.layout
        if self.reservation == Reservation.COMPLETE:
            return layout.slice_bytes
        return min(self.reserved_rows, layout.num_blocks) * layout.row_stride


class RegionHeader:
    """Reads and writes the fixed header over a buffer: the region's first page (writable),
    or the bytes read from a region's file (for reading only)."""

    def __init__(self, buffer: bytes | bytearray | memoryview):
        self._buf = buffer

    def write(self, layout: RegionLayout, *, generation: int, owner_pid: int,
              owner_start_ns: int, created_ns: int, region_id: int) -> None:
        """Write everything with state CREATING; ``set_state(READY)`` comes last."""
        encoded = layout.encode()
        # RegionLayout caps num_tensors so the longest layout ends before the socket field
        assert _FIXED.size + len(encoded) <= _RESERVATION_OFFSET, "RegionLayout caps num_tensors"
        self.set_state(RegionState.CREATING)
        _FIXED.pack_into(self._buf, 0, MAGIC, FORMAT_VERSION, RegionState.CREATING, layout.digest,
                         generation, owner_pid, owner_start_ns, created_ns, layout.total_bytes,
                         len(encoded), region_id)
        struct.pack_into(f"{len(encoded)}s", self._buf, _FIXED.size, encoded)

    def set_state(self, state: RegionState) -> None:
        struct.pack_into("<I", self._buf, _STATE_OFFSET, state)

    def set_owner(self, *, generation: int, owner_pid: int, owner_start_ns: int) -> None:
        struct.pack_into("<QQQ", self._buf, 32, generation, owner_pid, owner_start_ns)

    def set_reservation(self, reservation: Reservation, reserved_rows: int,
                        errno: int = 0) -> None:
        """Record how far the slices are reserved (the rows first: a reader that sees
        COMPLETE or the new rows never sees fewer rows than were reserved)."""
        struct.pack_into("<Q", self._buf, _RESERVATION_OFFSET + 8, reserved_rows)
        struct.pack_into("<II", self._buf, _RESERVATION_OFFSET, reservation, errno)

    def set_socket_path(self, path: str) -> None:
        """Record where the coordinator serves its control socket (``""``: none)."""
        encoded = path.encode()
        if len(encoded) > _SOCKET.size - 2:
            raise LayoutMismatchError(f"control socket path {path!r} is {len(encoded)} bytes; "
                                      f"the region header holds at most {_SOCKET.size - 2}")
        _SOCKET.pack_into(self._buf, _SOCKET_OFFSET, 0, encoded)  # a reader sees "" meanwhile
        struct.pack_into("<H", self._buf, _SOCKET_OFFSET, len(encoded))

    @property
    def state(self) -> RegionState:
        (raw,) = struct.unpack_from("<I", self._buf, _STATE_OFFSET)
        return RegionState(raw) if raw in RegionState._value2member_map_ else RegionState.EMPTY

    def has_magic(self) -> bool:
        return bytes(self._buf[:8]) == MAGIC

    def read(self) -> HeaderInfo:
        """Decode the header; raises LayoutMismatchError for a foreign or newer format."""
        (magic, version, state, digest, generation, pid, start_ns, created_ns, total,
         layout_len, region_id) = _FIXED.unpack_from(self._buf, 0)
        if magic != MAGIC:
            raise LayoutMismatchError(f"not a tiercache region (magic {magic!r}, want {MAGIC!r})")
        if version != FORMAT_VERSION:
            raise LayoutMismatchError(f"region format version {version}; this tiercache reads "
                                      f"version {FORMAT_VERSION}")
        layout = RegionLayout.decode(bytes(self._buf[_FIXED.size:_FIXED.size + layout_len]))
        if layout.digest != digest or layout.total_bytes != total:
            raise LayoutMismatchError("region header is inconsistent (digest or size does not "
                                      "match its layout): the region is corrupt")
        socket_len, socket_raw = _SOCKET.unpack_from(self._buf, _SOCKET_OFFSET)
        socket_path = socket_raw[:socket_len].decode(errors="replace")
        reservation, reserve_errno, reserved_rows = _RESERVATION.unpack_from(
            self._buf, _RESERVATION_OFFSET)
        if reservation not in Reservation._value2member_map_:
            raise LayoutMismatchError(f"region header names reservation state {reservation}: "
                                      "the region is corrupt")
        return HeaderInfo(version, RegionState(state), digest, generation, pid, start_ns,
                          created_ns, total, layout, socket_path, region_id,
                          Reservation(reservation), reserve_errno,
                          layout.num_blocks if reservation == Reservation.COMPLETE
                          else reserved_rows)

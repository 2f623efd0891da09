"""The control-plane wire protocol: length-prefixed binary frames over a Unix socket.

Each call is one request frame answered by one response frame with the same verb
and request id. Payloads are built from a few little-endian primitives (see
``FrameHeader`` for the header and ``Verb`` for each payload; each verb's payload
codec is in ``tiercache.link.payloads``); nothing is pickled.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from enum import IntEnum
from typing import NamedTuple

import numpy as np

from tiercache import errors
from tiercache.region.ledger import KEY_BYTES as LEDGER_KEY_BYTES
from tiercache.specs import CPULoadStoreSpec

MAGIC = b"TCKV"
# 2: sessions (HELLO first), LEASE_BATCH, RELEASE, more stats; 3: fenced specs (region id and
# slot generations in PREPARE_LOAD/PREPARE_STORE answers), liveness deadline in HELLO;
# 4: LEASE_BATCH answers each hit run's fenced spec, PREPARE_STORE takes an eviction limit and
# answers the keys that found no room; 5: TIER_STATS, lease answers name promoted blocks;
# 6: lease answers name each promoted block's tier, TIER_STATS carries queued blocks;
# 7: TIER_STATS carries the tier's calls in flight; 8: STATS carries quarantined blocks,
# TIER_STATS whether the tier promotes; 9: DESCRIBE. Which versions meet, and what stays
# frozen so that any two can tell each other no: ``tiercache.link.versions``.
PROTOCOL_VERSION = 9
MAX_FRAME_BYTES = 16 << 20  # payload bound; a bigger length closes the connection
MAX_KEYS_PER_CALL = 16384  # 128 Ki tokens of 8-token blocks, 256 Ki of 16-token blocks
# Key lists in one LEASE_BATCH: each list is a lease of its own (about 10 µs of the
# coordinator's one loop even when empty), so a request's work is bounded by its lists as
# well as its keys; 1024 lists (one per request an engine admits in a step) cost about as
# much as a lease of 8 Ki keys. ``Client.lease_batch`` sends more as several requests.
MAX_LISTS_PER_BATCH = 1024
MAX_KEY_BYTES = 256
MAX_SOCKET_PATH_BYTES = 107  # sun_path is 108 bytes with the terminating NUL
TOKEN_BYTES = 16  # a session token
MAX_NAME_BYTES = 256  # a client's name in HELLO
# Requests are bounded tighter than answers: the largest is MAX_KEYS_PER_CALL keys of
# MAX_KEY_BYTES with their lengths, plus a list header per key (LEASE_BATCH). The server
# buffers at most one request per connection, so this bounds its memory per connection.
MAX_REQUEST_BYTES = 5 << 20
assert 4 + MAX_KEYS_PER_CALL * (6 + 2 + MAX_KEY_BYTES) <= MAX_REQUEST_BYTES
# The largest payload (a PREPARE_STORE answer: keys to store or without room, evicted keys,
# a slot id and generation per key to store) must fit in a frame; so must a LEASE_BATCH
# answer (per list a flag and a spec's header, per key a slot id and generation).
assert 2 * MAX_KEYS_PER_CALL * (2 + MAX_KEY_BYTES) + 16 * MAX_KEYS_PER_CALL + 64 <= MAX_FRAME_BYTES
assert 4 + MAX_KEYS_PER_CALL * (1 + 4 + 8) + 16 * MAX_KEYS_PER_CALL <= MAX_FRAME_BYTES
assert MAX_KEY_BYTES < 0xFFFF  # VARIABLE_WIDTH is never a real width
assert MAX_KEY_BYTES <= LEDGER_KEY_BYTES  # every key on the wire fits the durable index


class Verb(IntEnum):
    """What each verb carries (``keys`` and ``ids`` are described in ``PayloadWriter``)::

        verb                request                 response
        1  LOOKUP           keys                    u32 hits
        2  PREPARE_LOAD     keys                    spec (slot ids co-indexed with the keys,
                                                    their generations, the region id)
        3  TOUCH            keys                    (empty)
        4  COMPLETE_LOAD    keys                    (empty)
        5  PREPARE_STORE    u32 max evictions       u8 0 (= None), or u8 1, keys to store,
                            (0xFFFFFFFF: no limit,  spec, evicted keys, keys without room
                            all or nothing), keys   (with a limit: never None)
        6  COMPLETE_STORE   u8 success, keys        (empty)
        7  TAKE_EVENTS      (empty)                 u32 n, n x (u8 removed, str medium, keys);
                                                    at most MAX_KEYS_PER_CALL keys in all, so
                                                    a full answer means: ask again
        8  RESET            (empty)                 (empty)
        9  STATS            (empty)                 u64 per ManagerStats field, in field order
        10 PING             (empty)                 (empty)
        11 HELLO            raw token (0 or 16      raw token (16 bytes), u8 resumed,
                            bytes), str name        u32 grace in milliseconds, u32 liveness
                                                    deadline in milliseconds (0: none)
        12 LEASE_BATCH      u32 n, n x keys (at     u32 n, n x (u8 pending, spec of the
                            most MAX_LISTS_PER_     hit run: its length is the hits; a
                            BATCH lists and         load reads these slots under the
                            MAX_KEYS_PER_CALL       lease's pins, no PREPARE_LOAD)
                            keys in all)
        13 RELEASE          keys                    u32 pins dropped
        14 TIER_STATS       (empty)                 u32 n, n x (str tier, u64 per TierStats
                                                    field in field order: seconds in
                                                    microseconds, flags 0/1)
        15 DESCRIBE         u8 engine family, raw   raw digest (8 bytes), u8 node events
                            description (<= 64 KiB) on (tiercache.link.describe)

    The first request on a connection must be HELLO: it opens a session (or resumes the
    one its token names) and every later call acts for that session. An ERROR response
    (``Status.ERROR``) carries u32 error code (``ERROR_CODES``) and str message instead;
    one with request id 0 answers no request: the server refused the connection and
    closes it.
    """

    LOOKUP = 1
    PREPARE_LOAD = 2
    TOUCH = 3
    COMPLETE_LOAD = 4
    PREPARE_STORE = 5
    COMPLETE_STORE = 6
    TAKE_EVENTS = 7
    RESET = 8
    STATS = 9
    PING = 10
    HELLO = 11
    LEASE_BATCH = 12
    RELEASE = 13
    TIER_STATS = 14
    DESCRIBE = 15


class Status(IntEnum):
    OK = 0
    ERROR = 1  # payload: u32 error code, str message (see ERROR_CODES)


_HEADER = struct.Struct("<4sBBBBII")

# Exceptions that cross the wire, by code; the client re-raises the same class.
ERROR_CODES: dict[int, type[errors.TiercacheError]] = {
    1: errors.TiercacheError,  # anything unexpected on the coordinator's side
    2: errors.ManagerError,
    3: errors.UnknownKeyError,
    4: errors.StateError,
    5: errors.InvalidKeyError,
    6: errors.ProtocolError,
    7: errors.ConfigError,
    8: errors.ControlSocketError,
    9: errors.SessionLimitError,
    10: errors.NamespaceError,
}


class FrameHeader(NamedTuple):
    """The 16-byte header in front of every frame, little-endian::

        offset  size  field
        0       4     magic           b"TCKV"
        4       1     version         the connection's version (``tiercache.control.
                                      versions``: the engine's PROTOCOL_VERSION)
        5       1     verb            ``Verb``
        6       1     status          ``Status`` (requests: 0)
        7       1     reserved        0
        8       4     request_id      u32, echoed by the response
        12      4     payload_bytes   u32, <= MAX_FRAME_BYTES; the payload follows

    This layout never changes (``tiercache.link.versions``). A header with the wrong
    magic or a version other than the connection's, or an oversized length, means the
    stream cannot be trusted: the reader raises ``ProtocolError`` and the connection is
    closed.
    """

    verb: Verb
    status: Status
    request_id: int
    payload_bytes: int
    version: int = PROTOCOL_VERSION

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, self.version, self.verb, self.status, 0,
                            self.request_id, self.payload_bytes)

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview,
               version: int = PROTOCOL_VERSION) -> FrameHeader:
        """The header at the start of ``data``, which must carry ``version``."""
        magic, found, verb, status, _, request_id, size = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise errors.ProtocolError(f"bad frame magic {bytes(magic)!r}; expected {MAGIC!r}")
        if found != version:
            raise errors.ProtocolError(
                f"protocol version {found} is not supported on a connection of version "
                f"{version}")
        if size > MAX_FRAME_BYTES:
            raise errors.ProtocolError(f"frame payload of {size} bytes; at most {MAX_FRAME_BYTES}")
        if verb not in _VERBS or status not in _STATUSES:
            raise errors.ProtocolError(f"bad frame header: verb {verb}, status {status}; allowed "
                                       f"verbs {sorted(_VERBS)}, statuses {sorted(_STATUSES)}")
        return cls(_VERBS[verb], _STATUSES[status], request_id, size, found)


_VERBS = {int(v): v for v in Verb}
_STATUSES = {int(s): s for s in Status}
HEADER_BYTES = _HEADER.size


def frame(verb: Verb, request_id: int, payload: bytes, status: Status = Status.OK,
          version: int = PROTOCOL_VERSION) -> bytes:
    header = _HEADER.pack(MAGIC, version, verb, status, 0, request_id, len(payload))
    return header + payload


def frame_version(data: bytes | bytearray | memoryview) -> int:
    """The version byte of the frame at the start of ``data`` (at least ``HEADER_BYTES``),
    read before anything else of its header; ``ProtocolError`` without the magic."""
    magic, version = _HEADER.unpack_from(data)[:2]
    if magic != MAGIC:
        raise errors.ProtocolError(f"bad frame magic {bytes(magic)!r}; expected {MAGIC!r}")
    return int(version)


# ---------------------------------------------------------------- payload primitives

_U8, _U32 = struct.Struct("<B"), struct.Struct("<I")
_KEYS_HEAD = struct.Struct("<IH")


@functools.lru_cache(maxsize=64)
def _fixed_keys(n: int, width: int) -> struct.Struct:
    """Splits n keys of one width in C (a call usually repeats the last call's shape)."""
    return struct.Struct(f"{width}s" * n)

VARIABLE_WIDTH = 0xFFFF


class PayloadWriter:
    """Builds a payload from primitives.

    ``keys``: u32 n, u16 width, then, only when width is ``VARIABLE_WIDTH``, n x u16
    key lengths; then the key bytes back to back. Keys of one length (block hashes
    usually are) need no per-key lengths: width is that length.
    ``ids``: u32 n, then n x i64. ``str``: u32 n, then n bytes of UTF-8.
    ``spec`` (a fenced ``CPULoadStoreSpec``): ids, u64 region id, then n x u64 slot
    generations.
    """

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def u8(self, value: int) -> PayloadWriter:
        self._parts.append(_U8.pack(value))
        return self

    def u32(self, value: int) -> PayloadWriter:
        self._parts.append(_U32.pack(value))
        return self

    def u64s(self, values: Sequence[int]) -> PayloadWriter:
        self._parts.append(struct.pack(f"<{len(values)}Q", *values))
        return self

    def text(self, value: str) -> PayloadWriter:
        return self.raw(value.encode())

    def raw(self, data: bytes) -> PayloadWriter:
        self._parts.append(_U32.pack(len(data)))
        self._parts.append(data)
        return self

    def keys(self, keys: Sequence[bytes]) -> PayloadWriter:
        n = len(keys)
        if n > MAX_KEYS_PER_CALL:
            raise errors.ProtocolError(f"{n} keys in one call; at most {MAX_KEYS_PER_CALL}")
        if not set(map(type, keys)) <= {bytes}:
            _check_wire_keys(keys)  # raises, naming the key
        widths = set(map(len, keys))
        if widths and max(widths) > MAX_KEY_BYTES:
            _check_wire_keys(keys)  # raises, naming the key
        if len(widths) <= 1:
            self._parts.append(_KEYS_HEAD.pack(n, widths.pop() if widths else 0))
        else:
            self._parts.append(_KEYS_HEAD.pack(n, VARIABLE_WIDTH))
            self._parts.append(struct.pack(f"<{n}H", *map(len, keys)))
        self._parts.append(b"".join(keys))
        return self

    def ids(self, ids: np.ndarray) -> PayloadWriter:
        arr = np.ascontiguousarray(ids, dtype="<i8")
        self._parts.append(_U32.pack(arr.size))
        self._parts.append(arr.tobytes())
        return self

    def spec(self, spec: CPULoadStoreSpec) -> PayloadWriter:
        self.ids(spec.block_ids)
        gens = spec.slot_gens if spec.slot_gens is not None else np.zeros(len(spec), np.uint64)
        self._parts.append(struct.pack("<Q", spec.region_id))
        self._parts.append(np.ascontiguousarray(gens, dtype="<u8").tobytes())
        return self

    def build(self) -> bytes:
        return b"".join(self._parts)


def _check_wire_keys(keys: Sequence[bytes]) -> None:
    for key in keys:
        if type(key) is not bytes:
            raise errors.InvalidKeyError(f"key {key!r} is {type(key).__name__}; keys must be bytes")
        if len(key) > MAX_KEY_BYTES:
            raise errors.InvalidKeyError(
                f"key of {len(key)} bytes ({key[:16]!r}...); the control plane carries at most "
                f"{MAX_KEY_BYTES} bytes per key"
            )


class PayloadReader:
    """Reads what ``PayloadWriter`` wrote; any shortfall or leftover is a ``ProtocolError``."""

    def __init__(self, data: bytes | memoryview):
        self._data = memoryview(data)
        self._pos = 0

    def _take(self, num_bytes: int) -> memoryview:
        end = self._pos + num_bytes
        if end > len(self._data):
            raise errors.ProtocolError(
                f"payload truncated: needs {end} bytes, has {len(self._data)}"
            )
        view = self._data[self._pos:end]
        self._pos = end
        return view

    def u8(self) -> int:
        return self._take(1)[0]

    def u32(self) -> int:
        return _U32.unpack(self._take(4))[0]

    def u64s(self, n: int) -> tuple[int, ...]:
        return struct.unpack(f"<{n}Q", self._take(8 * n))

    def text(self) -> str:
        raw = self._take(self.u32())
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as e:
            raise errors.ProtocolError(f"payload text is not UTF-8: {e}") from None

    def chunk(self, num_bytes: int) -> memoryview:
        """The next ``num_bytes`` as they are (a fixed-size array the caller unpacks)."""
        return self._take(num_bytes)

    def raw(self, max_bytes: int) -> bytes:
        n = self.u32()
        if n > max_bytes:
            raise errors.ProtocolError(f"a field of {n} bytes; at most {max_bytes}")
        return bytes(self._take(n))

    def keys(self) -> list[bytes]:
        n, width = _KEYS_HEAD.unpack(self._take(_KEYS_HEAD.size))
        if n > MAX_KEYS_PER_CALL:
            raise errors.ProtocolError(f"{n} keys in one call; at most {MAX_KEYS_PER_CALL}")
        if width != VARIABLE_WIDTH:
            if width > MAX_KEY_BYTES:
                raise errors.ProtocolError(f"keys of {width} bytes; at most {MAX_KEY_BYTES}")
            if width == 0:
                return [b""] * n
            return list(_fixed_keys(n, width).unpack(self._take(n * width)))
        lengths = struct.unpack(f"<{n}H", self._take(2 * n))
        if n and max(lengths) > MAX_KEY_BYTES:
            raise errors.ProtocolError(f"a key of {max(lengths)} bytes; at most {MAX_KEY_BYTES}")
        blob = bytes(self._take(sum(lengths)))
        keys = []
        pos = 0
        for length in lengths:
            keys.append(blob[pos:pos + length])
            pos += length
        return keys

    def ids(self) -> np.ndarray:
        n = self.u32()
        if n > MAX_KEYS_PER_CALL:
            raise errors.ProtocolError(f"{n} slot ids in one call; at most {MAX_KEYS_PER_CALL}")
        return np.frombuffer(self._take(8 * n), dtype="<i8").astype(np.int64)

    def spec(self) -> CPULoadStoreSpec:
        ids = self.ids()
        (region_id,) = struct.unpack("<Q", self._take(8))
        gens = np.frombuffer(self._take(8 * ids.size), dtype="<u8")
        if not region_id:
            return CPULoadStoreSpec(ids)
        return CPULoadStoreSpec(ids, gens, region_id)

    def done(self) -> None:
        if self._pos != len(self._data):
            raise errors.ProtocolError(
                f"payload has {len(self._data) - self._pos} unexpected trailing bytes"
            )

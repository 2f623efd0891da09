"""Moving whole blocks between host slots and the pool: one object per block and rank,
the header from a small registered buffer and the row straight from (or into) the
coordinator's mapping of the region. Knows nothing of the index: the cluster tier pins or
reserves the host slots, calls these, and books the outcome."""

from __future__ import annotations

import ctypes
import mmap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiercache.tiers.cluster_object import HEADER_BYTES, BlockFormat

# A host slot's rows: (address in the coordinator's mapping, writable view), one per rank.
Rows = Callable[[int], list[tuple[int, memoryview]]]


@dataclass(frozen=True)
class Outcome:
    """What one batched put or get did: ``done`` the keys whose every rank's object moved
    (and, for a get, checked); ``mismatched`` objects fetched whole whose header or CRC did
    not check; ``codes`` Mooncake's per-object answers; ``seconds`` the call's time."""

    done: list[bytes]
    mismatched: int
    codes: list[int]
    seconds: float


class BlockTransfers:
    """Batched puts and gets of blocks for ``num_areas`` threads at once, each thread with
    its own ``area`` of header buffers (``max_blocks`` blocks of every rank)."""

    def __init__(self, pool, block_format: BlockFormat, rows: Rows, *, num_areas: int,
                 max_blocks: int):
        self._pool = pool
        self._format = block_format
        self._rows = rows
        self._area_bytes = max_blocks * block_format.world_size * HEADER_BYTES
        self._map = mmap.mmap(-1, num_areas * self._area_bytes)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        pool.register(self._base, len(self._map))

    def exists(self, keys: Sequence[bytes]) -> list[int]:
        """Per key: 1 when the pool has every rank's object, 0 when not, < 0 an error."""
        world = self._format.world_size
        codes = self._pool.exists([self._format.name(k, r) for k in keys for r in range(world)])
        out = []
        for i in range(len(keys)):
            mine = codes[i * world:(i + 1) * world]
            out.append(min(mine) if min(mine) < 0 else int(all(c == 1 for c in mine)))
        return out

    def put(self, area: int, blocks: Sequence[tuple[bytes, int]]) -> Outcome:
        """Publish ``blocks`` ((key, host slot), the slots pinned by the caller)."""
        fmt, world = self._format, self._format.world_size
        names, parts = [], []
        for i, (key, slot) in enumerate(blocks):
            for rank, (address, row) in enumerate(self._rows(slot)):
                header = self._header(area, i * world + rank)
                self._map[header - self._base:header - self._base + HEADER_BYTES] = \
                    fmt.header(key, rank, row).ljust(HEADER_BYTES, b"\0")
                names.append(fmt.name(key, rank))
                parts.append([(header, HEADER_BYTES), (address, fmt.row_stride)])
        start = time.perf_counter()
        codes = self._pool.put_from(names, parts)
        seconds = time.perf_counter() - start
        done = [key for i, (key, _) in enumerate(blocks)
                if all(c == 0 for c in codes[i * world:(i + 1) * world])]
        return Outcome(done, 0, codes, seconds)

    def get(self, area: int, blocks: Sequence[tuple[bytes, int]]) -> Outcome:
        """Read ``blocks`` ((key, host slot), the slots reserved by the caller) from the
        pool into their slots and check each object; ``done`` the keys whose every rank
        came whole and checked (the others' slots hold garbage: never serve them)."""
        fmt, world = self._format, self._format.world_size
        names, parts, rows = [], [], []
        for i, (key, slot) in enumerate(blocks):
            for rank, (address, row) in enumerate(self._rows(slot)):
                names.append(fmt.name(key, rank))
                parts.append([(self._header(area, i * world + rank), HEADER_BYTES),
                              (address, fmt.row_stride)])
                rows.append(row)
        start = time.perf_counter()
        codes = self._pool.get_into(names, parts)
        seconds = time.perf_counter() - start
        done, mismatched = [], 0
        for i, (key, _) in enumerate(blocks):
            for rank in range(world):
                at = i * world + rank
                if codes[at] != fmt.object_bytes:
                    break
                offset = self._header(area, at) - self._base
                if not fmt.check(memoryview(self._map)[offset:offset + HEADER_BYTES], key,
                                 rank, rows[at]):
                    mismatched += 1
                    break
            else:
                done.append(key)
        return Outcome(done, mismatched, codes, seconds)

    def _header(self, area: int, index: int) -> int:
        return self._base + area * self._area_bytes + index * HEADER_BYTES

"""Moving whole blocks between host slots and the pool through staging areas: one object
per block and rank, and never a byte of the region reachable by a pool peer. Knows nothing
of the index: the cluster tier pins or reserves the host slots, calls these, and books the
outcome.

* **Only staging is registered with the pool.** Mooncake publishes every buffer a client
  registers in the metadata server, and a peer's transfer engine can then read and write it
  (the pool has no access control). So the region is never registered: each caller (a tier
  thread, ``area``) has its own staging area of at most ``STAGING_BYTES`` (whole objects;
  a batch larger than it moves in parts), and that is all a peer can reach.
* **Put:** each row's CRC and MAC are taken over the host row (pinned by the caller; no
  peer can touch it), then the row is copied behind its sealed header into staging and
  put from there. A peer writing into staging meanwhile makes the object fail every
  reader's check, never pass it.
* **Get:** objects land in staging; each whole one's header is copied out and its row
  copied into the host slot (reserved by the caller, not READY: nobody reads it), and only
  then checked — header, CRC and MAC over the host slot's copy — so what is checked is
  what will be served, whatever a peer writes into staging at any time.
* **A read given up on may still land — in staging.** Mooncake answers a get
  ``TRANSFER_FAIL`` after its timeout without stopping the transfer (a frozen peer that
  thaws writes it later). Any failed object but those the master refused before a
  transfer started (``NOTHING_MOVED``) marks its staging area *held*: replaced by a fresh
  one and kept mapped, never used again by this process (Mooncake 0.3.13 neither cancels
  such a transfer nor reports its end, so only the process's end proves it over; a late
  write lands in memory nothing reads). At most ``MAX_HELD_AREAS`` are held; past that the
  area stays out of use and its gets answer ``STAGING_HELD`` for every object (nothing
  moved). The host slots of such reads were never a transfer's target: they may be freed at
  once. ``Outcome.landing`` names the keys whose read may still land.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tiercache.sizes import format_bytes
from tiercache.tiers.block_header import SEALED_BYTES
from tiercache.tiers.cluster_object import HEADER_BYTES, BlockFormat
from tiercache.tiers.mooncake_pool import NOTHING_MOVED, STAGING_HELD

log = logging.getLogger(__name__)

# A host slot's rows: (address in the coordinator's mapping, writable view), one per rank.
Rows = Callable[[int], list[tuple[int, memoryview]]]
STAGING_BYTES = 64 << 20  # one caller's staging area, at most (at least one block)
MAX_HELD_AREAS = 8  # staging areas held after reads that may still land, for good


@dataclass(frozen=True)
class Outcome:
    """What one batched put or get did: ``done`` the keys whose every rank's object moved
    (and, for a get, checked, in its host slot); ``mismatched`` objects fetched whole whose
    header, CRC or MAC did not check; ``codes`` Mooncake's per-object answers (name order);
    ``seconds`` the batch's time; ``landing`` (get) the keys whose read failed in a way
    that may still land (into a held staging area, never a host slot)."""

    done: list[bytes]
    mismatched: int
    codes: list[int]
    seconds: float
    landing: list[bytes] = field(default_factory=list)


class _Area:
    """One staging buffer, registered with the pool."""

    def __init__(self, pool, num_bytes: int):
        self.map = mmap.mmap(-1, num_bytes)
        self.array = np.frombuffer(self.map, np.uint8)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        pool.register(self.base, num_bytes)


class BlockTransfers:
    """Batched puts and gets of blocks for ``num_areas`` callers at once, each with its
    own staging ``area`` (room for ``max_blocks`` blocks of every rank, at most
    ``staging_bytes``)."""

    def __init__(self, pool, block_format: BlockFormat, rows: Rows, *, num_areas: int,
                 max_blocks: int, staging_bytes: int = STAGING_BYTES):
        self._pool = pool
        self._format = block_format
        self._rows = rows
        block_bytes = block_format.world_size * block_format.object_bytes
        self.blocks_per_part = max(1, min(max_blocks, staging_bytes // block_bytes))
        self.area_bytes = self.blocks_per_part * block_bytes
        self._lock = threading.Lock()
        self._areas: list[_Area | None] = [_Area(pool, self.area_bytes)
                                           for _ in range(num_areas)]
        self._held: list[_Area] = []

    @property
    def held_areas(self) -> int:
        """Staging areas held out of use after reads that may still land."""
        with self._lock:
            return len(self._held)

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
        start = time.perf_counter()
        codes: list[int] = []
        for part in self._parts(blocks):
            codes += self._put_part(area, part)
        world = self._format.world_size
        done = [key for i, (key, _) in enumerate(blocks)
                if all(c == 0 for c in codes[i * world:(i + 1) * world])]
        return Outcome(done, 0, codes, time.perf_counter() - start)

    def _put_part(self, area: int, blocks: Sequence[tuple[bytes, int]]) -> list[int]:
        fmt = self._format
        staging = self._area(area)
        if staging is None:
            return [STAGING_HELD] * (len(blocks) * fmt.world_size)
        names, parts, at = [], [], 0
        for key, slot in blocks:
            for rank, (_, row) in enumerate(self._rows(slot)):
                sealed = fmt.header(key, rank, row)  # over the host row: peers cannot touch it
                staging.map[at:at + HEADER_BYTES] = sealed.ljust(HEADER_BYTES, b"\0")
                np.copyto(staging.array[at + HEADER_BYTES:at + fmt.object_bytes],
                          np.frombuffer(row, np.uint8))
                names.append(fmt.name(key, rank))
                parts.append([(staging.base + at, fmt.object_bytes)])
                at += fmt.object_bytes
        return self._pool.put_from(names, parts)

    def get(self, area: int, blocks: Sequence[tuple[bytes, int]]) -> Outcome:
        """Read ``blocks`` ((key, host slot), the slots reserved by the caller) from the
        pool into their slots, through staging, and check each object in its slot;
        ``done`` the keys whose every rank came whole and checked (the others' slots hold
        garbage: never serve them)."""
        start = time.perf_counter()
        done, codes, landing, mismatched = [], [], [], 0
        for part in self._parts(blocks):
            got = self._get_part(area, part)
            done += got.done
            codes += got.codes
            landing += got.landing
            mismatched += got.mismatched
        return Outcome(done, mismatched, codes, time.perf_counter() - start, landing)

    def _get_part(self, area: int, blocks: Sequence[tuple[bytes, int]]) -> Outcome:
        fmt, world = self._format, self._format.world_size
        staging = self._area(area)
        if staging is None:
            return Outcome([], 0, [STAGING_HELD] * (len(blocks) * world), 0.0)
        names = [fmt.name(key, rank) for key, _ in blocks for rank in range(world)]
        parts = [[(staging.base + i * fmt.object_bytes, fmt.object_bytes)]
                 for i in range(len(names))]
        codes = self._pool.get_into(names, parts)
        done, landing, mismatched = [], [], 0
        for i, (key, slot) in enumerate(blocks):
            mine = codes[i * world:(i + 1) * world]
            if any(c < 0 and c not in NOTHING_MOVED for c in mine):
                landing.append(key)
            if any(c != fmt.object_bytes for c in mine):
                continue
            checked = 0
            for rank, (_, row) in enumerate(self._rows(slot)):
                at = (i * world + rank) * fmt.object_bytes
                header = bytes(staging.map[at:at + SEALED_BYTES])
                target = np.frombuffer(row, np.uint8)
                np.copyto(target, staging.array[at + HEADER_BYTES:at + fmt.object_bytes])
                if not fmt.check(header, key, rank, row):  # what the slot holds now
                    mismatched += 1
                    break
                checked += 1
            if checked == world:
                done.append(key)
        if landing:
            self._hold(area, staging, len(landing))
        return Outcome(done, mismatched, codes, 0.0, landing)

    def _parts(self, blocks: Sequence[tuple[bytes, int]]) -> list[Sequence[tuple[bytes, int]]]:
        """``blocks`` cut into parts of at most ``blocks_per_part``, as even as can be."""
        count = -(-len(blocks) // self.blocks_per_part)
        size = -(-len(blocks) // max(count, 1))
        return [blocks[i:i + size] for i in range(0, len(blocks), size)] if blocks else []

    def _area(self, area: int) -> _Area | None:
        with self._lock:
            return self._areas[area]

    def _hold(self, area: int, staging: _Area, reads: int) -> None:
        """Keep ``staging`` out of use for good (a late write may land in it) and give
        ``area`` a fresh one while fewer than ``MAX_HELD_AREAS`` are held."""
        with self._lock:
            self._held.append(staging)
            fresh = len(self._held) < MAX_HELD_AREAS
            self._areas[area] = None
        replacement = _Area(self._pool, self.area_bytes) if fresh else None
        with self._lock:
            self._areas[area] = replacement
            held = len(self._held)
        log.error("cluster tier: %d read(s) from the pool failed with their transfer possibly "
                  "still running; their staging area (%s) is held out of use until the "
                  "coordinator restarts (%d held, %s)%s", reads, format_bytes(self.area_bytes),
                  held, format_bytes(held * self.area_bytes),
                  "" if fresh else f"; past {MAX_HELD_AREAS} held, this caller's reads and "
                  "writes fail from now on")

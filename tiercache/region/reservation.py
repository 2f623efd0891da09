"""``SliceReserver``: the region's slices reserved (``posix_fallocate``) in the background,
slot by slot, while the coordinator already serves (issue 41, "instant on").

Why: ``posix_fallocate`` of a whole region before READY is what made a large ``serve``
slow to answer (16 GiB: 5.5 s on the 2-core machine; docs/benchmarks.md, "Instant on").
Only the header (stats blocks, ledger, session table) is reserved before READY; the rest
follows here, in chunks of about ``RESERVE_CHUNK_BYTES``.

**Slot order, every rank in step.** Slot ``s`` is row ``s`` of every rank's slice, so a
chunk reserves rows ``[a, b)`` of rank 0, then of rank 1, ..., and only then is slot ``b - 1``
reserved. The index hands out fresh slots lowest first and never one at or past the
reserved rows (``OffloadingManager.set_usable_blocks``), so the free list and eviction
never see an unreserved slot: no store, load, tier move or lease touches one.

**The header first, then the index.** After each chunk the header records the rows
(``RegionHeader.set_reservation``), then the index may use them. So every slot a ledger
names is below the recorded rows, and a coordinator that re-adopts a partly reserved
region (``SharedOffloadRegion.create``) serves those rows at once and reserves the rest
(tmpfs keeps a reserved page until the file is removed).

**A full /dev/shm is a state, not a fallback.** When a chunk cannot be reserved
(``ENOSPC``: another user filled /dev/shm after ``check_space``), tmpfs undoes that chunk,
the header says FAILED with the errno and the rows reserved, an error line says what
happened, and the coordinator keeps serving the reserved slots only; metrics
(``tiercache_region_reservation``, ``tiercache_region_reserved_bytes``) and ``tiercache
status`` show it. The next ``serve`` re-adopting the region tries the rest again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tiercache.errors import RegionError
from tiercache.region.header import RegionHeader, Reservation
from tiercache.region.hostmem import fallocate
from tiercache.region.layout import RegionLayout
from tiercache.region.progress import Progress
from tiercache.sizes import format_bytes

log = logging.getLogger(__name__)

# a chunk takes well under the progress interval at the slowest fallocate rates measured
# (about 1.5 GiB/s), so the usable slots grow several times a second and a stop waits little
RESERVE_CHUNK_BYTES = 256 << 20

Allocate = Callable[[int, int, str, int], None]  # (fd, num_bytes, path, offset)


def _allocate(fd: int, num_bytes: int, path: str, offset: int) -> None:
    fallocate(fd, num_bytes, path, offset=offset)


@dataclass(frozen=True)
class Chunk:
    """Rows ``[first_row, end_row)`` of every rank's slice: one (offset, length) per rank.
    The last chunk also covers each slice's padding up to its 2 MiB boundary."""

    first_row: int
    end_row: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def num_bytes(self) -> int:
        return sum(n for _, n in self.ranges)


def reservation_chunks(layout: RegionLayout, first_row: int = 0,
                       chunk_bytes: int = RESERVE_CHUNK_BYTES) -> Iterator[Chunk]:
    """The chunks that reserve rows ``[first_row, num_blocks)`` of every slice, slot order."""
    rows_each = max(1, chunk_bytes // (layout.row_stride * layout.world_size))
    for first in range(first_row, layout.num_blocks, rows_each):
        end = min(first + rows_each, layout.num_blocks)
        ranges = []
        for rank in range(layout.world_size):
            start = layout.slice_offset(rank) + first * layout.row_stride
            stop = (layout.slice_offset(rank) + layout.slice_bytes if end == layout.num_blocks
                    else layout.slice_offset(rank) + end * layout.row_stride)
            ranges.append((start, stop - start))
        yield Chunk(first, end, tuple(ranges))


class SliceReserver:
    """Reserves the rows from ``first_row`` on, in a thread (``start``), telling
    ``on_reserved(rows)`` after each chunk is in the header; ``close`` stops it between
    chunks. ``allocate``: ``hostmem.fallocate`` over one range (tests fail it on purpose)."""

    def __init__(self, fd: int, path: str, header: RegionHeader, layout: RegionLayout,
                 first_row: int, on_reserved: Callable[[int], None],
                 say: Callable[[str], None] = log.info, *,
                 chunk_bytes: int = RESERVE_CHUNK_BYTES, allocate: Allocate = _allocate):
        self._fd, self._path, self._header, self._layout = fd, path, header, layout
        self._first_row = first_row
        self._on_reserved, self._say = on_reserved, say
        self._chunk_bytes, self._allocate = chunk_bytes, allocate
        self._stop = threading.Event()
        self._done = threading.Event()  # complete, failed or stopped
        self._thread: threading.Thread | None = None
        self.reserved_rows = first_row
        self.error: str | None = None  # why it stopped short (FAILED), None otherwise

    def start(self) -> None:
        """Reserve the first chunk in the caller, the rest in a thread: a ``serve`` that
        answers can store at once (never a refusal for want of reserved slots right after
        READY), and a region of one chunk is whole before it answers."""
        first = next(reservation_chunks(self._layout, self._first_row, self._chunk_bytes),
                     None)
        if first is None or not self._reserve_chunk(first):
            self._done.set()  # nothing to reserve, or FAILED (said, in the header)
            return
        self._first_row = first.end_row
        if first.end_row == self._layout.num_blocks:
            self._say(f"reserved the region's {self._layout.num_blocks} blocks "
                      f"({format_bytes(first.num_bytes)}) before answering")
            self._done.set()
            return
        self._thread = threading.Thread(target=self.run, name="tiercache-reserve", daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until the reservation completed, failed or was stopped; False on timeout."""
        return self._done.wait(timeout_s)

    def close(self) -> None:
        """Stop after the chunk under way (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def run(self) -> None:
        try:
            self._reserve()
        finally:
            self._done.set()

    def _reserve(self) -> None:
        layout, started = self._layout, time.perf_counter()
        chunks = list(reservation_chunks(layout, self._first_row, self._chunk_bytes))
        total = sum(c.num_bytes for c in chunks)
        with Progress(f"reserving {self._path}", total, self._say) as progress:
            for chunk in chunks:
                if self._stop.is_set() or not self._reserve_chunk(chunk):
                    return
                progress.advance(chunk.num_bytes)
        self._say(f"reserved the region's {layout.num_blocks} blocks "
                  f"({format_bytes(total)} in the background) in "
                  f"{time.perf_counter() - started:.2f} s")

    def _reserve_chunk(self, chunk: Chunk) -> bool:
        """Reserve ``chunk``, record it in the header, then tell the index; False: FAILED."""
        try:
            for offset, length in chunk.ranges:
                self._allocate(self._fd, length, self._path, offset)
        except RegionError as e:
            self._failed(e)
            return False
        done = chunk.end_row == self._layout.num_blocks
        self._header.set_reservation(
            Reservation.COMPLETE if done else Reservation.RESERVING, chunk.end_row)
        self.reserved_rows = chunk.end_row
        self._on_reserved(chunk.end_row)
        return True

    def _failed(self, e: RegionError) -> None:
        cause = e.__cause__
        code = cause.errno if isinstance(cause, OSError) and cause.errno else 0
        rows = self.reserved_rows
        self._header.set_reservation(Reservation.FAILED, rows, code)
        self.error = str(e)
        log.error("region reservation FAILED after %d of %d blocks: %s. The index serves the "
                  "%d reserved blocks only (tiercache_region_reservation{state=\"failed\"}); "
                  "free /dev/shm and restart `tiercache serve` to reserve the rest",
                  rows, self._layout.num_blocks, e, rows)

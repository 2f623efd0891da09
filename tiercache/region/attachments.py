"""Attachment slots: several worker processes per rank, each the single writer of its block.

Two engines on one node (vLLM instances with TP=1 on two GPUs, say) each attach rank 0 of
the same coordinator's region. Each such process is an *attachment* of the rank and needs
its own liveness, pin state and counters, so every rank has ``attachments_per_rank`` stats
blocks (``RegionLayout.stats_offset(rank, slot)``), and an attaching worker claims one.

Decisions and their reasons:

* **Claiming is a lock, not a pid.** A worker takes a write lock on one byte (the first byte
  of the slot's stats block) of the region's open file, ``F_OFD_SETLK``, and holds it for
  the attachment's life. The kernel drops it when the process dies (SIGKILL included), so a
  dead attachment's slot is free again without trusting any recorded pid. Open-file-
  description locks, not classic POSIX ``F_SETLK`` locks: a POSIX lock belongs to the
  process and is dropped when the process closes *any* descriptor of the file (a second
  ``SharedOffloadRegion`` or a ``status`` probe in the same process would free every slot
  it holds), and two attachments in one process would not exclude each other. An OFD lock
  belongs to the open file (``fork`` shares it: a forked child that keeps the region's
  descriptor keeps the slot held after its parent dies; ``exec`` drops it, shm_open sets
  ``O_CLOEXEC``). On Linux these locks do not interact with the coordinator's ``flock``
  owner lock (``tiercache.region.shm``); a test checks it.
* **Counters are per slot and never reset.** A block's counters survive its process; the
  next attachment that claims the slot continues from them (``mark_attached`` only resets
  pid, pin state and timings). A rank's totals are the sums over all its blocks, so they
  never go backwards when an attachment dies or detaches.
* **A rank is up while any of its attachments is up.** Per-rank pin state is that of the
  rank's live attachments (the worst, if they disagree: failed > unpinned > none > pinned);
  with none alive, that of the one updated last (so a SIGKILLed worker's state stays
  visible, as it did with one block per rank).
* **Incarnation** of an attachment: ``slot << 32 | attach_count`` of its block. Slot 0's
  incarnations are its attach counts (the single-engine case reads as before); any
  re-attach, in any slot, is a new value.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
from dataclasses import dataclass

from tiercache.errors import RankError, StatsStuckError
from tiercache.region.hostmem import process_alive
from tiercache.region.layout import RegionLayout
from tiercache.region.stats import (
    DURATION_BUCKETS_S, SIZE_BUCKETS_BYTES, DirectionStats, PinState, RankStatsSnapshot,
)
from tiercache.specs import Direction

F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)  # Linux values (Python 3.9+ names them)
F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_FLOCK = struct.Struct("hhqqi4x")  # struct flock: l_type, l_whence, l_start, l_len, l_pid
_PIN_RANK = {PinState.FAILED: 3, PinState.UNPINNED: 2, PinState.NONE: 1, PinState.PINNED: 0}


class AttachmentSlotsFullError(RankError):
    """Every attachment slot of the rank is held by a live process."""


def incarnation(slot: int, attach_count: int) -> int:
    return slot << 32 | attach_count


def _lock(fd: int, cmd: int, kind: int, offset: int) -> bytes:
    return fcntl.fcntl(fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, offset, 1, 0))


def try_lock_slot(fd: int, layout: RegionLayout, rank: int, slot: int) -> bool:
    """Take slot ``slot`` of ``rank`` for this open file; False if another holds it."""
    try:
        _lock(fd, F_OFD_SETLK, fcntl.F_WRLCK, layout.stats_offset(rank, slot))
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def unlock_slot(fd: int, layout: RegionLayout, rank: int, slot: int) -> None:
    _lock(fd, F_OFD_SETLK, fcntl.F_UNLCK, layout.stats_offset(rank, slot))


def slot_held(fd: int, layout: RegionLayout, rank: int, slot: int) -> bool:
    """True while another open file (a live attachment) holds the slot."""
    out = _lock(fd, F_OFD_GETLK, fcntl.F_WRLCK, layout.stats_offset(rank, slot))
    return _FLOCK.unpack(out)[0] != fcntl.F_UNLCK


def claim_slot(fd: int, layout: RegionLayout, rank: int) -> int:
    """The lowest free slot of ``rank``, now held by ``fd``'s open file."""
    layout.check_rank(rank)
    for slot in range(layout.attachments_per_rank):
        if try_lock_slot(fd, layout, rank, slot):
            return slot
    raise AttachmentSlotsFullError(
        f"rank {rank}: all {layout.attachments_per_rank} attachment slots are held by live "
        f"processes (region.attachments_per_rank = {layout.attachments_per_rank}); detach one, "
        "or raise region.attachments_per_rank in the coordinator's config (it is part of the "
        "region's geometry: the coordinator must be restarted with a new region)")


# ---------------------------------------------------------------------- readers
@dataclass(frozen=True)
class Attachment:
    """One slot's block as a reader sees it."""

    slot: int
    snapshot: RankStatsSnapshot
    up: bool  # its recorded pid runs and started at the recorded time

    @property
    def incarnation(self) -> int:
        return incarnation(self.slot, self.snapshot.attach_count)


@dataclass(frozen=True)
class RankSummary:
    """A rank over all its attachment blocks. ``attachments``: the blocks ever claimed
    (attach count > 0), readable now or from their last consistent snapshot."""

    rank: int
    attachments: tuple[Attachment, ...]
    unreadable_slots: tuple[int, ...]  # mid-update and never read consistently
    empty: RankStatsSnapshot | None  # slot 0's block when no slot was ever claimed

    @property
    def live(self) -> tuple[Attachment, ...]:
        return tuple(a for a in self.attachments if a.up)

    @property
    def up(self) -> bool:
        return bool(self.live)

    @property
    def readable(self) -> bool:
        return bool(self.attachments) or self.empty is not None

    @property
    def current(self) -> tuple[RankStatsSnapshot, ...]:
        """The blocks that describe the rank now: the live ones, else the last updated."""
        if self.live:
            return tuple(a.snapshot for a in self.live)
        if self.attachments:
            return (max((a.snapshot for a in self.attachments), key=lambda s: s.heartbeat_ns),)
        return () if self.empty is None else (self.empty,)

    @property
    def pin_state(self) -> PinState:
        states = [s.pin_state for s in self.current]
        return max(states, key=_PIN_RANK.__getitem__) if states else PinState.NONE

    @property
    def attach_count(self) -> int:
        return sum(a.snapshot.attach_count for a in self.attachments)

    @property
    def heartbeat_ns(self) -> int:
        return max((s.heartbeat_ns for s in self.current), default=0)

    @property
    def directions(self) -> tuple[DirectionStats, DirectionStats]:
        """Counters summed over every block of the rank (live or not): never decrease."""
        snaps = [a.snapshot for a in self.attachments]
        return (sum_direction(snaps, Direction.GPU_TO_CPU),
                sum_direction(snaps, Direction.CPU_TO_GPU))


def sum_direction(snaps: list[RankStatsSnapshot], direction: Direction) -> DirectionStats:
    parts = [s.directions[direction] for s in snaps]
    if not parts:
        return _ZERO
    return DirectionStats(
        bytes_total=sum(p.bytes_total for p in parts),
        busy_seconds_total=sum(p.busy_seconds_total for p in parts),
        transfers_ok=sum(p.transfers_ok for p in parts),
        transfers_failed=sum(p.transfers_failed for p in parts),
        duration_counts=tuple(map(sum, zip(*(p.duration_counts for p in parts)))),
        size_counts=tuple(map(sum, zip(*(p.size_counts for p in parts)))),
    )


_ZERO = DirectionStats(0, 0.0, 0, 0, (0,) * (len(DURATION_BUCKETS_S) + 1),
                       (0,) * (len(SIZE_BUCKETS_BYTES) + 1))


class AttachmentReader:
    """Reads every attachment block of every rank, keeping each block's last consistent
    snapshot: a worker SIGKILLed between the two sequence bumps of an update leaves its
    block odd for good, and its counters must still count. ``read_failures[rank]``: reads
    that found one of the rank's blocks mid-update. Safe to call from several threads."""

    def __init__(self, region, layout: RegionLayout):
        self.layout = layout
        self._views = [[region.stats(r, s) for s in range(layout.attachments_per_rank)]
                       for r in range(layout.world_size)]
        self._last: dict[tuple[int, int], RankStatsSnapshot] = {}
        self._lock = threading.Lock()
        self.read_failures = [0] * layout.world_size
        self.stuck_errors: list[str] = []  # messages of the last read's failures

    def read(self, rank: int) -> RankSummary:
        attachments, unreadable, empty = [], [], None
        for slot, view in enumerate(self._views[rank]):
            try:
                snap = view.snapshot()
                with self._lock:
                    self._last[rank, slot] = snap
            except StatsStuckError as e:
                with self._lock:
                    self.read_failures[rank] += 1
                    self.stuck_errors.append(f"{e} (attachment slot {slot})")
                    snap = self._last.get((rank, slot))
                if snap is None:
                    unreadable.append(slot)
                    continue
            if snap.attach_count > 0:
                up = snap.pid != 0 and process_alive(snap.pid, snap.pid_start_ns)
                attachments.append(Attachment(slot, snap, up))
            elif slot == 0:
                empty = snap
        return RankSummary(rank, tuple(attachments), tuple(unreadable), empty)

    def take_errors(self) -> list[str]:
        with self._lock:
            taken, self.stuck_errors = self.stuck_errors, []
        return taken

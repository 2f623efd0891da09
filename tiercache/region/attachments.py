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
  it holds), and two attachments in one process would not exclude each other. On Linux
  these locks do not interact with the coordinator's ``flock`` owner lock
  (``tiercache.region.shm``); a test checks it.
* **The lock dies with the attaching process, not with its forked children.** An OFD lock
  belongs to the open file description, and ``fork`` shares descriptions: a child that
  kept a copy of the descriptor would keep the slot held after its parent died (``attach``
  said "held by live processes" while ``status`` showed every slot down). So a
  ``SlotLock`` takes its lock on a description of its own (the region reopened through
  ``/proc/self/fd``; the mapping's descriptors, which Python's mmap duplicates, hold no
  lock) and an ``os.register_at_fork`` hook closes the child's copy of that descriptor.
  Closing a copy never frees the parent's lock (that takes closing the last descriptor of
  the description); ``F_UNLCK`` would, so the child never unlocks. ``exec`` drops the copy
  anyway (``O_CLOEXEC``). The hook needs to know this process's slot locks: the one piece
  of module state (``_HELD``), because forking is process-wide. A fork the hook does not
  see (a C library's ``fork()``) can still leave a slot held: readers report such a slot
  as held (``Attachment.held``, from ``F_OFD_GETLK``), so ``status`` and ``attach`` agree.
* **Counters are per slot and never reset.** A block's counters survive its process; the
  next attachment that claims the slot continues from them (``mark_attached`` only resets
  pid, pin state and timings). A rank's totals are the sums over all its blocks, so they
  never go backwards when an attachment dies or detaches.
* **A rank is up while any of its attachments is up.** Per-rank pin state is that of the
  rank's live attachments (the worst, if they disagree: failed > unpinned > none > pinning >
  pinned); with none alive, that of the one updated last (so a SIGKILLed worker's state stays
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
from typing import Protocol

from tiercache.errors import RankError, RegionError, StatsStuckError
from tiercache.numa.placement import NumaPlacement
from tiercache.region.hostmem import process_alive
from tiercache.region.layout import RegionLayout
from tiercache.region.stats import (
    DURATION_BUCKETS_S, SIZE_BUCKETS_BYTES, DirectionStats, PinState, RankStats, RankStatsSnapshot,
)
from tiercache.specs import Direction

F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)  # Linux values (Python 3.9+ names them)
F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_FLOCK = struct.Struct("hhqqi4x")  # struct flock: l_type, l_whence, l_start, l_len, l_pid
_PIN_RANK = {PinState.FAILED: 5, PinState.UNKNOWN: 4, PinState.UNPINNED: 3, PinState.NONE: 2,
             PinState.PINNING: 1, PinState.PINNED: 0,
             PinState.NOT_NEEDED: -1}  # a rank's state: its worst one


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
    """True while another open file description holds the slot: a live attachment, or a
    process that inherited one's (``F_OFD_GETLK`` names no pid for OFD locks)."""
    out = _lock(fd, F_OFD_GETLK, fcntl.F_WRLCK, layout.stats_offset(rank, slot))
    return bool(_FLOCK.unpack(out)[0] != fcntl.F_UNLCK)


def _reopen(fd: int) -> int:
    """A new open file description of the file ``fd`` refers to (a ``dup`` would share
    ``fd``'s, and with it its locks); the name is not looked up again, so it cannot have
    been replaced meanwhile."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise RegionError(f"cannot open the region again for its attachment slot lock "
                          f"(/proc/self/fd/{fd}): {e.strerror or e}") from e


class SlotLock:
    """One attachment slot of ``rank`` held by this process (the lowest free one, claimed
    at construction; ``AttachmentSlotsFullError`` if none is free) until ``release`` or
    this process's death, on a descriptor of its own that forked children close (see the
    module docstring)."""

    def __init__(self, region_fd: int, layout: RegionLayout, rank: int):
        layout.check_rank(rank)
        self.layout, self.rank = layout, rank
        self._fd = _reopen(region_fd)
        _HELD.add(self)  # before the lock exists: a fork from here on closes the child's copy
        try:
            self.slot = claim_slot(self._fd, layout, rank)
        except BaseException:
            _HELD.discard(self)
            os.close(self._fd)
            raise

    def release(self) -> None:
        """Free the slot (idempotent; a no-op in a forked child, which never held it)."""
        if self._fd < 0:
            return
        _HELD.discard(self)
        fd, self._fd = self._fd, -1
        try:
            unlock_slot(fd, self.layout, self.rank, self.slot)
        finally:
            os.close(fd)

    def _forget_in_child(self) -> None:
        """Close a forked child's copy of the descriptor; never ``F_UNLCK`` (that would
        free the parent's slot: the lock belongs to the description both share)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# The slot locks of this process, for the fork hook (forking is process-wide state).
_HELD: set[SlotLock] = set()


def _forget_inherited_slots() -> None:
    for lock in list(_HELD):
        lock._forget_in_child()
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_inherited_slots)


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
    held: bool  # its slot lock is held: by its worker (up), or by a process that outlived it

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
    def held_by_others(self) -> tuple[Attachment, ...]:
        """Down, yet their slot is held (a child the worker forked outlived it, or a new
        worker is attaching): ``attach`` cannot take these slots."""
        return tuple(a for a in self.attachments if a.held and not a.up)

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
    def numa(self) -> NumaPlacement:
        """The slice's NUMA placement the rank reports: the worst of its current
        attachments' (``NumaPlacement.worst``: an engine on the other socket shows)."""
        return NumaPlacement.worst([s.numa for s in self.current])

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


class StatsBlocks(Protocol):
    """The attachment blocks of a mapped region, as ``SharedOffloadRegion`` has them."""

    def stats(self, rank: int, slot: int | None = None) -> RankStats: ...

    def slot_held(self, rank: int, slot: int) -> bool: ...


class AttachmentReader:
    """Reads every attachment block of every rank, keeping each block's last consistent
    snapshot: a worker SIGKILLed between the two sequence bumps of an update leaves its
    block odd for good, and its counters must still count. ``read_failures[rank]``: reads
    that found one of the rank's blocks mid-update. Safe to call from several threads."""

    def __init__(self, region: StatsBlocks, layout: RegionLayout):
        self.layout = layout
        self._region = region
        self._views = [[region.stats(r, s) for s in range(layout.attachments_per_rank)]
                       for r in range(layout.world_size)]
        self._last: dict[tuple[int, int], RankStatsSnapshot] = {}
        self._lock = threading.Lock()
        self.read_failures = [0] * layout.world_size
        self.stuck_errors: list[str] = []  # messages of the last read's failures

    def read(self, rank: int) -> RankSummary:
        attachments: list[Attachment] = []
        unreadable: list[int] = []
        empty: RankStatsSnapshot | None = None
        for slot, view in enumerate(self._views[rank]):
            snap: RankStatsSnapshot | None
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
                held = up or self._region.slot_held(rank, slot)
                attachments.append(Attachment(slot, snap, up, held))
            elif slot == 0:
                empty = snap
        return RankSummary(rank, tuple(attachments), tuple(unreadable), empty)

    def take_errors(self) -> list[str]:
        with self._lock:
            taken, self.stuck_errors = self.stuck_errors, []
        return taken

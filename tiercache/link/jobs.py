"""The completion loop: a transfer job is done when every rank has finished it (or died).

With tensor parallelism a cached block is one page per rank, moved by one worker
process per rank. The index may publish a store (``complete_store``) only once every
rank wrote its page, and may release a load's slots (``complete_load``) only once no
rank still reads them. tiercache leaves that join to the engine's scheduler, which
already gathers per-rank results (it must know when a request's KV is on every GPU)::

    scheduler                                      worker, rank r (one per GPU)
    spec = client.prepare_store(keys) ...
    tracker.begin(job_id, JobKind.STORE, keys) ──► worker.transfer_async(job_id, spec)
    tracker.ack(r, incarnation, job_id, ok)    ◄── worker.get_finished()  (engine's own IPC)
    tracker.observe(monitor.incarnations(tracker.incarnations))  (liveness: stats blocks)
    for outcome in tracker.take_finished():
        outcome.complete(client)       # complete_store(keys, ok) / complete_load(keys)

Why the engine and not the coordinator (ranks reporting jobs through the region)?
The coordinator would need job ids mapped to keys, a per-rank completion ring in
shared memory with its own SIGKILL story, and a second writer into the region; and
when it dies it would take the in-flight jobs with it. The scheduler has all of it
already: job ids, keys, one message per rank per job, and it outlives a coordinator.

Contract of ``JobTracker`` (one per engine; pure bookkeeping, one thread):

* A job is begun with every rank up (``observe`` gave each rank an incarnation; a
  worker's incarnation is ``Worker.incarnation``: its attachment slot and that slot's
  ``attach_count``); it is then pending on each.
* It finishes when every rank either acked it or was lost: its worker died, or the
  rank re-attached as another incarnation. So a job never hangs on a dead rank, and
  ``complete_*`` is never called while a live rank may still touch the job's slots.
* It succeeded iff every rank acked success; a failed or lost rank fails the job.
* An ack from another incarnation than the job was begun with, or for a job that is
  not pending (finished, or dropped by ``reset``), is stale: ignored and counted in
  ``stale_acks``. A second ack of the same rank and incarnation for a pending job
  raises ``JobError`` (a bug in the caller, not a race).
* ``reset()`` drops every pending job (returned as failed, not to be completed: use it
  when the index that prepared them is gone, e.g. the coordinator was replaced).

``RankMonitor`` turns the stats blocks into incarnations: a rank is up while any of its
attachments (one worker process per engine may attach a rank, each with its own block,
``tiercache.region.attachments``) names a pid that runs and started at the recorded time
(``process_alive``). Which one is the engine's own: the one it follows (``incarnations
(following)``, the tracker's current ones) while that one lives, else the newest live one
(an engine that re-attached its rank). Another engine attaching or leaving the same rank
therefore never loses this engine's jobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from tiercache.errors import JobError, RankError
from tiercache.region.attachments import AttachmentReader
from tiercache.region.layout import RegionLayout
from tiercache.region.stats import RankStats


class JobKind(Enum):
    LOAD = "load"  # cpu_to_gpu: completes with complete_load(keys)
    STORE = "store"  # gpu_to_cpu: completes with complete_store(keys, success)


class CompletingIndex(Protocol):
    """The index verbs an outcome completes with (``Client`` and ``OffloadingManager``)."""

    def complete_load(self, keys: Sequence[bytes]) -> None: ...

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None: ...


@dataclass(frozen=True)
class JobOutcome:
    """A finished job. ``failed_ranks`` reported failure; ``lost_ranks`` died before acking."""

    job_id: int
    kind: JobKind
    keys: tuple[bytes, ...]
    success: bool
    failed_ranks: tuple[int, ...] = ()
    lost_ranks: tuple[int, ...] = ()

    def complete(self, index: CompletingIndex) -> None:
        """Close the job in the index: publish or free a store, release a load's slots."""
        if self.kind is JobKind.STORE:
            index.complete_store(self.keys, self.success)
        else:
            index.complete_load(self.keys)


@dataclass(eq=False)
class _Job:
    job_id: int
    kind: JobKind
    keys: tuple[bytes, ...]
    incarnations: tuple[int, ...]  # each rank's incarnation when the job began
    pending: set[int]
    failed: set[int]
    lost: set[int]

    def outcome(self) -> JobOutcome:
        return JobOutcome(self.job_id, self.kind, self.keys,
                          success=not self.failed and not self.lost,
                          failed_ranks=tuple(sorted(self.failed)),
                          lost_ranks=tuple(sorted(self.lost)))


class JobTracker:
    """Per-rank acks of transfer jobs; see the module docstring for the contract."""

    def __init__(self, world_size: int):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise JobError(f"world_size = {world_size!r}: must be an integer >= 1")
        self.world_size = world_size
        self._incarnations: list[int | None] = [None] * world_size
        self._jobs: dict[int, _Job] = {}
        self._finished: list[JobOutcome] = []
        self.stale_acks = 0

    # ---------------------------------------------------------------- ranks
    @property
    def incarnations(self) -> tuple[int | None, ...]:
        return tuple(self._incarnations)

    def down_ranks(self) -> list[int]:
        return [r for r, inc in enumerate(self._incarnations) if inc is None]

    def observe(self, incarnations: Sequence[int | None]) -> list[int]:
        """Each rank's live incarnation now (``None``: no live worker). Pending parts of
        a rank whose incarnation changed are lost. Returns the ranks that changed."""
        if len(incarnations) != self.world_size:
            raise JobError(f"observe: {len(incarnations)} incarnations given for world_size "
                           f"{self.world_size}")
        changed = [r for r, inc in enumerate(incarnations) if inc != self._incarnations[r]]
        for rank in changed:
            self._lose(rank)
            self._incarnations[rank] = incarnations[rank]
        return changed

    def _lose(self, rank: int) -> None:
        for job in list(self._jobs.values()):
            if rank in job.pending:
                job.pending.discard(rank)
                job.lost.add(rank)
                self._finish_if_done(job)

    # ---------------------------------------------------------------- jobs
    def begin(self, job_id: int, kind: JobKind, keys: Sequence[bytes]) -> None:
        """Start tracking a job submitted to every rank."""
        if job_id in self._jobs:
            raise JobError(f"job {job_id} is already pending; job ids must be unique")
        if not keys:
            raise JobError(f"job {job_id}: no keys (a job moves at least one block)")
        down = self.down_ranks()
        if down:
            raise JobError(f"job {job_id}: rank(s) {down} are down; a job needs all "
                           f"{self.world_size} ranks up")
        incarnations = tuple(inc for inc in self._incarnations if inc is not None)  # all up
        self._jobs[job_id] = _Job(job_id, kind, tuple(keys), incarnations,
                                  pending=set(range(self.world_size)), failed=set(), lost=set())

    def ack(self, rank: int, incarnation: int, job_id: int, success: bool) -> bool:
        """Rank ``rank`` (as ``incarnation``) finished ``job_id``. False if the ack is stale."""
        if not 0 <= rank < self.world_size:
            raise RankError(f"ack from rank {rank}: allowed 0..{self.world_size - 1}")
        job = self._jobs.get(job_id)
        if job is None or job.incarnations[rank] != incarnation:
            self.stale_acks += 1
            return False
        if rank not in job.pending:
            if rank in job.lost:  # lost (re-attach observed) before its ack was read
                self.stale_acks += 1
                return False
            raise JobError(f"job {job_id}: rank {rank} (incarnation {incarnation}) acked twice")
        job.pending.discard(rank)
        if not success:
            job.failed.add(rank)
        self._finish_if_done(job)
        return True

    def _finish_if_done(self, job: _Job) -> None:
        if not job.pending:
            del self._jobs[job.job_id]
            self._finished.append(job.outcome())

    def take_finished(self) -> list[JobOutcome]:
        """Jobs finished since the last call, in the order they finished."""
        taken, self._finished = self._finished, []
        return taken

    def reset(self) -> list[JobOutcome]:
        """Drop every pending job (returned as failed; their later acks are stale)."""
        dropped = [JobOutcome(j.job_id, j.kind, j.keys, success=False,
                              failed_ranks=tuple(sorted(j.failed)),
                              lost_ranks=tuple(sorted(j.pending | j.lost)))
                   for j in self._jobs.values()]
        self._jobs.clear()
        return dropped

    # ---------------------------------------------------------------- queries
    @property
    def num_pending(self) -> int:
        return len(self._jobs)

    def pending_ranks(self, job_id: int) -> set[int]:
        """Ranks that have not acked ``job_id`` yet (empty when it is not pending)."""
        job = self._jobs.get(job_id)
        return set(job.pending) if job else set()


class StatsBlocks(Protocol):
    """What the monitor reads (``SharedOffloadRegion`` satisfies it)."""

    layout: RegionLayout

    def stats(self, rank: int, slot: int | None = None) -> RankStats: ...

    def slot_held(self, rank: int, slot: int) -> bool: ...


class RankMonitor:
    """Liveness of each rank's workers, read from the attachment blocks in the region header."""

    def __init__(self, region: StatsBlocks, world_size: int):
        self._reader = AttachmentReader(region, region.layout)
        self._world_size = world_size

    def incarnations(self, following: Sequence[int | None] | None = None) -> list[int | None]:
        """Per rank: the incarnation in ``following`` if that attachment is still up, else the
        newest live attachment's (the latest-started process), else None."""
        found: list[int | None] = []
        for rank in range(self._world_size):
            live = self._reader.read(rank).live
            wanted = None if following is None else following[rank]
            if any(a.incarnation == wanted for a in live):
                found.append(wanted)
            elif live:
                newest = max(live, key=lambda a: (a.snapshot.pid_start_ns, a.snapshot.heartbeat_ns))
                found.append(newest.incarnation)
            else:
                found.append(None)
        self._reader.take_errors()  # a block left mid-update reads as its last snapshot
        return found

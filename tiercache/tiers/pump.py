"""``JobPump``: the queues and threads that serve a tier's jobs, one for every tier.

A tier (``tiercache.tiers.base``) answers ``submit`` at once and moves bytes on its
own threads. The pump is that part, the same for each tier:

* **Lanes.** A lane is a queue with its own threads and its own way to run a job
  (the disk: one lane of I/O threads; the cluster: publishers, and promoters that also
  probe). Within a lane the lowest ``priority`` goes first, then the oldest.
* **One lock.** The pump's queues live under the tier's own lock, so a tier checks its
  state and queues a job in one step (``put`` and ``queued`` are called under it), and the
  pump's ``finish`` callback, under it too, is where the tier books and reports a result.
* **A job always ends in one result.** ``run(job, worker)`` returns the job's
  ``JobResult``; a run that raises is a bug: logged, the whole job failed, the thread goes
  on serving. ``worker`` numbers the pump's job threads from 0 across lanes in order (the
  cluster gives each its own staging area).
* **Stop: bounded.** ``stop`` (under the lock) ends the serving and hands back every job
  never started (the tier reports them failed); ``join(timeout_s)`` waits at most that
  long in all for the threads and names those still alive, in a job (``doing``) or in a
  loop of the tier's own (``start``'s ``loops``): daemons, abandoned, which a tier's stop
  must outlive (a read may still land in the region's mapping: its owner keeps it).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiercache.errors import ArgumentError
from tiercache.tiers.base import JobResult, TierJob

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lane:
    """``threads`` threads named ``tiercache-<tier>-<name>-<i>``, each running
    ``run(job, worker)`` on this lane's jobs."""

    name: str
    threads: int
    run: Callable[[TierJob, int], JobResult]

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ArgumentError(f"lane {self.name!r} with {self.threads} threads; at least 1")


class JobPump:
    """See the module docstring. ``finish(job, result)`` runs under ``lock`` once per job
    that ran (a job ``stop`` hands back never runs and never finishes)."""

    def __init__(self, tier: str, lock: threading.Lock, lanes: Sequence[Lane],
                 finish: Callable[[TierJob, JobResult], None]):
        names = [lane.name for lane in lanes]
        if not lanes or len(set(names)) != len(names):
            raise ArgumentError(f"lanes {names}: at least one, each named once")
        self.tier = tier
        self._lock = lock
        self._lanes = {lane.name: lane for lane in lanes}
        # one condition a lane, all on the tier's lock: a job wakes a thread of its lane
        self._work = {name: threading.Condition(lock) for name in names}
        self._queues: dict[str, list[tuple[int, int, TierJob]]] = {n: [] for n in names}
        self._count = itertools.count()
        self._finish = finish
        self._doing: dict[str, str] = {}  # thread name -> the job it runs
        self._stop = False
        self._threads: list[threading.Thread] = []

    def start(self, loops: Sequence[tuple[str, Callable[[], None]]] = ()) -> None:
        """Start every lane's threads, and one thread per ``(name, loop)`` of the tier's
        own (it returns when the tier stops it; ``join`` waits for it too)."""
        worker = itertools.count()
        targets: list[tuple[str, Callable[..., None], tuple[object, ...]]] = [
            (f"{lane.name}-{i}", self._serve, (lane, next(worker)))
            for lane in self._lanes.values() for i in range(lane.threads)]
        targets += [(name, loop, ()) for name, loop in loops]
        for name, target, args in targets:
            thread = threading.Thread(target=target, args=args, daemon=True,
                                      name=f"tiercache-{self.tier}-{name}")
            thread.start()
            self._threads.append(thread)

    # ------------------------------------------------------------------ under the lock
    def put(self, lane: str, job: TierJob, priority: int = 0) -> None:
        """Queue ``job`` on ``lane`` (under the lock; never after ``stop``: the tier checks
        ``stopping`` first and reports the job failed)."""
        assert not self._stop, "a job queued after the pump stopped"
        heapq.heappush(self._queues[lane], (priority, next(self._count), job))
        self._work[lane].notify()

    def queued(self, lane: str) -> int:
        """Jobs waiting on ``lane`` (under the lock)."""
        return len(self._queues[lane])

    def drain(self, lane: str) -> list[TierJob]:
        """Take every job waiting on ``lane`` out of it, in the order they would have run
        (under the lock; the tier reports them: the cluster's publishes while it is down)."""
        queue = self._queues[lane]
        jobs = [job for _, _, job in sorted(queue)]
        queue.clear()
        return jobs

    @property
    def running(self) -> int:
        """Jobs in a thread now (under the lock)."""
        return len(self._doing)

    @property
    def stopping(self) -> bool:
        return self._stop

    def stop(self) -> list[TierJob]:
        """Stop serving (under the lock): returns the jobs never started, oldest first in
        each lane; jobs running finish as they end."""
        self._stop = True
        never = [job for queue in self._queues.values() for _, _, job in sorted(queue)]
        for queue in self._queues.values():
            queue.clear()
        for work in self._work.values():
            work.notify_all()
        return never

    def doing(self, thread: str) -> str | None:
        """What job thread ``thread`` runs now, None if none (under the lock)."""
        return self._doing.get(thread)

    # ------------------------------------------------------------------ not under it
    def join(self, timeout_s: float | None = None) -> list[str]:
        """Wait at most ``timeout_s`` in all (None: as long as it takes) for every thread;
        returns the names of those still alive (abandoned: ``doing`` says which job)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]
        return [t.name for t in self._threads]

    def _next(self, lane: str) -> TierJob | None:
        queue = self._queues[lane]
        with self._lock:
            while not queue and not self._stop:
                self._work[lane].wait()
            if self._stop:
                return None
            _, _, job = heapq.heappop(queue)
            self._doing[threading.current_thread().name] = (
                f"{job.kind.value} of {len(job.keys)} block(s)")
            return job

    def _serve(self, lane: Lane, worker: int) -> None:
        me = threading.current_thread().name
        while (job := self._next(lane.name)) is not None:
            result = JobResult(job.job_id, failed=job.keys)
            try:
                result = lane.run(job, worker)
            except Exception:  # a bug: keep the tier serving, say it loudly, fail the job
                log.exception("%s tier: a %s job failed", self.tier, job.kind.value)
            finally:
                with self._lock:
                    del self._doing[me]
                    self._finish(job, result)

"""The demo's scheduler: the index through ``Client``, one worker process per rank, and
the completion loop of ``tiercache.link.jobs`` between them.

One request at a time (its GPU blocks are reused by the next one): ``lease`` of the
hit run (its answer holds the slots) → ``prepare_store`` of the rest → a LOAD and a STORE
job to every rank → ``complete_load`` / ``complete_store`` once every rank reported
each job or was lost. Liveness comes from the stats blocks (``RankMonitor``), so a
SIGKILLed worker fails its jobs instead of hanging them.

A job's index is the coordinator it was prepared with. When a client call raises
``CoordinatorGoneError``, or the region's generation changes (a new coordinator
re-adopted it), the pending jobs are dropped from the tracker (``reset``), never
completed against an index that did not prepare them; their transfers still finish,
and their loads are still checked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from tiercache.link.client import Client
from tiercache.config import Config
from tiercache.errors import CoordinatorGoneError, JobError, RanksDownError, WorkerError
from tiercache.link.jobs import JobKind, JobOutcome, JobTracker, RankMonitor
from tiercache.region.attachments import AttachmentReader
from tiercache.region.layout import RegionLayout
from tiercache.region.shared import SharedOffloadRegion
from tiercache.specs import Direction
from tiercache.tools.demo.pool import RankPool
from tiercache.tools.demo.content import key_seeds
from tiercache.tools.demo.rank import RankOptions
from tiercache.tools.demo.report import Totals
from tiercache.tools.demo.wire import Command, Op, Report
from tiercache.tools.demo.workload import Request

log = logging.getLogger(__name__)

# A lease answered "pending" (the next blocks are being promoted from the disk tier, or
# written by another engine) is asked again after a pause, as an engine asks again at its
# next step: at most PENDING_RETRIES times (a slow tier never holds a request for long).
PENDING_RETRIES = 20
PENDING_WAIT_S = 0.002

ATTACH_TIMEOUT_S = 120.0  # a spawned worker imports torch and attaches (slow on small CI)
POLL_S = 0.02  # how often liveness is re-read while waiting for reports
KEEP_OUTCOMES = 4096  # finished outcomes remembered for callers (oldest dropped first)
_T = TypeVar("_T")


@dataclass(frozen=True)
class Submission:
    """The jobs one request became (``None``: nothing to load / store)."""

    request: Request
    hit_blocks: int
    load_job: int | None
    store_job: int | None
    stored_keys: tuple[bytes, ...]


class DemoEngine:
    """A scheduler with ``config.world_size`` rank workers; see the module docstring."""

    def __init__(self, config: Config, options: RankOptions, client_timeout_s: float = 10.0):
        self.config = config
        self.options = options
        self.world_size = config.world_size
        self.factor = config.kv.block_size_factor
        self.region = SharedOffloadRegion.attach(
            config.name, layout=RegionLayout.from_config(config), timeout_s=options.ready_timeout_s)
        self.client = Client(config, timeout_s=client_timeout_s)
        self.monitor = RankMonitor(self.region, self.world_size)
        self.tracker = JobTracker(self.world_size)
        self.totals = Totals(self.world_size)
        self.pool = RankPool(config, options)
        self.outcomes: dict[int, JobOutcome] = {}  # finished jobs, for callers that look
        self.bench_reports: list[Report] = []
        # a rank's counters are the sums over all its attachment blocks
        self._counters = AttachmentReader(self.region, self.region.layout)
        self._baseline = [self._counters.read(r).directions for r in range(self.world_size)]
        self._generation = self.region.info().generation
        self._epoch = 0  # bumped whenever the index that prepared pending jobs is gone
        self._job_epoch: dict[int, int] = {}
        self._next_sync = 0.0  # pump re-reads liveness at most every POLL_S
        self._next_job_id = 1

    # ---------------------------------------------------------------- workers
    def start(self, timeout_s: float = ATTACH_TIMEOUT_S) -> None:
        """Spawn every rank's worker and wait until all are attached and seen alive."""
        self.pool.spawn_all(timeout_s)
        self._await_ranks_up(timeout_s)

    def restart_rank(self, rank: int, timeout_s: float = ATTACH_TIMEOUT_S) -> None:
        """Replace ``rank``'s worker (reaping the old one) and wait until the new one is up."""
        self.pool.spawn(rank, timeout_s)
        self.totals.rank_restarts += 1
        self._await_ranks_up(timeout_s)

    def _await_ranks_up(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.sync()
            down = self.tracker.down_ranks()
            if not down:
                return
            if time.monotonic() > deadline:
                raise WorkerError(f"rank(s) {down} not up within {timeout_s} s")
            self.pump(POLL_S)

    def worker_pids(self) -> list[int]:
        return self.pool.pids()

    def numa(self) -> list[dict[str, Any]]:
        """Each rank's slice placement, as its stats blocks record it."""
        placements = [self._counters.read(r).numa for r in range(self.world_size)]
        return [{"rank": r, "state": p.state.label, "node": p.node,
                 "local_ratio": p.local_ratio} for r, p in enumerate(placements)]

    def stall(self, ranks: Sequence[int]) -> None:
        """Fault injection: block these ranks' compute streams (their transfers wait)."""
        self.pool.send(ranks, Command(Op.STALL))

    def release(self, ranks: Sequence[int]) -> None:
        self.pool.send(ranks, Command(Op.RELEASE))

    # ---------------------------------------------------------------- requests
    def run(self, request: Request, timeout_s: float = 60.0) -> Submission:
        """Submit one request and wait until its jobs are completed."""
        submission = self.submit(request)
        self.wait_idle(timeout_s)
        return submission

    def submit(self, request: Request) -> Submission:
        """Ask the index, start the load and store jobs on every rank; does not wait."""
        self.sync()
        down = self.tracker.down_ranks()
        if down:
            raise RanksDownError(down)
        if self.pool.outstanding():
            raise JobError("the previous request's transfers are still in flight; wait_idle() "
                           "first (their GPU blocks are reused)")
        keys = request.keys
        # A lease, not a lookup: its hits stay pinned until the load completes (the pin is
        # what complete_load drops), so nothing evicts them in between, not even a disk
        # tier's promotion running beside this engine.
        lease = self._index(self.client.lease, keys)
        for _ in range(PENDING_RETRIES):  # promoting from a lower tier: ask again, as an
            if not lease.pending:  # engine's next step would (vLLM: HIT_PENDING)
                break
            if lease.num_hit:
                self._index(self.client.release, keys[:lease.num_hit])
            time.sleep(PENDING_WAIT_S)
            lease = self._index(self.client.lease, keys)
        hits = lease.num_hit
        t = self.totals
        t.requests += 1
        t.lookup_blocks += len(keys)
        t.hit_blocks += hits
        load_job = store_job = None
        if hits:
            spec = lease.spec
            assert spec is not None, "a lease with hits names their slots"
            t.loaded_blocks += hits
            load_job = self._start_job(JobKind.LOAD, keys[:hits], spec.block_ids, range(hits))
        stored: tuple[bytes, ...] = ()
        if hits < len(keys):
            out = self._index(self.client.prepare_store, keys[hits:])
            if out is None:
                t.store_rejections += 1
            elif out.keys_to_store:
                stored = out.keys_to_store
                position = {k: i for i, k in enumerate(keys)}
                store_job = self._start_job(JobKind.STORE, stored, out.store_spec.block_ids,
                                            [position[k] for k in stored])
        return Submission(request, hits, load_job, store_job, stored)

    def _start_job(self, kind: JobKind, keys: Sequence[bytes], cpu_ids: np.ndarray,
                   positions: Sequence[int]) -> int:
        job_id = self.allocate_job_ids(1)
        first = np.asarray(positions, dtype=np.int64) * self.factor
        gpu_ids = (first[:, None] + np.arange(self.factor, dtype=np.int64)).reshape(-1)
        self.tracker.begin(job_id, kind, keys)
        self._job_epoch[job_id] = self._epoch
        command = Command(Op.STORE if kind is JobKind.STORE else Op.LOAD, job_id,
                          np.asarray(cpu_ids, np.int64), gpu_ids, key_seeds(keys))
        self.pool.broadcast(command)  # a dead worker's part is lost via the monitor
        return job_id

    def _index(self, call: Callable[..., _T], *args) -> _T:
        try:
            return call(*args)
        except CoordinatorGoneError:
            self._index_lost()
            raise

    def _index_lost(self) -> None:
        self.totals.coordinator_gone += 1
        self._drop_pending()

    def _drop_pending(self) -> None:
        """The index that prepared the pending jobs is gone: never complete them."""
        self._epoch += 1
        for outcome in self.tracker.reset():
            self._orphan(outcome)

    def _orphan(self, outcome: JobOutcome) -> None:
        self._remember(outcome)
        del self._job_epoch[outcome.job_id]
        self.totals.orphaned_jobs += 1

    def _remember(self, outcome: JobOutcome) -> None:
        self.outcomes[outcome.job_id] = outcome
        while len(self.outcomes) > KEEP_OUTCOMES:
            self.outcomes.pop(next(iter(self.outcomes)))

    # ---------------------------------------------------------------- the loop
    def pump(self, timeout_s: float) -> None:
        """Read reports for up to ``timeout_s``, refresh liveness, complete finished jobs."""
        for report in self.pool.reports(timeout_s):
            self._account(report)
        if time.monotonic() >= self._next_sync:
            self.sync()
        self._complete(self.tracker.take_finished())

    def _account(self, report: Report) -> None:
        if report.op is Op.DONE:
            self.totals.add_transfer(report)
            if report.direction.loads and report.success:
                self.totals.checked_blocks += report.num_blocks
                self.totals.mismatched_blocks += report.mismatched_blocks
            self.tracker.ack(report.rank, report.incarnation, report.job_id, report.success)
        elif report.op is Op.BENCH_DONE:
            self.bench_reports.append(report)

    def sync(self) -> None:
        """Re-read liveness (stats blocks) and the region generation."""
        self._next_sync = time.monotonic() + POLL_S
        generation = self.region.info().generation
        if generation != self._generation:
            log.warning("region generation %d -> %d: a new coordinator; pending jobs dropped",
                        self._generation, generation)
            self._generation = generation
            self._drop_pending()
        changed = self.tracker.observe(self.monitor.incarnations(self.tracker.incarnations))
        for rank in changed:
            if self.tracker.incarnations[rank] is None:
                log.warning("rank %d is down; its in-flight jobs fail", rank)
                self.pool.forget_outstanding(rank)

    def _complete(self, outcomes: list[JobOutcome]) -> None:
        for i, outcome in enumerate(outcomes):
            if self._job_epoch[outcome.job_id] != self._epoch:
                self._orphan(outcome)
                continue
            try:
                outcome.complete(self.client)
            except CoordinatorGoneError:
                for lost in outcomes[i:]:
                    self._orphan(lost)
                self._index_lost()
                return
            self._remember(outcome)
            del self._job_epoch[outcome.job_id]
            if not outcome.success:
                self.totals.failed_jobs += 1
            elif outcome.kind is JobKind.STORE:
                self.totals.stored_blocks += len(outcome.keys)

    def is_idle(self) -> bool:
        return not self.tracker.num_pending and not self.pool.outstanding()

    def wait_idle(self, timeout_s: float) -> None:
        """Until every job is completed and every live worker has reported all it was sent."""
        deadline = time.monotonic() + timeout_s
        while not self.is_idle():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"jobs still pending after {timeout_s} s: tracker "
                                   f"{self.tracker.num_pending}, per rank "
                                   f"{self.pool.outstanding()}")
            self.pump(min(POLL_S, left))

    def wait_for(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Pump until ``condition()`` holds; ``TimeoutError`` naming ``what`` otherwise."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout_s} s")
            self.pump(POLL_S)

    def allocate_job_ids(self, count: int) -> int:
        """Reserve ``count`` consecutive job ids; returns the first."""
        first = self._next_job_id
        self._next_job_id += count
        return first

    def take_bench_reports(self) -> list[Report]:
        taken, self.bench_reports = self.bench_reports, []
        return taken

    # ---------------------------------------------------------------- stats and teardown
    def stats_agree(self) -> bool:
        """Did the stats blocks count exactly what the workers reported since the start?"""
        for rank, dirs in enumerate(self.totals.ranks):
            now = self._counters.read(rank).directions
            then = self._baseline[rank]
            for d in Direction:
                counted = (now[d].bytes_total - then[d].bytes_total,
                           now[d].transfers_ok - then[d].transfers_ok,
                           now[d].transfers_failed - then[d].transfers_failed)
                if counted != (dirs[d].bytes, dirs[d].transfers_ok, dirs[d].transfers_failed):
                    return False
        return True

    def close(self) -> None:
        """Drain and close every worker, then the client and the region view."""
        try:
            for report in self.pool.close():
                self._account(report)
        finally:
            self.client.close()
            self.region.close()

"""``JobPump``, the job threads of every tier: lanes with their own threads and order
(priority, then age), one result per job (a run that raises fails its job and the thread
goes on), workers numbered across lanes, and a bounded stop that hands back what never
started and names the threads it abandons. Real threads; every wait ends on an event."""

from __future__ import annotations

import threading

import pytest

from tiercache.errors import ArgumentError
from tiercache.tiers.base import JobKind, JobResult, TierJob
from tiercache.tiers.pump import JobPump, Lane

WAIT_S = 30.0


def job(job_id: int, kind: JobKind = JobKind.DEMOTE, keys: int = 1) -> TierJob:
    ks = tuple(b"k%d-%d" % (job_id, i) for i in range(keys))
    return TierJob(job_id, kind, ks, tuple(range(keys)) if kind is not JobKind.PROBE else ())


class Recorder:
    """A tier's side: what ran (job id, worker, thread), what finished, under the lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ran: list[tuple[int, int, str]] = []
        self.finished: list[JobResult] = []
        self.done = threading.Condition(self.lock)

    def run(self, job: TierJob, worker: int) -> JobResult:
        with self.lock:
            self.ran.append((job.job_id, worker, threading.current_thread().name))
        return JobResult(job.job_id, done=job.keys)

    def finish(self, job: TierJob, result: JobResult) -> None:
        assert self.lock.locked()  # the pump calls it under the tier's lock
        self.finished.append(result)
        self.done.notify_all()

    def wait_finished(self, count: int) -> None:
        with self.lock:
            assert self.done.wait_for(lambda: len(self.finished) >= count, WAIT_S)


def test_jobs_of_a_lane_run_by_priority_then_age():
    tier = Recorder()
    started, gate = threading.Event(), threading.Event()
    order: list[int] = []

    def run(j: TierJob, worker: int) -> JobResult:
        if j.job_id == 0:
            started.set()
            gate.wait(WAIT_S)  # the one thread is busy while the others queue
        order.append(j.job_id)
        return JobResult(j.job_id, done=j.keys)

    pump = JobPump("t", tier.lock, [Lane("io", 1, run)], tier.finish)
    pump.start()
    with tier.lock:
        pump.put("io", job(0))
    assert started.wait(WAIT_S)
    with tier.lock:
        assert pump.running == 1
        for job_id, priority in ((1, 1), (2, 0), (3, 1), (4, 0)):
            pump.put("io", job(job_id), priority)
        assert pump.queued("io") == 4
    gate.set()
    tier.wait_finished(5)
    assert order == [0, 2, 4, 1, 3]
    with tier.lock:
        assert pump.stop() == []
    assert pump.join(WAIT_S) == []


def test_lanes_have_their_own_threads_and_workers_are_numbered_across_lanes():
    tier = Recorder()
    pump = JobPump("t", tier.lock, [Lane("publish", 2, tier.run), Lane("promote", 1, tier.run)],
                   tier.finish)
    pump.start()
    with tier.lock:
        for i in range(6):
            pump.put("publish", job(i))
        pump.put("promote", job(100, JobKind.PROMOTE))
    tier.wait_finished(7)
    by_job = {job_id: (worker, thread) for job_id, worker, thread in tier.ran}
    assert by_job[100] == (2, "tiercache-t-promote-0")
    assert {by_job[i] for i in range(6)} <= {(0, "tiercache-t-publish-0"),
                                             (1, "tiercache-t-publish-1")}
    assert sorted(r.job_id for r in tier.finished) == [0, 1, 2, 3, 4, 5, 100]
    assert all(r.done and not r.failed for r in tier.finished)
    with tier.lock:
        pump.stop()
    assert pump.join(WAIT_S) == []


def test_a_job_wakes_a_thread_of_its_own_lane():
    """Threads of every lane wait on the tier's one lock: a job for one lane, with the
    other lane's threads idle, still runs (a wake-up taken by the wrong lane would leave
    it queued for good)."""
    tier = Recorder()
    pump = JobPump("t", tier.lock, [Lane("publish", 4, tier.run), Lane("promote", 1, tier.run)],
                   tier.finish)
    pump.start()
    for i in range(20):  # one at a time: each put wakes one waiter
        with tier.lock:
            pump.put("promote", job(i, JobKind.PROMOTE))
        tier.wait_finished(i + 1)
    assert {worker for _, worker, _ in tier.ran} == {4}
    with tier.lock:
        pump.stop()
    assert pump.join(WAIT_S) == []


def test_a_run_that_raises_fails_its_whole_job_and_the_thread_serves_on(caplog):
    tier = Recorder()

    def run(j: TierJob, worker: int) -> JobResult:
        if j.job_id == 1:
            raise RuntimeError("a bug")
        return tier.run(j, worker)

    pump = JobPump("t", tier.lock, [Lane("io", 1, run)], tier.finish)
    pump.start()
    with tier.lock:
        pump.put("io", job(1, keys=3))
        pump.put("io", job(2))
    tier.wait_finished(2)
    first, second = tier.finished
    assert first.job_id == 1 and first.done == () and first.failed == job(1, keys=3).keys
    assert second.job_id == 2 and second.done == job(2).keys
    assert "t tier: a demote job failed" in caplog.text
    with tier.lock:
        pump.stop()
    assert pump.join(WAIT_S) == []


def test_stop_hands_back_what_never_started_and_join_names_what_it_abandons():
    tier = Recorder()
    started, release, loop_stop = threading.Event(), threading.Event(), threading.Event()

    def stuck(j: TierJob, worker: int) -> JobResult:
        started.set()
        release.wait(WAIT_S)  # a read the kernel holds
        return JobResult(j.job_id, done=j.keys)

    pump = JobPump("t", tier.lock, [Lane("io", 1, stuck)], tier.finish)
    pump.start([("health", lambda: loop_stop.wait(WAIT_S))])
    with tier.lock:
        pump.put("io", job(1, JobKind.PROMOTE, keys=2))
    assert started.wait(WAIT_S)
    with tier.lock:
        pump.put("io", job(2))
        pump.put("io", job(3))
        never = pump.stop()
        assert pump.stopping
    assert [j.job_id for j in never] == [2, 3]
    loop_stop.set()
    left = pump.join(timeout_s=0.2)
    assert left == ["tiercache-t-io-0"]  # the loop ended; the stuck job's thread did not
    with tier.lock:
        assert pump.doing(left[0]) == "promote of 2 block(s)"
    release.set()  # the stuck read ends: its job still finishes, once
    tier.wait_finished(1)
    assert [r.job_id for r in tier.finished] == [1]
    assert pump.join(WAIT_S) == []
    with tier.lock:
        assert pump.doing("tiercache-t-io-0") is None and pump.running == 0


def test_drain_takes_a_lane_s_waiting_jobs_in_order():
    tier = Recorder()
    pump = JobPump("t", tier.lock, [Lane("publish", 1, tier.run), Lane("promote", 1, tier.run)],
                   tier.finish)  # not started: every job waits
    with tier.lock:
        for job_id, priority in ((1, 1), (2, 0), (3, 1)):
            pump.put("publish", job(job_id), priority)
        pump.put("promote", job(9, JobKind.PROMOTE))
        assert [j.job_id for j in pump.drain("publish")] == [2, 1, 3]
        assert pump.queued("publish") == 0 and pump.queued("promote") == 1


def test_bad_lanes_are_refused():
    lock = threading.Lock()
    with pytest.raises(ArgumentError, match="at least 1"):
        Lane("io", 0, lambda j, w: JobResult(j.job_id))
    with pytest.raises(ArgumentError, match="each named once"):
        JobPump("t", lock, [Lane("io", 1, lambda j, w: JobResult(j.job_id))] * 2,
                lambda j, r: None)

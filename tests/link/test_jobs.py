"""The completion loop: narrated JobTracker scenarios, and RankMonitor over real processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest

from tiercache.errors import JobError, RankError
from tiercache.link.jobs import JobKind, JobOutcome, JobTracker, RankMonitor
from tiercache.index.manager import OffloadingManager
from tiercache.region.shared import SharedOffloadRegion
from spawned import attach_and_hold

K = [b"k%d" % i for i in range(4)]


def tracker_with(world_size: int = 2) -> JobTracker:
    tracker = JobTracker(world_size)
    tracker.observe([1] * world_size)  # every rank attached once
    return tracker


def test_a_job_finishes_when_every_rank_acked_and_succeeds_only_if_all_did():
    t = tracker_with(3)
    t.begin(1, JobKind.STORE, K[:2])
    t.begin(2, JobKind.LOAD, K[2:])
    assert t.ack(0, 1, 1, True) and t.ack(2, 1, 1, True)
    assert t.take_finished() == [] and t.pending_ranks(1) == {1}
    assert t.ack(1, 1, 1, True)
    assert t.take_finished() == [JobOutcome(1, JobKind.STORE, tuple(K[:2]), True)]
    for rank in range(3):
        t.ack(rank, 1, 2, rank != 1)
    assert t.take_finished() == [JobOutcome(2, JobKind.LOAD, tuple(K[2:]), False,
                                            failed_ranks=(1,))]
    assert t.num_pending == 0 and t.stale_acks == 0


def test_a_dead_rank_fails_its_jobs_once_the_live_ranks_reported_never_before():
    t = tracker_with(2)
    t.begin(7, JobKind.LOAD, K[:1])
    t.begin(8, JobKind.STORE, K[1:2])
    t.ack(0, 1, 7, True)
    assert t.observe([1, None]) == [1]  # rank 1's worker died
    assert [o.job_id for o in t.take_finished()] == [7]  # rank 0 already reported job 7
    assert t.pending_ranks(8) == {0}  # rank 0 may still be writing job 8's slots
    t.ack(0, 1, 8, True)
    (outcome,) = t.take_finished()
    assert (outcome.job_id, outcome.success, outcome.lost_ranks) == (8, False, (1,))
    with pytest.raises(JobError, match=r"rank\(s\) \[1\] are down"):
        t.begin(9, JobKind.LOAD, K[:1])


def test_acks_of_an_earlier_incarnation_or_a_dropped_job_are_stale():
    t = tracker_with(2)
    t.begin(1, JobKind.STORE, K[:1])
    t.observe([1, 2])  # rank 1 re-attached before its old worker's ack was read
    assert not t.ack(1, 1, 1, True)  # the old worker's ack: stale
    t.ack(0, 1, 1, True)
    assert t.take_finished()[0].lost_ranks == (1,)
    t.begin(2, JobKind.LOAD, K[:1])
    assert not t.ack(1, 1, 2, True)  # old incarnation again
    dropped = t.reset()
    assert [(o.job_id, o.success, o.lost_ranks) for o in dropped] == [(2, False, (0, 1))]
    assert not t.ack(0, 1, 2, True) and not t.ack(1, 2, 2, True)  # after the reset
    assert t.stale_acks == 4 and t.take_finished() == []


def test_misuse_is_refused_with_the_value_named():
    t = tracker_with(2)
    t.begin(1, JobKind.LOAD, K[:1])
    with pytest.raises(JobError, match="job 1 is already pending"):
        t.begin(1, JobKind.LOAD, K[:1])
    with pytest.raises(JobError, match="no keys"):
        t.begin(2, JobKind.STORE, [])
    t.ack(0, 1, 1, True)
    with pytest.raises(JobError, match="rank 0 .* acked twice"):
        t.ack(0, 1, 1, True)
    with pytest.raises(RankError, match="rank 5"):
        t.ack(5, 1, 1, True)
    with pytest.raises(JobError, match="3 incarnations given for world_size 2"):
        t.observe([1, 1, 1])
    with pytest.raises(JobError, match=r"rank\(s\) \[0, 1\] are down"):
        JobTracker(2).begin(1, JobKind.LOAD, K[:1])


def test_outcomes_complete_against_the_index():
    index = OffloadingManager(4)
    out = index.prepare_store(K[:2])
    assert out is not None
    JobOutcome(1, JobKind.STORE, tuple(K[:1]), True).complete(index)
    JobOutcome(2, JobKind.STORE, tuple(K[1:2]), False).complete(index)  # slot freed
    assert index.lookup(K[:2]) == 1
    index.prepare_load(K[:1])
    JobOutcome(3, JobKind.LOAD, tuple(K[:1]), False, lost_ranks=(1,)).complete(index)
    s = index.stats()
    assert (s.ready_blocks, s.loading_blocks, s.writing_blocks, s.free_blocks) == (1, 0, 0, 3)


def test_monitor_sees_attach_detach_sigkill_and_reattach(make_config):
    config = make_config()
    ctx = mp.get_context("spawn")
    with SharedOffloadRegion.create(config) as region:
        monitor = RankMonitor(region, config.world_size)
        assert monitor.incarnations() == [None, None]
        attached, release = ctx.Event(), ctx.Event()
        holder = ctx.Process(target=attach_and_hold, args=(config.name, 1, attached, release))
        holder.start()
        assert attached.wait(60)
        assert monitor.incarnations() == [None, 1]
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(10)
        assert monitor.incarnations() == [None, None]  # pid still recorded, process gone
        attached, release = ctx.Event(), ctx.Event()
        second = ctx.Process(target=attach_and_hold, args=(config.name, 1, attached, release))
        second.start()
        assert attached.wait(60)
        assert monitor.incarnations() == [None, 2]
        release.set()
        second.join(30)
        assert second.exitcode == 0
        assert monitor.incarnations() == [None, None]  # detached cleanly

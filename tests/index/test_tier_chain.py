"""The tier chain (tiercache.index.tiering) over one-way tiers that keep their blocks in a
dict and finish jobs when told to (the real tiers have tests of their own in tests/tiers):
the chain alone reserves, pins, completes and holds out; a tier only answers and reports.

The first tier that holds a key promotes it; each tier is given its own keys of a run and
the host-resident ones are protected beside them; engine stores are published, promotions
to every tier but the one they came from; a MAYBE is probed, then promoted from what the
probe found; a lease names where each promoted block came from; a reset while tier jobs
read and write never hands out their slots nor serves what lands after it; reads that may
still land are held out until they settle, and stop promotions meanwhile; demotion below
the watermark admits reused blocks first."""

from __future__ import annotations

from collections.abc import Callable

from tiercache.tiers.base import (
    JobKind, JobResult, KeyChange, LowerTier, Presence, TierJob, TierPolicy, TierStats,
)
from tiercache.index.manager import OffloadingManager
from tiercache.results import BlockSource
from tiercache.specs import Medium


class DictTier(LowerTier):
    def __init__(self, source: BlockSource, keys=(), *, maybe=(), publish: bool = False,
                 demote_below: float = 0.0):
        self.source = source
        self.policy = TierPolicy(Medium.STORAGE, demote_below=demote_below, publish=publish,
                                 max_queued_blocks=4, job_blocks=2, promote_blocks=4)
        self.blocks = set(keys)
        self.maybe = set(maybe)  # keys it has to ask about first
        self.jobs: list[TierJob] = []
        self.results: list[JobResult] = []
        self.changes: list[KeyChange] = []

    def holds(self, key: bytes, asker: int) -> Presence:
        if key in self.maybe:
            return Presence.MAYBE
        return Presence.YES if key in self.blocks else Presence.NO

    def submit(self, job: TierJob) -> None:
        self.jobs.append(job)

    def finish(self, **override) -> None:
        """Every job given so far ends (as the real tiers' threads end them)."""
        for job in self.jobs:
            if job.kind is JobKind.PROBE:
                self.maybe -= set(job.keys)
                run = []
                for key in job.keys:
                    if key not in self.blocks:
                        break
                    run.append(key)
                result = JobResult(job.job_id, done=tuple(run), failed=job.keys[len(run):])
            elif job.kind is JobKind.PROMOTE:
                done = tuple(k for k in job.keys if k in self.blocks)
                result = JobResult(job.job_id, done=done,
                                   failed=tuple(k for k in job.keys if k not in done))
            else:
                self.blocks |= set(job.keys)
                self.changes.append(KeyChange(job.keys, False))
                result = JobResult(job.job_id, done=job.keys)
            self.results.append(JobResult(**{**result.__dict__, **override}))
        self.jobs.clear()

    def take_finished(self) -> list[JobResult]:
        results, self.results = self.results, []
        return results

    def take_changes(self) -> list[KeyChange]:
        changes, self.changes = self.changes, []
        return changes

    def start(self, wake: Callable[[], None]) -> None:
        pass

    def close(self, timeout_s: float | None = None) -> list[str]:
        return []

    def snapshot(self) -> TierStats:
        return TierStats()

    def given(self, kind: JobKind) -> list[tuple[bytes, ...]]:
        return [job.keys for job in self.jobs if job.kind is kind]


def k(*ids: int) -> list[bytes]:
    return [b"key-%d" % i for i in ids]


def store(manager: OffloadingManager, *ids: int) -> list[int]:
    out = manager.prepare_store(k(*ids))
    manager.complete_store(list(out.keys_to_store))
    return out.store_spec.block_ids.tolist()


def chain(*tiers: DictTier, num_blocks: int = 8) -> OffloadingManager:
    manager = OffloadingManager(num_blocks)
    manager.chain.set_tiers(tiers)
    return manager


def settle(manager: OffloadingManager, *tiers: DictTier) -> None:
    for tier in tiers:
        tier.finish()
    manager.chain.run_once()


def test_the_first_tier_that_holds_a_key_promotes_it():
    disk = DictTier(BlockSource.DISK, k(0, 1))
    cluster = DictTier(BlockSource.CLUSTER, k(1, 2))
    manager = chain(disk, cluster)
    lease = manager.lease(k(0, 1, 2, 3))
    assert (lease.num_hit, lease.pending) == (0, True)  # k(3): nobody holds it, the run ends
    assert disk.given(JobKind.PROMOTE) == [tuple(k(0, 1))]
    assert cluster.given(JobKind.PROMOTE) == [tuple(k(2))]
    assert manager.stats().writing_blocks == 3  # the chain reserved their host slots


def test_each_tier_gets_its_keys_and_the_runs_host_blocks_are_protected():
    disk = DictTier(BlockSource.DISK, k(1))
    cluster = DictTier(BlockSource.CLUSTER, k(3))
    manager = chain(disk, cluster, num_blocks=3)
    store(manager, 2)  # the oldest block, but part of the run: not evicted for it
    manager.complete_store(list(manager.prepare_store([b"other"]).keys_to_store))
    store(manager, 0)
    lease = manager.lease(k(0, 1, 2, 3, 4))
    assert (lease.num_hit, lease.pending) == (1, True)  # 0 in host; 1 is promoting
    assert disk.given(JobKind.PROMOTE) == [tuple(k(1))]
    assert manager.lookup(k(2)) == 1 and manager.lookup([b"other"]) == 0  # "other" evicted
    assert cluster.jobs == []  # no room left for 3 without evicting the run: a miss


def test_stores_are_published_and_promotions_to_every_tier_but_their_own():
    disk = DictTier(BlockSource.DISK, k(4))
    cluster = DictTier(BlockSource.CLUSTER, k(5), publish=True)
    manager = chain(disk, cluster)
    store(manager, 0, 1)
    manager.chain.run_once()
    assert cluster.given(JobKind.PUBLISH) == [tuple(k(0, 1))]
    assert manager.stats().loading_blocks == 2  # pinned while the tier reads them
    settle(manager, cluster)
    assert manager.stats().loading_blocks == 0
    manager.lease(k(5), owner=3)
    settle(manager, cluster)  # up from the pool: READY, not published back to it
    manager.chain.run_once()
    assert manager.lookup(k(5)) == 1 and cluster.jobs == []
    manager.lease(k(4), owner=3)
    settle(manager, disk)  # up from the disk: published like an engine's store
    manager.chain.run_once()
    assert cluster.given(JobKind.PUBLISH) == [tuple(k(4))]
    cluster.finish()
    out = manager.prepare_store(k(6))  # a failed store is published to nobody
    manager.complete_store(list(out.keys_to_store), False)
    manager.chain.run_once()
    assert cluster.jobs == []


def test_a_maybe_is_probed_then_promoted_from_what_the_probe_found():
    cluster = DictTier(BlockSource.CLUSTER, k(2), maybe=k(2, 3))
    manager = chain(cluster)
    lease = manager.lease(k(2, 3), owner=7)
    assert (lease.num_hit, lease.pending) == (0, True)
    assert [(j.kind, j.keys, j.asker) for j in cluster.jobs] == [
        (JobKind.PROBE, tuple(k(2, 3)), 7)]
    assert manager.lease(k(2, 3), owner=8).pending  # probed once however many ask
    assert len(cluster.jobs) == 1 and manager.stats().writing_blocks == 0
    settle(manager, cluster)
    assert cluster.given(JobKind.PROMOTE) == [tuple(k(2))]  # what it found: 2, not 3
    settle(manager, cluster)
    lease = manager.lease(k(2, 3), owner=7)
    assert (lease.num_hit, lease.pending) == (1, False)
    assert (lease.promoted, lease.sources) == ((0,), (BlockSource.CLUSTER,))
    again = manager.lease(k(2), owner=8)  # the block is in host memory now: a host hit
    assert (again.num_hit, again.promoted, again.sources) == (1, (), ())


def test_a_reset_while_tier_jobs_run_hands_out_none_of_their_slots():
    """The wrong byte of issue 33: a promotion reading into host slots and a demotion
    reading from them when a reset comes; another session's stores then get other slots,
    and the promotion's late completion is not served."""
    disk = DictTier(BlockSource.DISK, k(0, 1), demote_below=0.5)
    manager = chain(disk, num_blocks=8)
    store(manager, 10, 11, 12, 13, 14)  # 3 free of 8: below the watermark (4)
    manager.chain.run_once()
    demoting = [job for job in disk.jobs if job.kind is JobKind.DEMOTE]
    assert demoting
    assert manager.lease(k(0, 1)).pending
    promoting = [job for job in disk.jobs if job.kind is JobKind.PROMOTE]
    busy = {s for job in demoting + promoting for s in job.slots}
    manager.reset()
    out = manager.prepare_store([b"new-%d" % i for i in range(8 - len(busy))], owner=9)
    assert out is not None and not set(out.store_spec.block_ids.tolist()) & busy
    assert manager.prepare_store([b"one-more"], owner=9) is None  # the rest is in use
    settle(manager, disk)  # the jobs end: their slots come back, nothing READY of them
    s = manager.stats()
    assert (s.free_blocks, s.ready_blocks, s.writing_blocks) == (len(busy), 0, len(out.keys_to_store))
    assert manager.lookup(k(0)) == 0 and manager.lookup(k(10)) == 0


def test_reads_that_may_still_land_are_held_out_until_they_settle():
    cluster = DictTier(BlockSource.CLUSTER, k(0, 1))
    manager = chain(cluster, num_blocks=8)  # one slot held out stops promotions (8 // 64)
    manager.lease(k(0))
    (job,) = cluster.jobs
    cluster.finish(done=(), may_land=job.keys, settled=False)
    manager.chain.run_once()
    s = manager.stats()
    assert (s.quarantined_blocks, s.writing_blocks) == (1, 0) and manager.lookup(k(0)) == 0
    assert not manager.chain.stats()["cluster"].promoting
    assert manager.lease(k(1)) .pending is False and cluster.jobs == []  # none start now
    taken = manager.prepare_store([b"x%d" % i for i in range(7)])
    assert job.slots[0] not in taken.store_spec.block_ids.tolist()
    cluster.results.append(JobResult(job.job_id, settled=True))  # the read ended
    manager.chain.run_once()
    assert manager.stats().quarantined_blocks == 0
    assert manager.chain.stats()["cluster"].promoting


def test_demotion_below_the_watermark_admits_reused_blocks_first():
    """Admitted blocks wait unpinned; the chain pins at most 1/8 of host memory (one job at
    least) for a tier's reads at once, so a small host tier keeps room to store."""
    disk = DictTier(BlockSource.DISK, demote_below=0.5)  # at most 4 queued, 2 per job
    manager = chain(disk, num_blocks=8)
    store(manager, 0, 1, 2, 3)
    manager.lease(k(0))  # reused: it goes down whatever the queue
    manager.release(k(0))
    store(manager, 4, 5, 6, 7)  # LRU end: 3, 2, 1, 0 (a batch's head ends most recent)
    manager.chain.run_once()
    assert disk.given(JobKind.DEMOTE) == [tuple(k(3, 2))]  # 1: unproven, dropped; 0 waits
    assert manager.stats().loading_blocks == 2  # one job pinned: 8 // 8 < 2 blocks per job
    assert manager.chain.stats()["disk"].dropped_spills == 1
    assert manager.prepare_store([b"room"]) is not None  # unpinned blocks can still go
    settle(manager, disk)  # unpinned; the next round hands over what waited, 0 first
    assert disk.blocks == set(k(2, 3))
    assert disk.given(JobKind.DEMOTE)[0][0] == k(0)[0]
    again = [key for keys in disk.given(JobKind.DEMOTE) for key in keys]
    assert manager.stats().loading_blocks == len(again) <= 2

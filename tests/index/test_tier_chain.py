"""The index's lower tiers as an ordered chain (host -> disk -> cluster), with a tier that
keeps its blocks in a dict and promotes when told to (the real tiers have tests of their
own in tests/tiers): the first tier that holds a key promotes it; each tier is given its
own keys of a run and the host-resident ones beside them; engine stores are told to every
tier, promotions to every tier but the one they came from; a lease names the tier each
promoted block came from."""

from __future__ import annotations

from tiercache.index.manager import TIER_OWNER, OffloadingManager
from tiercache.index.results import BlockSource, TierStats


class DictTier:
    def __init__(self, manager: OffloadingManager, source: BlockSource, keys=()):
        self.manager, self.source, self.name = manager, source, source.label
        self.blocks = set(keys)
        self.asked: list[tuple[list[bytes], set[bytes]]] = []
        self.told: list[bytes] = []

    def holds(self, key: bytes, owner: int) -> bool:
        return key in self.blocks

    def promote(self, run, mine, owner) -> None:
        self.asked.append((list(run), set(mine)))

    def stored(self, keys) -> None:
        self.told.extend(keys)

    def snapshot(self) -> TierStats:
        return TierStats()

    def finish(self) -> None:
        """Bring up what was asked (as the real tiers do on their threads)."""
        for run, mine in self.asked:
            out = self.manager.prepare_store(run, owner=TIER_OWNER)
            self.manager.complete_store([k for k in out.keys_to_store if k in mine],
                                        owner=TIER_OWNER, source=self.source)
        self.asked.clear()


def k(i: int) -> bytes:
    return b"key-%d" % i


def chain(disk_keys=(), cluster_keys=(), num_blocks: int = 8):
    manager = OffloadingManager(num_blocks)
    disk = DictTier(manager, BlockSource.DISK, disk_keys)
    cluster = DictTier(manager, BlockSource.CLUSTER, cluster_keys)
    manager.set_lower_tiers([disk, cluster])
    return manager, disk, cluster


def test_the_first_tier_that_holds_a_key_promotes_it():
    manager, disk, cluster = chain(disk_keys=[k(0), k(1)], cluster_keys=[k(1), k(2)])
    lease = manager.lease([k(0), k(1), k(2), k(3)])
    assert (lease.num_hit, lease.pending) == (0, True)  # k(3): nobody holds it, the run ends
    assert disk.asked == [([k(0), k(1)], {k(0), k(1)})]
    assert cluster.asked == [([k(2)], {k(2)})]


def test_each_tier_gets_its_keys_of_a_run_with_the_host_ones_beside_them():
    manager, disk, cluster = chain(disk_keys=[k(1)], cluster_keys=[k(3)])
    out = manager.prepare_store([k(0), k(2)])
    manager.complete_store(list(out.keys_to_store))
    lease = manager.lease([k(0), k(1), k(2), k(3), k(4)])
    assert (lease.num_hit, lease.pending) == (1, True)  # k(0) in host; k(1) is promoting
    manager.release([k(0)])
    assert disk.asked == [([k(1), k(2)], {k(1)})]  # k(2) is in host memory: protected,
    assert cluster.asked == [([k(2), k(3)], {k(3)})]  # not promoted


def test_engine_stores_are_told_to_every_tier_and_promotions_to_the_others():
    manager, disk, cluster = chain(disk_keys=[k(4)], cluster_keys=[k(5)])
    out = manager.prepare_store([k(0), k(1)])
    manager.complete_store(list(out.keys_to_store))
    assert disk.told == cluster.told == [k(0), k(1)]
    manager.lease([k(5)])
    cluster.finish()  # up from the pool: the disk is told, the pool is not told again
    assert (disk.told, cluster.told) == ([k(0), k(1), k(5)], [k(0), k(1)])
    manager.lease([k(4)])
    disk.finish()  # up from the disk: published like an engine's store
    assert (disk.told, cluster.told) == ([k(0), k(1), k(5)], [k(0), k(1), k(4)])
    out = manager.prepare_store([k(6)])  # a failed store is told to nobody
    manager.complete_store(list(out.keys_to_store), False)
    assert (len(disk.told), len(cluster.told)) == (3, 3)


def test_a_lease_names_the_tier_each_promoted_block_came_from():
    manager, disk, cluster = chain(disk_keys=[k(1)], cluster_keys=[k(2)])
    out = manager.prepare_store([k(0)])
    manager.complete_store(list(out.keys_to_store))
    assert manager.lease([k(0), k(1), k(2)]).pending
    manager.release([k(0)])
    disk.finish()
    cluster.finish()
    lease = manager.lease([k(0), k(1), k(2)])
    assert lease.num_hit == 3
    assert (lease.promoted, lease.sources) == ((1, 2), (BlockSource.DISK, BlockSource.CLUSTER))
    assert manager.tier_stats().keys() == {"disk", "cluster"}

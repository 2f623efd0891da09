"""Each lower tier built from its config section over the coordinator's region: the
registry's factories (``tiercache.tiers.TIER_FACTORIES``). A builder either returns a
tier ready to start or raises having closed what it opened. Each tier's checker
(``tiercache.tiers.TIER_CHECKS``) refuses, before the coordinator allocates anything,
what its builder would refuse for a cheap reason (a file, a directory, free room)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from tiercache.config import Config
from tiercache.sizes import format_bytes

if TYPE_CHECKING:
    import numpy as np

    from tiercache.tiers.base import LowerTier
    from tiercache.region.layout import RegionLayout

DISK_STOP_S = 5.0  # a stop waits this long for disk I/O in flight, then abandons it


class TierRegion(Protocol):
    """What a builder reads of the coordinator's region (``SharedOffloadRegion``): its
    layout, and each rank's slice as ``(num_blocks, row_stride)`` bytes."""

    @property
    def layout(self) -> RegionLayout: ...

    def rank_array(self, rank: int) -> np.ndarray: ...


def check_disk(config: Config, layout: RegionLayout) -> None:
    """The disk tier's directory, the file under its name, and the room it needs
    (``DiskSlotFile.check``)."""
    from tiercache.tiers.disk_file import DiskSlotFile

    disk = config.disk
    assert disk is not None, "the registry checks a tier only when its section is configured"
    DiskSlotFile.check(disk.file_path(config.name), disk.capacity_bytes,
                       world_size=layout.world_size, row_stride=layout.row_stride)


def check_cluster(config: Config, layout: RegionLayout) -> None:
    """The cluster's key file (``load_cluster_key``); the pool's master is waited for at
    build time, not here (``cluster.start_timeout_s``)."""
    from tiercache.tiers.cluster_key import load_cluster_key

    assert config.cluster is not None, "the registry checks a tier only when configured"
    load_cluster_key(config.cluster.key_file)


def build_disk(config: Config, region: TierRegion, say: Callable[[str], None]) -> LowerTier:
    """The disk tier over its file (created, or reopened and its index rebuilt from the
    slot headers)."""
    from tiercache.tiers.disk import DiskTier
    from tiercache.tiers.disk_file import DiskSlotFile

    disk, layout = config.disk, region.layout
    assert disk is not None, "the registry builds a tier only when its section is configured"
    t0 = time.perf_counter()
    file = DiskSlotFile(disk.file_path(config.name), disk.capacity_bytes,
                        world_size=layout.world_size, row_stride=layout.row_stride,
                        layout_digest=layout.digest, direct_io=disk.direct_io)

    def rows(slot: int) -> list[memoryview]:
        return [memoryview(region.rank_array(rank)[slot]) for rank in range(layout.world_size)]

    try:
        tier = DiskTier(file, rows, io_threads=disk.io_threads,
                        low_watermark=disk.low_watermark, down_s=disk.retry_s,
                        stop_timeout_s=DISK_STOP_S)
        say(f"disk tier: reading {file.num_slots} slot header(s) of {file.path}"
            + (f"; it starts empty: {file.fresh_reason}" if file.fresh_reason else ""))
        found = tier.rebuild()
    except BaseException:
        file.close()
        raise
    how = "O_DIRECT" if file.direct_io else f"buffered I/O ({file.direct_io_reason})"
    say(f"disk tier: {file.num_slots} block(s) of {format_bytes(file.slot_bytes)} "
        f"({format_bytes(file.num_slots * file.slot_bytes)}) at {file.path}, {how}; "
        f"{found} block(s) rebuilt from slot headers in {time.perf_counter() - t0:.2f} s")
    return tier


def build_cluster(config: Config, region: TierRegion, say: Callable[[str], None]) -> LowerTier:
    """The cluster tier: the cluster's key read, this node's segment mounted in the pool
    (waiting up to ``cluster.start_timeout_s`` for the master). The region is never
    registered with the pool (peers could reach it): blocks move through the tier's
    staging areas (``tiers.cluster_transfer``)."""
    from tiercache.tiers.cluster import ClusterTier
    from tiercache.tiers.cluster_key import load_cluster_key
    from tiercache.tiers.cluster_object import BlockFormat
    from tiercache.tiers.mooncake_pool import MooncakePool

    cfg, layout = config.cluster, region.layout
    assert cfg is not None, "the registry builds a tier only when its section is configured"
    block_format = BlockFormat.of(layout, load_cluster_key(cfg.key_file))
    t0 = time.perf_counter()
    pool = MooncakePool(cfg)
    pool.open()
    try:
        def rows(slot: int) -> list[tuple[int, memoryview]]:
            views = [region.rank_array(rank)[slot] for rank in range(layout.world_size)]
            return [(row.ctypes.data, memoryview(row)) for row in views]

        tier = ClusterTier(
            pool, block_format, rows,
            capacity_blocks=cfg.segment_bytes // (block_format.object_bytes * layout.world_size),
            publish_queue_blocks=cfg.publish_queue_blocks, exists_ttl_s=cfg.exists_ttl_s,
            exists_wait_s=cfg.exists_wait_s, retry_s=cfg.retry_s,
            census_period_s=cfg.census_period_s, publish_threads=cfg.publish_threads,
            promote_threads=cfg.promote_threads, stop_timeout_s=cfg.stop_timeout_s)
    except BaseException:
        pool.close()
        raise
    say(f"cluster tier: Mooncake Store, master {cfg.master}, this node's segment "
        f"{format_bytes(cfg.segment_bytes)} at {pool.hostname} ({cfg.protocol}); "
        f"block format {block_format.digest.hex()}; ready in {time.perf_counter() - t0:.2f} s")
    return tier

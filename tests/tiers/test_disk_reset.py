"""A ``reset`` while the disk tier moves bytes (issue 33's wrong bytes): promotions reading
from a slow disk into host slots, or demotions writing host slots to it, when a client
resets the index; another client then stores new keys into whatever slots the index hands
out. Before the tier chain kept those slots out of use, the promotions' late reads landed
in the new keys' slots (10/10 rounds served wrong bytes) and demotions wrote the new keys'
rows to disk under the old keys with a fresh CRC. Now: every new key's bytes are exact,
and every old key is its own bytes or a miss, also after a SIGKILL and a restart. The
disk's file lives on a real FUSE filesystem that sleeps in its reads and writes."""

from __future__ import annotations

import pytest

import faulty_fs
from control_children import block_pattern, rows_hold
from control_support import wait_for
from e2e_support import metrics_url, sample, scrape
from test_disk_failures import faulty_disk_config
from test_disk_tier import HOST_BLOCKS, KEYS, lease_when_settled, store_paced, tier
from tiercache.link.client import Client
from tiercache.region.shared import SharedOffloadRegion
from tiercache.service.process import CoordinatorProcess

pytestmark = pytest.mark.skipif(not faulty_fs.available(),
                                reason="needs /dev/fuse for the fault-injecting filesystem")

NEW = [b"after-reset-%d" % i for i in range(HOST_BLOCKS)]


def store_new(config, keys: list[bytes]) -> int:
    """Another client stores ``keys`` (their patterns in every rank's row), one at a time
    into whatever slot the index hands out, while it has room; how many it stored."""
    stored = 0
    with SharedOffloadRegion.attach(config.name) as region, Client(config) as client:
        stride = region.layout.row_stride
        for key in keys:
            out = client.prepare_store([key])
            if out is None:
                break
            for slot, new in zip(out.store_spec.block_ids.tolist(), out.keys_to_store):
                for rank in range(config.world_size):
                    region.rank_array(rank)[slot] = block_pattern(new, rank, stride)
            client.complete_store([key])
            stored += 1
    return stored


def exact_or_missing(config, keys: list[bytes]) -> tuple[int, int]:
    """(exact, wrong) over the keys that hit; a miss is neither."""
    exact = wrong = 0
    with SharedOffloadRegion.attach(config.name) as region, Client(config) as client:
        for key in keys:
            lease = lease_when_settled(client, key)
            if lease.num_hit:
                slot = int(lease.spec.block_ids[0])
                if rows_hold(region, slot, key):
                    exact += 1
                else:
                    wrong += 1
                client.release([key])
    return exact, wrong


@pytest.fixture
def slow_disk(make_config, tmp_path):
    backing, mount = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir()
    fs = faulty_fs.FaultyFS(str(backing), str(mount), str(tmp_path))
    config = faulty_disk_config(make_config, mount)
    try:
        yield fs, config
    finally:
        fs.close()


def idle(url: str) -> bool:
    """Nothing queued for the disk tier and no call of it under way (one scrape)."""
    metrics = scrape(url)
    return all(sample(metrics, f"tiercache_tier_{name}", tier="disk") == 0
               for name in ("queued_blocks", "calls_in_flight"))


def test_a_reset_under_promotions_never_serves_their_late_reads(slow_disk, tmp_path):
    fs, config = slow_disk
    with CoordinatorProcess(config, tmp_path / "c") as coordinator:
        url = metrics_url(coordinator)
        store_paced(config, url, KEYS[:32])  # the oldest 16 on disk only
        # every host block on disk too before the disk turns slow: a demotion admitted
        # later pins its host slot on the slow disk through the reset, and the 8 new keys
        # below then share 4 free slots (1 run in 8 or so)
        wait_for(lambda: tier(url, "blocks") == 32 and idle(url), "the tier holds all 32")
        fs.set("slow 0.3")
        with Client(config) as client:
            assert client.lease(KEYS[:8]).pending  # 8 promotions reading from the slow disk
            client.reset()
        assert store_new(config, NEW[:8]) == 8  # the slots the index hands out now
        wait_for(lambda: tier(url, "calls_in_flight") == 0, "the slow reads end", 60)
        fs.set("ok")
        assert exact_or_missing(config, NEW[:8]) == (8, 0)
        exact, wrong = exact_or_missing(config, KEYS[:16])
        assert wrong == 0 and exact > 0  # promoted again from disk, each its own bytes


def test_a_reset_under_demotions_never_writes_another_blocks_bytes(slow_disk, tmp_path):
    fs, config = slow_disk
    with CoordinatorProcess(config, tmp_path / "c") as coordinator:
        url = metrics_url(coordinator)
        store_paced(config, url, KEYS[:12])
        fs.set("slow 0.2")
        store_new(config, KEYS[12:16])  # below the watermark: demotions start, slowly
        wait_for(lambda: tier(url, "calls_in_flight") > 0, "a demotion writes", 30)
        with Client(config) as client:
            client.reset()
        assert store_new(config, NEW) > 0  # every slot it has, while demotions still write
        wait_for(lambda: tier(url, "calls_in_flight") == 0, "the slow writes end", 60)
        fs.set("ok")
        coordinator.kill()  # what the disk holds is all that is left of the old keys
    with CoordinatorProcess(config, tmp_path / "d"):
        exact, wrong = exact_or_missing(config, KEYS[:16])
        assert wrong == 0 and exact > 0

"""The disk tier through a real coordinator: a host region far smaller than the stored set,
paced stores, then every key comes back — promoted from disk on lookup (pending first) —
and is compared byte for byte; the same after a coordinator SIGKILL and after a clean
restart; flipped bytes in the tier's file give misses, never wrong bytes; two clients
asking for one key promote it once."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from control_children import block_pattern, rows_hold
from control_support import wait_for
from e2e_support import metrics_url, sample, scrape
from tiercache.config import DiskConfig, KVGeometry, RegionConfig
from tiercache.link.client import Client
from tiercache.region.shared import SharedOffloadRegion
from tiercache.service.process import CoordinatorProcess
from tiercache.region.layout import RegionLayout
from tiercache.tiers.disk_file import HEADER_BYTES, DiskSlotFile

HOST_BLOCKS = 16
KEYS = [b"disk-key-%d" % i for i in range(64)]
ROW = 4096


@pytest.fixture
def config(make_config, tmp_path):
    disk_dir = tmp_path / "disk"
    disk_dir.mkdir()
    slot = HEADER_BYTES + 2 * ROW
    return make_config(kv=KVGeometry(page_bytes=(ROW,)),
                       region=RegionConfig(capacity_bytes=None, num_blocks=HOST_BLOCKS,
                                           prefault_threads=1),
                       disk=DiskConfig(path=str(disk_dir), capacity_bytes=128 * slot,
                                       low_watermark=0.5))


def tier(url: str, name: str) -> float:
    return sample(scrape(url), f"tiercache_tier_{name}", tier="disk")


def store_paced(config, url: str, keys: list[bytes]) -> None:
    """Store ``keys`` four at a time, each batch's bytes written into every rank's row, and
    wait for the tier to demote what the next batch will evict."""
    region = SharedOffloadRegion.attach(config.name)
    try:
        with Client(config) as client:
            for start in range(0, len(keys), 4):
                batch = keys[start:start + 4]
                out = client.prepare_store(batch)
                assert out is not None
                for slot, key in zip(out.store_spec.block_ids.tolist(), out.keys_to_store):
                    for rank in range(config.world_size):
                        region.rank_array(rank)[slot] = block_pattern(key, rank, ROW)
                client.complete_store(list(out.keys_to_store))
                stored = start + len(batch)
                if stored > HOST_BLOCKS // 2:
                    wait_for(lambda: tier(url, "blocks") >= stored - 4,
                             f"the tier demotes ahead of eviction ({stored} stored)")
    finally:
        region.close()


def lease_when_settled(client, key: bytes, timeout_s: float = 30.0):
    """Lease ``key``, asking again while it is pending (a pending lease pins nothing)."""
    deadline = time.monotonic() + timeout_s
    lease = client.lease([key])
    while not lease.num_hit and lease.pending:
        assert time.monotonic() < deadline, f"{key!r} stayed pending for {timeout_s} s"
        time.sleep(0.005)
        lease = client.lease([key])
    return lease


def load_every_key(config, keys: list[bytes]) -> tuple[int, int, int]:
    """(exact, wrong, missing): each key leased (pending while it is promoted), its rows
    compared with its pattern while the lease pins it."""
    region = SharedOffloadRegion.attach(config.name)
    exact = wrong = missing = 0
    try:
        with Client(config) as client:
            for key in keys:
                lease = lease_when_settled(client, key)
                if not lease.num_hit:
                    missing += 1
                    continue
                slot = int(client.prepare_load([key]).block_ids[0])
                if rows_hold(region, slot, key):
                    exact += 1
                else:
                    wrong += 1
                client.complete_load([key])
                client.release([key])
    finally:
        region.close()
    return exact, wrong, missing


def test_blocks_evicted_from_host_come_back_from_disk_byte_for_byte(config, tmp_path):
    with CoordinatorProcess(config, tmp_path / "c1") as coordinator:
        assert "disk tier:" in coordinator.output() and "O_DIRECT" in coordinator.output()
        url = metrics_url(coordinator)
        store_paced(config, url, KEYS)
        assert (tier(url, "up"), tier(url, "direct_io")) == (1, 1)
        assert load_every_key(config, KEYS) == (len(KEYS), 0, 0)
        assert tier(url, "promotions_total") >= len(KEYS) - HOST_BLOCKS
        coordinator.kill()
    with CoordinatorProcess(config, tmp_path / "c2") as again:  # after a SIGKILL
        assert "rebuilt from slot headers" in again.output()
        assert load_every_key(config, KEYS) == (len(KEYS), 0, 0)
        assert again.stop() == 0  # a clean stop: no worker attached, the region goes
    with CoordinatorProcess(config, tmp_path / "c3") as fresh:  # a new, empty region
        url = metrics_url(fresh)
        assert tier(url, "rebuilt_blocks_total") >= len(KEYS) - 4
        assert load_every_key(config, KEYS) == (len(KEYS), 0, 0)


def test_flipped_bytes_in_the_tiers_file_give_misses_never_wrong_bytes(config, tmp_path):
    with CoordinatorProcess(config, tmp_path / "c1") as coordinator:
        store_paced(config, metrics_url(coordinator), KEYS[:32])
        assert coordinator.stop() == 0  # the newest few were never demoted: they go with
    layout = RegionLayout.from_config(config)  # the region; count what is on disk
    disk = DiskSlotFile(config.disk.file_path(config.name), config.disk.capacity_bytes,
                        world_size=2, row_stride=layout.row_stride, layout_digest=layout.digest)
    on_disk = len(disk.scan())
    offsets = [disk.offset(slot) + HEADER_BYTES + 1000 for slot in range(disk.num_slots)]
    disk.close()
    path = config.disk.file_path(config.name)
    with open(path, "r+b") as raw:  # one bit of data in every slot
        for offset in offsets:
            raw.seek(offset)
            byte = raw.read(1)
            raw.seek(offset)
            raw.write(bytes([byte[0] ^ 1]))
    with CoordinatorProcess(config, tmp_path / "c2") as again:
        exact, wrong, missing = load_every_key(config, KEYS[:32])
        assert (exact, wrong) == (0, 0) and missing == 32
        assert tier(metrics_url(again), "checksum_failures_total") == on_disk >= 28


def test_two_clients_asking_for_one_key_promote_it_once(config, tmp_path):
    with CoordinatorProcess(config, tmp_path / "c1") as coordinator:
        url = metrics_url(coordinator)
        store_paced(config, url, KEYS[:32])
        key = KEYS[0]  # the oldest: long evicted from host memory, on disk
        before = tier(url, "promotions_total")
        with Client(config) as one, Client(config) as two:
            first, second = one.lease([key]), two.lease([key])
            assert first.num_hit == 0 and first.pending  # not in host memory: promoting
            assert second.pending or second.num_hit == 1  # the same promotion (or done)
            wait_for(lambda: one.lookup([key]) == 1, "the key is promoted")
            assert lease_when_settled(two, key).num_hit == 1
        assert tier(url, "promotions_total") == before + 1
        with Client(config) as client:  # the same figures over the control socket
            (name, stats), = client.tier_stats().items()
            assert name == "disk" and stats.promotions == before + 1 and stats.up
        out = subprocess.run([sys.executable, "-m", "tiercache", "status", "--config",
                              str(coordinator.config_path)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert f"disk tier: up, {int(tier(url, 'blocks'))} of 128 blocks, O_DIRECT" in out.stdout

"""A disk that fails (EIO) or stalls never stops the host tier: the disk tier is marked
down, counted and logged, lookups fall back to misses, nothing wrong is served, and it
comes back by itself. The disk tier's file lives on a real FUSE filesystem that returns
real EIO or sleeps in its reads and writes (``faulty_fs``)."""

from __future__ import annotations

import signal
import time

import pytest

import faulty_fs
from control_support import wait_for
from e2e_support import metrics_url
from index_scenarios import k, store
from test_disk_tier import HOST_BLOCKS, KEYS, ROW, load_every_key, \
    store_paced, tier
from tiercache.config import DiskConfig, KVGeometry, RegionConfig
from tiercache.link.client import Client
from tiercache.index.tiering import PROMOTION_WAIT_S
from tiercache.results import LeaseResult
from tiercache.service.process import CoordinatorProcess
from tiercache.tiers.disk_file import HEADER_BYTES

pytestmark = pytest.mark.skipif(not faulty_fs.available(),
                                reason="needs /dev/fuse for the fault-injecting filesystem")


def faulty_disk_config(make_config, mount):
    """A host tier of HOST_BLOCKS rows of ROW bytes over a disk tier in ``mount`` (the
    fault-injecting filesystem: buffered I/O, FUSE takes no O_DIRECT)."""
    return make_config(kv=KVGeometry(page_bytes=(ROW,)),
                       region=RegionConfig(capacity_bytes=None, num_blocks=HOST_BLOCKS,
                                           prefault_threads=1),
                       disk=DiskConfig(path=str(mount),
                                       capacity_bytes=64 * (HEADER_BYTES + 2 * ROW),
                                       low_watermark=0.5, direct_io=False, retry_s=5.0))


@pytest.fixture
def faulty(make_config, tmp_path):
    """(the filesystem, the config, the metrics URL): a coordinator whose disk tier lives on
    the fault-injecting filesystem, with 32 keys stored (the oldest 16 on disk only)."""
    backing, mount = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir()
    fs = faulty_fs.FaultyFS(str(backing), str(mount), str(tmp_path))
    config = faulty_disk_config(make_config, mount)
    try:
        with CoordinatorProcess(config, tmp_path / "c") as coordinator:
            url = metrics_url(coordinator)
            store_paced(config, url, KEYS[:32])
            yield fs, config, url
            fs.set("ok")  # a stalled disk must not hold up the coordinator's stop
    finally:
        fs.close()


def test_a_disk_returning_eio_is_marked_down_and_the_host_tier_keeps_serving(faulty):
    fs, config, url = faulty
    fs.set("eio")
    exact, wrong, missing = load_every_key(config, KEYS[:16])  # on disk only
    assert (exact, wrong) == (0, 0) and missing == 16
    assert tier(url, "errors_total") >= 3
    assert tier(url, "up") == 0  # 3 errors in a row: down for disk.retry_s
    with Client(config) as client:
        assert client.lease([KEYS[0]]) == LeaseResult(0, False)  # down: a plain miss
        store(client, 900, 901)  # the host tier is untouched
        assert client.lookup(k(900, 901)) == 2
    fs.set("ok")
    wait_for(lambda: tier(url, "up") == 1, "the disk tier comes back by itself")
    assert load_every_key(config, KEYS[:8]) == (8, 0, 0)  # exact once the disk reads


def test_a_stalled_disk_never_holds_up_the_host_tier(faulty):
    fs, config, url = faulty
    fs.set("slow 20")
    with Client(config) as client, Client(config) as other:
        assert client.lease([KEYS[0]]).pending  # its promotion is stuck in a read
        for i in range(10):  # meanwhile the host tier answers every call
            store(other, 1000 + i)
            assert other.lookup(k(1000 + i)) == 1
        time.sleep(PROMOTION_WAIT_S)  # stuck longer than a lookup waits on a promotion:
        assert client.lease([KEYS[0]]) == LeaseResult(0, False)  # a plain miss meanwhile
        fs.set("ok")
        wait_for(lambda: client.lease([KEYS[0]]).num_hit == 1, "the read lands: a hit", 60)
        client.release([KEYS[0]])
    assert load_every_key(config, KEYS[:4])[1] == 0


def test_serve_stops_while_the_disk_stalls(make_config, tmp_path):
    """SIGTERM with a read stuck in the disk (sleeping 25 s): the tier's stop waits its
    bound (5 s), abandons the I/O thread (named in one line), and serve's shutdown finishes
    (region and socket removed) long before the read ends (was: still running 90 s after
    SIGTERM, joining the tier's threads). The process itself exits when the kernel lets the
    stuck read go: a thread in a disk read cannot be killed, SIGKILL included."""
    backing, mount = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir()
    fs = faulty_fs.FaultyFS(str(backing), str(mount), str(tmp_path))
    config = faulty_disk_config(make_config, mount)
    try:
        coordinator = CoordinatorProcess(config, tmp_path / "c")
        try:
            url = metrics_url(coordinator)
            store_paced(config, url, KEYS[:32])
            fs.set("slow 25")
            with Client(config) as client:
                assert client.lease([KEYS[0]]).pending  # its promotion is stuck in a read
            wait_for(lambda: tier(url, "calls_in_flight") >= 1, "a read is stuck", 30)
            coordinator.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: "stopped; removed region" in coordinator.output(),
                     "serve's shutdown ends while the read is stuck", 60)
            assert coordinator.proc.poll() is None  # done, though the read still sleeps
            out = coordinator.output()
            assert "abandoned what the pool's master or the disk still holds" in out
            assert "disk tiercache-disk-io-" in out
            fs.set("ok")
            assert coordinator.proc.wait(90) == 0  # the read ends: the process exits
        finally:
            fs.set("ok")
            coordinator.cleanup()
    finally:
        fs.close()
